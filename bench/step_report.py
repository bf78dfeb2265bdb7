#!/usr/bin/env python3
"""bench/step_report.py - the training-step table: moe-lua (bench/train_125m.lua json=) beside the
PyTorch reference (bench/train_torch.py --json, eager and --compile) for each model, from one
device call: device, date, versions, tokens/s, ms/step, MFU, peak memory, the loss over the timed
steps, and moe-lua's throughput over each PyTorch mode's.

  python3 bench/step_report.py OUT_PREFIX \\
      --row "dMoE-46M" MOE.json EAGER.json COMPILE.json \\
      --row "dMoE-125M" MOE.json EAGER.json COMPILE.json \\
      --row "GPT-125M (dense)" MOE.json EAGER.json COMPILE.json \\
      [--floor "dMoE-46M=12.3"] [--command "what ran"]

A file that is missing or given as "-" is a run that did not happen: its cells read "not run".
--floor NAME=MS adds the computed floor of a model's step (ms) and each implementation's
ms/step over it. Writes OUT_PREFIX.json (every number) and OUT_PREFIX.md (the table). Ratios
are only meaningful when every run of a row was on the same device in the same call; the table
says when the devices differ.
"""
import argparse
import json
import os
import sys


def load(path):
    if not path or path == "-" or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        print("step_report: %s is not JSON (%s): taken as not run" % (path, e), file=sys.stderr)
        return None


def timed_losses(r):
    """The interval means of the lm loss over the timed steps: moe-lua times the log intervals after
    the first; train_torch.py the steps after its untimed warm-up."""
    if not r or not r.get("losses"):
        return []
    if r.get("impl") == "torch":
        first_timed = r["steps"] - r["steps_timed"]
        return [v for s, v in r["losses"] if s > first_timed]
    return [v for _, v in r["losses"][1:]]


def summary(r):
    if not r:
        return None
    tl = timed_losses(r)
    return {
        "device": r.get("device"), "tokens_per_s": r.get("tokens_per_s"), "ms_per_step": r.get("ms_per_step"),
        "mfu": r.get("mfu"), "peak_allocated_bytes": r.get("peak_allocated_bytes"),
        "peak_reserved_bytes": r.get("peak_reserved_bytes"), "steps": r.get("steps"),
        "steps_timed": r.get("steps_timed"), "tokens_per_step": r.get("tokens_per_step"),
        "timed_loss_first": tl[0] if tl else None, "timed_loss_last": tl[-1] if tl else None,
        "timed_loss_mean": sum(tl) / len(tl) if tl else None,
        "params": r.get("params"), "active_params": r.get("active_params"),
        "flops_per_token": r.get("flops_per_token"),
        "detail": ({"mlp_impl": r.get("mlp_impl")} if r.get("impl") != "torch" else
                   {k: r.get(k) for k in ("compile_mode", "compile_scope", "expert_impl", "sdpa", "clip_mode",
                                          "data", "untimed_seconds")}),
    }


def fmt(v, f):
    return "-" if v is None else f % v


