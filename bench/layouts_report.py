#!/usr/bin/env python3
"""bench/layouts_report.py - the table of bench/dist_round.sh's scale125 step: the 125M dMoE
on one GPU and on two with each layout, from the s125_<name>.json files that
bench/train_125m.lua wrote (json=), as JSON and markdown.

  python3 bench/layouts_report.py DIR OUT_PREFIX     (writes OUT_PREFIX.json and OUT_PREFIX.md)

Per-GPU efficiency is a layout's tokens/s per GPU over the one-GPU run's (the same micro-batch of
sequences per GPU, from the runs' config); model-state memory is what bench/train_125m.lua measured at the end of
the third step (parameters, gradients, optimizer state), over the one-GPU run's.

The collectives' columns come from runs with comm_profile=true (dist_round.sh passes it to the
ep = 2 and ZeRO-3 runs): per step, the milliseconds of each kind of collective on its
communication stream (rank 0; CUDA events of moe.dist's opt-in timing) and their share of the
step's wall time. Where a layout overlaps a collective with compute the time is partly hidden, so
the share is an upper bound on the step time lost to it, not the exposed time.
"""
import json, os, sys

src, prefix = sys.argv[1], sys.argv[2]
names = [("gpu1", "1 GPU", "-"), ("dp2", "2 GPUs", "dp = 2"), ("ep2", "2 GPUs", "ep = 2"),
         ("zero2", "2 GPUs", "dp_shard = 2 (ZeRO-2)"),
         ("zero3", "2 GPUs", "dp_shard = 2, shard_params (ZeRO-3 / FSDP)"),
         ("big_gpu1", "1 GPU", "-"), ("big_ep2", "2 GPUs", "ep = 2"),
         ("big_zero3", "2 GPUs", "dp_shard = 2, shard_params (ZeRO-3 / FSDP)")]
# ZeRO-3 runs with a deeper prefetch (dist_round.sh's ZERO3_PREFETCH), after the default one
extra = sorted(int(f[len("s125_zero3_p"):-len(".json")]) for f in os.listdir(src)
               if f.startswith("s125_zero3_p") and f.endswith(".json"))
at = [n[0] for n in names].index("zero3") + 1
names[at:at] = [(f"zero3_p{n}", "2 GPUs", f"dp_shard = 2, shard_params (ZeRO-3 / FSDP), prefetch {n}")
                for n in extra]
