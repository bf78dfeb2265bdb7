"""bench/matmul_torch.py - the cases of bench/matmul.lua timed with PyTorch on
the same GPU, in the same run: torch.matmul and torch.nn.functional.linear,
bf16 (and one f32 GEMM with TF32 off, torch's default for matmul).

  python3 bench/matmul_torch.py [--json FILE] [--repeats N]

Timing: warm-up, then `repeats` samples of `iters` calls between two CUDA
events (the same iters as the Lua side), the median per call. Inputs are
random normal. FLOPs: 2 M N K per GEMM (3 GEMMs for a layer's forward and
backward).
"""
import argparse
import datetime
import json
import statistics
import time

import torch
import torch.nn.functional as F


def time_cuda(f, iters, repeats):
    for _ in range(5):
        f()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            f()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(samples)


def blas_library():
    try:
        return str(torch.backends.cuda.preferred_blas_library())
    except Exception:  # older torch: no such query
        return None


def cooldown(seconds):
    """Idles the GPU (synchronised first), as bench/matmul.lua --cooldown."""
    torch.cuda.synchronize()
    if seconds > 0:
        time.sleep(seconds)


def fused_breakdown(repeats, randn, cool=0.0):
    """The fused step's phases, as bench/matmul.lua's breakdown: fwd_ms and
    bwd_ms between CUDA events one step per sync (medians); by_hand_ms the
    same GPU work without autograd (F.linear + bias, dY W, dY^T X, dY.sum(0));
    step_events_ms the table's step timed the same way as the Lua side's."""
    x = randn(16384, 4096).requires_grad_()
    w = randn(14336, 4096).requires_grad_()
    b = randn(14336).requires_grad_()
    dy = randn(16384, 14336)
    xd, wd, bd = x.detach(), w.detach(), b.detach()

    def step():
        F.linear(x, w, b).backward(dy)
        x.grad = None
        w.grad = None
        b.grad = None

    def by_hand():
        F.linear(xd, wd, bd)
        torch.matmul(dy, wd)
        torch.matmul(dy.t(), xd)
        dy.sum(0)

    # the same order as bench/matmul.lua, each part after its own idle
    cooldown(cool)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    step_ms = time_cuda(step, 3, repeats) * 1e3
    cooldown(cool)
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    fwd, bwd = [], []
    for _ in range(repeats):
        e[0].record()
        y = F.linear(x, w, b)
        e[1].record()
        y.backward(dy)
        e[2].record()
        e[2].synchronize()
        fwd.append(e[0].elapsed_time(e[1]))
        bwd.append(e[1].elapsed_time(e[2]))
        del y
        x.grad = None
        w.grad = None
        b.grad = None
    cooldown(cool)
    out = {"step_events_ms": step_ms,
           "fwd_ms": statistics.median(fwd), "bwd_ms": statistics.median(bwd),
           "by_hand_ms": time_cuda(by_hand, 3, repeats) * 1e3}
    del x, w, b, dy, xd, wd, bd
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--cooldown", type=float, default=0.0,
                    help="idle seconds before each case and the breakdown (as bench/matmul.lua)")
    args = ap.parse_args()
    assert torch.cuda.is_available()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    bf = torch.bfloat16

    def randn(*shape, dtype=bf):
        return torch.randn(*shape, device=dev, dtype=dtype)

    def mm(M, N, K, dtype=bf):
        a, b = randn(M, K, dtype=dtype), randn(K, N, dtype=dtype)
        return lambda: torch.matmul(a, b)

    def linear(bias):
        x, w = randn(16384, 4096), randn(14336, 4096)
        b = randn(14336) if bias else None
        return lambda: F.linear(x, w, b)

    def dw():
        dy, x = randn(16384, 14336), randn(16384, 4096)
        return lambda: torch.matmul(dy.t(), x)

    def linear_train():
        x = randn(16384, 4096).requires_grad_()
        w = randn(14336, 4096).requires_grad_()
        b = randn(14336).requires_grad_()
        dy = randn(16384, 14336)

        def f():
            F.linear(x, w, b).backward(dy)
            x.grad = None
            w.grad = None
            b.grad = None
        return f

    cases = [
        ("matmul 4096^3", 4096, 4096, 4096, "bf16", lambda: mm(4096, 4096, 4096)),
        ("matmul 8192^3", 8192, 8192, 8192, "bf16", lambda: mm(8192, 8192, 8192)),
        ("linear x W^T", 16384, 14336, 4096, "bf16", lambda: linear(False)),
        ("linear x W^T + b", 16384, 14336, 4096, "bf16", lambda: linear(True)),
        ("linear bwd dX = dY W", 16384, 4096, 14336, "bf16", lambda: mm(16384, 4096, 14336)),
        ("linear bwd dW = dY^T X", 14336, 4096, 16384, "bf16", dw),
        ("linear fwd+bwd (autograd)", 16384, 14336, 4096, "bf16", linear_train, 3),
        ("matmul 4096^3 f32", 4096, 4096, 4096, "f32",
         lambda: mm(4096, 4096, 4096, dtype=torch.float32)),
    ]
    results = []
    print(f"{'case':26s} {'dtype':6s} {'ms':>10s} {'TFLOP/s':>10s}")
    for name, M, N, K, dtype, setup, *rest in cases:
        gemms = rest[0] if rest else 1  # M x N x K GEMMs per call
        f = setup()
        cooldown(args.cooldown)
        flops = 2 * M * N * K * gemms
        iters = max(3, min(200, int(2e13 // flops)))
        t = time_cuda(f, iters, args.repeats)
        r = {"name": name, "M": M, "N": N, "K": K, "gemms": gemms, "dtype": dtype, "ms": t * 1e3,
             "tflops": flops / t / 1e12}
        results.append(r)
        print(f"{name:26s} {dtype:6s} {r['ms']:10.4f} {r['tflops']:10.1f}")
        del f
        torch.cuda.empty_cache()
    breakdown = fused_breakdown(args.repeats, randn, args.cooldown)
    clock = next(r["ms"] for r in results if r["name"] == "linear fwd+bwd (autograd)")
    print(f"breakdown of the fused step: events {breakdown['step_events_ms']:.4f} ms "
          f"(table {clock:.4f}), fwd {breakdown['fwd_ms']:.4f}, bwd {breakdown['bwd_ms']:.4f}, "
          f"by hand {breakdown['by_hand_ms']:.4f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({
                "tool": f"torch {torch.__version__}",
                "device": torch.cuda.get_device_name(0),
                "cuda": torch.version.cuda,
                "blas_library": blas_library(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "repeats": args.repeats,
                "cooldown_s": args.cooldown,
                "tf32": False,
                "results": results,
                "breakdown": breakdown,
            }, fh, indent=1)


if __name__ == "__main__":
    main()
