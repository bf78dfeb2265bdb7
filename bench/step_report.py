#!/usr/bin/env python3
"""bench/step_report.py OUT MODEL... - the table of bench/step_round.sh.

Reads, in OUT: rates.json (GEMM rate, copy bandwidth), floor.json (bench/step_floor.lua),
and per model moe_MODEL.json and prof_MODEL.json (bench/train_125m.lua, timed and profiled),
torch_MODEL.json and torchc_MODEL.json (bench/train_torch.py eager and --compile). Writes
OUT/step_round.json (everything joined) and OUT/step_round.md: one row per model and
implementation (tokens/s, ms/step, the floor, step / floor, tokens/s over PyTorch eager, peak
memory, the loss over the timed steps), then each model's per-phase profile. A file that is
missing is a row that says "not run". Needs only the standard library.
"""
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def loss_span(r):
    ls = r.get("losses") or []
    if isinstance(ls, list) and ls and isinstance(ls[0], list) and len(ls[0]) >= 2:
        first, last = ls[0][1], ls[-1][1]
    else:
        first, last = r.get("first_train_loss"), r.get("last_loss")
    if first is None or last is None:
        return ""
    return "%.4f -> %.4f" % (first, last)


def main(argv):
    out, models = argv[1], argv[2:]
    rates = load(os.path.join(out, "rates.json")) or {}
    floor = load(os.path.join(out, "floor.json")) or {}
    floors = {r["model"]: r for r in floor.get("results", [])}
    report = {"rates": rates, "floor_model": floor.get("model"), "models": {}}
    rows, md_prof = [], []
    for m in models:
        fl = floors.get(m)
        floor_ms = 1e3 * fl["floor"] if fl else None
        entry = {"floor": fl, "impls": {}}
        sides = [("moe-lua", "moe"), ("torch eager", "torch"), ("torch compile", "torchc")]
        eager = load(os.path.join(out, f"torch_{m}.json"))
        for label, prefix in sides:
            r = load(os.path.join(out, f"{prefix}_{m}.json"))
            entry["impls"][label] = r
            if r is None:
                if prefix != "torchc" or os.path.exists(os.path.join(out, f"torchc_{m}.log")):
                    rows.append(f"| {m} | {label} | not run | | | | | | |")
                continue
            tps, ms = r.get("tokens_per_s"), r.get("ms_per_step")
            ratio = "%.2fx" % (tps / eager["tokens_per_s"]) if eager and tps and eager.get("tokens_per_s") else ""
            over = "%.2f" % (ms / floor_ms) if ms and floor_ms else ""
            peak = r.get("peak_allocated_bytes")
            rows.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                m, label, "%.0f" % tps if tps else "", "%.1f" % ms if ms else "",
                "%.1f" % floor_ms if floor_ms else "", over, ratio,
                "%.2f" % (peak / 2 ** 30) if peak else "", loss_span(r)))
        prof = load(os.path.join(out, f"prof_{m}.json"))
        p = prof and prof.get("profile")
        entry["profile"] = p
        if p:
            md_prof.append(f"\n### {m}: one step by phase ({p.get('method')}, {p.get('steps_measured')} measured "
                           f"+ {p.get('steps_saturated')} saturated steps)\n")
            md_prof.append("| phase | GPU ms (queue span) | host ms | kernel ms (saturated) |")
            md_prof.append("|---|---|---|---|")
            for ph in p.get("phases", []):
                k = ph.get("kernel_ms")
                md_prof.append("| %s | %.3f | %.3f | %s |" % (ph["phase"], ph["gpu_ms"], ph["host_ms"],
                                                            "%.3f" % k if k is not None else "-"))
            reads = p.get("host_reads_per_step")
            md_prof.append("\nwall %.2f ms/step, kernels %.2f ms, GPU idle %.2f ms; host reads per step: %s; "
                           "backstop collections per step: %.2f; Lua heap growth %.1f KiB per step" % (
                               p.get("wall_ms") or 0, p.get("kernel_ms") or 0, p.get("gpu_idle_ms") or 0,
                               "%.1f" % reads if reads is not None else "not counted by this build",
                               p.get("gc_cycles_per_step") or 0, p.get("lua_heap_kib_per_step") or 0))
        report["models"][m] = entry
    head = ["| model | impl | tokens/s | ms/step | floor ms | step / floor | vs torch eager | peak GiB | "
            "loss first -> last |", "|---|---|---|---|---|---|---|---|---|"]
    tj = [load(os.path.join(out, "torch_%s.json" % m)) for m in models]
    torch_data = next((t["data"] for t in tj if t and t.get("data")), "the exported first batch repeated")
    mj = [load(os.path.join(out, "moe_%s.json" % m)) for m in models]
    impls = ", ".join("%s %s" % (m, j.get("mlp_impl")) for m, j in zip(models, mj) if j and j.get("mlp_impl"))
    version_line = next((j["version"].splitlines()[2] for j in mj if j and isinstance(j.get("version"), str)
                         and len(j["version"].splitlines()) > 2), "version not recorded")
    facts = ["# The training step on one GPU: moe-lua, PyTorch and the floor", "",
             "- device: %s; GEMM %.0f TFLOP/s (bf16 8192^3), copy %.2f TB/s (d2d, read + write), torch %s" % (
                 rates.get("device", "?"), rates.get("gemm_tflops") or 0, rates.get("copy_tbs") or 0,
                 rates.get("torch", "?")),
             "- floor: %s" % (floor.get("model") or "not computed"),
             "- both start from moe-lua's exported initial weights; moe-lua trains on the dataset's batches, "
             "bench/train_torch.py on %s; tokens/s of both over the steps after their warm-up" % torch_data,
             "- moe-lua %s; the expert path moe-lua ran: %s" % (version_line, impls), ""]
    md = "\n".join(facts + head + rows + md_prof) + "\n"
    with open(os.path.join(out, "step_round.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "step_round.json"), "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    print("\n".join(head + rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