rows, base = [], {}
for key, gpus, layout in names:
    p = os.path.join(src, f"s125_{key}.json")
    big = key.startswith("big")
    if not os.path.exists(p):
        log = os.path.join(src, f"s125_{key}.log")
        why = "did not run"
        if os.path.exists(log) and "out of memory" in open(log, errors="replace").read():
            why = "out of memory"
        rows.append({"name": key, "gpus": gpus, "layout": layout, "status": why})
        continue
    d = json.load(open(p))
    r = {"name": key, "gpus": gpus, "layout": layout, "status": "ran", "device": d["device"],
         "date": d["date"], "experts": d["config"]["experts"], "params_per_rank": d["params"],
         "tokens_per_s_per_gpu": d["tokens_per_s"], "ms_per_step": d["ms_per_step"],
         "peak_allocated_gib": (d.get("peak_allocated_bytes") or 0) / 2**30,
         "model_state_gib": (d.get("state_allocated_bytes") or 0) / 2**30,
         "mlp_impl": d["mlp_impl"], "loss_first": d["first_train_loss"], "loss_last": d["last_loss"],
         "steps": d["steps"], "version": d.get("version"),
         "micro_batch": d["config"].get("batch_size")}
    if d.get("comm") and d["comm"].get("ep_balance"):
        r["ep_balance"] = dict(d["comm"]["ep_balance"], steps=d["comm"]["steps"])
    if d.get("comm"):
        r["comm"] = {k["kind"]: {"ms_per_step": k["ms_per_step"], "share": k.get("share"),
                                 "max_ms_per_step": k.get("max_ms_per_step"),
                                 "calls_per_step": k["calls_per_step"], "bytes_per_step": k["bytes_per_step"]}
                     for k in d["comm"]["kinds"]}
    if key == "gpu1":
        base = r
    if not big and base:
        r["efficiency_per_gpu"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        if base["model_state_gib"] > 0:
            r["model_state_vs_1gpu"] = r["model_state_gib"] / base["model_state_gib"]
    rows.append(r)
json.dump({"title": "The 125M dMoE on one GPU and on two, by layout", "rows": rows},
          open(prefix + ".json", "w"), indent=1)
dev = next((r["device"] for r in rows if r.get("device")), "?")
date = next((r["date"] for r in rows if r.get("date")), "?")
with open(prefix + ".md", "w") as f:
    f.write(f"# The 125M dMoE by layout ({dev}, {date})\n\n")
    mb = next((r["micro_batch"] for r in rows if r.get("micro_batch")), "?")
    f.write("MegaBlocks ladder 125M dMoE (12 x 768, 64 experts top-1, GELU experts 3072 wide, seq 1024, "
            f"byte vocabulary), bf16 compute with fp32 weights and AdamW, micro-batch {mb} per GPU, "
            "`bench/dist_round.sh scale125` (one call; the one-GPU run is the reference).\n\n")
    kinds = ["all_to_all", "all_gather", "reduce_scatter", "all_reduce"]
    def comm_cell(r, k):
        c = r.get("comm", {}).get(k)
        if not c:
            return "-" if r.get("comm") is not None else ""
        share = " (%.1f%%)" % (100 * c["share"]) if c.get("share") is not None else ""
        return "%.2f%s" % (c["ms_per_step"], share)
    f.write("| model | GPUs | layout | experts impl | tokens/s per GPU | ms/step | per-GPU efficiency "
            "| peak GiB | model state GiB | state vs 1 GPU | loss | " +
            " | ".join(f"{k} ms/step (share)" for k in kinds) + " |\n|" + "---|" * (11 + len(kinds)) + "\n")
    for r in rows:
        big_e = next((x["experts"] for x in rows if x["name"].startswith("big") and x.get("experts")), "?")
        model = "125M, %s experts" % (r.get("experts") or (big_e if r["name"].startswith("big") else 64))
        if r["status"] != "ran":
            f.write(f"| {model} | {r['gpus']} | {r['layout']} | | {r['status']} | | | | | | |" + " |" * len(kinds) + "\n")
            continue
        eff = "%.1f%%" % (100 * r["efficiency_per_gpu"]) if "efficiency_per_gpu" in r else ""
        st = "%.1f%%" % (100 * r["model_state_vs_1gpu"]) if "model_state_vs_1gpu" in r else ""
        f.write(f"| {model} | {r['gpus']} | {r['layout']} | {r['mlp_impl']} | {r['tokens_per_s_per_gpu']:.0f} | "
                f"{r['ms_per_step']:.1f} | {eff} | {r['peak_allocated_gib']:.2f} | {r['model_state_gib']:.2f} | {st} | "
                f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} | " + " | ".join(comm_cell(r, k) for k in kinds) + " |\n")
    if any(r.get("comm") for r in rows):
        f.write("\nThe collectives' columns (runs with `comm_profile=true`, rank 0): milliseconds per step of "
                "each kind of collective on its communication stream, measured with CUDA events by moe.dist's "
                "opt-in timing (`dist.comm_timing`), and in brackets their share of the step's wall time. "
                "That time includes waiting for the other rank, and where the layout overlaps a collective "
                "with compute (ZeRO-3's prefetched gathers, a bucket's reduce_scatter while backward goes "
                "on) it is partly hidden: the share is an upper bound on the step time lost to it, not the "
                "exposed time. \"-\": none of that kind in the step.\n")
    for r in rows:
        b = r.get("ep_balance")
        if b:
            per = " / ".join("%.0f" % (x / max(1, b["steps"])) for x in b["rows_per_rank"])
            f.write(f"\n{r['layout']} ({r['name']}): the experts' rows per timed step by rank {per}; per layer "
                    f"the busiest rank's rows over the mean {b['busiest_over_mean']:.3f} (averaged over the "
                    f"{b['layers']} MoE layers; the exchange makes every rank wait for the busiest)")
            if "step_busiest_over_mean" in b:
                f.write(f"; per step and layer {b['step_busiest_over_mean']:.3f} (what the exchange waits "
                        "for)")
            f.write(".\n")
    big = next((x for x in rows if x["name"] == "big_zero3" and x["status"] == "ran"), None)
    if big:
        f.write(f"\nThe model with {big['experts']} experts has {big['params_per_rank']:,} parameters: "
                f"{2 * big['model_state_gib']:.0f} GiB of model state in all, more than one GPU holds. "
                "Per-GPU efficiency compares the same micro-batch per GPU, so the global batch of the "
                "two-GPU runs is twice the one-GPU run's (hence the other losses).\n")
print(open(prefix + ".md").read())
