#!/usr/bin/env python3
"""bench/train_report.py - bench/results/train_125m.{json,md} from the json files of
bench/train_125m.lua (moe-lua) and bench/train_torch.py (PyTorch), run on the same GPU in
the same device call: device, date, versions, tokens/s, MFU, peak memory, first-step
agreement, loss curves.

  python3 bench/train_report.py MOE.json TORCH.json OUT_PREFIX [--dense-moe F --dense-torch F]
      [--command "what ran"]
"""
import argparse
import json


def gib(b):
    return None if b is None else b / 2 ** 30


def fmt(v, f):
    return "-" if v is None else f % v


def row(name, m):
    return "| %s | %s | %s | %s | %s | %s | %s |" % (
        name, fmt(m.get("tokens_per_s"), "%.0f"), fmt(m.get("ms_per_step"), "%.1f"),
        fmt(None if m.get("mfu") is None else 100 * m["mfu"], "%.1f%%"),
        fmt(gib(m.get("peak_allocated_bytes")), "%.2f"), fmt(gib(m.get("peak_reserved_bytes")), "%.2f"),
        "%s / %s" % (m.get("steps_timed", "-"), m.get("steps", "-")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("moe")
    ap.add_argument("torch")
    ap.add_argument("out_prefix")
    ap.add_argument("--dense-moe")
    ap.add_argument("--dense-torch")
    ap.add_argument("--command", default="")
    a = ap.parse_args()
    m, t = json.load(open(a.moe)), json.load(open(a.torch))
    dm = json.load(open(a.dense_moe)) if a.dense_moe else None
    dt = json.load(open(a.dense_torch)) if a.dense_torch else None
    c = m["config"]
    fs = t.get("first_step")
    res = {
        "benchmark": "train_125m", "device": m["device"], "date": m["date"], "command": a.command,
        "versions": {"moe_lua": m.get("version"), "torch": t.get("torch"), "torch_cuda": t.get("cuda")},
        "model": {"kind": c["kind"], "n_layers": c["n_layers"], "d_model": c["d_model"], "n_heads": c["n_heads"],
                  "seq_len": c["seq_len"], "experts": c["experts"], "top_k": c["top_k"], "ffn": c["ffn"],
                  "vocab": 257, "params": m["params"], "active_params": m["active_params"],
                  "flops_per_token": m["flops_per_token"]},
        "batch": {"batch_size": c["batch_size"], "tokens_per_step": m["tokens_per_step"]},
        "moe_lua": {k: m.get(k) for k in ("tokens_per_s", "ms_per_step", "mfu", "peak_allocated_bytes",
                                          "peak_reserved_bytes", "steps", "steps_timed", "first_train_loss",
                                          "last_loss", "losses")},
        "torch": {k: t.get(k) for k in ("tokens_per_s", "ms_per_step", "mfu", "peak_allocated_bytes",
                                        "peak_reserved_bytes", "steps", "steps_timed", "grouped_mm", "compile",
                                        "compile_mode", "expert_impl", "losses", "data", "note")},
        "first_step_agreement": fs,
        "speed_ratio_moe_lua_over_torch": m["tokens_per_s"] / t["tokens_per_s"],
    }
    if dm and dt:
        res["dense"] = {"moe_lua": {k: dm.get(k) for k in ("tokens_per_s", "ms_per_step", "mfu",
                                                           "peak_allocated_bytes", "params", "first_loss")},
                        "torch": {k: dt.get(k) for k in ("tokens_per_s", "ms_per_step", "mfu",
                                                         "peak_allocated_bytes", "first_step")}}
    with open(a.out_prefix + ".json", "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")

    L = []
    L.append("# 125M dMoE training: moe-lua vs PyTorch")
    L.append("")
    L.append("Device: %s; date %s; moe-lua: %s; torch %s (CUDA %s)." % (
        m["device"], m["date"], (m.get("version") or "?").split("\n")[0], t.get("torch"), t.get("cuda")))
    if a.command:
        L.append("Command: `%s`." % a.command)
    L.append("")
    L.append("Model: MegaBlocks' 125M dMoE: %d layers, d_model %d, %d heads, seq_len %d, %d experts top-%d, "
             "ffn %d, GELU, byte vocabulary 257 (tied), RoPE, LayerNorm; %.3f B parameters, %.1f M active "
             "per token, %.3g FLOPs per token (6 N_active + 12 L d S). bf16 (moe-lua: bf16 parameters, fp32 "
             "master weights and AdamW state; torch: fp32 parameters under bf16 autocast, fused AdamW), "
             "batch %d x %d = %d tokens per step, AdamW lr %g cosine, clip 1.0." % (
                 c["n_layers"], c["d_model"], c["n_heads"], c["seq_len"], c["experts"], c["top_k"], c["ffn"],
                 m["params"] / 1e9, m["active_params"] / 1e6, m["flops_per_token"], c["batch_size"],
                 c["seq_len"], m["tokens_per_step"], c["lr"]))
    L.append("")
    L.append("| implementation | tokens/s | ms/step | MFU (bf16 dense peak 989 TFLOP/s) | peak allocated GiB "
             "| peak reserved GiB | steps timed / run |")
    L.append("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    L.append(row("moe-lua (train.run, %s experts)" % m.get("mlp_impl", "grouped"), m))
    L.append(row("PyTorch %s (%s experts, eager)" % (t.get("torch"), "torch._grouped_mm" if t.get("grouped_mm")
                                                    else "looped"), t))
    if dm and dt:
        L.append(row("moe-lua, dense GPT 125M (ffn 3072)", dm))
        L.append(row("PyTorch, dense GPT 125M", dt))
    L.append("")
    L.append("moe-lua / PyTorch throughput: %.2fx. Timing excludes the first log interval (moe-lua) or the "
             "first %s steps (torch); both times include the data loading. Data: moe-lua the KJV windows of "
             "its loader; torch %s." % (res["speed_ratio_moe_lua_over_torch"],
                                        t["steps"] - t["steps_timed"] if "steps_timed" in t else "10",
                                        t.get("data", "the exported first batch repeated")))
    L.append("")
    if fs is None:
        L.append("First step: not checked (the torch run had no moe-lua export to start from).")
    else:
        L.append("First step (identical weights exported by moe-lua as safetensors, the same batch, eval mode): "
                 "loss moe-lua %.6f, torch %.6f (|diff| %.2e, tolerance %g); logits mean |diff| %.2e (mean |logit| "
                 "%.3f, tolerance %g relative), max |diff| %.3g; argmax agreement %.4f (tolerance %g): %s." % (
                     fs["moe_lua_loss"], fs["torch_loss"], fs["loss_abs_diff"], fs["tolerance"]["loss_abs_diff"],
                     fs["logits_mean_abs_diff"], fs["logits_mean_abs"], fs["tolerance"]["logits_mean_abs_diff_rel"],
                     fs["logits_max_abs_diff"], fs["argmax_agreement"], fs["tolerance"]["argmax_agreement"],
                     "agree" if fs["ok"] else "DISAGREE"))
    L.append("")
    L.append("moe-lua training loss (step, lm loss): " + ", ".join("%d: %.3f" % (s, v) for s, v in m["losses"]))
    L.append("")
    with open(a.out_prefix + ".md", "w") as f:
        f.write("\n".join(L))


if __name__ == "__main__":
    main()
