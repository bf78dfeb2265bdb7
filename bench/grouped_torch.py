"""bench/grouped_torch.py - the GEMMs of bench/grouped.lua timed with PyTorch on
the same GPU in the same run, then the joined report.

  python3 bench/grouped_torch.py MOE_JSON [OUTDIR] [--repeats N] [--command TEXT]
      [--extra MOE_JSON2]   (results of a second bench/grouped.lua run to join)

Reads the configs and the exact per-expert row counts that bench/grouped.lua
used (its JSON), builds the same shapes in bf16 and times the six GEMMs of
the GLU expert MLP (fwd_13, fwd_2, dgrad_2, wgrad_2, dgrad_13, wgrad_13; see
bench/grouped.lua) three ways:
  torch _grouped_mm: torch._grouped_mm(a, b, offs=int32 cumulative ends)
     (2-D x 3-D for the forward and input gradients, 2-D x 2-D with a^T for
     the weight gradients, as torch's own backward does);
  torch loop: one torch.matmul per non-empty expert (the naive loop);
  torch dense: the same GEMMs with one group of all rows (the dense rate).
Checks torch._grouped_mm against the loop at full size before timing.
Timing: CUDA events, warm-up, median of `repeats` samples, as the Lua side.
Writes OUTDIR/grouped.json (both sides) and OUTDIR/grouped.md (the table:
ms, TFLOP/s counting 18 T k d f, percent of the dense rate of the same
side, and moe / torch._grouped_mm time ratios).
"""
import datetime
import json
import os
import statistics
import sys

import torch

OPS = ["fwd_13", "fwd_2", "dgrad_2", "wgrad_2", "dgrad_13", "wgrad_13"]


def time_cuda(f, repeats):
    for _ in range(2):
        f()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return statistics.median(samples)


def grouped_ops(o, offs):
    """The six GEMMs with torch._grouped_mm; offs int32 (G,) cumulative ends."""
    gm = torch._grouped_mm
    w13t, w2t = o["w13"].transpose(-2, -1), o["w2"].transpose(-2, -1)
    return {
        "fwd_13": lambda: gm(o["x"], o["w13"], offs=offs),
        "fwd_2": lambda: gm(o["h"], o["w2"], offs=offs),
        "dgrad_2": lambda: gm(o["dy"], w2t, offs=offs),
        "wgrad_2": lambda: gm(o["h"].t(), o["dy"], offs=offs),
        "dgrad_13": lambda: gm(o["dh13"], w13t, offs=offs),
        "wgrad_13": lambda: gm(o["x"].t(), o["dh13"], offs=offs),
    }


def loop_ops(o, bounds):
    """The six GEMMs as one torch.matmul per non-empty group."""
    def fwd(a, w, trans):
        out = torch.empty(a.shape[0], w.shape[1] if trans else w.shape[2], dtype=a.dtype,
                          device=a.device)
        for g, (s, e) in enumerate(bounds):
            if e > s:
                torch.matmul(a[s:e], w[g].t() if trans else w[g], out=out[s:e])
        return out

    def wgrad(a, b):
        out = torch.zeros(len(bounds), a.shape[1], b.shape[1], dtype=a.dtype, device=a.device)
        for g, (s, e) in enumerate(bounds):
            if e > s:
                torch.matmul(a[s:e].t(), b[s:e], out=out[g])
        return out

    return {
        "fwd_13": lambda: fwd(o["x"], o["w13"], False),
        "fwd_2": lambda: fwd(o["h"], o["w2"], False),
        "dgrad_2": lambda: fwd(o["dy"], o["w2"], True),
        "wgrad_2": lambda: wgrad(o["h"], o["dy"]),
        "dgrad_13": lambda: fwd(o["dh13"], o["w13"], True),
        "wgrad_13": lambda: wgrad(o["x"], o["dh13"]),
    }


def operands(R, G, d, f):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)
    return {"x": randn(R, d), "h": randn(R, f), "dy": randn(R, d), "dh13": randn(R, 2 * f),
            "w13": randn(G, d, 2 * f, scale=d ** -0.5), "w2": randn(G, f, d, scale=f ** -0.5)}


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run(label, fs, total, repeats, cfg, results):
    per = {op: time_cuda(fs[op], repeats) for op in OPS}

    def chain():
        for op in OPS:
            fs[op]()
    ms = time_cuda(chain, repeats)
    r = {"config": cfg, "impl": label, "ms": ms, "tflops": total / (ms / 1e3) / 1e12, "ops": per}
    results.append(r)
    print(f"{cfg:8s} {label:22s} chain {ms:9.3f} ms {r['tflops']:7.1f} TFLOP/s  | " +
          " ".join(f"{op} {per[op]:.3f}" for op in OPS), flush=True)


