"""bench/dist_collectives_torch.py - the torch.distributed reference for
bench/dist_collectives.lua: all_reduce (sum) and all_to_all_single (equal
splits) on the NCCL backend, the same sizes (MiB per rank), dtype, checks,
timing and JSON fields, under the same mpirun (no torchrun):

  mpirun -n 2 --bind-to none python3 bench/dist_collectives_torch.py [--json FILE] [--dtype bf16]
         [--sizes 8,64,256,1024] [--ops all_reduce,all_to_all] [--iters 0] [--repeats 10] [--warmup 3]

Rank, world size and local rank come from Open MPI's OMPI_COMM_WORLD_*
variables (torchrun's RANK / WORLD_SIZE / LOCAL_RANK otherwise); the process
group meets at tcp://127.0.0.1:$MASTER_PORT (default 29533), one node.

Timing: CUDA events on the current stream around `iters` synchronous calls
(each waits for the current stream and makes it wait, as moe.dist does), the
median of `repeats` samples after `warmup` calls, on rank 0. Bandwidths as
nccl-tests: algbw = bytes per rank / time; busbw = algbw * 2(n-1)/n
(all_reduce), algbw * (n-1)/n (all_to_all); GB/s = 1e9 bytes/s.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

COLS = 1024  # elements per row of the all_to_all tensors, as the Lua script


def env_int(*names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v is not None and v != "":
            return int(v)
    return default


def iters_for(mib, iters):
    if iters > 0:
        return iters
    if mib <= 64:
        return 20
    if mib <= 256:
        return 10
    return 5


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32", "f16", "f64"])
    ap.add_argument("--sizes", default="8,64,256,1024")
    ap.add_argument("--ops", default="all_reduce,all_to_all")
    ap.add_argument("--iters", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    rank = env_int("OMPI_COMM_WORLD_RANK", "RANK", default=0)
    world = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", default=1)
    local = env_int("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK", default=0)
    port = env_int("MASTER_PORT", default=29533)
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    n = world
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16,
             "f64": torch.float64}[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    ops = [o for o in args.ops.split(",") if o]

    def check(cond, what):
        if not cond:
            raise SystemExit(f"dist_collectives_torch: check failed on rank {rank}: {what}")

    def validate(op, mib):
        elems = mib * 1024 * 1024 // esize
        if op == "all_reduce":
            t = torch.full((elems,), rank + 1, dtype=dtype, device=device)
            dist.all_reduce(t)
            want = n * (n + 1) / 2
            lo, hi = t.min().item(), t.max().item()
            check(lo == want and hi == want, f"all_reduce of {mib} MiB: [{lo}, {hi}], {want} expected")
        else:
            rows = elems // COLS
            chunk = rows // n
            inp = torch.empty((rows, COLS), dtype=dtype, device=device)
            for j in range(n):
                inp[j * chunk:(j + 1) * chunk].fill_(rank * n + j)
            out = torch.zeros_like(inp)
            dist.all_to_all_single(out, inp)
            for r in range(n):
                blk = out[r * chunk:(r + 1) * chunk]
                lo, hi, want = blk.min().item(), blk.max().item(), r * n + rank
                check(lo == want and hi == want,
                      f"all_to_all of {mib} MiB: rows from rank {r} are [{lo}, {hi}], {want} expected")
        torch.cuda.synchronize()

    results = []
    for op in ops:
        if op not in ("all_reduce", "all_to_all"):
            raise SystemExit(f"dist_collectives_torch: unknown op {op}")
        for mib in sizes:
            validate(op, mib)
            nbytes = mib * 1024 * 1024
            elems = nbytes // esize
            if op == "all_reduce":
                t = torch.randn((elems,), dtype=dtype, device=device)

                def f():
                    dist.all_reduce(t)
            else:
                rows = elems // COLS
                inp = torch.randn((rows, COLS), dtype=dtype, device=device)
                out = torch.empty_like(inp)

                def f():
                    dist.all_to_all_single(out, inp)
            iters = iters_for(mib, args.iters)
            for _ in range(args.warmup):
                f()
            torch.cuda.synchronize()
            samples = []
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            for _ in range(args.repeats):
                e0.record()
                for _ in range(iters):
                    f()
                e1.record()
                e1.synchronize()
                samples.append(e0.elapsed_time(e1) / 1e3 / iters)
            s = statistics.median(samples)
            if op == "all_reduce":
                del t
            else:
                del inp, out
            torch.cuda.empty_cache()
            algbw = nbytes / s / 1e9
            factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
            results.append({"op": op, "mib": mib, "bytes": nbytes, "dtype": args.dtype, "ranks": n,
                            "iters": iters, "ms": s * 1e3, "algbw_gbps": algbw,
                            "busbw_gbps": algbw * factor})
            if rank == 0:
                print(f"{op:<10} {mib:5d} MiB  {s * 1e3:9.3f} ms  algbw {algbw:7.1f} GB/s  "
                      f"busbw {algbw * factor:7.1f} GB/s", flush=True)

    dist.barrier()
    if rank == 0:
        nv = torch.cuda.nccl.version()
        nccl_version = ".".join(str(x) for x in nv) if isinstance(nv, tuple) else str(nv)
        obj = {
            "title": f"torch.distributed collectives on {n} GPUs ({args.dtype})",
            "tool": f"torch {torch.__version__}",
            "impl": "torch",
            "device": torch.cuda.get_device_name(device),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "ranks": n,
            "nccl_version": nccl_version,
            "torch": torch.__version__,
            "cuda_runtime": torch.version.cuda,
            "command": " ".join(["python3"] + sys.argv),
            "timing": "CUDA events",
            "repeats": args.repeats,
            "warmup": args.warmup,
            "results": results,
        }
        lines = [f"# {obj['title']}", "",
                 f"- device: {obj['device']}", f"- date: {obj['date']}",
                 f"- versions: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl_version}",
                 f"- command: `{obj['command']}`",
                 f"- timing: CUDA events, median of {args.repeats} repeats after {args.warmup} warm-up calls",
                 "", "| op | MiB | iters | ms | algbw GB/s | busbw GB/s |", "|---|---|---|---|---|---|"]
        for r in results:
            lines.append(f"| {r['op']} | {r['mib']} | {r['iters']} | {r['ms']:.3f} | "
                         f"{r['algbw_gbps']:.1f} | {r['busbw_gbps']:.1f} |")
        md = "\n".join(lines) + "\n"
        print("\n" + md)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(obj, fh, indent=1, sort_keys=True)
                fh.write("\n")
            mdpath = args.md or (args.json[:-5] if args.json.endswith(".json") else args.json) + ".md"
            with open(mdpath, "w") as fh:
                fh.write(md)
            print(f"wrote {args.json} and {mdpath}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
