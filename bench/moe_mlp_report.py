"""bench/moe_mlp_report.py - joins the JSON of bench/moe_mlp.lua (moe-lua)
and bench/moe_mlp_torch.py (PyTorch), timed in one run on one GPU, into
bench/results/moe_mlp.json and the table bench/results/moe_mlp.md: per
config and implementation ms, TFLOP/s (18 T k d f model FLOPs), percent of
the dense bf16 GEMM rate measured in the same run, peak extra memory, and
the targets:
  resolve: grouped faster than torch._grouped_mm on all three configs;
           sparse within 10% of grouped on mixtral (time <= 1.10 x grouped)
  goal:    grouped >= 85% of dense on mixtral, >= 60% on olmoe and qwen3.
The dense rate is the larger of the two measured (moe.matmul and
torch.matmul 8192^3): percentages are never flattered by a slow reference.

  python3 bench/moe_mlp_report.py MOE_JSON TORCH_JSON [OUTDIR] [--command TEXT]
"""
import json
import os
import sys


def main():
    argv = sys.argv[1:]
    command = None
    if "--command" in argv:
        i = argv.index("--command")
        command = argv[i + 1]
        del argv[i:i + 2]
    moe = json.load(open(argv[0]))
    th = json.load(open(argv[1]))
    outdir = argv[2] if len(argv) > 2 else "bench/results"
    dense = max(moe["dense"]["tflops"], th["dense"]["tflops"])
    rows = []
    for r in moe["results"] + th["results"]:
        row = dict(r)
        row["side"] = "moe-lua" if r in moe["results"] else "torch"
        if "tflops" in r:
            row["pct_dense"] = 100 * r["tflops"] / dense
        rows.append(row)

    def get(cfg, impl):
        for r in rows:
            if r["config"] == cfg and r["impl"] == impl and "ms" in r:
                return r
        return None

    configs = ["mixtral", "olmoe", "qwen3"]
    faster = {}
    for c in configs:
        g, t = get(c, "grouped"), get(c, "torch_grouped_mm")
        faster[c] = bool(g and t and g["ms"] < t["ms"])
    g, s = get("mixtral", "grouped"), get("mixtral", "sparse")
    sparse_ratio = s["ms"] / g["ms"] if g and s else None
    goal = {}
    for c, want in (("mixtral", 85), ("olmoe", 60), ("qwen3", 60)):
        g = get(c, "grouped")
        goal[c] = {"pct_dense": g["pct_dense"] if g else None, "target_pct": want,
                   "met": bool(g and g["pct_dense"] >= want)}
    targets = {
        "grouped_faster_than_torch_grouped_mm": faster,
        "grouped_faster_than_torch_grouped_mm_all": all(faster.values()),
        "sparse_over_grouped_time_mixtral": sparse_ratio,
        "sparse_within_10pct_mixtral": bool(sparse_ratio is not None and sparse_ratio <= 1.10),
        "goal_pct_dense": goal,
    }
    targets["resolve_met"] = (targets["grouped_faster_than_torch_grouped_mm_all"]
                              and targets["sparse_within_10pct_mixtral"])
    out = {"device": moe["device"], "torch_device": th["device"], "date": moe["date"],
           "versions": {"moe": moe["tool"], "torch": th["tool"], "torch_cuda": th["cuda"],
                        "cuda_runtime": moe["cuda_runtime"], "cuda_driver": moe["cuda_driver"],
                        "cublas": moe["cublas"], "grouped_backend": moe.get("grouped_backend")},
           "T": moe["T"], "dtype": "bf16",
           "dense": {"moe": moe["dense"], "torch": th["dense"], "reference_tflops": dense},
           "method": "forward + backward of the SwiGLU expert MLP (routing plan / sort, permute, "
                     "3 expert GEMMs, combine; all weight, input and gate gradients); median of "
                     "per-step CUDA-event times after 2 warm-up steps; TFLOP/s = 18 T k d f / time",
           "command": command, "rows": rows, "targets": targets}
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "moe_mlp.json"), "w") as fh:
        json.dump(out, fh, indent=1)

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    lines = ["# MoE expert MLP (SwiGLU), forward + backward, bf16: moe-lua vs PyTorch", "",
             f"- device: {out['device']}", f"- date: {out['date']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()),
             f"- T = {out['T']} tokens; routing: top-k of softmax of random logits",
             f"- dense bf16 GEMM 8192^3: moe {moe['dense']['tflops']:.1f} TFLOP/s, "
             f"torch {th['dense']['tflops']:.1f} TFLOP/s (percentages use {dense:.1f})",
             f"- method: {out['method']}", ""]
    if command:
        lines += [f"- command: `{command}`", ""]
    lines += ["| config | d | f | E | k | implementation | ms | TFLOP/s | % of dense | peak extra GiB |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for c in configs:
        for r in rows:
            if r["config"] != c:
                continue
            if "ms" in r:
                lines.append(f"| {c} | {r['d']} | {r['f']} | {r['E']} | {r['k']} | {r['impl']} | "
                             f"{r['ms']:.3f} | {r['tflops']:.1f} | {r['pct_dense']:.1f} | "
                             f"{r['peak_extra_bytes'] / 2**30:.2f} |")
            else:
                lines.append(f"| {c} | {r['d']} | {r['f']} | {r['E']} | {r['k']} | {r['impl']} | "
                             f"skipped: {r.get('error', '?')} | | | |")
    lines += ["", "Targets (same run, same GPU):"]
    for c in configs:
        g, t = get(c, "grouped"), get(c, "torch_grouped_mm")
        lines.append(f"- grouped faster than torch._grouped_mm on {c}: "
                     f"{fmt(g and g['ms'], '.3f')} ms vs {fmt(t and t['ms'], '.3f')} ms: "
                     + ("met" if faster[c] else "NOT met"))
    lines.append(f"- sparse within 10% of grouped on mixtral: time ratio "
                 f"{fmt(sparse_ratio, '.3f')}: "
                 + ("met" if targets["sparse_within_10pct_mixtral"] else "NOT met"))
    for c in configs:
        lines.append(f"- goal: grouped >= {goal[c]['target_pct']}% of dense on {c}: "
                     f"{fmt(goal[c]['pct_dense'], '.1f')}%: "
                     + ("met" if goal[c]["met"] else "NOT met"))
    lines.append(f"- resolve targets: {'met' if targets['resolve_met'] else 'NOT met'}")
    with open(os.path.join(outdir, "moe_mlp.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
