#!/usr/bin/env python3
"""torch_compare.py - recomputes with PyTorch every case bench/torch_compare.lua
saved (one safetensors file per op and dtype) and compares moe's output and
input gradients with torch's, on the same GPU.

    python3 bench/torch_compare.py DIR [--json OUT.json] [--md OUT.md]

Error = max |moe - torch| / max(max |torch|, 1e-6), per tensor. Tolerances per
dtype: f32 1e-4 (both sides compute in f32 but reduce in different orders);
bf16 2e-2 (outputs are rounded to bf16: 2^-8 relative, and inputs of later
steps carry that rounding: a few ulp). A row passes when the output and every
gradient are within the tolerance. The reader parses safetensors itself
(8-byte header size, JSON header, raw little-endian data), so the
`safetensors` package is not needed.
"""
import argparse, glob, json, os, struct, sys
import torch
import torch.nn.functional as F

DT = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
      "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
TOL = {"f32": 1e-4, "bf16": 2e-2, "f64": 1e-10}

def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        buf = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        raw = bytearray(buf[b:end])
        t = torch.frombuffer(raw, dtype=DT[e["dtype"]]) if end > b else torch.empty(0, dtype=DT[e["dtype"]])
        out[name] = t.reshape(e["shape"]).clone()
    return out, meta

def err(a, b):
    a, b = a.double(), b.double()
    scale = max(b.abs().max().item() if b.numel() else 0.0, 1e-6)
    return (a - b).abs().max().item() / scale if b.numel() else 0.0

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    dev = "cuda"
    rows = []
    for path in sorted(glob.glob(os.path.join(args.dir, "*.safetensors"))):
        ts, meta = load(path)
        env = {"torch": torch, "F": F}
        leaves = {}
        for k, t in ts.items():
            if k.startswith("in."):
                name = k[3:]
                t = t.to(dev)
                if t.is_floating_point():
                    t.requires_grad_(True)
                    leaves[name] = t
                env[name] = t
        out = eval(meta["torch"], env)
        out.backward(ts["cot"].to(dev))
        errs = {"out": err(ts["out"].to(dev), out.detach())}
        for name, t in leaves.items():
            errs["grad." + name] = err(ts["grad." + name].to(dev), t.grad)
        tol = TOL[meta["dtype"]]
        worst = max(errs.values())
        rows.append({"case": meta["case"], "dtype": meta["dtype"], "torch": meta["torch"], "errors": errs,
                     "worst": worst, "tol": tol, "pass": worst <= tol})
    ok = sum(r["pass"] for r in rows)
    lines = [f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
             "| op | dtype | out error | worst grad error | tolerance | pass |", "|---|---|---|---|---|---|"]
    for r in rows:
        g = max([v for k, v in r["errors"].items() if k != "out"] or [0.0])
        lines.append(f"| {r['case'].rsplit('.', 1)[0]} | {r['dtype']} | {r['errors']['out']:.2e} | {g:.2e} | "
                     f"{r['tol']:.0e} | {'yes' if r['pass'] else 'NO'} |")
    lines.append(f"\n{ok} of {len(rows)} cases within tolerance")
    text = "\n".join(lines)
    print(text)
    if args.md:
        open(args.md, "w").write(text + "\n")
    if args.json:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows},
                  open(args.json, "w"), indent=1)
    return 0 if ok == len(rows) else 1

if __name__ == "__main__":
    sys.exit(main())
