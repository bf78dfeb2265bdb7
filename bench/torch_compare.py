#!/usr/bin/env python3
"""torch_compare.py - recomputes with PyTorch every case bench/torch_compare_check.lua
saved (one safetensors file per op and dtype) and compares moe's output and
input gradients with torch's, on the same GPU.

    python3 bench/torch_compare.py DIR [--json OUT.json] [--md OUT.md]

Each case is computed twice with torch from the same inputs and cotangent:
in the case's dtype (what a PyTorch user gets) and in float64 (the
reference). Error = max |x - ref| / max(max |ref|, 1e-6), per tensor, for
moe and for torch. Tolerances per dtype: f32 1e-4 (both sides compute in f32
but reduce in different orders); bf16 2e-2 (outputs are rounded to bf16,
2^-8 relative, and later steps carry that rounding: a few ulp). A row passes
when every moe error is within the tolerance, or within twice torch's own
error in the same dtype (some bf16 gradients, logsumexp's for one, lose more
than 2e-2 in torch too). The reader parses safetensors itself
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
        def run(dtype):
            env = {"torch": torch, "F": F}
            leaves = {}
            for k, t in ts.items():
                if k.startswith("in."):
                    name = k[3:]
                    t = t.to(dev)
                    if t.is_floating_point():
                        t = t.to(dtype).requires_grad_(True)
                        leaves[name] = t
                    env[name] = t
            out = eval(meta["torch"], env)
            out.backward(ts["cot"].to(dev).to(out.dtype))
            res = {"out": out.detach()}
            for name, t in leaves.items():
                res["grad." + name] = t.grad
            return res
        native = run(DT[{"f32": "F32", "bf16": "BF16", "f64": "F64"}[meta["dtype"]]])
        ref = run(torch.float64)
        moe_err = {k: err(ts[k].to(dev), v) for k, v in ref.items()}
        torch_err = {k: err(native[k], v) for k, v in ref.items()}
        tol = TOL[meta["dtype"]]
        passed = all(moe_err[k] <= max(tol, 2 * torch_err[k]) for k in ref)
        rows.append({"case": meta["case"], "dtype": meta["dtype"], "torch": meta["torch"],
                     "moe_error": moe_err, "torch_error": torch_err, "tol": tol, "pass": passed})
    ok = sum(r["pass"] for r in rows)
    lines = [f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}; errors against float64",
             "| op | dtype | moe out | torch out | moe worst grad | torch worst grad | tolerance | pass |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mg = max([v for k, v in r["moe_error"].items() if k != "out"] or [0.0])
        tg = max([v for k, v in r["torch_error"].items() if k != "out"] or [0.0])
        lines.append(f"| {r['case'].rsplit('.', 1)[0]} | {r['dtype']} | {r['moe_error']['out']:.1e} | "
                     f"{r['torch_error']['out']:.1e} | {mg:.1e} | {tg:.1e} | {r['tol']:.0e} | "
                     f"{'yes' if r['pass'] else 'NO'} |")
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
