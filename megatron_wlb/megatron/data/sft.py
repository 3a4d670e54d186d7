"""``--sft`` with WLB: Megatron's SFT jsonl, one conversation one document, packed by work.

Translation only: Megatron's args name the jsonl files (``--data-path [WEIGHT] FILE.jsonl ...`` or the
per-split flags, as for Megatron's own ``SFTDataset``) and its tokenizer (``--tokenizer-type SFTTokenizer
--tokenizer-model DIR --sft-tokenizer-prompt-format ...``, built by Megatron: ``get_tokenizer()``); the data
layer (``data.sft``) tokenizes each conversation through that tokenizer's ``tokenize_conversation`` and
``data.reader.DocumentReader`` splits, shuffles and streams the conversations like any documents, so
checkpoints and resume are the documents mode's. Each piece the packer places is read with its own
labels and loss mask (``read_piece``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from megatron_wlb.data.blend import parse_data_path
from megatron_wlb.data.reader import DocumentReader
from megatron_wlb.data.sft import SAMPLES_MEGATRON, SftCorpus, SftInputError
from megatron_wlb.data.sft_cache import default_cache_dir, file_sha256
from megatron_wlb.megatron.args.megatron_args import MegatronArgs

#: (stream id, offset, length) -> a piece's tokens, labels and loss mask
PieceRead = Callable[[int, int, int], Any]
#: corpora already tokenized in this process: (path, seq_len, tokenizer id, samples, CP) -> corpus (train/valid/test
#: share)
_CORPORA: dict[tuple[str, int, int, str, int], SftCorpus] = {}
#: the files of a --tokenizer-model directory that make its identity (weights are left out)
_TOKENIZER_FILES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".py")


def tokenizer_files_digest(args: Any) -> str:
    """``--tokenizer-model``'s small files (vocabulary, merges, config, chat template; not weights) hashed with
    the prompt format: part of the SFT cache's tokenizer identity (``data.sft.tokenizer_identity``)."""
    a = MegatronArgs.of(args)
    h = hashlib.sha256(f"{a.tokenizer_model}|{a.sft_tokenizer_prompt_format}".encode())
    model = a.tokenizer_model
    if model and os.path.isdir(model):
        for name in sorted(os.listdir(model)):
            full = os.path.join(model, name)
            if name.endswith(_TOKENIZER_FILES) and os.path.isfile(full) and os.path.getsize(full) < 1 << 28:
                h.update(name.encode())
                h.update(file_sha256(full).encode())
    elif model and os.path.isfile(model):
        h.update(file_sha256(model).encode())
    return h.hexdigest()


def sft_corpus(path: str, tokenizer: Any, seq_len: int, cache_dir: str | None = None, identity_extra: str = "",
               samples: str = SAMPLES_MEGATRON, context_parallel: int = 1) -> SftCorpus:
    """``data.sft.SftCorpus`` of one jsonl, opened once per process: mapped from its cache (``--data-cache-path``,
    else ``cache/`` beside the jsonl), which the first rank to start tokenizes while the others wait."""
    key = (os.path.abspath(path), int(seq_len), id(tokenizer), samples, int(context_parallel))
    if key not in _CORPORA:
        _CORPORA[key] = SftCorpus.build(path, tokenizer, seq_len, cache_dir=cache_dir, identity_extra=identity_extra,
                                        print_fn=lambda line: print(f"> {line}", flush=True), samples=samples,
                                        context_parallel=context_parallel)
    return _CORPORA[key]


def sft_reader(args: Any, split_name: str, tokenizer: Any = None,
               print_fn: Callable[[str], None] | None = None, samples: str = SAMPLES_MEGATRON
               ) -> tuple[DocumentReader, PieceRead]:
    """The documents of one split (``samples``: ``SFTDataset``'s samples' conversations, or each conversation
    whole; ``data.sft``) as a ``DocumentReader`` (blend, epoch order and stream ids as for indexed data; the
    split by jsonl lines, as Megatron's) and the ``read_piece`` that gives each piece its tokens, labels and
    loss mask, every token id checked against the tokenizer's vocabulary as it is read."""
    a = MegatronArgs.of(args)
    if tokenizer is None:
        from megatron.training import get_tokenizer  # lazy: the package imports this module without Megatron

        tokenizer = get_tokenizer()
    own = a.data_path_of(split_name)
    given = own or a.data_path
    if not given:
        raise SftInputError("--sft with WLB reads jsonl conversations: give --data-path [WEIGHT] FILE.jsonl ...")
    parts = parse_data_path(given)
    extra = tokenizer_files_digest(args)
    corpora = [sft_corpus(path, tokenizer, int(a.seq_length), a.data_cache_path or None, extra, samples, a.cp)
               for path, _ in parts]
    for corpus in corpora:
        note = corpus.note()
        if note is not None and print_fn is not None:
            print_fn(f"megatron_wlb: {note}")
    weights = [1.0 if w is None else float(w) for _, w in parts]
    seed = 1234 if a.seed is None else int(a.seed)
    split = "1,0,0" if own else (a.split or "969,30,1")
    sources = [c.source(split, "train" if own else split_name) for c in corpora]
    reader = DocumentReader([(src, w) for (src, _), w in zip(sources, weights, strict=True)], split="1,0,0",
                            split_name="train", seed=seed,
                            order_cache=a.data_cache_path or default_cache_dir(parts[0][0]))
    vocab = getattr(tokenizer, "vocab_size", None)

    def read_piece(stream_id: int, offset: int, length: int) -> Any:
        _, dataset, doc = reader.locate(stream_id)
        tokens, labels, mask = got = corpora[dataset].piece(sources[dataset][1] + doc, offset, length)
        if vocab is not None and tokens.size and (int(tokens.max()) >= vocab or int(tokens.min()) < 0
                                                  or int(labels.max()) >= vocab):
            bad = int(max(tokens.max(), labels.max())) if int(tokens.min()) >= 0 else int(tokens.min())
            corpus = corpora[dataset]
            raise SftInputError(f"{corpus.path}: token id {bad} in its SFT cache is outside the tokenizer's "
                                f"vocabulary of {vocab}; the cache is damaged: remove {corpus.arrays.prefix}.* to "
                                "rebuild it")
        return got

    return reader, read_piece


__all__ = ["sft_corpus", "sft_reader"]
