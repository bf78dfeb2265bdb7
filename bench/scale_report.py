#!/usr/bin/env python3
"""bench/scale_report.py - the report of bench/scale_round.sh: weak scaling (tokens/s and memory
per GPU by layout), collective bandwidth beside torch.distributed, the expert-parallel
all_to_all, the restart timeline and the resumed losses, from the files the round wrote.

  python3 bench/scale_report.py DIR OUT_PREFIX [TOL]  (writes OUT_PREFIX.json and OUT_PREFIX.md)

Exits 1 when a resumed run's losses differ from the saving run's by more than TOL (relative;
default 1e-4), or a resume logged none of the steps it should have.
"""
import glob, json, os, re, sys

src, prefix = sys.argv[1], sys.argv[2]
tol = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-4
rep = {"weak": [], "collectives": [], "a2a": None, "restart": None, "resume": []}
setup = open(os.path.join(src, "scale_setup.txt")).read().split() if os.path.exists(
    os.path.join(src, "scale_setup.txt")) else ["?", "?"]
rep["device_kind"], rep["ranks"] = setup[0], setup[1]
ver = os.path.join(src, "version.txt")
rep["version"] = open(ver).read().strip() if os.path.exists(ver) else None


def name_key(p):
    m = re.match(r"weak_(\w+?)_n(\d+)(.*)\.json", os.path.basename(p))
    return (m.group(1), int(m.group(2)), m.group(3)) if m else ("", 0, "")


base = {}
for log in sorted(glob.glob(os.path.join(src, "weak_*.log")), key=lambda p: name_key(p[:-4] + ".json")):
    p = log[:-4] + ".json"
    model, k, lay = name_key(p)
    lp = log[:-4] + ".layout"
    layout = open(lp).read().strip() if os.path.exists(lp) else (lay.strip("_") or "-")
    row = {"model": model, "ranks": k, "layout": layout}
    if os.path.exists(p):
        d = json.load(open(p))
        row.update(status="ran", device=d["device"], date=d["date"], tokens_per_s_per_gpu=d["tokens_per_s"],
                   ms_per_step=d["ms_per_step"], peak_gib=(d.get("peak_allocated_bytes") or 0) / 2**30,
                   state_gib=(d.get("state_allocated_bytes") or 0) / 2**30, mlp_impl=d["mlp_impl"],
                   params_per_rank=d["params"], loss_last=d["last_loss"])
        if k == 1:
            base[model] = row
    else:
        txt = open(log, errors="replace").read()
        row["status"] = "out of memory" if "out of memory" in txt else "failed"
    rep["weak"].append(row)
for r in rep["weak"]:
    b = base.get(r["model"])
    if b and r.get("tokens_per_s_per_gpu") and b.get("tokens_per_s_per_gpu"):
        r["efficiency_per_gpu"] = r["tokens_per_s_per_gpu"] / b["tokens_per_s_per_gpu"]
        if b.get("state_gib"):
            r["state_vs_1"] = r["state_gib"] / b["state_gib"]


def coll(kind):
    p = os.path.join(src, f"coll_{kind}.json")
    return {(r["op"], r["mib"]): r for r in json.load(open(p))["results"]} if os.path.exists(p) else {}


cm, ct = coll("moe"), coll("torch")
for k in sorted(set(cm) | set(ct)):
    a, b = cm.get(k), ct.get(k)
    rep["collectives"].append({"op": k[0], "mib": k[1], "moe_busbw": a and a["busbw_gbps"],
                               "torch_busbw": b and b["busbw_gbps"],
                               "ratio": a["busbw_gbps"] / b["busbw_gbps"] if a and b else None})
if os.path.exists(os.path.join(src, "a2a.json")):
    rep["a2a"] = json.load(open(os.path.join(src, "a2a.json")))
if os.path.exists(os.path.join(src, "restart.json")):
    rep["restart"] = json.load(open(os.path.join(src, "restart.json")))


def losses(p):
    out = {}
    if os.path.exists(p):
        for line in open(p):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "step" in r and "loss" in r:
                out[r["step"]] = r["loss"]
    return out