def main():
    argv = sys.argv[1:]
    opts = {"--repeats": "7", "--command": None, "--extra": None}
    for k in list(opts):
        if k in argv:
            i = argv.index(k)
            opts[k] = argv[i + 1]
            del argv[i:i + 2]
    repeats = int(opts["--repeats"])
    moe = json.load(open(argv[0]))
    if opts["--extra"] and os.path.exists(opts["--extra"]):
        extra = json.load(open(opts["--extra"]))
        moe["results"] += extra["results"]
        moe["validation"] = moe.get("validation", []) + extra.get("validation", [])
    outdir = argv[1] if len(argv) > 1 else "bench/results"
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0)}", flush=True)
    results, validation = [], []
    for c in moe["configs"]:
        d, f, E, k, T = c["d"], c["f"], c["E"], c["k"], c["T"]
        counts = c["counts"]
        ends, bounds, s = [], [], 0
        for n in counts:
            bounds.append((s, s + n))
            s += n
            ends.append(s)
        R = s
        offs = torch.tensor(ends, dtype=torch.int32, device="cuda")
        o = operands(R, E, d, f)
        total = 18 * T * k * d * f
        g, lp = grouped_ops(o, offs), loop_ops(o, bounds)
        ok_grouped = True
        for op in OPS:
            try:
                e = rel_err(g[op](), lp[op]())
            except Exception as ex:  # a layout torch._grouped_mm refuses
                print(f"{c['name']} torch._grouped_mm {op}: {ex}", flush=True)
                validation.append({"config": c["name"], "op": op, "error": str(ex)[:300]})
                ok_grouped = False
                continue
            validation.append({"config": c["name"], "op": op, "rel_err": e, "ok": e < 2 ** -6})
            print(f"validate {c['name']:8s} torch._grouped_mm {op:9s} vs loop: {e:.2e}", flush=True)
        if ok_grouped:
            run("torch _grouped_mm", g, total, repeats, c["name"], results)
        run("torch loop", lp, total, repeats, c["name"], results)
        one = dict(o)
        one["w13"], one["w2"] = o["w13"][:1], o["w2"][:1]
        run("torch dense (1 group)", loop_ops(one, [(0, R)]), total, repeats, c["name"], results)
        del o, one, g, lp
        torch.cuda.empty_cache()

    th = {"torch": torch.__version__, "cuda": torch.version.cuda,
          "device": torch.cuda.get_device_name(0), "repeats": repeats,
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
          "validation": validation, "results": results}
    report(moe, th, outdir, opts["--command"])


def report(moe, th, outdir, command):
    rows = moe["results"] + th["results"]
    by = {(r["config"], r["impl"]): r for r in rows}
    os.makedirs(outdir, exist_ok=True)
    lines = ["# Grouped GEMM: the GEMMs of the GLU expert MLP, forward + backward (bf16)", "",
             f"- device: {moe['device']}; date {moe['date']}",
             f"- {moe['tool']}, CUDA runtime {moe['cuda_runtime']}, driver {moe['cuda_driver']}, "
             f"cuBLAS {moe['cublas']}; torch {th['torch']} (CUDA {th['cuda']})",
             f"- T = {moe['T']} tokens, random top-k routing (the same group sizes on both sides), "
             "median of %d samples with CUDA events" % moe["repeats"],
             "- chain = fwd_13 + fwd_2 + dgrad_2 + wgrad_2 + dgrad_13 + wgrad_13 (w13 the fused "
             "(E, d, 2f) gate/up weight); TFLOP/s counts 18 T k d f",
             "- % dense: of the same side's dense rate (the six GEMMs as one group of all rows); "
             "vs torch: time of torch._grouped_mm's chain / this time (> 1: faster than torch)"]
    if command:
        lines.append(f"- command: `{command}`")
    lines += ["", "| config | impl | ms | TFLOP/s | % dense | vs torch._grouped_mm |",
              "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        side = "moe" if r["impl"].startswith("moe") else "torch"
        dense = by.get((r["config"], f"{side} dense (1 group)"))
        tg = by.get((r["config"], "torch _grouped_mm"))
        pct = f"{100 * r['tflops'] / dense['tflops']:.0f}%" if dense and dense['tflops'] > 0 else "-"
        vs = f"{tg['ms'] / r['ms']:.2f}x" if tg else "-"
        lines.append(f"| {r['config']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                     f"{pct} | {vs} |")
    lines += ["", "Per GEMM (ms):", "", "| config | impl | " + " | ".join(OPS) + " |",
              "|---|---|" + "---:|" * len(OPS)]
    for r in rows:
        lines.append(f"| {r['config']} | {r['impl']} | " +
                     " | ".join(f"{r['ops'][op]:.3f}" for op in OPS) + " |")
    with open(os.path.join(outdir, "grouped.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(outdir, "grouped.json"), "w") as fh:
        json.dump({"moe": moe, "torch": th, "command": command}, fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
