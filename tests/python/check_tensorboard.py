#!/usr/bin/env python3
"""
check_tensorboard.py - moe-lua's TensorBoard event files against TensorBoard's
own readers (PyPI `tensorboard`). Run by tests/lua/tensorboard_spec.lua:

    python3 tests/python/check_tensorboard.py LOGDIR

and by tests/lua/metrics_spec.lua, for the expert load the training loop
logs (lua/moe/train/log.lua) with 64 experts in layer 0 and 4 in layer 1:

    python3 tests/python/check_tensorboard.py --expert-load LOGDIR

(see expert_load_main below).

LOGDIR holds one event file written by lua/moe/tensorboard.lua with the
recipe EXPECTED below (built here from the same rule as in the spec, not read
from moe-lua). Checks, with both of TensorBoard's readers:
  - event_file_loader.EventFileLoader (the raw record reader: it verifies
    the TFRecord framing and parses each Event): the first event's
    file_version, then every scalar's step, tag and value;
  - event_accumulator.EventAccumulator (what the TensorBoard UI uses): the
    scalar tags and each tag's (step, value) series.
Values are float32 in the file: compared after rounding the expected value to
float32 (numpy), i.e. exactly. Exits 0 when everything matches, 1 with the
reason otherwise.
"""
import glob
import os
import sys

import numpy as np
from tensorboard.backend.event_processing import event_accumulator, event_file_loader


def expected():
    """tag -> list of (step, value): the recipe of tensorboard_spec.lua."""
    e = {}
    for step in range(1, 21):
        e.setdefault("loss", []).append((step, 5.0 / step))
        e.setdefault("lr", []).append((step, 1e-3 * step))
        if step % 5 == 0:
            e.setdefault("val_loss", []).append((step, 4.0 / step + 0.25))
            for j in range(4):
                e.setdefault("expert_load/layer0/e%d" % j, []).append((step, (j + 1) / 10.0))
    e.setdefault("big_step", []).append((2**40 + 3, -1.5))
    return e


def f32(x):
    return float(np.float32(x))


def scalar_value(v):
    # The loader migrates simple_value into a tensor (data_compat); accept both.
    if v.HasField("tensor"):
        return float(v.tensor.float_val[0])
    return float(v.simple_value)


def main():
    logdir = sys.argv[1]
    files = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    if len(files) != 1:
        print("expected one event file in %s, found %d" % (logdir, len(files)))
        return 1
    exp = expected()

    events = list(event_file_loader.EventFileLoader(files[0]).Load())
    if not events or events[0].file_version != "brain.Event:2":
        print("first event has no file_version brain.Event:2: %r" % (events[:1],))
        return 1
    got = {}
    for ev in events[1:]:
        for v in ev.summary.value:
            got.setdefault(v.tag, []).append((ev.step, scalar_value(v)))
    want = {t: [(s, f32(x)) for s, x in series] for t, series in exp.items()}
    if got != want:
        print("event_file_loader: scalars differ")
        for t in sorted(set(got) | set(want)):
            if got.get(t) != want.get(t):
                print("  %s: got %r want %r" % (t, got.get(t), want.get(t)))
        return 1
    print("event_file_loader: %d events, %d tags match" % (len(events), len(got)))

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = sorted(acc.Tags()["scalars"])
    if tags != sorted(exp):
        print("EventAccumulator tags %r, want %r" % (tags, sorted(exp)))
        return 1
    for t in tags:
        series = [(e.step, e.value) for e in acc.Scalars(t)]
        if series != want[t]:
            print("EventAccumulator %s: got %r want %r" % (t, series, want[t]))
            return 1
    print("EventAccumulator: %d scalar tags match" % len(tags))
    return 0


def expert_counts(step, n):
    """The recipe of metrics_spec.lua: expert j's count at step (1..5) of a layer of n."""
    return [(j * 7 + step * (n + 1)) % 13 for j in range(n)]


