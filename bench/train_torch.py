#!/usr/bin/env python3
"""bench/train_torch.py - the PyTorch reference of moe-lua's training step (bench/train_125m.lua).

The same model as moe.nn's TransformerLM with layers.dMoE feed-forward blocks (MegaBlocks' ladder
dMoE): pre-norm GPT, LayerNorm with bias (eps 1e-5), qkv/proj without bias, rotary positions
(rotate-half, base 10000, applied in f32), tied embeddings over the byte vocabulary (257), a top-k
softmax router in fp32 with MegaBlocks' load-balancing loss (loss_weight * E * sum_e f_e P_e per
layer, summed over the layers, as moe-lua), GELU (erf) expert MLPs w1 (E, d, f), w2 (E, f, d);
`--kind dense` is the dense GPT with an MLP of ffn hidden units (fc1, fc2). It trains on the
KJV corpus in moe-lua's Megatron indexed format (PREFIX.bin/.idx) in moe-lua's batch order: the
train split of data.GPTDataset (the last 5% of the documents held out, samples of seq_len + 1
tokens at multiples of seq_len, each epoch a Fisher-Yates permutation from splitmix64 seeded by
(data seed 1234, epoch, split)), so step s sees the same tokens as moe-lua's step s.

  python3 bench/train_torch.py --data PREFIX --steps N --batch-size B --n-layers L --d-model D \\
      --n-heads H --ffn F --experts E --kind dmoe|dense [--compile] --json FILE \\
      [--balance-jsonl FILE] [--device cuda|cpu] [--init DIR]
  python3 bench/train_torch.py --export DIR --config MOE.json --json FILE      (the older form)

Defaults are train_125m.lua's: seq_len 1024, top-1, loss weight 0.1, lr 6e-4 (warm-up 20 steps,
cosine to 6e-5 at the last step), AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on tensors
of two or more dimensions, clip 1.0, log every 10 steps. `--init DIR` (or `--export DIR`) starts
from moe-lua's exported initial weights (DIR/model.safetensors from train_125m.lua export=DIR),
and when DIR/first_step.safetensors is there it first checks the loss and logits on that batch
against moe-lua's (exit status 1 when they disagree beyond the tolerances written beside the
check). Without it the weights are drawn as moe-lua draws them (normal std 0.02, output
projections of attention and the dense MLP std 0.02 / sqrt(2 L)), from torch's generator.

What the step does (the fastest honest PyTorch we know how to write; the GPU figures are
bench/step_round.sh's to measure, per mode):
- fp32 parameters under bf16 autocast; LayerNorm and the router in fp32 (autocast / explicit).
- attention: one qkv GEMM, RoPE on q and k together in four kernels (f32 tables holding the
  bf16-rounded cos/sin, as moe-lua), F.scaled_dot_product_attention(is_causal) on strided views
  (no copies); `--sdpa auto|flash|cudnn|efficient` pins a backend (auto: torch's choice).
- MoE: top-1 by max (top-k by topk), a stable sort of the expert ids, the group ends by
  searchsorted (no bincount: torch's CUDA bincount reads max() to the host, a sync per
  layer, and a scatter_add of ones into E bins contends on atomics), the inverse permutation by one
  scatter, then dispatch and combine as gathers in both directions (custom autograd
  functions: no index_add atomics), experts through torch._grouped_mm on bf16 copies of the
  expert weights (`--expert-layout kn`: stored as moe-lua's (E, d, f) / (E, f, d); `nk`: stored
  transposed so the grouped GEMMs get K-major B operands, torchtitan's layout);
  `--expert-impl loop`: one matmul per expert with the group sizes read to the host, used
  automatically only where torch._grouped_mm is missing or fails (older or CPU builds).
- no host synchronisation inside a step: losses, aux losses, grad norms and expert counts stay
  on the device in one small vector per step and are read once per log interval.
- gradient clipping at 1.0 without a pass over the gradients: the global norm by
  torch._foreach_norm, and the clip applied inside the fused AdamW update through its
  grad_scale (grad / max(1, norm / clip), the same update as clip_grad_norm_ then step);
  found_inf skips the update of a step whose gradient norm is not finite, as moe-lua does.
  `--clip-mode foreach` runs torch.nn.utils.clip_grad_norm_(foreach=True) instead.
- torch.optim.AdamW(fused=True), zero_grad(set_to_none=True).
- batches gathered on the host from the token stream into pinned memory and copied with
  non_blocking=True; the host runs ahead of the GPU (nothing waits).
- `--compile`: torch.compile of the whole forward (model and loss; backward through
  AOTAutograd), `--compile-mode default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs`
  (default "default"), `--compile-scope model|dense` (dense: only the attention halves of the
  blocks, the dense MLPs and the head + loss; the MoE layers stay eager). The dropless MoE
  needs no dynamic shapes here: every tensor's shape is fixed by (B, S, k), only the contents
  of the group offsets vary, so the graph is static (dynamic=False) and compiles once.
  On an H200 (bench/results/step/step_round.md) the default mode with the whole model compiled
  ran 1.13-1.52x eager's tokens/s; the other modes and scopes have not been compared on a GPU.

Timing: the first --warmup-steps (10) steps are untimed (they hold compilation), the rest are
timed from a device synchronisation to one after the last step, data loading and the log-interval
reads included (as moe-lua's train.run); peak memory over the whole run.

Routing balance against moe-lua (same initial weights, batches, lr schedule and router: softmax
top-k, jitter 0, loss weight as given): export from moe-lua with per-step records, then
  moe-lua bench/train_125m.lua ... steps=300 log_every=1 export=DIR out_dir=DIR/out json=...
  python3 bench/train_torch.py --init DIR --data data/bible_kjv --steps 300 ... --balance-jsonl B.jsonl
  python3 bench/balance_compare.py DIR/out/metrics.jsonl B.jsonl OUT_PREFIX
(the balance JSONL has every step whatever --log-every is; moe-lua's metrics.jsonl has one record
per log interval). On a CPU shared with other work, OMP_NUM_THREADS=1 runs far faster.

Outputs: --json FILE (tokens/s, ms/step, MFU at 989 TFLOP/s on H100/H200, peak memory, the loss
per log interval, the first-step agreement when checked; bench/step_report.py and
bench/train_report.py read it); --balance-jsonl FILE: one record per step with moe-lua's
metrics.jsonl names (step, loss, aux_loss = the summed layers' load-balancing losses, lr,
grad_norm, expert_counts {"blocks.<i>.ffn": [E counts]}, load_balance = the worst layer's
max/mean count) plus aux_loss_layers, load_max_over_mean (per layer) and load_mean (their
mean over the layers); bench/balance_compare.py sets it beside moe-lua's metrics.jsonl.
"""
import argparse
import datetime
import json
import math
import mmap
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
          "F64": torch.float64, "I32": torch.int32}


