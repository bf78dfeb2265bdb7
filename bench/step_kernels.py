#!/usr/bin/env python3
"""bench/step_kernels.py - the kernels of an Nsight Systems profile of training steps, summed by
what they do: the expert GEMMs, dense GEMMs, attention, routing, permute and combine, the loss,
norms, activations, rope, the embedding, copies and casts, other elementwise and reduction
kernels, gradient clipping and the optimizer. Reads bench/step_profile.sh's NAME_cuda_gpu_kern_sum.csv
(nsys stats -r cuda_gpu_kern_sum) and writes a markdown table of milliseconds per step.

  python3 bench/step_kernels.py NAME_cuda_gpu_kern_sum.csv STEPS [--title TEXT] > OUT.md

The classes are matched on the kernels' names (first match wins; CLASSES below); a kernel that
matches none is counted as "other" and named under the table.
"""
import argparse
import csv
import re
import sys

CLASSES = [
    ("optimizer (AdamW)", r"op_adamw|adamw"),
    ("gradient clipping (norm)", r"op_norm_|op_scale_multi"),
    ("expert GEMMs (block-sparse / grouped)", r"bs_wg_kernel|bs_\w+_kernel|gg_|grouped"),
    ("dense GEMMs (cuBLAS)", r"nvjet|xmma_gemm|cutlass|gemm|splitKreduce"),
    ("attention", r"attn_"),
    ("permute and combine", r"rt_gather|rt_combine"),
    ("routing (softmax, top-k, plan, counts, gate gradient)",
     r"rt_|ix_topk|moe_softmax|bincount|RadixSort|ix_scatter|moe_fill_bits"),
    ("loss (cross entropy)", r"moe_ce_"),
    ("norms (LayerNorm)", r"moe_norm_"),
    ("activations (GELU)", r"pw_contig"),
    ("rope", r"ix_rope"),
    ("embedding (gather, index_add)", r"ix_index|ix_gather"),
    ("copies and dtype casts", r"moe_copy_|MoeIdentityFn"),
    ("other elementwise (residual adds, scales)", r"moe_ew_contig"),
    ("reductions (bias and norm-weight gradients, sums)", r"moe_red|moe_colsum"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("steps", type=int)
    ap.add_argument("--title", default="Kernel time per step by class")
    a = ap.parse_args()
    try:
        rows = list(csv.DictReader(open(a.csv)))
    except OSError as e:
        sys.exit("step_kernels: %s: %s" % (a.csv, e.strerror))
    tot, calls, other = {}, {}, []
    for r in rows:
        name, ms, n = r["Name"], float(r["Total Time (ns)"]) / 1e6 / a.steps, int(r["Instances"]) / a.steps
        cls = next((c for c, pat in CLASSES if re.search(pat, name)), "other")
        if cls == "other":
            other.append(name[:80])
        tot[cls] = tot.get(cls, 0.0) + ms
        calls[cls] = calls.get(cls, 0.0) + n
    total = sum(tot.values())
    print("# " + a.title + "\n")
    print("| class | ms per step | share | launches per step |")
    print("|---|---|---|---|")
    for c, _ in CLASSES + [("other", None)]:
        if c in tot:
            print("| %s | %.3f | %.1f%% | %.1f |" % (c, tot[c], 100 * tot[c] / total, calls[c]))
    print("| **all kernels** | **%.3f** | 100%% | %.1f |" % (total, sum(calls.values())))
    if other:
        print("\nother: " + "; ".join(other))


if __name__ == "__main__":
    main()
