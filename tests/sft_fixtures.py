"""A local tokenizer with a chat template and a jsonl of conversations with heavy-tailed lengths (issue 50).

Nothing comes from a hub: a WordLevel ``tokenizers`` vocabulary of words ``w0 .. w{WORDS-1}`` plus the
special tokens Megatron's ``nemotron-h-aligned`` SFT prompt format names (``<SPECIAL_10>``, ``<SPECIAL_11>``,
``<SPECIAL_233>`` its pad), saved as a transformers ``PreTrainedTokenizerFast`` directory with a jinja chat
template (``tokenizer_config.json``), which Megatron's ``SFTTokenizer`` opens with ``AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = 200
SPECIALS = ["<unk>", "<eos>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>"]
#: a chat template of the tokenizer's own (what --sft-tokenizer-prompt-format default uses)
CHAT_TEMPLATE = ("{% for message in messages %}"
                 "{{ '<SPECIAL_11>' + message['role'] + '\n' + message['content'] + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<SPECIAL_11>assistant\n' }}{% endif %}")


def build_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A word-level tokenizer saved at ``directory`` (AutoTokenizer opens it), with ``chat_template``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ["System", "User", "Assistant", "system", "user", "assistant"] + [f"w{i}" for i in range(WORDS)]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the special tokens are split out before it
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<SPECIAL_233>")
    if chat_template is not None:
        fast.chat_template = chat_template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def _text(rng: np.random.Generator, words: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(0, WORDS, max(1, words)))


def conversation(rng: np.random.Generator, scale: float, system: bool = True) -> list[dict]:
    """One conversation: a system turn, then 1-3 user/assistant exchanges whose lengths are heavy-tailed
    (log-normal, sigma 1.2: most are short, a few are long)."""
    turns = [{"role": "system", "content": _text(rng, int(rng.integers(2, 8)))}] if system else []
    for _ in range(int(rng.integers(1, 4))):
        turns.append({"role": "user", "content": _text(rng, int(rng.lognormal(np.log(6 * scale), 1.2)))})
        turns.append({"role": "assistant", "content": _text(rng, int(rng.lognormal(np.log(10 * scale), 1.2)))})
    return turns


def write_corpus(path: Path, lines: int, seed: int = 0, scale: float = 1.0, multi_every: int = 7) -> Path:
    """``lines`` jsonl lines of conversations; every ``multi_every``-th line holds two (SFTDataset splits a
    line at each system turn)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(lines):
            messages = conversation(rng, scale)
            if multi_every and i % multi_every == multi_every - 1:
                messages += conversation(rng, scale)
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def megatron_sft_tokenizer(directory: Path, prompt_format: str = "nemotron-h-aligned"):
    """Megatron's own tokenizer over ``directory`` as its ``build_tokenizer`` makes it for
    ``--tokenizer-type SFTTokenizer`` (a ``MegatronTokenizer`` of library ``sft``: ``tokenize_conversation``,
    ``pad``, ``eod``)."""
    import types

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build_tokenizer

    args = types.SimpleNamespace(tokenizer_type="SFTTokenizer", tokenizer_model=str(directory),
                                 sft_tokenizer_prompt_format=prompt_format, tokenizer_metadata=None,
                                 metadata_path=None, vocab_size=None, make_vocab_size_divisible_by=128,
                                 tensor_model_parallel_size=1, rank=0, padded_vocab_size=None, pad_vocab_size=False)
    return megatron_build_tokenizer(args)
