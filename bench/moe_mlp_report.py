"""bench/moe_mlp_report.py - joins the JSON of bench/moe_mlp.lua (moe-lua)
and bench/moe_mlp_torch.py (PyTorch), timed in one run on one GPU, into
bench/results/moe_mlp.json and the table bench/results/moe_mlp.md: per
config and implementation ms, TFLOP/s (18 T k d f model FLOPs), percent of
the dense bf16 GEMM rate measured in the same run, peak extra memory, and
the targets of the fine-grained expert kernels:
  resolve: the best moe-lua path (grouped or sparse) at >= 88% of dense on
           mixtral and >= 60% on olmoe and qwen3; every moe-lua path faster
           than the faster of torch._grouped_mm eager and torch.compile'd
  goal:    90% on mixtral, 65% on olmoe and qwen3.
With bench/moe_mlp_torch.py --dense-bound it also reports the dense bound: the
same FLOPs as one dense MLP with no MoE work, and its GEMMs alone, on cuBLAS.
--gathered FILE adds the grouped and sparse rows of a moe_mlp.lua run with
MOE_BSMM_GATHER=1 (the token rows gathered inside the wgmma kernel instead
of a permuted copy) as implementations "grouped_gather" and "sparse_gather",
or of one with MOE_BSMM_GATHER=wgrad (only the weight gradients' products
gather) as "grouped_gather_wgrad" and "sparse_gather_wgrad"; it may be given
once for each. Their peak extra memory is compared with ScatterMoE's too.
The dense rate is the larger of the two measured (moe.matmul and
torch.matmul 8192^3): percentages are never flattered by a slow reference.

  python3 bench/moe_mlp_report.py MOE_JSON TORCH_JSON [OUTDIR] [--command TEXT]
                                  [--gathered MOE_JSON]...
"""
import json
import os
import sys


USAGE = "usage: python3 bench/moe_mlp_report.py MOE_JSON TORCH_JSON [OUTDIR] [--command TEXT] [--gathered MOE_JSON]..."


def fail(msg):
    sys.exit(f"moe_mlp_report: {msg}\n{USAGE}")


def load(path, what, keys):
    """The JSON at path (what: which input it is), with the keys the report reads."""
    try:
        with open(path) as fh:
            v = json.load(fh)
    except (OSError, ValueError) as e:
        fail(f"cannot read {what} {path!r}: {e}")
    missing = [k for k in keys if not isinstance(v, dict) or k not in v]
    if missing:
        fail(f"{what} {path!r} has no {', '.join(repr(k) for k in missing)}")
    return v


def option(argv, name):
    """The value of --name (removed from argv with its flag), or None."""
    if name not in argv:
        return None
    i = argv.index(name)
    if i + 1 >= len(argv):
        fail(f"{name} needs a value")
    v = argv[i + 1]
    del argv[i:i + 2]
    return v


