#!/usr/bin/env python3
"""tests/python/check_tokenizers.py - the reference for moe-lua's GPT-2 /
Hugging Face byte-level BPE (lua/moe/data/gpt2.lua, core/bpe.c): the
`tokenizers` package from PyPI.

  check_tokenizers.py DIR CORPUS       (run by tests/lua/tokenizer_spec.lua)
    trains a byte-level BPE on CORPUS (deterministic: BpeTrainer, vocab 1000,
    min_frequency 2, the 256 ByteLevel characters, <|endoftext|> special), saves
    it as DIR/tokenizer.json and DIR/vocab.json + DIR/merges.txt, writes the
    ids of CORPUS to DIR/expected.json; the same with add_prefix_space into
    DIR/prefix/; checks that the committed fixture (tests/data/tokenizer/)
    still encodes CORPUS to its expected.json; prints OK.
  check_tokenizers.py --fixture FIXDIR CORPUS
    writes the small committed fixture (vocab 320): vocab.json, merges.txt,
    tokenizer.json, expected.json. Run once; the spec reads it without PyPI.
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def train(corpus, vocab_size, add_prefix_space=False):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus], trainer=trainer)
    return tok


def save(tok, d, corpus):
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    tok.model.save(d)  # vocab.json, merges.txt
    ids = tok.encode(corpus).ids
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump({"ids": ids, "vocab_size": tok.get_vocab_size(),
                   "eod": tok.token_to_id("<|endoftext|>")}, f)
        f.write("\n")
    return ids


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--fixture":
        corpus = open(sys.argv[3], encoding="utf-8", newline="").read()
        tok = train(corpus, 320)
        ids = save(tok, sys.argv[2], corpus)
        assert tok.decode(ids, skip_special_tokens=False) == corpus
        print("fixture: %d ids" % len(ids))
        return
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    d, corpus_path = sys.argv[1], sys.argv[2]
    corpus = open(corpus_path, encoding="utf-8", newline="").read()
    tok = train(corpus, 1000)
    ids = save(tok, d, corpus)
    assert tok.decode(ids, skip_special_tokens=False) == corpus, "tokenizers does not decode its own ids"
    print("trained: %d ids for %d bytes" % (len(ids), len(corpus.encode())))
    pids = save(train(corpus, 1000, add_prefix_space=True), os.path.join(d, "prefix"), corpus)
    print("add_prefix_space: %d ids" % len(pids))
    # the committed fixture still agrees with this version of tokenizers
    fix = os.path.join(os.path.dirname(os.path.abspath(corpus_path)))
    for name in ("tokenizer.json",):
        tok = Tokenizer.from_file(os.path.join(fix, name))
        want = json.load(open(os.path.join(fix, "expected.json")))["ids"]
        got = tok.encode(corpus).ids
        assert got == want, "the committed fixture %s no longer matches tokenizers %s" % (fix, name)
    print("fixture agrees")
    print("OK")


if __name__ == "__main__":
    main()
