"""bench/train46_compare.py OUT - the weak-scaling table of bench/dist_round.sh's train46 step:
OUT/train46_dp1.json (one GPU) beside OUT/train46_dp2.json (moe-lua launch -n 2, dp = 2)."""
import json
import os
import sys

out = sys.argv[1]
rows = []
for dp in (1, 2):
    p = os.path.join(out, f"train46_dp{dp}.json")
    rows.append(json.load(open(p)) if os.path.exists(p) else None)
print("| GPUs | device | tokens/s per GPU | ms/step | peak GiB per GPU | loss first -> last |")
print("|---|---|---|---|---|---|")
for dp, r in zip((1, 2), rows):
    if r is None:
        print(f"| {dp} | not run | | | | |")
        continue
    print(f"| {dp} | {r['device']} | {r['tokens_per_s']:.0f} | {r['ms_per_step']:.1f} | "
          f"{(r.get('peak_allocated_bytes') or 0) / 2**30:.2f} | "
          f"{r['first_train_loss']:.4f} -> {r['last_loss']:.4f} |")
if rows[0] and rows[1]:
    print(f"\nweak scaling 1 -> 2 GPUs (tokens/s per GPU): "
          f"{rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.3f}")
