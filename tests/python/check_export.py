"""tests/python/check_export.py - what `moe-lua export format=hf` wrote, read by
Hugging Face's `safetensors` package (tests/lua/export_spec.lua runs it):

  python3 check_export.py HF_DIR REFERENCE.safetensors

HF_DIR holds model.safetensors and config.json; REFERENCE holds the moe-lua
model's own tensors (its state dict names), "tokens" (1, S) and "logits"
(1, S, V): moe-lua's forward of those tokens. Checked:
  - config.json's layout: every tensor name and shape that layout has
    (Mixtral: MixtralForCausalLM's names, GPT-2: GPT2LMHeadModel's), no other;
  - the values: each exported tensor against the moe-lua tensor it comes
    from (transposed, split or per expert), exactly;
  - the model: a numpy forward written from the layout's own definition
    (HF transformers' modeling_mixtral / modeling_gpt2: rotate-half rope,
    RMSNorm, softmax top-k router renormalised, SwiGLU experts; GPT-2's
    Conv1D, LayerNorm, learned positions, GELU) gives moe-lua's logits
    within 1e-4 (float32 against moe-lua's float32).
Prints one "ok" line per check; exits 1 on the first failure.
"""
import json
import math
import sys

import numpy as np
from safetensors.numpy import load_file


def fail(msg):
    print("FAILED: " + msg)
    sys.exit(1)


def same(a, b, what):
    if a.shape != b.shape:
        fail("%s: shape %s, expected %s" % (what, a.shape, b.shape))
    if not np.array_equal(a, b):
        fail("%s: values differ (max %g)" % (what, np.abs(a - b).max()))


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, k, v):
    # q, k, v: (H, S, D); causal
    S, D = q.shape[1], q.shape[2]
    s = q @ k.transpose(0, 2, 1) / math.sqrt(D)
    mask = np.triu(np.ones((S, S), dtype=bool), 1)
    s = np.where(mask, -np.inf, s)
    return softmax(s) @ v


