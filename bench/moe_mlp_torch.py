"""bench/moe_mlp_torch.py - the MoE MLP benchmark, PyTorch side: the cases of
bench/moe_mlp.lua (SwiGLU expert MLP, forward + backward, bf16, T = 16384,
top-k of softmax of random logits; mixtral, olmoe, qwen3) with two PyTorch
implementations, in the same run on the same GPU:

  torch_naive        the per-expert loop: sort the assignments by expert
                     (argsort, bincount -> host: one sync), gather the token
                     rows, per expert silu(x W1) * (x W3) @ W2 on its slice,
                     weight by the gates and index_add back to the tokens.
  torch_grouped_mm   torch._grouped_mm (2-D x 3-D with int32 group ends)
                     for the three GEMMs, groups padded to 16 rows on the GPU
                     (as torchtitan does for _grouped_mm; no host sync), the
                     same gather, gate weighting and index_add.

  torch_grouped_mm_compiled  (--compile) the same function through
                     torch.compile (default mode), which fuses the gathers,
                     activation and gate weighting around the GEMMs.

  scattermoe         (--scattermoe DIR: a checkout of github.com/shawntan/scattermoe,
                     imported from there, nothing of it copied here) its
                     parallel_linear as its GLUMLP uses it: one Triton
                     scatter2scatter for x -> [h1 | h3] (W1 and W3 held as one
                     (E, d, 2f) weight, as ScatterMoE stores them) with the
                     gather fused, silu(h1) * h3, and one for the output with
                     the gate weighting and scatter fused; its own sort/count.

  torch_dense_mlp    (--dense-bound) the same FLOPs with no MoE work at
                     all: one dense SwiGLU MLP (d x f weights) over all T k
                     token copies, no routing, gather, gates or combine; eager,
                     and with --compile also torch.compile'd
                     (torch_dense_mlp_compiled).
  torch_dense_gemms  (--dense-bound) its nine GEMMs alone (cuBLAS through
                     torch.mm into preallocated outputs; dx's two products
                     as one addmm): the same FLOPs with nothing else.

plus the dense bf16 GEMM rate (torch.matmul 8192^3). Every step computes
all weight gradients and the gradients of x and the gates.

  python3 bench/moe_mlp_torch.py [--json FILE] [--repeats N] [--budget S]
                                 [--configs mixtral,olmoe,qwen3]
                                 (also qwen3_t4k, qwen3_t64k: qwen3 at T = 4096 and
                                 65536; deepseek: d 7168, f 2048, E 256, k 8, T = 8192;
                                 llama4: d 5120, f 8192, E 16, k 1)
                                 [--compile] [--scattermoe DIR] [--dense-bound]
                                 [--impls NAME,...] [--cooldown S]

--impls keeps only the named rows; --cooldown S idles the GPU S seconds
before the dense rate and before each row (as moe_mlp.lua's cooldown=), so
that no row starts on a GPU the rows before it have heated.

Timing: 2 warm-up steps, then `repeats` steps each between two CUDA events,
the median (as the Lua side). Peak extra memory:
torch.cuda.max_memory_allocated() during one step minus
torch.cuda.memory_allocated() before it. TFLOP/s: 18 T k d f per step.
"""
import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

T0 = 16384  # tokens, unless a config names its own
CONFIGS = [
    {"name": "mixtral", "d": 4096, "f": 14336, "E": 8, "k": 2},
    {"name": "olmoe", "d": 2048, "f": 1024, "E": 64, "k": 8},
    {"name": "qwen3", "d": 2048, "f": 768, "E": 128, "k": 8},
    # on request (--configs): how qwen3 scales with tokens, and a DeepSeek-V3-like layer
    {"name": "qwen3_t4k", "d": 2048, "f": 768, "E": 128, "k": 8, "T": 4096},
    {"name": "qwen3_t64k", "d": 2048, "f": 768, "E": 128, "k": 8, "T": 65536},
    {"name": "deepseek", "d": 7168, "f": 2048, "E": 256, "k": 8, "T": 8192},
    # top-1 routing (Llama-4-Scout-like experts)
    {"name": "llama4", "d": 5120, "f": 8192, "E": 16, "k": 1},
]
ALIGN = 16


