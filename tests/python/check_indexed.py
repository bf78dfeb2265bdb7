#!/usr/bin/env python3
"""
check_indexed.py - moe-lua's Megatron indexed datasets against numpy,
following the layout of Megatron-LM's megatron/core/datasets/indexed_dataset.py
(_IndexReader / _IndexWriter: "MMIDIDX\\0\\0", version <Q 1, dtype code <B,
sequence count <Q, document count <Q, sizes int32[n], pointers int64[n],
document indices int64[count]).

    python3 tests/python/check_indexed.py DIR

Reads DIR/moe.bin/.idx written by tests/lua/data_spec.lua and checks every
token against RECIPE (shared with the spec); then writes DIR/py.bin/.idx
(int32 tokens, two sequences per document) that the spec reads back.
Prints OK on success; exits 1 with a message otherwise.
"""
import struct
import sys

import numpy as np

HEADER = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float32, 8: np.uint16}


def recipe(n_docs=50):
    """Document i of the moe-lua file (u16 tokens; some documents empty)."""
    return [[(i * 37 + j * 11) % 60000 for j in range((i * 7) % 13)] for i in range(n_docs)]


def read(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == HEADER, "bad magic %r" % idx[:9]
    (version,) = struct.unpack("<Q", idx[9:17])
    assert version == 1, "version %d" % version
    (code,) = struct.unpack("<B", idx[17:18])
    (n,) = struct.unpack("<Q", idx[18:26])
    (count,) = struct.unpack("<Q", idx[26:34])
    offset = 34
    sizes = np.frombuffer(idx, dtype=np.int32, count=n, offset=offset)
    offset += sizes.nbytes
    pointers = np.frombuffer(idx, dtype=np.int64, count=n, offset=offset)
    offset += pointers.nbytes
    docs = np.frombuffer(idx, dtype=np.int64, count=count, offset=offset)
    offset += docs.nbytes
    assert offset == len(idx), "idx has %d bytes, layout needs %d" % (len(idx), offset)
    dtype = DTYPES[code]
    bin_ = np.memmap(prefix + ".bin", dtype=np.uint8, mode="r")
    seqs = [np.frombuffer(bin_, dtype=dtype, count=int(s), offset=int(p)) for s, p in zip(sizes, pointers)]
    return dtype, seqs, docs


def write(prefix, documents, dtype):
    """Megatron's builder: each document a list of sequences."""
    sizes, docs = [], [0]
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            for seq in doc:
                f.write(np.array(seq, dtype=dtype).tobytes(order="C"))
                sizes.append(len(seq))
            docs.append(len(sizes))
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if sizes:
        pointers[1:] = np.cumsum(np.array(sizes[:-1], dtype=np.int64) * itemsize)
    code = [c for c, t in DTYPES.items() if t == dtype][0]
    with open(prefix + ".idx", "wb") as f:
        f.write(HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(np.array(sizes, dtype=np.int32).tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.array(docs, dtype=np.int64).tobytes(order="C"))


def py_documents():
    """What DIR/py.* holds: document d has sequences [d*1000 + k*100 + j] of lengths 3 and d % 4."""
    return [[[d * 1000 + j for j in range(3)], [d * 1000 + 100 + j for j in range(d % 4)]] for d in range(20)]


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    d = sys.argv[1]
    dtype, seqs, docs = read(d + "/moe")
    want = recipe()
    assert dtype == np.uint16, "dtype %s, expected uint16" % dtype
    assert len(seqs) == len(want), "%d sequences, expected %d" % (len(seqs), len(want))
    assert list(docs) == list(range(len(want) + 1)), "document indices %s" % list(docs)
    for i, (got, exp) in enumerate(zip(seqs, want)):
        assert got.tolist() == exp, "sequence %d: %s, expected %s" % (i, got.tolist()[:8], exp[:8])
    write(d + "/py", py_documents(), np.int32)
    print("read %d sequences (%d tokens) written by moe-lua; wrote py.bin/.idx" %
          (len(seqs), sum(len(s) for s in seqs)))
    print("OK")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as e:
        print("FAILED:", e)
        sys.exit(1)