def mixtral_forward(t, c, tokens):
    d, H = c["hidden_size"], c["num_attention_heads"]
    D = d // H
    eps, theta, k = c["rms_norm_eps"], c["rope_theta"], c["num_experts_per_tok"]

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    S = tokens.shape[0]
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    ang = np.outer(np.arange(S), inv)
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # (H, S, D), HF's rotate_half
        half = np.concatenate([-x[..., D // 2:], x[..., : D // 2]], -1)
        return x * cos + half * sin

    x = t["model.embed_tokens.weight"][tokens].astype(np.float64)
    for i in range(c["num_hidden_layers"]):
        p = "model.layers.%d." % i
        h = rms(x, t[p + "input_layernorm.weight"])
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(S, H, D).transpose(1, 0, 2)
        kk = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(S, H, D).transpose(1, 0, 2)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(S, H, D).transpose(1, 0, 2)
        a = attention(rope(q), rope(kk), v).transpose(1, 0, 2).reshape(S, d)
        x = x + a @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        probs = softmax(h @ t[p + "block_sparse_moe.gate.weight"].T)
        y = np.zeros_like(h)
        for s in range(S):
            top = np.argsort(-probs[s], kind="stable")[:k]
            w = probs[s, top] / probs[s, top].sum()
            for e, g in zip(top, w):
                ep = p + "block_sparse_moe.experts.%d." % e
                a1 = h[s] @ t[ep + "w1.weight"].T
                a3 = h[s] @ t[ep + "w3.weight"].T
                y[s] += g * ((a1 / (1 + np.exp(-a1)) * a3) @ t[ep + "w2.weight"].T)
        x = x + y
    x = rms(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


def gpt2_forward(t, c, tokens):
    d, H = c["n_embd"], c["n_head"]
    D, S = d // H, tokens.shape[0]
    eps = c["layer_norm_epsilon"]
    erf = np.vectorize(math.erf)

    def ln(x, p):
        m = x.mean(-1, keepdims=True)
        var = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / np.sqrt(var + eps) * t[p + ".weight"] + t[p + ".bias"]

    def gelu(x):
        if c["activation_function"] == "gelu_new":
            return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        return 0.5 * x * (1 + erf(x / math.sqrt(2)))

    x = (t["transformer.wte.weight"][tokens] + t["transformer.wpe.weight"][:S]).astype(np.float64)
    for i in range(c["n_layer"]):
        p = "transformer.h.%d." % i
        h = ln(x, p + "ln_1")
        qkv = h @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
        q, k, v = (qkv[:, j * d:(j + 1) * d].reshape(S, H, D).transpose(1, 0, 2) for j in range(3))
        a = attention(q, k, v).transpose(1, 0, 2).reshape(S, d)
        x = x + a @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        h = ln(x, p + "ln_2")
        x = x + gelu(h @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"]) @ t[p + "mlp.c_proj.weight"] \
            + t[p + "mlp.c_proj.bias"]
    x = ln(x, "transformer.ln_f")
    return x @ t["transformer.wte.weight"].T


def main():
    hf_dir, ref_path = sys.argv[1], sys.argv[2]
    t = load_file(hf_dir + "/model.safetensors")
    c = json.load(open(hf_dir + "/config.json"))
    r = load_file(ref_path)
    arch = c["architectures"][0]
    want = {}  # name -> array it must equal
    if arch == "MixtralForCausalLM":
        d, E = c["hidden_size"], c["num_local_experts"]
        want["model.embed_tokens.weight"] = r["wte.weight"]
        want["model.norm.weight"] = r["ln_f.weight"]
        if not c["tie_word_embeddings"]:
            want["lm_head.weight"] = r["lm_head.weight"]
        for i in range(c["num_hidden_layers"]):
            b, h = "blocks.%d." % i, "model.layers.%d." % i
            want[h + "input_layernorm.weight"] = r[b + "ln1.weight"]
            want[h + "post_attention_layernorm.weight"] = r[b + "ln2.weight"]
            qkv = r[b + "attn.qkv.weight"]
            for j, n in enumerate(("q", "k", "v")):
                want[h + "self_attn.%s_proj.weight" % n] = qkv[j * d:(j + 1) * d]
            want[h + "self_attn.o_proj.weight"] = r[b + "attn.proj.weight"]
            want[h + "block_sparse_moe.gate.weight"] = r[b + "ffn.router.layer.weight"]
            for e in range(E):
                for w in ("w1", "w2", "w3"):
                    want[h + "block_sparse_moe.experts.%d.%s.weight" % (e, w)] = r[b + "ffn.experts." + w][e].T
        forward = mixtral_forward
    elif arch == "GPT2LMHeadModel":
        want["transformer.wte.weight"] = r["wte.weight"]
        want["transformer.wpe.weight"] = r["wpe.weight"]
        for n in ("weight", "bias"):
            want["transformer.ln_f." + n] = r["ln_f." + n]
        for i in range(c["n_layer"]):
            b, h = "blocks.%d." % i, "transformer.h.%d." % i
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                for n in ("weight", "bias"):
                    want[h + theirs + "." + n] = r[b + ours + "." + n]
            for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                                 ("ffn.fc1", "mlp.c_fc"), ("ffn.fc2", "mlp.c_proj")):
                w = r[b + ours + ".weight"]
                want[h + theirs + ".weight"] = w.T
                want[h + theirs + ".bias"] = r.get(b + ours + ".bias", np.zeros(w.shape[0], dtype=w.dtype))
        forward = gpt2_forward
    elif arch == "MoeLuaTransformerLM":
        want = {k: v for k, v in r.items() if k not in ("tokens", "logits")}
        forward = None
    else:
        fail("unknown architecture " + arch)
    extra = sorted(set(t) - set(want))
    missing = sorted(set(want) - set(t))
    if extra or missing:
        fail("%s: names differ: unexpected %s, missing %s" % (arch, extra[:5], missing[:5]))
    for name in sorted(want):
        same(t[name], np.ascontiguousarray(want[name]), name)
    print("ok   %s: %d tensors, names, shapes and values" % (arch, len(want)))
    if forward is not None:
        tokens = r["tokens"].reshape(-1)
        logits = forward(t, c, tokens)
        ref = r["logits"].reshape(logits.shape).astype(np.float64)
        err = np.abs(logits - ref).max() / max(np.abs(ref).max(), 1e-30)
        if not err <= 1e-4:
            fail("%s: the numpy forward's logits differ from moe-lua's by %.3g of their largest" % (arch, err))
        print("ok   %s: a numpy forward from the layout's definition gives moe-lua's logits (%.2e)" % (arch, err))


main()