def timed(fn):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def naive(x, w1, w3, w2, ids, gates, E):
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()  # the host sync
    tok = order // k
    xs = x[tok]
    outs = []
    start = 0
    for e, c in enumerate(counts):
        if c:
            h = xs[start:start + c]
            outs.append((F.silu(h @ w1[e]) * (h @ w3[e])) @ w2[e])
        start += c
    ys = torch.cat(outs) * gates.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, ys)


def grouped(x, w1, w3, w2, ids, gates, E):
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = torch.cumsum(padded, 0)
    starts_pad = ends - padded
    starts = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    rank = torch.arange(flat.numel(), device=x.device) - starts[sorted_e]
    pos = starts_pad[sorted_e] + rank  # padded row of each sorted assignment
    rows = flat.numel() + ALIGN * E  # static bound: no host sync
    tok = order // k
    xs = x.new_zeros(rows, x.shape[1]).index_copy(0, pos, x[tok])
    offs = ends.to(torch.int32)
    h = F.silu(torch._grouped_mm(xs, w1, offs=offs)) * torch._grouped_mm(xs, w3, offs=offs)
    y = torch._grouped_mm(h, w2, offs=offs)[pos]
    ys = y * gates.reshape(-1)[order].unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, ys)


def dense_mlp(x, w1, w3, w2):
    """The layer's FLOPs as one dense SwiGLU MLP over x = (T k, d)."""
    return (F.silu(x @ w1) * (x @ w3)) @ w2


class DenseGemms:
    """The nine GEMMs of a dense SwiGLU MLP's forward + backward over R rows,
    into preallocated outputs: h1 = x w1, h3 = x w3, y = a w2; da = dy w2^T,
    dw2 = a^T dy, dx = dh1 w1^T + dh3 w3^T (one mm, one addmm), dw1 = x^T dh1,
    dw3 = x^T dh3. The operands are random; only the products run."""

    def __init__(self, R, d, f, o):
        r = lambda *shape: torch.randn(*shape, **o)  # noqa: E731
        self.x, self.dy, self.a, self.dh1, self.dh3 = r(R, d), r(R, d), r(R, f), r(R, f), r(R, f)
        self.w1, self.w3, self.w2 = r(d, f) * 0.02, r(d, f) * 0.02, r(f, d) * 0.02
        self.h, self.y, self.dx = r(R, f), r(R, d), r(R, d)
        self.dw1, self.dw2 = r(d, f), r(f, d)

    def __call__(self):
        torch.mm(self.x, self.w1, out=self.h)
        torch.mm(self.x, self.w3, out=self.h)
        torch.mm(self.a, self.w2, out=self.y)
        torch.mm(self.dy, self.w2.t(), out=self.h)
        torch.mm(self.a.t(), self.dy, out=self.dw2)
        torch.mm(self.dh1, self.w1.t(), out=self.dx)
        torch.addmm(self.dx, self.dh3, self.w3.t(), out=self.dx)
        torch.mm(self.x.t(), self.dh1, out=self.dw1)
        torch.mm(self.x.t(), self.dh3, out=self.dw1)


def scattermoe_step(smoe):
    """ScatterMoE's GLU expert MLP over (x, W13 (E, d, 2f), W2 (E, f, d))."""
    def glu(x, w13, w2, ids, gates, E):
        k = ids.shape[1]
        sei, ssi, offs = smoe.flatten_sort_count(ids, num_experts=E)
        h = smoe.parallel_linear(x, w13, k, sei, ssi, offs, grouped_out=True)
        h1, h3 = h.chunk(2, dim=-1)
        return smoe.parallel_linear(F.silu(h1) * h3, w2, 1, sei, ssi, offs, gates=gates, grouped_in=True)
    return glu


