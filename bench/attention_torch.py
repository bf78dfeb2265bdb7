"""bench/attention_torch.py - PyTorch's side of the attention benchmark.

1. --dump DIR: checks the problem bench/attention_check.lua dumped (q, k, v, dout and
   moe's out, lse, dq, dk, dv as raw f32 of bf16 values) against
   torch.nn.functional.scaled_dot_product_attention(is_causal=True) in bf16
   and against a float64 reference of the same inputs; prints the errors of
   both implementations against float64 so they can be compared.
2. Times SDPA forward and forward+backward (bf16, causal) at the shapes of
   bench/attention.lua with CUDA events: warm-up, then the median of repeats.
   The default backend (what torch picks) is the baseline; FLASH_ATTENTION
   and CUDNN_ATTENTION are timed too for reference where available.
3. --moe FILE --out DIR: merges moe's JSON with these figures into
   DIR/attention.json and DIR/attention.md (the committed results).

FLOPs: forward 4*B*H*T*T*D/2 (causal half), backward 2.5x forward.
"""
import argparse
import datetime
import json
import os
import statistics

import torch
import torch.nn.functional as F

NOTES = """
Notes:
- moe's default kernels on an H100/H200 (compute capability 9.x) are warp-specialised
  Hopper kernels (kernels/attention.cu): a producer warpgroup loads tiles by TMA into a
  shared-memory ring guarded by mbarriers, two consumer warpgroups run wgmma (S = Q K^T
  from shared memory, O += P V with P from registers). Forward: 128 queries per block,
  key blocks of 128, the softmax of one key block overlapped with the P V product of the
  previous one, the two consumers taking turns (ping-pong). Backward: 128 keys per
  block, query blocks of 64; dQ summed over key blocks in f32 by bulk reductions
  (cp.reduce.async.bulk), so it is not bit-reproducible; MOE_ATTN_DETERMINISTIC=1 runs
  the deterministic mma.sync backward instead (its own dQ pass, no atomics). Both
  kernels are persistent: one block per multiprocessor loops over the tiles, a head's
  tiles together (heaviest first within the head) so that the blocks running at once
  share that head's K, V, Q and dO in L2, and the next tile's loads overlap the current
  one's last products and output (MOE_ATTN_PERSISTENT=0: one block per tile;
  MOE_ATTN_ORDER=block: every head's heaviest tile first; bench/gpu_round.sh prints
  those timings and the ones without ping-pong beside these).
- "moe mma.sync" is the FlashAttention-2-style mma.sync m16n8k16 kernels
  (MOE_ATTN_WG=0: what GPUs other than 9.x run), timed in the same run.
- The TF/s columns count the conventional 2.5x forward for the backward.
"""


SHAPES = [(8, 16, 1024, 128), (4, 16, 2048, 128), (2, 16, 4096, 128), (4, 16, 2048, 64)]


def load(dump, name, shape):
    import numpy as np
    a = np.fromfile(os.path.join(dump, name + ".f32"), dtype="<f4").reshape(shape)
    return torch.from_numpy(a.copy()).cuda()