def fail(msg):
    print("train_torch: " + msg, file=sys.stderr)
    sys.exit(2)


def read_safetensors(path, device):
    """name -> tensor on device, metadata: a minimal safetensors reader (header JSON + raw bytes)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    n = struct.unpack("<Q", mm[:8])[0]
    header = json.loads(mm[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        dt = DTYPES[e["dtype"]]
        a, b = e["data_offsets"]
        count = (b - a) // torch.empty((), dtype=dt).element_size()
        buf = bytearray(mm[8 + n + a:8 + n + b])
        t = torch.frombuffer(buf, dtype=dt, count=count).reshape(e["shape"]) if count else \
            torch.empty(e["shape"], dtype=dt)
        out[name] = t.to(device)
    mm.close()
    return out, meta


# ------------------------------------------------------------------ data (moe/data/gpt.lua)

M64 = (1 << 64) - 1
# core/moe_data.h's dtype codes: (torch dtype read, mask applied after widening)
IDX_DTYPES = {1: (torch.uint8, None), 2: (torch.int8, None), 3: (torch.int16, None), 4: (torch.int32, None),
              5: (torch.int64, None), 8: (torch.int16, 0xFFFF)}


def splitmix64(seed):
    state = [seed & M64]

    def nxt():
        state[0] = (state[0] + 0x9E3779B97F4A7C15) & M64
        z = state[0]
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)
    return nxt


def permutation(n, seed, epoch, salt):
    """moe/data/gpt.lua's permutation(n, seed, epoch, salt): 0-based sample indices."""
    nxt = splitmix64(seed * 1000003 + epoch * 7919 + salt)
    p = list(range(n))
    for i in range(n, 1, -1):
        j = (nxt() >> 1) % i  # Lua: ((nextr() >> 1) % i) + 1, 1-based
        p[i - 1], p[j] = p[j], p[i - 1]
    return p