def dense_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s = [timed(lambda: [a @ b for _ in range(5)]) / 5 for _ in range(10)]
    ms = statistics.median(s)
    return {"name": "torch.matmul bf16 8192^3", "ms": ms, "tflops": 2 * 8192 ** 3 / (ms / 1e3) / 1e12}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--budget", type=float, default=60)
    ap.add_argument("--configs", default="mixtral,olmoe,qwen3")
    ap.add_argument("--compile", action="store_true",
                    help="also torch.compile of the _grouped_mm step (torch_grouped_mm_compiled)")
    ap.add_argument("--scattermoe", metavar="DIR",
                    help="also ScatterMoE, imported from this checkout of shawntan/scattermoe")
    ap.add_argument("--impls", help="only these rows (comma separated names)")
    ap.add_argument("--cooldown", type=float, default=0,
                    help="seconds the GPU idles before the dense rate and before each row")
    ap.add_argument("--dense-bound", action="store_true",
                    help="also the layer's FLOPs as one dense MLP (torch_dense_mlp, torch_dense_gemms)")
    a = ap.parse_args()
    smoe_version = None
    if a.scattermoe:  # its commit: a COMMIT file beside the package (an exported tree), else git
        import importlib
        import os
        import subprocess
        sys.path.insert(0, a.scattermoe)
        smoe = importlib.import_module("scattermoe")
        marker = os.path.join(a.scattermoe, "COMMIT")
        if os.path.exists(marker):
            smoe_version = open(marker).read().strip()
        elif os.path.exists(os.path.join(a.scattermoe, ".git")):  # its own checkout, not an enclosing repository
            git = subprocess.run(["git", "-C", a.scattermoe, "rev-parse", "HEAD"], capture_output=True, text=True)
            smoe_version = git.stdout.strip() or "unknown"
        else:
            smoe_version = "unknown (no COMMIT file, no .git)"

    def cooldown():
        torch.cuda.synchronize()
        if a.cooldown > 0:
            time.sleep(a.cooldown)

    impls = [("torch_naive", naive), ("torch_grouped_mm", grouped)]
    if a.compile:  # the warm-up step compiles (once per config: static shapes)
        impls.append(("torch_grouped_mm_compiled", torch.compile(grouped)))
    if a.dense_bound:
        impls.append(("torch_dense_mlp", dense_mlp))
        if a.compile:
            impls.append(("torch_dense_mlp_compiled", torch.compile(dense_mlp)))
        impls.append(("torch_dense_gemms", None))
    if a.scattermoe:  # last: an illegal address in it (DeepSeek-like) ends the process's CUDA work
        impls.append(("scattermoe", scattermoe_step(smoe)))
    if a.impls:
        known = [n for n, _ in impls]
        unknown = [n for n in a.impls.split(",") if n not in known]
        if unknown:
            ap.error(f"--impls: no row named {', '.join(unknown)} with these options (rows: {', '.join(known)})")
        impls = [(n, f) for n, f in impls if n in a.impls.split(",")]
    t0 = time.time()
    cooldown()
    dense = dense_rate()
    print(f"dense bf16 GEMM 8192^3: {dense['ms']:.3f} ms, {dense['tflops']:.1f} TFLOP/s")
    results = []
    lost = None  # an error that left the CUDA context unusable (e.g. an illegal address)
    for c in CONFIGS:
        if c["name"] not in a.configs.split(","):
            continue
        if lost:  # nothing more can run in this process: say so for each row, keep the rest
            for name, _ in impls:
                results.append({"config": c["name"], "impl": name, "skipped": True, "error": lost})
                print(f"{c['name']:8s} {name:17s} skipped: {lost}")
            continue
        torch.manual_seed(1234)
        d, f, E, k, T = c["d"], c["f"], c["E"], c["k"], c.get("T", T0)
        o = {"device": "cuda", "dtype": torch.bfloat16}
        x = torch.randn(T, d, **o).requires_grad_()
        w1 = (torch.randn(E, d, f, **o) * 0.02).requires_grad_()
        w3 = (torch.randn(E, d, f, **o) * 0.02).requires_grad_()
        w2 = (torch.randn(E, f, d, **o) * 0.02).requires_grad_()
        logits = torch.randn(T, E, device="cuda")
        g, ids = torch.topk(torch.softmax(logits, -1), k, -1)
        gates = g.to(torch.bfloat16).requires_grad_()
        dy = torch.randn(T, d, **o)
        params = [x, w1, w3, w2, gates]
        flops = 18 * T * k * d * f
        for name, fn in impls:
            r = {"config": c["name"], "impl": name, "T": T, "d": d, "f": f, "E": E, "k": k,
                 "flops": flops}
            if lost:
                r.update(skipped=True, error=lost)
            elif time.time() - t0 > a.budget:
                r.update(skipped=True, error="time budget exhausted")
            else:
                w13, dyd = None, dy
                if name == "scattermoe":  # W1 and W3 as one weight, made once (not timed)
                    w13 = torch.cat([w1, w3], 2).detach().requires_grad_()
                    args, ps = (x, w13, w2, ids, gates, E), [x, w13, w2, gates]
                elif name.startswith("torch_dense_mlp"):  # T k rows, expert 0's weights
                    ps = [torch.randn(T * k, d, **o).requires_grad_()]
                    ps += [w[0].detach().clone().requires_grad_() for w in (w1, w3, w2)]
                    args, dyd = tuple(ps), torch.randn(T * k, d, **o)
                else:
                    args, ps = (x, w1, w3, w2, ids, gates, E), params

                def step():
                    fn(*args).backward(dyd)
                    for p in ps:
                        p.grad = None
                if name == "torch_dense_gemms":  # the products alone: no autograd
                    step = DenseGemms(T * k, d, f, o)
                try:
                    cooldown()
                    step()  # warm-up (cuBLAS heuristics, caching allocator growth)
                    first = timed(step)
                    if first > 3000:
                        raise RuntimeError(f"too slow to time: a warm step took {first:.0f} ms")
                    reps = 3 if first > 1000 else a.repeats
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    step()
                    torch.cuda.synchronize()
                    r["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
                    ms = statistics.median([timed(step) for _ in range(reps)])
                    r.update(ms=ms, repeats=reps, tflops=flops / (ms / 1e3) / 1e12)
                    r["pct_dense"] = 100 * r["tflops"] / dense["tflops"]
                except Exception as e:  # report, keep going
                    r.update(skipped=True, error=f"{type(e).__name__}: {e}"[:300])
                    if "illegal memory access" in str(e) or "unspecified launch failure" in str(e):
                        lost = f"not run: the CUDA context was lost to {name} on {c['name']}"
                    else:
                        torch.cuda.empty_cache()
                del w13, args, ps, dyd, step
            results.append(r)
            if "ms" in r:
                print(f"{c['name']:8s} {name:17s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s "
                      f"{r['pct_dense']:5.1f}% of dense  peak extra {r['peak_extra_bytes'] / 2**30:.2f} GiB")
            else:
                print(f"{c['name']:8s} {name:17s} skipped: {r['error']}")
        del x, w1, w3, w2, gates, dy, params
        if not lost:
            torch.cuda.empty_cache()
    if a.json:
        out = {"tool": f"torch {torch.__version__}", "cuda": torch.version.cuda,
               "device": torch.cuda.get_device_name(0),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "dtype": "bf16", "T": T0, "dense": dense, "results": results,
               "command": " ".join(["python3"] + sys.argv), "cooldown_s": a.cooldown,
               "scattermoe": smoe_version and {"repo": "github.com/shawntan/scattermoe", "commit": smoe_version}}
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