def ratio(a, b):
    if not a or not b or not a.get("tokens_per_s") or not b.get("tokens_per_s"):
        return None
    return a["tokens_per_s"] / b["tokens_per_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_prefix")
    ap.add_argument("--row", nargs=4, action="append", metavar=("NAME", "MOE", "EAGER", "COMPILE"), default=[])
    ap.add_argument("--floor", action="append", default=[], metavar="NAME=MS")
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    if not a.row:
        sys.exit("step_report: give at least one --row NAME MOE.json EAGER.json COMPILE.json")
    floors = {}
    for f in a.floor:
        name, _, ms = f.rpartition("=")
        try:
            floors[name] = float(ms)
        except ValueError:
            sys.exit("step_report: --floor %s: expected NAME=MS with MS a number" % f)

    rows, versions, devices, dates = [], {}, set(), set()
    for name, pm, pe, pc in a.row:
        m, e, c = load(pm), load(pe), load(pc)
        for r in (m, e, c):
            if r:
                devices.add(r.get("device"))
                if r.get("date"):
                    dates.add(r["date"])
        if m and m.get("version"):
            versions["moe_lua"] = m["version"].split("\n")[0]
        for r in (e, c):
            if r:
                versions["torch"], versions["torch_cuda"] = r.get("torch"), r.get("cuda")
        cfg = (m or {}).get("config") or (e or c or {}).get("config") or {}
        same = len({r.get("device") for r in (m, e, c) if r}) <= 1
        rows.append({
            "name": name, "config": {k: cfg.get(k) for k in ("kind", "n_layers", "d_model", "n_heads", "ffn",
                                                            "experts", "top_k", "seq_len", "batch_size")},
            "moe_lua": summary(m), "torch_eager": summary(e), "torch_compile": summary(c),
            "ratio_moe_over_eager": ratio(m, e), "ratio_moe_over_compile": ratio(m, c),
            "same_device": same, "floor_ms": floors.get(name),
            "files": {"moe_lua": pm, "torch_eager": pe, "torch_compile": pc},
        })
    res = {"benchmark": "training step, one GPU", "devices": sorted(d for d in devices if d),
           "dates": sorted(dates), "versions": versions, "command": a.command, "rows": rows}
    with open(a.out_prefix + ".json", "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")

    L = ["# The training step on one GPU: moe-lua vs PyTorch (eager and torch.compile)", ""]
    L.append("Device: %s; dates %s; moe-lua: %s; torch %s (CUDA %s)." % (
        ", ".join(res["devices"]) or "?", ", ".join(res["dates"]) or "?", versions.get("moe_lua", "?"),
        versions.get("torch", "?"), versions.get("torch_cuda", "?")))
    if a.command:
        L.append("Command: `%s`." % a.command)
    L.append("")
    L.append("Same model, data (the KJV windows in moe-lua's order) and batch on each row; bf16 (moe-lua: bf16 "
             "parameters with fp32 master weights; torch: fp32 parameters under bf16 autocast, fused AdamW), "
             "clip 1.0, cosine lr. tokens/s and ms/step over the timed steps (moe-lua: the log intervals "
             "after the first; torch: after its untimed warm-up, which holds compilation). Loss: the lm "
             "loss over the timed steps, first and last log interval (mean). MFU at 989 TFLOP/s.")
    L.append("")
    has_floor = any(r["floor_ms"] for r in rows)
    head = "| model | implementation | tokens/s | ms/step | MFU | peak allocated GiB | loss over timed steps "
    head += "| moe-lua / this |" + (" floor ms | ms / floor |" if has_floor else "")
    L.append(head)
    L.append("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |" + (" ---: | ---: |" if has_floor else ""))
    for r in rows:
        for key, label, rat in (("moe_lua", "moe-lua", None), ("torch_eager", "PyTorch eager", "ratio_moe_over_eager"),
                                ("torch_compile", "PyTorch compile", "ratio_moe_over_compile")):
            s = r[key]
            if key == "torch_compile" and s and s["detail"].get("compile_mode"):
                label += " (%s, %s)" % (s["detail"]["compile_mode"], s["detail"].get("compile_scope"))
            if key == "moe_lua" and s and s["detail"].get("mlp_impl"):
                label += " (%s experts)" % s["detail"]["mlp_impl"]
            if not s:
                cells = ["not run"] + ["-"] * 5
            else:
                loss = "-" if s["timed_loss_first"] is None else "%.4f -> %.4f (%.4f)" % (
                    s["timed_loss_first"], s["timed_loss_last"], s["timed_loss_mean"])
                cells = [fmt(s["tokens_per_s"], "%.0f"), fmt(s["ms_per_step"], "%.1f"),
                         fmt(None if s["mfu"] is None else 100 * s["mfu"], "%.1f%%"),
                         fmt(None if s["peak_allocated_bytes"] is None else s["peak_allocated_bytes"] / 2 ** 30,
                             "%.2f"), loss, fmt(r[rat], "%.2fx") if rat else ""]
            line = "| %s | %s | %s |" % (r["name"], label, " | ".join(cells))
            if has_floor:
                fl = r["floor_ms"]
                line += " %s | %s |" % (fmt(fl, "%.1f"), fmt(s["ms_per_step"] / fl if (s and fl and s["ms_per_step"])
                                                             else None, "%.2fx"))
            L.append(line)
        if not r["same_device"]:
            L.append("| %s | (runs on different devices: the ratios do not compare) | | | | | | |%s" % (
                r["name"], " | |" if has_floor else ""))
    L.append("")
    for r in rows:
        c = r["config"]
        if c.get("kind") is None:
            L.append("- %s: no run." % r["name"])
            continue
        L.append("- %s: %s, %s layers x %s, %s heads, ffn %s%s, seq %s, batch %s." % (
            r["name"], c.get("kind"), c.get("n_layers"), c.get("d_model"), c.get("n_heads"), c.get("ffn"),
            ", %s experts top-%s" % (c.get("experts"), c.get("top_k")) if c.get("kind") != "dense" else "",
            c.get("seq_len"), c.get("batch_size")))
    L.append("")
    with open(a.out_prefix + ".md", "w") as f:
        f.write("\n".join(L))
    print("step_report: wrote %s.md and %s.json" % (a.out_prefix, a.out_prefix))


if __name__ == "__main__":
    main()