class GPTBatches:
    """data.GPTDataset(IndexedDataset(prefix), {seq_len, seed, split, valid_fraction}):batch(B)."""

    def __init__(self, prefix, seq_len, seed=1234, split="train", valid_fraction=0.05):
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                fail("--data %s: no %s%s (moe-lua's indexed dataset: PREFIX.bin and PREFIX.idx)" % (
                    prefix, prefix, ext))
        with open(prefix + ".idx", "rb") as f:
            m = f.read()
        if len(m) < 34 or m[:9] != b"MMIDIDX\x00\x00":
            fail("--data %s: %s.idx is not a Megatron MMIDIDX index" % (prefix, prefix))
        version, code, n, c = struct.unpack("<QBQQ", m[9:34])
        if version != 1 or code not in IDX_DTYPES:
            fail("--data %s: index version %d, dtype code %d: not supported" % (prefix, version, code))
        if len(m) not in (34 + 12 * n + 8 * c, 34 + 13 * n + 8 * c):
            fail("--data %s: %s.idx has %d bytes, not what %d sequences and %d documents need" % (
                prefix, prefix, len(m), n, c))
        sizes = struct.unpack_from("<%di" % n, m, 34)
        ptrs = struct.unpack_from("<%dq" % n, m, 34 + 4 * n)
        docs = struct.unpack_from("<%dq" % c, m, 34 + 12 * n)
        ndocs = c - 1
        nvalid = 0
        if valid_fraction > 0 and ndocs >= 2:
            nvalid = max(1, math.floor(ndocs * valid_fraction + 0.5))
        if nvalid >= ndocs:
            nvalid = ndocs - 1
        d0, d1 = (0, ndocs - nvalid) if split == "train" else (ndocs - nvalid, ndocs)
        s0, s1 = docs[d0], docs[d1]
        tdt, mask = IDX_DTYPES[code]
        item = torch.empty((), dtype=tdt).element_size()
        with open(prefix + ".bin", "rb") as f:
            raw = f.read()
        parts = []
        for j in range(s0, s1):
            if sizes[j]:
                parts.append(torch.frombuffer(bytearray(raw[ptrs[j]:ptrs[j] + sizes[j] * item]), dtype=tdt))
        stream = torch.cat(parts).to(torch.int64) if parts else torch.empty(0, dtype=torch.int64)
        if mask is not None:
            stream &= mask
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.tokens = stream.numel()
        self.samples = (self.tokens - 1) // seq_len
        if self.samples < 1:
            fail("--data %s: the %s split has %d tokens, fewer than seq_len + 1 = %d" % (
                prefix, split, self.tokens, seq_len + 1))
        self.salt = 1 if split == "train" else 2
        self.epoch, self.position = 0, 0
        self.perm = permutation(self.samples, seed, 0, self.salt)
        self.offsets = torch.arange(seq_len + 1, dtype=torch.int64)

    def batch(self, B, pin=False):
        starts = []
        for _ in range(B):
            if self.position >= self.samples:
                self.epoch, self.position = self.epoch + 1, 0
                self.perm = permutation(self.samples, self.seed, self.epoch, self.salt)
            starts.append(self.perm[self.position] * self.seq_len)
            self.position += 1
        idx = torch.tensor(starts, dtype=torch.int64)[:, None] + self.offsets
        w = torch.empty((B, self.seq_len + 1), dtype=torch.int64, pin_memory=pin)
        torch.index_select(self.stream, 0, idx.reshape(-1), out=w.view(-1))
        return w


# ------------------------------------------------------------------ model

def rope_tables(S, D, base, device):
    # moe_rope_cache: angle t * base^(-2j / D) in double, stored in bf16; held here as f32 tables
    # of the bf16 values, laid out for rotate-half: cos | cos and -sin | sin over the head dim
    j = torch.arange(D // 2, dtype=torch.float64)
    inv = base ** (-2.0 * j / D)
    ang = torch.arange(S, dtype=torch.float64)[:, None] * inv[None, :]
    c = ang.cos().to(torch.bfloat16).float()
    s = ang.sin().to(torch.bfloat16).float()
    cos = torch.cat([c, c], -1)[:, None, None, :]    # (S, 1, 1, D) against (B, S, 2, H, D)
    sin = torch.cat([-s, s], -1)[:, None, None, :]
    return cos.to(device), sin.to(device)


def rope_qk(qk, cos, sin):
    """qk (B, S, 2, H, D) bf16 -> rotate-half RoPE of q and k, computed in f32, rounded to bf16."""
    h = qk.shape[-1] // 2
    rot = torch.cat([qk[..., h:], qk[..., :h]], -1)
    return torch.addcmul(qk * cos, rot, sin).to(qk.dtype)


SDPA = {"backend": "auto"}


def sdpa(q, k, v):
    b = SDPA["backend"]
    if b == "auto":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    pick = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[b]
    with sdpa_kernel(pick):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(torch.nn.Module):
    def __init__(self, d, H):
        super().__init__()
        self.H, self.D = H, d // H
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        B, S, d = x.shape
        qkv = self.qkv(x).view(B, S, 3, self.H, self.D)
        qk = rope_qk(qkv[:, :, :2], cos, sin)
        q, k, v = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        o = sdpa(q, k, v)  # (B, H, S, D) view of (B, S, H, D) memory
        return self.proj(o.transpose(1, 2).reshape(B, S, d))


class Router(torch.nn.Module):
    def __init__(self, d, E):
        super().__init__()
        self.layer = torch.nn.Linear(d, E, bias=False)


class Experts(torch.nn.Module):
    """w1 (E, d, f), w2 (E, f, d) as moe-lua (layout "kn": the GEMMs' B operands row-major), or
    stored transposed, w1 (E, f, d) and w2 (E, d, f) (layout "nk": B K-major, torchtitan's)."""

    def __init__(self, E, d, f, layout):
        super().__init__()
        self.nk = layout == "nk"
        self.w1 = torch.nn.Parameter(torch.empty(E, f, d) if self.nk else torch.empty(E, d, f))
        self.w2 = torch.nn.Parameter(torch.empty(E, d, f) if self.nk else torch.empty(E, f, d))

    def bf16(self):
        """-> w1 (E, d, f), w2 (E, f, d) bf16 (views of transposed copies for "nk")."""
        w1, w2 = self.w1.to(torch.bfloat16), self.w2.to(torch.bfloat16)
        if self.nk:
            return w1.transpose(1, 2), w2.transpose(1, 2)
        return w1, w2


class Dispatch(torch.autograd.Function):
    """x (T, d) -> x[src] (T k, d), src = order // k; backward: gathers by inv, sums the k copies."""

    @staticmethod
    def forward(ctx, x, src, inv, k):
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx, g):
        (inv,) = ctx.saved_tensors
        gx = g.index_select(0, inv)
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, g.shape[-1]).sum(1)
        return gx, None, None, None