def validate(dump):
    B, H, T, D = map(int, open(os.path.join(dump, "shape.txt")).read().split())
    s4, s3 = (B, H, T, D), (B, H, T)
    q, k, v, dout = (load(dump, n, s4).bfloat16() for n in ("q", "k", "v", "dout"))
    moe = {n: load(dump, n, s4) for n in ("out", "dq", "dk", "dv")}
    moe["lse"] = load(dump, "lse", s3)

    def run(dtype, backend=None):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*x, is_causal=True)
        o.backward(dout.to(dtype))
        return {"out": o.detach().double(), "dq": x[0].grad.double(), "dk": x[1].grad.double(),
                "dv": x[2].grad.double()}

    ref = run(torch.float64)
    tch = run(torch.bfloat16)
    sc = q.double() @ k.double().transpose(-1, -2) / D ** 0.5
    sc = sc.masked_fill(torch.ones(T, T, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref["lse"] = torch.logsumexp(sc, -1)
    rows = []
    for n in ("out", "lse", "dq", "dk", "dv"):
        r = ref[n]
        scale = r.abs().max().item()
        em = (moe[n].double() - r).abs().max().item()
        et = (tch[n] - r).abs().max().item() if n in tch else None  # torch returns no lse
        emt = (moe[n].double() - tch[n]).abs().max().item() if n in tch else None
        rows.append({"tensor": n, "max_abs_ref": scale, "moe_vs_f64": em, "torch_vs_f64": et,
                     "moe_vs_torch": emt})
    print("validation (B, H, T, D) = %s, causal, bf16; max abs errors:" % (s4,))
    print("%-6s %12s %12s %12s %12s" % ("tensor", "max|ref|", "moe-f64", "torch-f64", "moe-torch"))
    g = lambda x: "%.4g" % x if x is not None else "n/a"
    for r in rows:
        print("%-6s %12s %12s %12s %12s" % (r["tensor"], g(r["max_abs_ref"]), g(r["moe_vs_f64"]),
                                           g(r["torch_vs_f64"]), g(r["moe_vs_torch"])))
    ok = all(r["moe_vs_f64"] <= 2 * max(r["torch_vs_f64"], 1e-3) + 1e-3 for r in rows
             if r["tensor"] != "lse") and rows[1]["moe_vs_f64"] < 1e-3
    print("validation:", "PASS" if ok else "FAIL",
          "(moe's error against float64 within 2x torch's + 1e-3; lse within 1e-3)")
    return {"shape": list(s4), "rows": rows, "pass": ok}


def time_ms(fn, iters=5, repeats=15):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / iters)
    return statistics.median(samples)


def bench_torch(backend=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    res = []
    for B, H, T, D in SHAPES:
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwdbwd():
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            o.backward(do)
            qg.grad = kg.grad = vg.grad = None

        try:
            if backend is None:
                tf, tfb = time_ms(fwd), time_ms(fwdbwd, iters=3)
            else:
                with sdpa_kernel([getattr(SDPBackend, backend)]):
                    tf, tfb = time_ms(fwd), time_ms(fwdbwd, iters=3)
        except RuntimeError as e:
            print("torch backend %s unavailable at %s: %s" % (backend, (B, H, T, D), str(e)[:100]))
            tf = tfb = None
        flops = 4 * B * H * T * T * D / 2
        res.append({"B": B, "H": H, "T": T, "D": D, "fwd_ms": tf, "fwdbwd_ms": tfb,
                    "fwd_tflops": flops / tf / 1e9 if tf else None,
                    "fwdbwd_tflops": 3.5 * flops / tfb / 1e9 if tfb else None})
    return res


def moe_results(path):
    """The rows of a bench/attention.lua JSON: its "results" (a bare list in files written
    before bench/lib.lua)."""
    if not path:
        return []
    j = json.load(open(path))
    return j["results"] if isinstance(j, dict) else j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump")
    ap.add_argument("--moe")
    ap.add_argument("--moe-alt", help="moe's JSON with MOE_ATTN_WG=0 (the mma.sync kernels)")
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    env = {"device": dev, "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        import subprocess
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    print(env)
    val = validate(a.dump) if a.dump else None
    torch_default = bench_torch()
    torch_flash = bench_torch("FLASH_ATTENTION")
    torch_cudnn = bench_torch("CUDNN_ATTENTION")
    moe = moe_results(a.moe)
    alt = moe_results(a.moe_alt)
    rows = []
    for i, t in enumerate(torch_default):
        m = next((r for r in moe if (r["B"], r["H"], r["T"], r["D"]) == (t["B"], t["H"], t["T"], t["D"])), None)
        row = {"B": t["B"], "H": t["H"], "T": t["T"], "D": t["D"], "causal": True, "moe": m,
               "torch_default": t, "torch_flash": torch_flash[i], "torch_cudnn": torch_cudnn[i],
               "moe_mma_sync": next((r for r in alt if (r["B"], r["H"], r["T"], r["D"]) == (t["B"], t["H"], t["T"], t["D"])), None)}
        if m:
            row["ratio_fwd"] = t["fwd_ms"] / m["fwd_ms"]
            row["ratio_fwdbwd"] = t["fwdbwd_ms"] / m["fwdbwd_ms"]
        rows.append(row)
    hdr = ("| B,H,T,D | moe fwd ms (TF/s) | torch fwd ms (TF/s) | moe f+b ms (TF/s) | torch f+b ms (TF/s) "
           "| f+b ratio (torch/moe) | torch flash fwd / f+b ms | f+b ratio vs flash | torch cudnn fwd / f+b ms "
           "| moe mma.sync fwd / f+b ms |")
    lines = [hdr, "|" + "---|" * 10]
    fmt = lambda ms, tf: "%.3f (%.0f)" % (ms, tf) if ms else "n/a"
    both = lambda t: "%.3f / %.3f" % (t["fwd_ms"], t["fwdbwd_ms"]) if t["fwdbwd_ms"] else "n/a"
    # which backend the default picked, judged by timing
    for r in rows:
        d, fl, cu = r["torch_default"]["fwdbwd_ms"], r["torch_flash"]["fwdbwd_ms"], r["torch_cudnn"]["fwdbwd_ms"]
        cands = [(abs(d - x) / d, n) for x, n in ((fl, "flash"), (cu, "cudnn")) if x]
        r["torch_default_like"] = min(cands)[1] if cands else "?"
    for r in rows:
        m, t = r["moe"] or {}, r["torch_default"]
        lines.append("| %d,%d,%d,%d | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["B"], r["H"], r["T"], r["D"], fmt(m.get("fwd_ms"), m.get("fwd_tflops")),
            fmt(t["fwd_ms"], t["fwd_tflops"]), fmt(m.get("fwdbwd_ms"), m.get("fwdbwd_tflops")),
            fmt(t["fwdbwd_ms"], t["fwdbwd_tflops"]),
            "%.2f" % r["ratio_fwdbwd"] if "ratio_fwdbwd" in r else "n/a",
            both(r["torch_flash"]),
            "%.2f" % (r["torch_flash"]["fwdbwd_ms"] / m["fwdbwd_ms"]) if m and r["torch_flash"]["fwdbwd_ms"] else "n/a",
            both(r["torch_cudnn"]), both(r["moe_mma_sync"]) if r["moe_mma_sync"] else "n/a"))
    print("\n".join(lines))
    if a.out:
        json.dump({"env": env, "validation": val, "results": rows}, open(os.path.join(a.out, "attention.json"), "w"), indent=1)
        with open(os.path.join(a.out, "attention.md"), "w") as f:
            f.write("# Attention benchmark: moe fused causal attention vs torch SDPA\n\n")
            f.write("%s, torch %s (CUDA %s), driver %s, %s. bf16, causal; median of 15 repeats after warm-up.\n"
                    "FLOPs: forward 4*B*H*T*T*D/2, backward 2.5x forward. Ratio = torch ms / moe ms "
                    "(target >= 0.8 for forward+backward, head dim 128, T 1024-4096). torch's default "
                    "backend's timings match: %s.\n\n"
                    % (env["device"], env["torch"], env["cuda"], env.get("driver", "?"), env["date"],
                       ", ".join(sorted(set(r["torch_default_like"] for r in rows)))))
            f.write("\n".join(lines) + "\n")
            tgt = [r for r in rows if r["D"] == 128 and "ratio_fwdbwd" in r]
            met = [r["T"] for r in tgt if r["ratio_fwdbwd"] >= 0.8]
            miss = [r["T"] for r in tgt if r["ratio_fwdbwd"] < 0.8]
            verdict = "met at T = %s" % (", ".join(map(str, met)) or "none")
            if miss:
                verdict += "; NOT met at T = %s" % ", ".join(map(str, miss))
            f.write("\nTarget (forward+backward >= 0.8x torch's default SDPA, head dim 128, "
                    "T 1024-4096): %s.\n" % verdict)
            if val:
                f.write("\nValidation against float64 (B,H,T,D = %s, max abs error): \n\n" % (val["shape"],))
                f.write("| tensor | max abs ref | moe vs f64 | torch vs f64 | moe vs torch |\n|---|---|---|---|---|\n")
                g = lambda x: "%.4g" % x if x is not None else "n/a"
                for r in val["rows"]:
                    f.write("| %s | %s | %s | %s | %s |\n" % (r["tensor"], g(r["max_abs_ref"]), g(r["moe_vs_f64"]),
                                                           g(r["torch_vs_f64"]), g(r["moe_vs_torch"])))
                f.write("\nvalidation: %s\n" % ("PASS" if val["pass"] else "FAIL"))
            f.write(NOTES)


if __name__ == "__main__":
    main()
