#!/usr/bin/env python3
"""
check_safetensors.py - moe-lua's safetensors files against the real
`safetensors` library (PyPI) and numpy. Run by tests/lua/safetensors_spec.lua:

    python3 tests/python/check_safetensors.py DIR

DIR holds what the spec wrote with moe.save:
  moe_all.safetensors     every dtype, strided views, an empty tensor, a
                          scalar, metadata (see EXPECTED below)
  moe_nobf16.safetensors  the same without t_bf16, for numpy's load_file
  exact.safetensors       a small file that must be byte-identical to what
                          the library writes for the same tensors
This script checks them, then writes DIR/py.safetensors with the library
(PY_WRITTEN below) for the spec to read back with moe.load.

The expected values are built here from the same recipe as in the spec
(arange-based), not read from moe-lua. numpy has no bfloat16 and
safetensors.numpy.load_file cannot return BF16 tensors: t_bf16 is checked
from the bytes the library's own parser (safetensors.deserialize) returns,
and that is said in the output. Exits 0 when everything matches, 1 (with
the reason) otherwise.
"""
import json
import os
import struct
import sys

import numpy as np
import safetensors
import safetensors.numpy as stnp

FLOATS = (np.arange(6) - 2.5) * 0.5  # exact in bf16 and f16


def expected():
    e = {}
    for name, dt in [("f32", np.float32), ("f64", np.float64), ("f16", np.float16)]:
        e["t_" + name] = FLOATS.astype(dt).reshape(2, 3)
    for name, dt in [("i8", np.int8), ("i32", np.int32), ("i64", np.int64)]:
        e["t_" + name] = (np.arange(6) - 2).astype(dt).reshape(2, 3)
    e["t_u8"] = (np.arange(6) * 50).astype(np.uint8).reshape(2, 3)
    e["t_bool"] = (np.arange(6) % 2 == 1).reshape(2, 3)
    e["transposed"] = np.arange(12, dtype=np.float32).reshape(3, 4).T
    e["sliced"] = np.arange(20, dtype=np.int32)[1::3]
    e["expanded"] = np.broadcast_to(np.array([[7], [-8]], dtype=np.int64), (2, 5))
    e["empty"] = np.zeros((0, 3), dtype=np.float32)
    e["scalar"] = np.array(3.25, dtype=np.float64)
    return e


EXPECTED = expected()
EXPECTED_BF16 = FLOATS.astype(np.float32).reshape(2, 3)  # t_bf16, as float32
EXPECTED_META = {"format": "pt", "source": "moe-lua", "note": 'ünïcødé "quoted"\n'}
DTYPE_OF = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16",
            np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32",
            np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL"}


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def raw_header(path):
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    if n % 8 != 0:
        fail(f"{path}: header length {n} is not a multiple of 8")
    return json.loads(data[8:8 + n].decode("utf-8")), data


def same(name, got, want):
    if got.dtype != want.dtype:
        fail(f"{name}: dtype {got.dtype}, wanted {want.dtype}")
    if got.shape != want.shape:
        fail(f"{name}: shape {got.shape}, wanted {want.shape}")
    if not np.array_equal(got, want):
        fail(f"{name}: values {got.tolist()}, wanted {want.tolist()}")


def check_header(path, names):
    header, data = raw_header(path)
    meta = header.pop("__metadata__", None)
    if meta != EXPECTED_META:
        fail(f"{path}: metadata {meta!r}, wanted {EXPECTED_META!r}")
    if sorted(header) != sorted(names):
        fail(f"{path}: tensors {sorted(header)}, wanted {sorted(names)}")
    for name in names:
        info = header[name]
        want_dt = "BF16" if name == "t_bf16" else DTYPE_OF[EXPECTED[name].dtype]
        want_shape = [2, 3] if name == "t_bf16" else list(EXPECTED[name].shape)
        if info["dtype"] != want_dt or info["shape"] != want_shape:
            fail(f"{path}: {name} is {info['dtype']} {info['shape']}, wanted {want_dt} {want_shape}")
    return data