def main():
    argv = sys.argv[1:]
    command = option(argv, "--command")
    gpaths = []
    while "--gathered" in argv:
        gpaths.append(option(argv, "--gathered"))
    unknown = [a for a in argv if a.startswith("--")]
    if unknown:
        fail(f"unknown option {unknown[0]}")
    if len(argv) not in (2, 3):
        fail(f"expected MOE_JSON TORCH_JSON [OUTDIR], got {len(argv)} arguments")
    gathered = [load(p, "--gathered JSON", ["results"]) for p in gpaths]
    moe = load(argv[0], "MOE_JSON (bench/moe_mlp.lua)", ["dense", "results", "device", "date"])
    th = load(argv[1], "TORCH_JSON (bench/moe_mlp_torch.py)", ["dense", "results", "device"])
    outdir = argv[2] if len(argv) > 2 else "bench/results"
    dense = max(moe["dense"]["tflops"], th["dense"]["tflops"])
    rows = []
    for r in moe["results"] + th["results"]:
        row = dict(r)
        row["side"] = "moe-lua" if r in moe["results"] else "torch"
        if "tflops" in r:
            row["pct_dense"] = 100 * r["tflops"] / dense
        rows.append(row)
    gathered_impls = []
    for gj in gathered:
        # MOE_BSMM_GATHER of that run: "1" (true in older JSON) or "wgrad"
        mode = gj.get("bsmm_gather")
        suffix = "_gather" if mode in (True, "1") else "_gather_" + str(mode)
        for r in gj["results"]:
            if r.get("impl") in ("grouped", "sparse"):
                row = dict(r, impl=r["impl"] + suffix, side="moe-lua")
                if "tflops" in r:
                    row["pct_dense"] = 100 * r["tflops"] / dense
                rows.append(row)
                if row["impl"] not in gathered_impls:
                    gathered_impls.append(row["impl"])

    def get(cfg, impl):
        for r in rows:
            if r["config"] == cfg and r["impl"] == impl and "ms" in r:
                return r
        return None

    order = ["mixtral", "olmoe", "qwen3", "qwen3_t4k", "qwen3_t64k", "deepseek"]
    configs = [c for c in order if any(r["config"] == c for r in rows)]
    configs += sorted({r["config"] for r in rows} - set(configs))
    moe_impls = ["grouped", "sparse"]
    torch_impls = ["torch_grouped_mm", "torch_grouped_mm_compiled"]

    def best(c, impls):
        got = [get(c, i) for i in impls]
        got = [r for r in got if r]
        return min(got, key=lambda r: r["ms"]) if got else None

    # The targets of the fine-grained kernels: the best moe-lua path at 88% of dense on
    # mixtral and 60% on olmoe and qwen3 (goal 90 / 65); every moe-lua path faster than
    # the faster of torch._grouped_mm eager and compiled on every config.
    pct_target = {"mixtral": (88, 90), "olmoe": (60, 65), "qwen3": (60, 65)}
    best_pct, faster, auto = {}, {}, {}
    for c in configs:
        b, t = best(c, moe_impls), best(c, torch_impls)
        if c in pct_target:
            want, goal = pct_target[c]
            best_pct[c] = {"impl": b and b["impl"], "pct_dense": b and b["pct_dense"],
                           "target_pct": want, "goal_pct": goal,
                           "met": bool(b and b["pct_dense"] >= want),
                           "goal_met": bool(b and b["pct_dense"] >= goal)}
        faster[c] = {i: bool(get(c, i) and t and get(c, i)["ms"] < t["ms"]) for i in moe_impls}
        faster[c]["torch_best"] = t and t["impl"]
        a = next((r for r in rows if r["config"] == c and str(r["impl"]).startswith("auto:") and "ms" in r), None)
        if a:
            pick = a["impl"].split(":", 1)[1]
            fastest = best(c, moe_impls)
            auto[c] = {"pick": pick, "tuner_ms": a.get("pick_ms"), "tuner_T": a.get("pick_T"),
                       "fastest_timed": fastest and fastest["impl"],
                       "picked_fastest": bool(fastest and fastest["impl"] == pick),
                       "faster_than_torch": bool(t and a["ms"] < t["ms"])}
    # Memory: every moe-lua path's peak extra memory at most ScatterMoE's (goal: 0.8x), when
    # ScatterMoE ran in the torch run (bench/moe_mlp_torch.py --scattermoe)
    memory = {}
    for c in configs:
        sm = get(c, "scattermoe")
        if not sm or "peak_extra_bytes" not in sm:
            continue
        v = {"scattermoe_gib": sm["peak_extra_bytes"] / 2**30, "scattermoe_ms": sm["ms"]}
        for i in moe_impls + gathered_impls:
            r = get(c, i)
            if r and "peak_extra_bytes" in r:
                v[i] = {"gib": r["peak_extra_bytes"] / 2**30, "ms": r["ms"],
                        "met": r["peak_extra_bytes"] <= sm["peak_extra_bytes"],
                        "goal_met": r["peak_extra_bytes"] <= 0.8 * sm["peak_extra_bytes"]}
        memory[c] = v
    # The dense bound (bench/moe_mlp_torch.py --dense-bound): the layer's FLOPs as one dense MLP
    # over all T k token copies, and its nine GEMMs alone, both by cuBLAS through torch
    bound = {}
    for c in configs:
        mlp = best(c, ["torch_dense_mlp", "torch_dense_mlp_compiled"])
        gemms = get(c, "torch_dense_gemms")
        if mlp or gemms:
            b = best(c, moe_impls)
            bound[c] = {"dense_mlp": mlp and {"impl": mlp["impl"], "ms": mlp["ms"], "pct_dense": mlp["pct_dense"]},
                        "dense_gemms": gemms and {"ms": gemms["ms"], "pct_dense": gemms["pct_dense"]},
                        "best_pct_of_dense_mlp_speed": mlp and b and 100 * mlp["ms"] / b["ms"]}
    targets = {
        "best_pct_dense": best_pct,
        "dense_bound": bound or "not measured (bench/moe_mlp_torch.py without --dense-bound)",
        "faster_than_best_torch_grouped_mm": faster,
        "resolve_time_met": all(v["met"] for v in best_pct.values()) and len(best_pct) == 3
        and all(all(v[i] for i in moe_impls) for v in faster.values()),
        "auto": auto,
        "memory": memory or "ScatterMoE did not run: its peak extra memory is not compared in this run",
    }
    out = {"device": moe["device"], "torch_device": th["device"], "date": moe["date"],
           "versions": {"moe": moe.get("tool"), "torch": th.get("tool"), "torch_cuda": th.get("cuda"),
                        "cuda_runtime": moe.get("cuda_runtime"), "cuda_driver": moe.get("cuda_driver"),
                        "cublas": moe.get("cublas"), "grouped_backend": moe.get("grouped_backend"),
                        "scattermoe": (th.get("scattermoe") or {}).get("commit")},
           "T": moe.get("T"), "dtype": "bf16", "bsmm_gather": moe.get("bsmm_gather"),
           "dense": {"moe": moe["dense"], "torch": th["dense"], "reference_tflops": dense},
           "method": "forward + backward of the SwiGLU expert MLP (routing plan / sort, permute, "
                     "3 expert GEMMs, combine; all weight, input and gate gradients); median of "
                     "per-step CUDA-event times after 2 warm-up steps; TFLOP/s = 18 T k d f / time; "
                     "grouped: moe-lua's sm_90a grouped GEMM, group offsets read on the device; "
                     "grouped_cublas: cuBLAS with the offsets copied to the host (not an auto pick); "
                     "*_gather: token rows gathered inside the kernels (MOE_BSMM_GATHER=1), "
                     "*_gather_wgrad: by the weight gradients' products only (MOE_BSMM_GATHER=wgrad)",
           "command": command, "rows": rows, "targets": targets}
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "moe_mlp.json"), "w") as fh:
        json.dump(out, fh, indent=1)

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    lines = ["# MoE expert MLP (SwiGLU), forward + backward, bf16: moe-lua vs PyTorch", "",
             f"- device: {out['device']}", f"- date: {out['date']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()),
             f"- T = {out['T']} tokens unless the row says; routing: top-k of softmax of random logits",
             f"- dense bf16 GEMM 8192^3: moe {moe['dense']['tflops']:.1f} TFLOP/s, "
             f"torch {th['dense']['tflops']:.1f} TFLOP/s (percentages use {dense:.1f})",
             f"- method: {out['method']}", ""]
    if command:
        lines += [f"- command: `{command}`", ""]
    lines += ["| config | T | d | f | E | k | implementation | ms | TFLOP/s | % of dense | peak extra GiB |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for c in configs:
        for r in rows:
            if r["config"] != c:
                continue
            if "ms" in r:
                lines.append(f"| {c} | {r.get('T', '')} | {r['d']} | {r['f']} | {r['E']} | {r['k']} | "
                             f"{r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['pct_dense']:.1f} | "
                             f"{r['peak_extra_bytes'] / 2**30:.2f} |")
            else:
                lines.append(f"| {c} | {r.get('T', '')} | {r['d']} | {r['f']} | {r['E']} | {r['k']} | "
                             f"{r['impl']} | skipped: {r.get('error', '?')} | | | |")
    lines += ["", "Targets of the fine-grained kernels (same run, same GPU):"]
    for c, v in best_pct.items():
        lines.append(f"- best moe-lua path ({v['impl']}) >= {v['target_pct']}% of dense on {c}: "
                     f"{fmt(v['pct_dense'], '.1f')}%: " + ("met" if v["met"] else "NOT met")
                     + f" (goal {v['goal_pct']}%: " + ("met" if v["goal_met"] else "not met") + ")")
    for c, v in faster.items():
        t = best(c, torch_impls)
        for i in moe_impls:
            r = get(c, i)
            lines.append(f"- {i} faster than {v['torch_best'] or 'torch._grouped_mm'} on {c}: "
                         f"{fmt(r and r['ms'], '.3f')} ms vs {fmt(t and t['ms'], '.3f')} ms: "
                         + ("met" if v[i] else "NOT met"))
    for c, v in auto.items():
        tuned = ", ".join(f"{k} {ms:.3f} ms" for k, ms in sorted((v["tuner_ms"] or {}).items()))
        lines.append(f"- mlp_impl auto on {c}: picks {v['pick']} (its own measurement at T = {v['tuner_T']}: "
                     f"{tuned}); the faster of the rows above: {v['fastest_timed']}: "
                     + ("same" if v["picked_fastest"] else "DIFFERENT")
                     + "; faster than torch: " + ("yes" if v["faster_than_torch"] else "NO"))
    if memory:
        for c, v in memory.items():
            for i in moe_impls + gathered_impls:
                if i in v:
                    lines.append(f"- {i} peak extra memory <= ScatterMoE's on {c}: {v[i]['gib']:.2f} vs "
                                 f"{v['scattermoe_gib']:.2f} GiB: " + ("met" if v[i]["met"] else "NOT met")
                                 + " (goal 0.8x: " + ("met" if v[i]["goal_met"] else "not met") + "); time "
                                 f"{v[i]['ms']:.3f} vs {v['scattermoe_ms']:.3f} ms")
    else:
        lines.append(f"- memory: {targets['memory']}")
    lines.append(f"- time targets: {'met' if targets['resolve_time_met'] else 'NOT met'}")
    if bound:
        lines += ["", "The dense bound (same run): the same FLOPs as one dense SwiGLU MLP over all T k token "
                  "copies (no routing, gather, gates or combine), and its nine GEMMs alone, by cuBLAS through "
                  "torch. An MoE layer whose GEMMs are no faster than cuBLAS's and whose activation runs "
                  "outside them cannot beat these:"]
        for c, v in bound.items():
            m, g = v["dense_mlp"], v["dense_gemms"]
            b, speed = best(c, moe_impls), v["best_pct_of_dense_mlp_speed"]
            lines.append(f"- {c}: dense MLP ({m['impl'] if m else '-'}) {fmt(m and m['ms'], '.3f')} ms, "
                         f"{fmt(m and m['pct_dense'], '.1f')}% of dense; GEMMs alone {fmt(g and g['ms'], '.3f')} ms, "
                         f"{fmt(g and g['pct_dense'], '.1f')}%; best moe-lua path {fmt(b and b['ms'], '.3f')} ms, "
                         f"{fmt(b and b['pct_dense'], '.1f')}%, at {fmt(speed, '.1f')}% of the dense MLP's speed")
    with open(os.path.join(outdir, "moe_mlp.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