ref = {s: l for s, l in (rep["restart"] or {}).get("losses", [])}
for k in (2, 1):
    got = losses(os.path.join(src, f"resume{k}_metrics.jsonl"))
    common = sorted(s for s in got if s in ref)
    rel = max((abs(got[s] - ref[s]) / abs(ref[s]) for s in common), default=None)
    rep["resume"].append({"ranks": k, "steps": common, "losses": [got[s] for s in common],
                          "reference": [ref[s] for s in common], "max_rel_diff": rel})
json.dump(rep, open(prefix + ".json", "w"), indent=1)

f = open(prefix + ".md", "w")
dev = next((r["device"] for r in rep["weak"] if r.get("device")), rep["device_kind"])
date = next((r["date"] for r in rep["weak"] if r.get("date")), "?")
f.write(f"# Scaling the MegaBlocks ladder on {rep['ranks']} ranks ({dev}, {date})\n\n")
if rep["version"]:
    f.write("```\n" + rep["version"] + "\n```\n\n")
f.write("## Weak scaling (the same micro-batch per GPU)\n\n| model | ranks | layout | experts impl | tokens/s per GPU "
        "| per-GPU efficiency | ms/step | peak GiB | model state GiB | state vs 1 |\n|---|---|---|---|---|---|---|---|---|---|\n")
for r in rep["weak"]:
    if r["status"] != "ran":
        f.write(f"| {r['model']} | {r['ranks']} | {r['layout']} | | {r['status']} | | | | | |\n")
        continue
    eff = "%.1f%%" % (100 * r["efficiency_per_gpu"]) if "efficiency_per_gpu" in r else ""
    sv = "%.1f%%" % (100 * r["state_vs_1"]) if "state_vs_1" in r else ""
    f.write(f"| {r['model']} | {r['ranks']} | {r['layout']} | {r['mlp_impl']} | {r['tokens_per_s_per_gpu']:.0f} | {eff} | "
            f"{r['ms_per_step']:.1f} | {r['peak_gib']:.2f} | {r['state_gib']:.2f} | {sv} |\n")
if rep["collectives"]:
    f.write("\n## Collectives (bus bandwidth GB/s, bf16)\n\n| op | MiB per rank | moe.dist | torch.distributed | moe / torch |\n"
            "|---|---|---|---|---|\n")
    for c in rep["collectives"]:
        fm = lambda v: "%.1f" % v if v is not None else "not run"
        f.write(f"| {c['op']} | {c['mib']} | {fm(c['moe_busbw'])} | {fm(c['torch_busbw'])} | "
                f"{'%.2f' % c['ratio'] if c['ratio'] else '-'} |\n")
else:
    f.write("\n## Collectives\n\nNot run (GPU only).\n")
if rep["a2a"]:
    f.write("\n## Expert-parallel all_to_all\n\n```\n" + json.dumps(rep["a2a"].get("rows", rep["a2a"]), indent=1)[:3000] + "\n```\n")
r = rep["restart"]
if r:
    ev = r["events"]
    f.write("\n## kill -9 of rank 1 with --max-restarts 1\n\n| event | seconds from launch |\n|---|---|\n")
    for k in ("kill", "detected", "restart", "first_step", "end"):
        if k in ev:
            f.write(f"| {k} | {ev[k]:.1f} |\n")
    f.write(f"\nKilled after step {ev.get('killed_at_step')}; resumed from step {r.get('resumed_from_step')}; "
            f"launcher status {r['launcher_status']}; last step {r['last_step']}.\n")
if rep["resume"]:
    f.write(f"\n## The checkpoint of step {rep['resume'][0]['steps'][0] - 1 if rep['resume'][0]['steps'] else '?'} resumed on fewer ranks (same global batch)\n\n| ranks | steps | max relative "
            "loss difference to the run that saved it |\n|---|---|---|\n")
    for x in rep["resume"]:
        rng = f"{x['steps'][0]}-{x['steps'][-1]}" if x["steps"] else "none"
        f.write(f"| {x['ranks']} | {rng} | {'%.2e' % x['max_rel_diff'] if x['max_rel_diff'] is not None else 'not run'} |\n")
f.close()
print(open(prefix + ".md").read())
bad = [x for x in rep["resume"] if x["steps"] and x["max_rel_diff"] > tol]
if bad:
    print(f"scale_report: resumed losses differ by more than {tol:g} on {[x['ranks'] for x in bad]} rank(s)")
    sys.exit(1)
