#!/usr/bin/env python3
"""Block-sparse kernel time per product kind and step, from an nsys kernel summary.

    python3 bench/bsmm_kinds.py SUM.csv CONFIG ENV STEP_MS [--steps 13] >> kinds.jsonl

SUM.csv is `nsys stats -r cuda_gpu_kern_sum -f csv` of one `moe-lua bench/moe_mlp.lua
configs=CONFIG impls=sparse` run (2 warm-up steps, 1 memory step and 10 timed ones: 13 steps,
each running every product of the layer's forward and backward). Prints one JSON line:
{config, env, step_ms, kernel_ms_per_step: {sdd, sdd_t, dsd, dsd_sum, dsd_tr, dds}}, the
total time of each kind's wgmma kernel (kernels/blocksparse.cu, bs_wg_kernel<KIND, TRANS,
GATHER>) divided by the steps. `bash bench/gpu_round.sh kinds` runs it.
"""
import argparse
import csv
import json
import re

# bs_wg_kernel<KIND, TRANS, GATHER>: KIND 0 SDD, 1 DSD, 2 DSD^T, 3 DDS; how the GLU layer uses each
KINDS = {"000": "sdd", "010": "sdd_t", "100": "dsd", "110": "dsd_sum", "200": "dsd_tr", "300": "dds",
         "001": "sdd_gather", "011": "sdd_t_gather", "201": "dsd_tr_gather", "301": "dds_gather"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("config")
    ap.add_argument("env")
    ap.add_argument("step_ms", type=float)
    ap.add_argument("--steps", type=int, default=13)
    a = ap.parse_args()
    out = {}
    with open(a.csv) as fh:
        for r in csv.DictReader(fh):
            m = re.search(r"bs_wg_kernel<\(int\)(\d), \(bool\)(\d), \(bool\)(\d)>", r["Name"])
            if m:
                key = "".join(m.groups())
                out[KINDS.get(key, key)] = float(r["Total Time (ns)"]) / 1e6 / a.steps
    print(json.dumps({"config": a.config, "env": a.env, "step_ms": a.step_ms, "kernel_ms_per_step": out}))


if __name__ == "__main__":
    main()
