#!/usr/bin/env python3
"""Overlap of collectives and compute in a training run, from an Nsight Systems GPU trace.

    python3 bench/overlap_report.py NAME TRACE.csv [TRACE.csv ...] > NAME.md

Each TRACE.csv is one rank's `nsys stats -r cuda_gpu_trace -f csv` (bench/dist_profile.sh writes
them). Steps end with the optimizer: a step boundary is the end of the last AdamW kernel of a
cluster of them. For each rank, over the steps after the first SKIP (default 3), per step:

  wall        one step boundary to the next
  compute     time some compute kernel runs (kernels that are not NCCL's; copies excluded)
  compute_sum the compute kernels' summed durations (against the one-GPU run: what the
              collectives' SMs and the layout's extra kernels cost the compute)
  nccl        time some NCCL kernel runs, and per kind (AllGather, ReduceScatter, AllReduce,
              SendRecv: all_to_all) its summed durations
  exposed     time an NCCL kernel runs and no compute kernel does: communication the step waits on
              (NCCL kernels also wait for the other rank inside them: imbalance shows up here)
  idle        time nothing runs (the GPU waiting for the host: synchronisations, launches)
  copies      time memcpy/memset rows run
"""
import csv
import os
import re
import sys

SKIP = int(os.environ.get("SKIP", "3"))


def load(path):
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            try:
                s = int(float(r["Start (ns)"]))
                d = int(float(r["Duration (ns)"]))
            except (KeyError, ValueError):
                continue
            name = r.get("Name", "")
            rows.append((s, s + d, name))
    rows.sort()
    return rows


def kind(name):
    if name.startswith("[CUDA"):
        return "copy"
    if "nccl" in name.lower():
        return "nccl"
    return "compute"


def nccl_kind(name):
    m = re.search(r"ncclDevKernel_(\w+?)_", name)
    return m.group(1) if m else "other"


def union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1][1] = b
        else:
            out.append([a, b])
    return out


def length(u):
    return sum(b - a for a, b in u)


def intersect(u, v):
    i = j = 0
    out = 0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if a < b:
            out += b - a
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(iv, lo, hi):
    return [(max(a, lo), min(b, hi)) for a, b, *_ in iv if b > lo and a < hi]


def step_ends(rows):
    ad = [r for r in rows if "adamw" in r[2].lower()]
    ends = []
    for s, e, _ in ad:
        if ends and s - ends[-1] < 2_000_000:
            ends[-1] = max(ends[-1], e)
        else:
            ends.append(e)
    return ends


def analyse(rows):
    ends = step_ends(rows)
    steps = []
    for i in range(SKIP, len(ends) - 1):
        lo, hi = ends[i], ends[i + 1]
        inside = [r for r in rows if r[1] > lo and r[0] < hi]
        comp = clip([r for r in inside if kind(r[2]) == "compute"], lo, hi)
        nc = [r for r in inside if kind(r[2]) == "nccl"]
        cp = clip([r for r in inside if kind(r[2]) == "copy"], lo, hi)
        uc, un, ucp = union(comp), union(clip(nc, lo, hi)), union(cp)
        per = {}
        for s, e, n in nc:
            k = nccl_kind(n)
            per[k] = per.get(k, 0) + min(e, hi) - max(s, lo)
        every = union([tuple(x) for x in uc] + [tuple(x) for x in un] + [tuple(x) for x in ucp])
        steps.append({
            "wall": hi - lo,
            "compute": length(uc),
            "compute_sum": sum(b - a for a, b in comp),
            "nccl": length(un),
            "exposed": length(un) - intersect(un, uc),
            "idle": (hi - lo) - length(every),
            "copies": length(ucp),
            "per": per,
            "kernels": len(inside),
        })
    return steps


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        sys.exit(2)
    name, paths = sys.argv[1], sys.argv[2:]
    kinds = set()
    results = []
    for p in paths:
        st = analyse(load(p))
        for s in st:
            kinds.update(s["per"])
        results.append((p, st))
    kinds = sorted(kinds)
    ms = lambda ns: f"{ns / 1e6:.2f}"
    hdr = ["trace", "steps", "wall", "compute", "compute sum", "nccl", "exposed nccl", "idle", "copies"]
    hdr += [f"{k} sum" for k in kinds]
    print(f"# {name}: compute and collectives per step (ms, mean over steps after the first {SKIP})\n")
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for p, st in results:
        if not st:
            print(f"| {os.path.basename(p)} | 0 |" + " |" * (len(hdr) - 2))
            continue
        row = [os.path.basename(p), str(len(st))]
        for key in ["wall", "compute", "compute_sum", "nccl", "exposed", "idle", "copies"]:
            row.append(ms(mean([s[key] for s in st])))
        for k in kinds:
            row.append(ms(mean([s["per"].get(k, 0) for s in st])))
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
