#!/usr/bin/env python3
"""
check_tensorboard.py - moe-lua's TensorBoard event files against TensorBoard's
own readers (PyPI `tensorboard`). Run by tests/lua/tensorboard_spec.lua:

    python3 tests/python/check_tensorboard.py LOGDIR

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


if __name__ == "__main__":
    sys.exit(main())
