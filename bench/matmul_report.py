"""bench/matmul_report.py - joins the JSON of bench/matmul.lua (moe) and
bench/matmul_torch.py (torch), timed in one run on one GPU, into
bench/results/matmul.json and the table bench/results/matmul.md: per case ms
and TFLOP/s for both, the ratio moe/torch of the times and whether moe is
within 5% of torch (ratio <= 1.05), the target for large bf16 shapes.

  python3 bench/matmul_report.py MOE_JSON TORCH_JSON [OUTDIR] [--command TEXT] [--check CHECK_JSON]

--check: the JSON of bench/matmul_check.lua (each layout against the CPU),
whose "validation" list the report shows (older MOE_JSON files carry it
themselves).
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
    check = None
    if "--check" in argv:
        i = argv.index("--check")
        check = json.load(open(argv[i + 1]))
        del argv[i:i + 2]
    moe_path, torch_path = argv[0], argv[1]
    outdir = argv[2] if len(argv) > 2 else "bench/results"
    moe = json.load(open(moe_path))
    th = json.load(open(torch_path))
    moe.setdefault("validation", (check or {}).get("validation", []))
    by_name = {r["name"]: r for r in th["results"]}
    rows = []
    for r in moe["results"]:
        t = by_name[r["name"]]
        ratio = r["ms"] / t["ms"]
        rows.append({"name": r["name"], "dtype": r["dtype"], "M": r["M"], "N": r["N"], "K": r["K"],
                     "gemms": r.get("gemms", 1),
                     "moe_ms": r["ms"], "moe_tflops": r["tflops"],
                     "torch_ms": t["ms"], "torch_tflops": t["tflops"],
                     "time_ratio_moe_over_torch": ratio, "within_5pct": ratio <= 1.05})
    target = [r for r in rows if r["dtype"] == "bf16"]
    out = {"device": moe["device"], "date": moe["date"],
           "versions": {"moe": moe["tool"], "torch": th["tool"], "torch_cuda": th["cuda"],
                        "torch_blas_library": th.get("blas_library"),
                        "cuda_runtime": moe["cuda_runtime"], "cuda_driver": moe["cuda_driver"],
                        "cublas": moe["cublas"]},
           "method": "median of %d samples per case; both sides: CUDA events around the "
                     "same iterations per sample; the GPU idle %g s before each case (cooldown)"
                     % (moe["repeats"], moe.get("cooldown_s", 0)),
           "command": command, "validation": moe["validation"], "cases": rows,
           "target_bf16_within_5pct": all(r["within_5pct"] for r in target),
           "target_bf16_single_gemms_within_5pct":
               all(r["within_5pct"] for r in target if r["gemms"] == 1)}
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "matmul.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    lines = ["# Matrix products: moe (cuBLASLt) vs torch.matmul / F.linear", "",
             f"- device: {out['device']}", f"- date: {out['date']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in out["versions"].items()),
             f"- method: {out['method']}",
             "- validation before timing (bf16 on CUDA vs the CPU in f32 on the same values): " +
             "; ".join(f"{v['name']} {v['rel_err']:.1e} {'ok' if v['ok'] else 'FAILED'}"
                       for v in moe["validation"]),
             "",
             "| case | dtype | M x N x K | moe ms | moe TFLOP/s | torch ms | torch TFLOP/s | moe/torch time | within 5% |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        shape = f"{r['M']} x {r['N']} x {r['K']}" + (f" (x{r['gemms']})" if r["gemms"] > 1 else "")
        lines.append(f"| {r['name']} | {r['dtype']} | {shape} | "
                     f"{r['moe_ms']:.4f} | {r['moe_tflops']:.1f} | {r['torch_ms']:.4f} | "
                     f"{r['torch_tflops']:.1f} | {r['time_ratio_moe_over_torch']:.3f} | "
                     f"{'yes' if r['within_5pct'] else 'no'} |")
    single = out["target_bf16_single_gemms_within_5pct"]
    lines += ["", "Target: matmul/linear within 5% of torch.matmul for large bf16 shapes:",
              "- single products (matmul, linear forward, each backward GEMM): "
              + ("met" if single else "NOT met") + ";"]
    for r in target:
        if r["gemms"] > 1:
            lines.append(f"- {r['name']}: {r['time_ratio_moe_over_torch']:.3f}x torch's time, "
                         + ("met" if r["within_5pct"] else "NOT met") + ".")
    with open(os.path.join(outdir, "matmul.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