class Combine(torch.autograd.Function):
    """ys (T k, d) in expert order -> ys[inv] (T k, d) in token order; backward: gathers by order."""

    @staticmethod
    def forward(ctx, ys, inv, order):
        ctx.save_for_backward(order)
        return ys.index_select(0, inv)

    @staticmethod
    def backward(ctx, g):
        (order,) = ctx.saved_tensors
        return g.index_select(0, order), None, None


EXPERT_IMPL = {"impl": "grouped"}


def expert_mlp(xs, w1, w2, offs, counts):
    """xs (N, d) sorted by expert -> (N, d): gelu(xs w1[e]) w2[e] for each expert's rows."""
    if EXPERT_IMPL["impl"] == "grouped":
        h = torch._grouped_mm(xs, w1, offs=offs)
        return torch._grouped_mm(F.gelu(h), w2, offs=offs)
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):  # host read of the group sizes: the loop's price
        if c:
            outs.append(F.gelu(xs[start:start + c] @ w1[e]) @ w2[e])
        start += c
    return torch.cat(outs, 0)


class DMoE(torch.nn.Module):
    def __init__(self, d, f, E, k, loss_weight, layout):
        super().__init__()
        self.E, self.k, self.loss_weight = E, k, loss_weight
        self.router = Router(d, E)
        self.experts = Experts(E, d, f, layout)
        self.register_buffer("bins", torch.arange(E, dtype=torch.int64), persistent=False)

    def forward(self, x):
        """x (B, S, d) -> y (B, S, d) f32, aux loss (scalar; 0 in eval), counts (E) i64."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        T, k = x2.shape[0], self.k
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x2.float(), self.router.layer.weight.float())  # fp32 router
            probs = logits.softmax(-1)
        if k == 1:
            gates, ids = probs.max(-1, keepdim=True)
        else:
            gates, ids = probs.topk(k, -1)
        sorted_ids, order = ids.reshape(-1).sort(stable=True)
        ends = torch.searchsorted(sorted_ids, self.bins, right=True)  # (E) end of each group
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=x.device))
        src = order if k == 1 else torch.div(order, k, rounding_mode="floor")
        xs = Dispatch.apply(x2.to(torch.bfloat16), src, inv, k)
        w1, w2 = self.experts.bf16()
        ys = expert_mlp(xs, w1, w2, ends.to(torch.int32), counts)
        yk = Combine.apply(ys, inv, order)  # (T k, d) token order
        if k == 1:
            y = yk * gates
        else:
            y = (yk.view(T, k, -1) * gates[..., None]).sum(1)
        if self.training and self.loss_weight > 0:
            aux = (counts.float() * (1.0 / (T * k)) * probs.mean(0)).sum() * (self.E * self.loss_weight)
        else:
            aux = probs.new_zeros(())
        return y.reshape(shape), aux, counts


class MLP(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, f, bias=False)
        self.fc2 = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class AttnHalf(torch.nn.Module):
    """x + attn(ln1(x)): the block's first half (compiled alone by --compile-scope dense)."""

    def __init__(self, d, H):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d, eps=1e-5)
        self.attn = Attention(d, H)

    def forward(self, x, cos, sin):
        return x + self.attn(self.ln1(x), cos, sin)