def main():
    d = sys.argv[1]
    print(f"python check: safetensors {safetensors.__version__}, numpy {np.__version__}")

    # 1. load_file (the numpy API) on the file without BF16: every tensor.
    path = os.path.join(d, "moe_nobf16.safetensors")
    check_header(path, list(EXPECTED))
    loaded = stnp.load_file(path)
    if sorted(loaded) != sorted(EXPECTED):
        fail(f"load_file: names {sorted(loaded)}, wanted {sorted(EXPECTED)}")
    for name, want in EXPECTED.items():
        same(name, loaded[name], want)
    with safetensors.safe_open(path, framework="np") as f:
        if f.metadata() != EXPECTED_META:
            fail(f"safe_open: metadata {f.metadata()!r}")
    print(f"load_file({os.path.basename(path)}): {len(loaded)} tensors and the metadata match")

    # 2. The file with every dtype: the library's parser validates all of
    #    it; numpy tensors through safe_open, BF16 from the raw bytes.
    path = os.path.join(d, "moe_all.safetensors")
    data = check_header(path, list(EXPECTED) + ["t_bf16"])
    parsed = dict(safetensors.deserialize(data))
    with safetensors.safe_open(path, framework="np") as f:
        for name, want in EXPECTED.items():
            same(name, f.get_tensor(name), want)
    bf = parsed["t_bf16"]
    if bf["dtype"] != "BF16" or list(bf["shape"]) != [2, 3]:
        fail(f"t_bf16: {bf['dtype']} {bf['shape']}")
    as_f32 = (np.frombuffer(bytes(bf["data"]), dtype="<u2").astype("<u4") << 16).view("<f4")
    same("t_bf16", as_f32.reshape(2, 3), EXPECTED_BF16)
    try:
        stnp.load_file(path)
        print("load_file reads BF16 with this numpy: unexpected but fine")
    except (KeyError, TypeError, ValueError) as e:
        print(f"BF16: numpy has no bfloat16 (load_file raises {type(e).__name__}: {e}); "
              "t_bf16 checked from the bytes safetensors.deserialize returned")
    print(f"{os.path.basename(path)}: {len(parsed)} tensors match (safe_open + deserialize)")

    # 3. Byte-identical to the library's own writer.
    with open(os.path.join(d, "exact.safetensors"), "rb") as f:
        ours = f.read()
    theirs = stnp.save({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                        "b": np.array([1, -2], dtype=np.int64),
                        "c": np.array([0.5], dtype=np.float16),
                        "d": np.array([True, False, True])}, metadata={"format": "pt"})
    if ours != theirs:
        fail(f"exact.safetensors differs from the library's bytes:\n ours   {ours!r}\n theirs {theirs!r}")
    print(f"exact.safetensors: byte-identical to safetensors.numpy.save ({len(ours)} bytes)")

    # 4. A file written by the library, for moe.load.
    out = os.path.join(d, "py.safetensors")
    tensors = {
        "p_f32": np.arange(6, dtype=np.float32).reshape(2, 3) * 1.5,
        "p_f64": (np.arange(4) / 8).reshape(2, 2),
        "p_f16": np.array([0.5, -2, 1024], dtype=np.float16),
        "p_i8": np.array([-128, 0, 127], dtype=np.int8),
        "p_u8": np.array([0, 255], dtype=np.uint8),
        "p_i32": np.array([-2**31, 2**31 - 1], dtype=np.int32),
        "p_i64": np.array([-2**62, 2**53 + 1], dtype=np.int64),
        "p_bool": np.array([True, False]),
        "p_empty": np.zeros((3, 0), dtype=np.float32),
        "p_scalar": np.array(2.5),
        "p_t": np.arange(6, dtype=np.int32).reshape(2, 3).T,  # a strided numpy view
    }
    meta = {"writer": "python safetensors"}
    try:  # BF16 through the library's TensorSpec (not a numpy dtype)
        bits = np.array([0x3F80, 0xC000, 0x3F00], dtype="<u2")  # 1.0, -2.0, 0.5
        keep = [np.array(v, order="C", copy=True) for v in tensors.values()]  # keeps 0-d
        flat = {k: safetensors.TensorSpec(dtype=c.dtype.name, shape=c.shape, data_ptr=c.ctypes.data,
                                          data_len=c.nbytes) for k, c in zip(tensors, keep)}
        flat["p_bf16"] = safetensors.TensorSpec(dtype="bfloat16", shape=(3,), data_ptr=bits.ctypes.data,
                                                data_len=bits.nbytes)
        meta["bf16"] = "yes"
        safetensors.serialize_file(flat, out, metadata=meta)
        print("py.safetensors: written with safetensors.serialize_file (p_bf16 included)")
    except (AttributeError, TypeError) as e:
        meta["bf16"] = "no"
        stnp.save_file(tensors, out, metadata=meta)
        print(f"py.safetensors: written with safetensors.numpy.save_file, without p_bf16 ({e})")
    print("OK")


if __name__ == "__main__":
    main()
