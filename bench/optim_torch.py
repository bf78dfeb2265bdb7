"""bench/optim_torch.py - PyTorch's side of bench/optim.lua: the optimizer step
and gradient clipping on the same parameter shapes (the JSON that
`moe-lua bench/optim.lua model=both shapes=FILE` writes), as the PyTorch
training reference runs them: fp32 parameters and gradients,
torch.optim.AdamW(fused=True) (and foreach=True), two weight-decay groups
(1-D parameters without decay), clip_grad_norm_(foreach=True) with its
host read of the norm (.item(), as a loop that checks the norm does) and
without. Timed with CUDA events: the median over --repeats samples of
--iters calls after a warm-up.

  python3 bench/optim_torch.py SHAPES.json [--models 46m,125m] [--json FILE]

Bytes: an fp32 AdamW step reads the gradient and reads and writes the
parameter, exp_avg and exp_avg_sq (28 bytes per element, as bench/optim.lua
counts for bf16 parameters with fp32 masters); a norm reads the gradient (4).
"""
import argparse
import json
import statistics

import torch


def timed(fn, iters, repeats, warmup=3):
    for _ in range(warmup):
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
        samples.append(a.elapsed_time(b) / 1e3 / iters)
    return statistics.median(samples)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes")
    ap.add_argument("--models", default="")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    spec = json.load(open(args.shapes))
    models = args.models.split(",") if args.models else list(spec)
    dev = torch.device("cuda")
    rows = []
    for name in models:
        plist = spec[name]
        params = [torch.nn.Parameter(torch.randn(p["shape"], device=dev) * 0.02) for p in plist]
        for p in params:
            p.grad = torch.randn_like(p) * 0.01
        numel = sum(p.numel() for p in params)
        decay = [p for p, s in zip(params, plist) if s["decay"]]
        nodecay = [p for p, s in zip(params, plist) if not s["decay"]]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}]

        def add(case, secs, nbytes):
            rows.append({"model": name, "tensors": len(params), "params": numel, "case": case,
                         "ms": secs * 1e3, "gbs": nbytes / secs / 1e9})
            print(f"{name:5s} {case:45s} {secs * 1e3:9.3f} ms {nbytes / secs / 1e9:7.0f} GB/s", flush=True)

        for kind in ("fused", "foreach"):
            opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), **{kind: True})
            add(f"AdamW({kind}=True)", timed(opt.step, args.iters, args.repeats), 28 * numel)
            opt.state.clear()
            del opt
            torch.cuda.empty_cache()
        clip = torch.nn.utils.clip_grad_norm_
        add("clip_grad_norm_(foreach) + .item()",
            timed(lambda: clip(params, 1e9, foreach=True).item(), args.iters, args.repeats), 4 * numel)
        add("clip_grad_norm_(foreach), no read",
            timed(lambda: clip(params, 1e9, foreach=True), args.iters, args.repeats), 4 * numel)
        opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)

        def clipped_step():
            clip(params, 1.0, foreach=True)
            opt.step()

        add("clip_grad_norm_ + AdamW(fused) (a clipped step)",
            timed(clipped_step, args.iters, args.repeats), 28 * numel + 12 * numel)
        del opt, params, decay, nodecay, groups
        torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print("wrote " + args.json)


if __name__ == "__main__":
    main()
