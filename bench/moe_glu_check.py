"""bench/moe_glu_check.py - the PyTorch reference of bench/moe_glu_check.lua:
reads DIR/glu_check.safetensors with a small reader of its own (8-byte
little-endian header length, JSON header, raw little-endian bytes: the GPU
machine may lack the safetensors package), recomputes the MoE GLU layer in
f32 from the same bf16 values and the same routing (the ids moe-lua chose;
gates gathered from torch's own f32 softmax at those ids, so the router
weight gets its gradient), backpropagates the same dy, and prints the max
relative error (max |moe - torch| / max |torch|) per tensor with PASS/FAIL.

Tolerances (moe-lua runs in bf16 with f32 accumulation; the reference in
f32 from the same bf16 inputs):
  out, grad x, grad w1, w3, w2: 2e-2 - h1, h3, act(h1) * h3 and y are
      stored in bf16 (relative rounding 2^-9 = 2e-3 each, a few deep),
      the gradients likewise, so errors of several 1e-3 of the largest
      magnitude are expected; 2e-2 still catches a wrong expert or gate.
  gates: 1e-2 - softmax in f32 of bf16 logits, then one bf16 rounding.
  grad wr: 5e-2 - through the gate gradient (a dot product of bf16 values
      over d) and the bf16 logits of the router matmul.

  python3 bench/moe_glu_check.py DIR
"""
import json
import struct
import sys

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
          "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    with open(path, "rb") as fh:
        blob = fh.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    out = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        t = torch.frombuffer(bytearray(data[b:e]), dtype=DTYPES[h["dtype"]]) if e > b else \
            torch.empty(0, dtype=DTYPES[h["dtype"]])
        out[name] = t.reshape(h["shape"])
    return out, meta


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "."
    t, meta = read_safetensors(d + "/glu_check.safetensors")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    E, k = int(meta["E"]), int(meta["k"])
    tol = {"out": 2e-2, "gates": 1e-2, "grad_x": 2e-2, "grad_w1": 2e-2, "grad_w3": 2e-2,
           "grad_w2": 2e-2, "grad_wr": 5e-2}
    ok_all = True
    for impl in ("grouped", "sparse"):
        p = {n: t[n].to(dev).float().clone().requires_grad_() for n in ("x", "wr", "w1", "w3", "w2")}
        ids = t["ids_" + impl].to(dev)
        probs = torch.softmax(p["x"] @ p["wr"], -1)
        gates = probs.gather(1, ids)
        out = torch.zeros_like(p["x"])
        for e in range(E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            h = p["x"][tok]
            y = (F.silu(h @ p["w1"][e]) * (h @ p["w3"][e])) @ p["w2"][e]
            out = out.index_add(0, tok, y * gates[tok, slot].unsqueeze(1))
        out.backward(t["dy"].to(dev).float())
        ref = {"out": out, "gates": gates, "grad_x": p["x"].grad, "grad_wr": p["wr"].grad,
               "grad_w1": p["w1"].grad, "grad_w3": p["w3"].grad, "grad_w2": p["w2"].grad}
        for name, r in ref.items():
            key = name + "_" + impl if name in ("out", "gates") else name + "_" + impl
            got = t[key].to(dev).float()
            r = r.detach().float()
            err = ((got - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            ok = err <= tol[name]
            ok_all = ok_all and ok
            print(f"{impl:8s} {name:8s} max rel err {err:.3e} (tol {tol[name]:.0e}) "
                  f"{'PASS' if ok else 'FAIL'}")
    print("moe_glu_check:", "PASS" if ok_all else "FAIL")
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
