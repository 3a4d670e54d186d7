#!/usr/bin/env python3
"""Train a byte-level BPE tokenizer offline and save it as a HuggingFace tokenizer directory.

    python scripts/train_tokenizer.py --input corpus.jsonl [more files] --vocab-size 32000 --out my_tokenizer

Megatron's ``tools/preprocess_data.py`` then reads it with ``--tokenizer-type HuggingFaceTokenizer
--tokenizer-model my_tokenizer`` (no download: megatron-core 0.19's GPT2BPETokenizer fetches "gpt2" even
with --vocab-file/--merge-file). Inputs are JSON lines (the ``--json-key`` field of each line, as
preprocess_data.py reads them) or plain text files. Needs ``pip install tokenizers transformers``.
The end-of-document token is ``<|endoftext|>`` (id 0); every id is below ``--vocab-size``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator


def texts(paths: list[str], key: str) -> Iterator[str]:
    """The training texts: each JSON line's ``key`` field (``.jsonl``/``.json``), else each file whole."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.endswith((".jsonl", ".json")):
                for line in f:
                    if line.strip():
                        yield json.loads(line)[key]
            else:
                yield f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="JSON-lines or text files")
    parser.add_argument("--json-key", default="text", help="the field of each JSON line (default text)")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--out", required=True, help="the tokenizer directory to write")
    opts = parser.parse_args(argv)
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError as exc:
        print(f"train_tokenizer.py: error: {exc}; pip install tokenizers transformers", file=sys.stderr)
        return 2
    eod = "<|endoftext|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=opts.vocab_size, special_tokens=[eod],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts(opts.input, opts.json_key), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eod).save_pretrained(opts.out)
    print(f"wrote {opts.out}: {tokenizer.get_vocab_size()} tokens, end of document {eod!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