def expert_load_main(logdir):
    """Layer 0 (64 experts, more than the 16 drawn as lines) must be one histogram
    per step of load / mean load, tag expert_load/layer0, with every value in the
    bucket TensorFlow's rule puts it in; layer 1 (4 experts) one scalar per expert
    (expert_load/layer1/e<j>: its share); both a max/mean scalar. Read with
    EventAccumulator (the Histograms and Distributions dashboards' source) and
    with the histogram plugin's data_compat migration (what they draw)."""
    from tensorboard import data_compat
    from tensorboard.util import tensor_util

    files = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
    if len(files) != 1:
        print("expected one event file in %s, found %d" % (logdir, len(files)))
        return 1
    acc = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0})
    acc.Reload()
    tags = acc.Tags()
    if tags["histograms"] != ["expert_load/layer0"]:
        print("histogram tags %r, want ['expert_load/layer0']" % (tags["histograms"],))
        return 1
    want_scalars = {"expert_load/layer0/max_over_mean", "expert_load/layer1/max_over_mean"}
    want_scalars |= {"expert_load/layer1/e%d" % j for j in range(4)}
    got_scalars = {t for t in tags["scalars"] if t.startswith("expert_load/")}
    if got_scalars != want_scalars:
        print("expert_load scalar tags %r, want %r" % (sorted(got_scalars), sorted(want_scalars)))
        return 1
    events = acc.Histograms("expert_load/layer0")
    if [e.step for e in events] != [1, 2, 3, 4, 5]:
        print("histogram steps %r, want 1..5" % ([e.step for e in events],))
        return 1
    for e in events:
        c = expert_counts(e.step, 64)
        loads = [x * 64 / sum(c) for x in c]
        h = e.histogram_value
        if (h.min, h.max, h.num) != (min(loads), max(loads), 64) or abs(h.sum - sum(loads)) > 1e-9:
            print("step %d: min/max/num/sum %r, want %r" % (e.step, (h.min, h.max, h.num, h.sum),
                                                           (min(loads), max(loads), 64, sum(loads))))
            return 1
        if abs(h.sum_squares - sum(x * x for x in loads)) > 1e-9:
            print("step %d: sum_squares %r" % (e.step, h.sum_squares))
            return 1
        limits = list(h.bucket_limit)
        want = [0.0] * len(limits)
        for x in loads:  # bucket i holds [limit[i-1], limit[i])
            i = next(k for k, lim in enumerate(limits) if x < lim)
            want[i] += 1
        if list(h.bucket) != want:
            print("step %d: buckets %r, want %r" % (e.step, list(h.bucket), want))
            return 1
        for name, n in (("layer0", 64), ("layer1", 4)):
            c = expert_counts(e.step, n)
            mom = f32(max(c) / (sum(c) / n))
            got = [s.value for s in acc.Scalars("expert_load/%s/max_over_mean" % name) if s.step == e.step]
            if got != [mom]:
                print("step %d: %s max_over_mean %r, want %r" % (e.step, name, got, mom))
                return 1
        c = expert_counts(e.step, 4)
        for j in range(4):
            got = [s.value for s in acc.Scalars("expert_load/layer1/e%d" % j) if s.step == e.step]
            if got != [f32(c[j] / sum(c))]:
                print("step %d: layer1 e%d %r, want %r" % (e.step, j, got, f32(c[j] / sum(c))))
                return 1
    # the histogram plugin's view: the raw event migrated to its [left, right, count] tensor
    n_hist = 0
    for ev in event_file_loader.EventFileLoader(files[0]).Load():
        for v in ev.summary.value:
            if v.HasField("histo"):  # a loader that does not migrate: do it here
                v = data_compat.migrate_value(v)
            if v.metadata.plugin_data.plugin_name == "histograms":
                arr = tensor_util.make_ndarray(v.tensor)
                if arr.ndim != 2 or arr.shape[1] != 3:
                    print("data_compat: unexpected tensor of shape %r" % (arr.shape,))
                    return 1
                if arr[:, 2].sum() != 64:
                    print("data_compat: counts %r do not sum to 64" % (arr[:, 2].tolist(),))
                    return 1
                n_hist += 1
    if n_hist != 5:
        print("data_compat: %d histograms, want 5" % n_hist)
        return 1
    print("expert load: 5 histograms, %d scalar tags match" % len(want_scalars))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--expert-load":
        sys.exit(expert_load_main(sys.argv[2]))
    sys.exit(main())
