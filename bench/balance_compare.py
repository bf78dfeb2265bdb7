#!/usr/bin/env python3
"""bench/balance_compare.py - routing balance of two training runs side by side: moe-lua's
metrics.jsonl (train.run's out_dir; one record per log interval, so run it with log_every=1
for per-step curves) and bench/train_torch.py's --balance-jsonl (one record per step).

  python3 bench/balance_compare.py MOE_METRICS.jsonl TORCH_BALANCE.jsonl OUT_PREFIX \\
      [--steps 1,10,20,50,100,200,300] [--labels moe-lua,PyTorch] [--title TEXT]

Both files carry step, loss, aux_loss (the load-balancing losses of all MoE layers, summed) and
expert_counts {"blocks.<i>.ffn": [count per expert]}; from the counts this computes each layer's
expert load max/mean (1 = balanced, E = every token on one expert), then its mean over the layers
and its worst layer (metrics.jsonl's load_balance). A record that covers several steps (a log
interval) has the counts summed over them, which evens the load out: the table says when a
step's record is such an interval. Writes OUT_PREFIX.md (the table at the given steps and the
means over stretches of the run) and, when matplotlib is importable, OUT_PREFIX.png (load
and aux loss against the step).
"""
import argparse
import json
import sys


def read(path, label):
    recs = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError as e:
                    sys.exit("balance_compare: %s line %d: not JSON (%s)" % (path, n, e))
                # training records (an evaluation's record has the step but no training loss)
                if "step" in r and ("loss" in r or "expert_counts" in r):
                    recs.append(r)
    except OSError as e:
        sys.exit("balance_compare: %s (%s): %s" % (label, path, e.strerror))
    if not recs:
        sys.exit("balance_compare: %s (%s) has no step records" % (label, path))
    out, prev = {}, 0
    for r in sorted(recs, key=lambda r: r["step"]):
        counts = r.get("expert_counts") or {}
        layers = [c for _, c in sorted(counts.items(), key=lambda kv: layer_index(kv[0]))]
        loads = [max(c) * len(c) / sum(c) for c in layers if c and sum(c) > 0]
        out[r["step"]] = {
            "span": r["step"] - prev, "loss": r.get("loss"), "aux": r.get("aux_loss"),
            "load_mean": sum(loads) / len(loads) if loads else None,
            "load_worst": max(loads) if loads else None, "layers": len(loads),
        }
        prev = r["step"]
    return out


def layer_index(name):
    digits = "".join(ch if ch.isdigit() else " " for ch in name).split()
    return int(digits[0]) if digits else 0


def fmt(v, f="%.2f"):
    return "-" if v is None else f % v


def stretch_mean(run, lo, hi, key):
    vals = [r[key] for s, r in run.items() if lo <= s <= hi and r[key] is not None]
    return sum(vals) / len(vals) if vals else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("moe")
    ap.add_argument("torch")
    ap.add_argument("out_prefix")
    ap.add_argument("--steps", default="1,10,20,50,100,200,300")
    ap.add_argument("--labels", default="moe-lua,PyTorch")
    ap.add_argument("--title", default="Routing balance: moe-lua vs PyTorch")
    a = ap.parse_args()
    try:
        steps = [int(s) for s in a.steps.split(",") if s.strip()]
    except ValueError:
        sys.exit("balance_compare: --steps must be a comma-separated list of integers, got %s" % a.steps)
    labels = a.labels.split(",")
    if len(labels) != 2:
        sys.exit("balance_compare: --labels must name the two runs, e.g. moe-lua,PyTorch")
    m, t = read(a.moe, labels[0]), read(a.torch, labels[1])
    last = min(max(m), max(t))

    L = ["# " + a.title, ""]
    L.append("Expert load = max / mean of the tokens each expert received in a layer (1 = balanced); "
             "\"mean\" averages it over the MoE layers, \"worst\" is the worst layer. aux = the load-"
             "balancing losses of all layers, summed. Sources: `%s` (%s, %d records, %d MoE layers) and "
             "`%s` (%s, %d records, %d MoE layers)." % (
                 a.moe, labels[0], len(m), m[max(m)]["layers"], a.torch, labels[1], len(t), t[max(t)]["layers"]))
    L.append("")
    h = labels
    L.append("| step | load mean %s | load mean %s | load worst %s | load worst %s | aux %s | aux %s "
             "| lm loss %s | lm loss %s |" % (h[0], h[1], h[0], h[1], h[0], h[1], h[0], h[1]))
    L.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    intervals = False
    for s in steps:
        rm, rt = m.get(s), t.get(s)
        if rm is None and rt is None:
            continue

        def cell(r, key, f="%.2f"):
            nonlocal intervals
            if r is None:
                return "-"
            mark = ""
            if r["span"] > 1:
                intervals, mark = True, "*"
            return fmt(r[key], f) + mark
        L.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            s, cell(rm, "load_mean"), cell(rt, "load_mean"), cell(rm, "load_worst"), cell(rt, "load_worst"),
            cell(rm, "aux", "%.4f"), cell(rt, "aux", "%.4f"), cell(rm, "loss", "%.4f"), cell(rt, "loss", "%.4f")))
    if intervals:
        L.append("")
        L.append("\\* the record covers a log interval ending at that step (counts summed, losses averaged "
                 "over it): run with log_every=1 for per-step values.")
    L.append("")
    L.append("Means over stretches of the run (per record):")
    L.append("")
    L.append("| steps | load mean %s | load mean %s | load worst %s | load worst %s | aux %s | aux %s |" % (
        h[0], h[1], h[0], h[1], h[0], h[1]))
    L.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    edges = [1, 11, 51, 101, 201, 301]
    for lo, hi in zip(edges, edges[1:] + [10 ** 9]):
        if lo > last:
            break
        hi = min(hi - 1, last)
        L.append("| %d-%d | %s | %s | %s | %s | %s | %s |" % (
            lo, hi, fmt(stretch_mean(m, lo, hi, "load_mean")), fmt(stretch_mean(t, lo, hi, "load_mean")),
            fmt(stretch_mean(m, lo, hi, "load_worst")), fmt(stretch_mean(t, lo, hi, "load_worst")),
            fmt(stretch_mean(m, lo, hi, "aux"), "%.4f"), fmt(stretch_mean(t, lo, hi, "aux"), "%.4f")))
    L.append("")

    png = None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        L.append("(matplotlib is not importable here: no plot.)")
    else:
        fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
        for run, lab, st in ((m, labels[0], "-"), (t, labels[1], "--")):
            xs = sorted(run)
            for i, (key, title) in enumerate((("load_mean", "expert load max/mean, mean over layers"),
                                              ("load_worst", "expert load max/mean, worst layer"),
                                              ("aux", "load-balancing loss (sum over layers)"))):
                ys = [run[s][key] for s in xs]
                pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if pts:
                    ax[i].plot([p[0] for p in pts], [p[1] for p in pts], st, label=lab, linewidth=1.2)
                ax[i].set_title(title, fontsize=10)
                ax[i].set_xlabel("step")
        for x in ax:
            x.grid(alpha=0.3)
            x.legend()
        fig.suptitle(a.title)
        fig.tight_layout()
        png = a.out_prefix + ".png"
        fig.savefig(png, dpi=110)
        L.append("![balance curves](%s)" % png.split("/")[-1])
        L.append("")
    with open(a.out_prefix + ".md", "w") as f:
        f.write("\n".join(L))
    print("balance_compare: wrote %s.md%s" % (a.out_prefix, " and " + png if png else ""))


if __name__ == "__main__":
    main()