class Block(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        d = a["d_model"]
        self.sa = AttnHalf(d, a["n_heads"])
        self.ln2 = torch.nn.LayerNorm(d, eps=1e-5)
        self.moe = a["kind"] != "dense"
        if self.moe:
            self.ffn = DMoE(d, a["ffn"], a["experts"], a["top_k"], a["loss_weight"], a["expert_layout"])
        else:
            self.ffn = MLP(d, a["ffn"])

    def forward(self, x, cos, sin):
        x = self.sa(x, cos, sin)
        if self.moe:
            y, aux, counts = self.ffn(self.ln2(x))
            return x + y, aux, counts
        return x + self.ffn(self.ln2(x)), None, None


# moe-lua's state-dict names (train_125m.lua export) -> this module's
def moe_name(n):
    n = n.replace(".sa.ln1.", ".ln1.").replace(".sa.attn.", ".attn.")
    return n[len("head."):] if n.startswith("head.") else n


class Head(torch.nn.Module):
    """ln_f, the tied output projection and the cross-entropy (compiled alone by scope dense)."""

    def __init__(self, d):
        super().__init__()
        self.ln_f = torch.nn.LayerNorm(d, eps=1e-5)

    def forward(self, x, wte, y):
        logits = F.linear(self.ln_f(x), wte)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


class LM(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.a = a
        self.wte = torch.nn.Embedding(257, a["d_model"])
        self.blocks = torch.nn.ModuleList([Block(a) for _ in range(a["n_layers"])])
        self.head = Head(a["d_model"])
        cos, sin = rope_tables(a["seq_len"], a["d_model"] // a["n_heads"], 10000.0, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def trunk(self, idx):
        S = idx.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        x = self.wte(idx)
        auxes, counts = [], []
        for b in self.blocks:
            x, aux, c = b(x, cos, sin)
            if aux is not None:
                auxes.append(aux)
                counts.append(c)
        return x, auxes, counts

    def logits(self, idx):
        x, _, _ = self.trunk(idx)
        return F.linear(self.head.ln_f(x), self.wte.weight)

    def forward(self, idx, y):
        """-> loss (lm + aux), the step's stats vector [lm, aux, aux per layer..., counts...] (f32)."""
        with torch.autocast(idx.device.type, dtype=torch.bfloat16):
            x, auxes, counts = self.trunk(idx)
            lm = self.head(x, self.wte.weight, y)
        if auxes:
            aux_l = torch.stack(auxes)
            aux = aux_l.sum()
            stats = torch.cat([lm.detach().view(1), aux.detach().view(1), aux_l.detach(),
                               torch.stack(counts).reshape(-1).float()])
            return lm + aux, stats
        return lm, lm.detach().view(1)


def init_weights(model, a):
    """moe-lua's init: normal(0, 0.02); attention proj and dense fc2 0.02 / sqrt(2 L); LN 1, 0."""
    out_std = 0.02 / math.sqrt(2 * a["n_layers"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("ln1.weight") or n.endswith("ln2.weight") or n.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif n.endswith(".bias"):
                p.zero_()
            elif n.endswith("attn.proj.weight") or n.endswith("ffn.fc2.weight"):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, 0.02)


def check_grouped(device):
    if not hasattr(torch, "_grouped_mm"):
        return False, "torch %s has no torch._grouped_mm" % torch.__version__
    try:
        a = torch.randn(64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(4, 32, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 16, 40, 64], device=device, dtype=torch.int32)
        out = torch._grouped_mm(a, w, offs=offs)
        ref = torch.cat([a[0:16] @ w[0], a[16:40] @ w[2], a[40:64] @ w[3]])
        out.float().sum().backward()
        ok = bool((out.float() - ref.float()).abs().max() < 0.5) and w.grad is not None
        return ok, None if ok else "torch._grouped_mm gave wrong results on %s" % device
    except Exception as e:  # noqa: BLE001 - any failure means: use the loop
        return False, "torch._grouped_mm unusable on %s (%s)" % (device, str(e).split("\n")[0])


def param_counts(model, a):
    n = sum(p.numel() for p in model.parameters())
    # moe-lua's num_active_parameters: the output projection (V d, the tied embedding), ln_f, and per
    # block everything but the experts, of which top_k / E
    active = 0
    for name, p in model.named_parameters():
        if name == "wte.weight" or ".experts." in name:
            continue
        active += p.numel()
    active += 257 * a["d_model"]
    if a["kind"] != "dense":
        per_layer = 2 * a["d_model"] * a["ffn"] * a["experts"]
        active += a["n_layers"] * per_layer * a["top_k"] // a["experts"]
    flops = 6 * active + 12 * a["n_layers"] * a["d_model"] * a["seq_len"]
    return n, active, flops


# ------------------------------------------------------------------ main

def parse_args(argv):
    ap = argparse.ArgumentParser(description="PyTorch reference of moe-lua's training step "
                                 "(see the header of bench/train_torch.py)")
    ap.add_argument("--data", default=None, help="indexed dataset prefix (PREFIX.bin/.idx), e.g. data/bible_kjv")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--n-heads", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--kind", choices=["dmoe", "dense"], default=None)
    ap.add_argument("--loss-weight", type=float, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--min-lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None, help="lr warm-up steps")
    ap.add_argument("--seed", type=int, default=None, help="torch seed of the initial weights (without --init)")
    ap.add_argument("--data-seed", type=int, default=1234, help="seed of the batch order (moe-lua's data_seed)")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--warmup-steps", type=int, default=10, help="untimed steps at the start")
    ap.add_argument("--device", default=None, help="cuda (default when available), cuda:N or cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the forward (and its backward)")
    ap.add_argument("--compile-mode", default="default",
                    choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    ap.add_argument("--compile-scope", default="model", choices=["model", "dense"])
    ap.add_argument("--expert-impl", default="auto", choices=["auto", "grouped", "loop"])
    ap.add_argument("--expert-layout", default="kn", choices=["kn", "nk"],
                    help="kn: expert weights stored as moe-lua's (E, d, f) / (E, f, d); nk: stored transposed, "
                    "so torch._grouped_mm gets K-major B operands")
    ap.add_argument("--sdpa", default="auto", choices=["auto", "flash", "cudnn", "efficient", "math"])
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping: the global norm's bound")
    ap.add_argument("--clip-mode", default="fused", choices=["fused", "foreach"],
                    help="fused: the clip as AdamW's grad_scale; foreach: clip_grad_norm_(foreach=True)")
    ap.add_argument("--init", default=None, help="moe-lua export folder: start from its model.safetensors "
                    "and check first_step.safetensors when present")
    ap.add_argument("--export", default=None, help="the older name of --init")
    ap.add_argument("--config", default=None, help="moe-lua's json (train_125m.lua json=): model, batch, "
                    "steps and data from its config, unless given here")
    ap.add_argument("--json", default="")
    ap.add_argument("--balance-jsonl", default="")
    ap.add_argument("--loop", action="store_true", help="the older name of --expert-impl loop")
    return ap.parse_args(argv)


DEFAULTS = {"kind": "dmoe", "steps": 200, "batch_size": 8, "seq_len": 1024, "n_layers": 12, "d_model": 768,
            "n_heads": 12, "ffn": 3072, "experts": 64, "top_k": 1, "loss_weight": 0.1, "lr": 6e-4,
            "min_lr": 6e-5, "warmup": 20, "seed": 1234, "log_every": 10}


def resolve(args):
    """The run's settings: the command line, else moe-lua's config (--config), else DEFAULTS."""
    conf = {}
    if args.config:
        try:
            conf = json.load(open(args.config))["config"]
        except (OSError, ValueError, KeyError) as e:
            fail("--config %s: cannot read moe-lua's config (%s)" % (args.config, e))
    a = {}
    for k, v in DEFAULTS.items():
        given = getattr(args, k)
        a[k] = given if given is not None else conf.get(k, v)
    if args.data is None and conf.get("data") and os.path.isfile(conf["data"] + ".idx"):
        args.data = conf["data"]
    for k in ("steps", "batch_size", "seq_len", "n_layers", "d_model", "n_heads", "ffn", "experts", "top_k",
              "log_every"):
        if not isinstance(a[k], int) or a[k] < 1:
            fail("--%s must be an integer >= 1, got %s" % (k.replace("_", "-"), a[k]))
    if a["d_model"] % a["n_heads"] or (a["d_model"] // a["n_heads"]) % 2:
        fail("--d-model %d must split into --n-heads %d heads of an even size" % (a["d_model"], a["n_heads"]))
    if a["kind"] not in ("dmoe", "dense"):
        fail("kind %s: this reference trains dmoe or dense" % a["kind"])
    if a["kind"] != "dense" and a["top_k"] > a["experts"]:
        fail("--top-k %d exceeds --experts %d" % (a["top_k"], a["experts"]))
    a["warmup"] = min(a["warmup"], a["steps"])
    a["expert_layout"] = args.expert_layout
    return a


def lr_at(a, s):
    """moe/optim/schedule.lua, cosine, 0-based step."""
    if s < a["warmup"]:
        return a["lr"] * (s + 1) / a["warmup"]
    span = a["steps"] - a["warmup"]
    p = min((s - a["warmup"]) / span, 1.0) if span > 0 else 1.0
    return a["min_lr"] + (a["lr"] - a["min_lr"]) * (1 + math.cos(math.pi * p)) / 2


def first_step_check(model, init_dir, dev):
    """Loss and logits on moe-lua's exported first batch at the same weights (eval mode)."""
    fs, meta = read_safetensors(os.path.join(init_dir, "first_step.safetensors"), dev)
    x, y, ref_logits = fs["x"], fs["y"], fs["logits"]
    ref_loss = float(meta["loss"])
    model.eval()
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16):
        logits = model.logits(x).float()
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    model.train()
    diff = (logits - ref_logits).abs()
    scale = ref_logits.abs().mean().item()
    agree = {
        "moe_lua_loss": ref_loss, "torch_loss": lm, "loss_abs_diff": abs(lm - ref_loss),
        "logits_max_abs_diff": diff.max().item(), "logits_mean_abs_diff": diff.mean().item(),
        "logits_mean_abs": scale,
        "argmax_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
    }
    # Tolerances: both sides run the model in bf16 (8-bit mantissa, relative rounding 2^-9 per op)
    # with fp32 accumulation, through the layers with different kernels and summation orders; the
    # top-1 router (fp32 on both sides) can pick another expert for a token whose two best
    # scores are within that rounding, which changes that token's logits by O(1). So: the mean
    # loss within 1e-2 nats (0.2% of ~5.5), the mean absolute logit difference within 5% of
    # the mean absolute logit, and the argmax token the same for >= 97% of positions.
    agree["tolerance"] = {"loss_abs_diff": 1e-2, "logits_mean_abs_diff_rel": 0.05, "argmax_agreement": 0.97}
    agree["ok"] = bool(agree["loss_abs_diff"] <= 1e-2 and agree["logits_mean_abs_diff"] <= 0.05 * scale
                       and agree["argmax_agreement"] >= 0.97)
    return agree, x, y


def main(argv=None):
    args = parse_args(argv)
    a = resolve(args)
    init_dir = args.init or args.export
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        fail("--device %s: this torch (%s) sees no CUDA device" % (dev, torch.__version__))
    on_gpu = dev.type == "cuda"
    if on_gpu and dev.index is not None:
        torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    SDPA["backend"] = args.sdpa
    impl = "loop" if args.loop else args.expert_impl
    why = None
    if a["kind"] == "dense":
        impl = "none"
    elif impl in ("auto", "grouped"):
        ok, why = check_grouped(dev)
        if not ok and impl == "grouped":
            fail("--expert-impl grouped: " + why)
        impl = "grouped" if ok else "loop"
        if why:
            print("train_torch: %s: experts looped (one matmul per expert, group sizes read to the host)%s" % (
                why, "; this is not a fair GPU reference" if on_gpu else ""), file=sys.stderr)
    EXPERT_IMPL["impl"] = impl

    t0 = time.time()
    torch.manual_seed(a["seed"])
    with torch.device(dev):  # parameters made and initialised where they train (3.6 B at 125M x 64)
        model = LM(a)
    if init_dir:
        path = os.path.join(init_dir, "model.safetensors")
        if not os.path.isfile(path):
            fail("--init %s: no %s (bench/train_125m.lua export=DIR writes it)" % (init_dir, path))
        sd, _ = read_safetensors(path, "cpu")
        names = {moe_name(k): k for k, _ in model.named_parameters()}
        missing, unexpected = set(names) - set(sd), set(sd) - set(names)
        if missing or unexpected:
            fail("--init %s: model.safetensors does not match the model given (missing %s, unexpected %s)" % (
                init_dir, sorted(missing)[:4], sorted(unexpected)[:4]))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for mn, k in names.items():
                if a["expert_layout"] == "nk" and ".experts.w" in mn:
                    sd[mn] = sd[mn].transpose(1, 2)
                if tuple(sd[mn].shape) != tuple(params[k].shape):
                    fail("--init %s: %s is %s in model.safetensors, %s here" % (
                        init_dir, mn, tuple(sd[mn].shape), tuple(params[k].shape)))
                params[k].copy_(sd[mn].float())
        del sd
    else:
        init_weights(model, a)
    model.to(dev)
    n_params, n_active, fpt = param_counts(model, a)
    agree, first_xy = None, None
    if init_dir and os.path.isfile(os.path.join(init_dir, "first_step.safetensors")):
        agree, fx, fy = first_step_check(model, init_dir, dev)
        first_xy = (fx, fy)
        print("train_torch: first step: " + json.dumps(agree))
    data = None
    if args.data:
        data = GPTBatches(args.data, a["seq_len"], seed=args.data_seed)
        data_note = "%s train split in moe-lua's order (data seed %d)" % (args.data, args.data_seed)
    elif first_xy is not None:
        data_note = "moe-lua's exported first batch, repeated"
    else:
        fail("--data PREFIX is needed (or --init DIR with first_step.safetensors)")
    if first_xy is not None and data is not None:
        # moe-lua's first batch is the loader's first: the same order, or say so
        w0 = data.batch(a["batch_size"])
        data.epoch, data.position = 0, 0
        same = w0.shape[1] - 1 == first_xy[0].shape[1] and w0.shape[0] == first_xy[0].shape[0] and \
            torch.equal(w0[:, :-1], first_xy[0].cpu())
        if agree is not None:
            agree["first_batch_same"] = bool(same)
        if not same:
            print("train_torch: the loader's first batch is not moe-lua's exported one", file=sys.stderr)
    load_s = time.time() - t0

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        opt = torch.optim.AdamW(groups, lr=a["lr"], betas=(0.9, 0.95), eps=1e-8, fused=True)
        fused = True
    except (RuntimeError, ValueError) as e:
        print("train_torch: fused AdamW unavailable on %s (%s): foreach" % (dev, e), file=sys.stderr)
        opt = torch.optim.AdamW(groups, lr=a["lr"], betas=(0.9, 0.95), eps=1e-8, foreach=True)
        fused = False
    clip_mode = args.clip_mode if fused else "foreach"
    params = decay + no_decay

    fwd = model
    if args.compile:
        if args.compile_scope == "model":
            # one static graph (no graph break) unless the experts loop over host-read group sizes
            fwd = torch.compile(model, mode=args.compile_mode, dynamic=False, fullgraph=impl != "loop")
        else:
            for b in model.blocks:
                b.sa = torch.compile(b.sa, mode=args.compile_mode, dynamic=False)
                if not b.moe:
                    b.ffn = torch.compile(b.ffn, mode=args.compile_mode, dynamic=False)
            model.head = torch.compile(model.head, mode=args.compile_mode, dynamic=False)

    graphs = args.compile and args.compile_mode == "reduce-overhead"

    def step_once(s, x, y):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        for g in opt.param_groups:
            g["lr"] = lr_at(a, s)
        loss, stats = fwd(x, y)
        loss.backward()
        grads = [p.grad for p in params if p.grad is not None]
        gn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if clip_mode == "fused":
            # clip_grad_norm_'s coefficient min(1, clip / (norm + 1e-6)) as AdamW's grad divisor
            opt.grad_scale = torch.clamp((gn + 1e-6) * (1.0 / args.clip), min=1.0)
            opt.found_inf = (~torch.isfinite(gn)).float()
        else:
            torch._foreach_mul_(grads, torch.clamp(args.clip / (gn + 1e-6), max=1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return torch.cat([stats, gn.detach().float().view(1)])

    bal = open(args.balance_jsonl, "w") if args.balance_jsonl else None
    L, E = a["n_layers"], a["experts"]
    names = ["blocks.%d.ffn" % i for i in range(L)]

    def flush(pending, losses):
        """Reads the pending steps' stats (one device-to-host copy) into losses and the balance file."""
        if not pending:
            return
        rows = torch.stack([v for _, v in pending]).cpu().tolist()
        lm_sum = 0.0
        for (s, _), r in zip(pending, rows):
            lm_sum += r[0]
            if bal and a["kind"] != "dense":
                aux_l = r[2:2 + L]
                cnt = [[int(c) for c in r[2 + L + i * E:2 + L + (i + 1) * E]] for i in range(L)]
                mm = [max(c) / (sum(c) / E) if sum(c) else None for c in cnt]
                rec = {"step": s + 1, "loss": r[0], "aux_loss": r[1], "lr": lr_at(a, s), "grad_norm": r[-1],
                       "aux_loss_layers": aux_l, "expert_counts": dict(zip(names, cnt)),
                       "load_max_over_mean": mm, "load_balance": max(m for m in mm if m is not None),
                       "load_mean": sum(mm) / len(mm)}
                bal.write(json.dumps(rec) + "\n")
            elif bal:
                bal.write(json.dumps({"step": s + 1, "loss": r[0], "lr": lr_at(a, s), "grad_norm": r[-1]}) + "\n")
        losses.append([pending[-1][0] + 1, lm_sum / len(rows)])
        pending.clear()

    if on_gpu:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    steps, B = a["steps"], a["batch_size"]
    nw = min(args.warmup_steps, max(steps - 1, 0))
    pending, losses = [], []
    t_start = t_warm = time.time()
    for s in range(steps):
        if s == nw:
            if on_gpu:
                torch.cuda.synchronize(dev)
            t_start = time.time()
        if data is not None:
            w = data.batch(B, pin=on_gpu).to(dev, non_blocking=True)
            x, y = w[:, :-1], w[:, 1:]
        else:
            x, y = first_xy
        pending.append((s, step_once(s, x, y)))
        if (s + 1) % a["log_every"] == 0 or s == steps - 1 or s + 1 == nw:
            flush(pending, losses)
    if on_gpu:
        torch.cuda.synchronize(dev)
    t_end = time.time()
    if bal:
        bal.close()
    timed = steps - nw
    secs = t_end - t_start
    tps = timed * B * a["seq_len"] / secs if secs > 0 else None
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    peak = 989e12 if ("H100" in name or "H200" in name) else None
    timed_losses = [v for st, v in losses if st > nw]
    out = {
        "impl": "torch", "mode": "compile" if args.compile else "eager", "kind": a["kind"],
        "compile_mode": args.compile_mode if args.compile else None,
        "compile_scope": args.compile_scope if args.compile else None,
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "config": a, "expert_impl": impl, "grouped_mm": impl == "grouped", "compile": bool(args.compile),
        "sdpa": args.sdpa, "clip_mode": clip_mode, "fused_adamw": fused, "data": data_note,
        "params": n_params, "active_params": n_active, "flops_per_token": fpt,
        "steps": steps, "steps_timed": timed, "tokens_per_step": B * a["seq_len"],
        "tokens_per_s": tps, "ms_per_step": 1000 * secs / timed if timed else None,
        "mfu": fpt * tps / peak if (peak and tps) else None,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(dev) if on_gpu else None,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev) if on_gpu else None,
        "load_seconds": load_s, "untimed_seconds": t_start - t_warm,
        "first_step": agree, "losses": losses,
        "first_train_loss": losses[0][1] if losses else None, "last_loss": losses[-1][1] if losses else None,
        "timed_loss_mean": sum(timed_losses) / len(timed_losses) if timed_losses else None,
    }
    print("train_torch: %s %s, %d steps (%d timed), %s tokens/s, %s ms/step, MFU %s, peak allocated %s, "
          "loss %s -> %s" % (a["kind"], out["mode"], steps, timed, "%.0f" % tps if tps else "?",
                             "%.1f" % out["ms_per_step"] if out["ms_per_step"] else "?",
                             "%.1f%%" % (100 * out["mfu"]) if out["mfu"] else "?",
                             "%.2f GiB" % (out["peak_allocated_bytes"] / 2 ** 30) if on_gpu else "-",
                             "%.4f" % out["first_train_loss"] if losses else "?",
                             "%.4f" % out["last_loss"] if losses else "?"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0 if (agree is None or agree["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
