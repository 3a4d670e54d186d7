"""Fine-tuning conversations as documents: Megatron's SFT jsonl, one conversation one document.

Megatron-LM's ``SFTDataset`` (``megatron/training/datasets/sft_dataset.py``, 0.19 and main) reads a jsonl
whose every line holds ``{"messages": [{"role": ..., "content": ...}, ...]}``; a line may hold several
conversations, each starting at a ``system`` turn (``split_conversations``). Each conversation goes
through the tokenizer's ``tokenize_conversation(conversation, return_target=True,
add_generation_prompt=False)`` (the chat template; targets outside the assistant turns are
``IGNORE_INDEX``). ``SFTDataset.__getitem__`` then packs one line's conversations into ``seq_length``
tokens with padding: inputs ``tokens[:-1]``, labels ``targets[1:]``, loss mask 0 where a label is the pad
id or ``IGNORE_INDEX``.

Here every conversation is one document with exactly those arrays (``conversation_sample``): its tokens,
its targets shifted by one with the pad id after the last, and the same loss mask. A conversation longer
than ``seq_length`` is cut as ``SFTDataset`` cuts it (its first ``seq_length`` tokens; counted in
``SftCorpus.truncated`` and said by the caller). Unlike ``SFTDataset``, a line's later conversations are
not dropped when the line overflows the window: each is its own document.

Pure: numpy and the standard library; the tokenizer is any object with Megatron's
``tokenize_conversation`` and ``pad`` (the adapter passes Megatron's own).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from megatron_wlb.data.reader import IndexedSource

#: the target of a token no loss is computed on (Megatron's ``IGNORE_INDEX``)
IGNORE_INDEX = -100
#: how the intake holds token ids and targets (4 bytes each: a vocabulary below 2**31, and -100)
TOKEN_DTYPE = np.int32
#: the roles ``SFTTokenizer.tokenize_conversation`` accepts
ROLES = ("system", "user", "assistant", "tool")

Message = dict[str, Any]
Conversation = list[Message]


class SftInputError(ValueError):
    """A jsonl line, a conversation or a tokenizer the SFT intake cannot use (one line, naming it)."""


class ConversationTokenizer(Protocol):
    """What the intake needs of a tokenizer: Megatron's ``tokenize_conversation`` and its pad id."""

    @property
    def pad(self) -> int: ...

    def tokenize_conversation(self, conversation: Conversation, return_target: bool,
                              add_generation_prompt: bool) -> Any: ...


def split_conversations(messages: list[Message]) -> list[Conversation]:
    """One line's messages -> its conversations: a new one at every ``system`` turn (as
    ``SFTDataset._split_conversations``)."""
    out: list[Conversation] = []
    current: Conversation = []
    for msg in messages:
        if msg["role"] == "system":
            if current:
                out.append(current)
            current = [msg]
        else:
            current.append(msg)
    if current:
        out.append(current)
    return out


def _check_messages(path: str, line: int, record: Any) -> list[Message]:
    where = f"{path}:{line}"
    if not isinstance(record, dict) or "messages" not in record:
        raise SftInputError(f"{where}: no \"messages\" key; each line must be {{\"messages\": [{{\"role\": ..., "
                            "\"content\": ...}, ...]}")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise SftInputError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} turns")
    for k, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise SftInputError(f"{where}: message {k + 1} is not {{\"role\": str, \"content\": str}}")
        if msg["role"].lower() not in ROLES:
            raise SftInputError(f"{where}: message {k + 1} has role {msg['role']!r}; use one of {', '.join(ROLES)}")
    return messages


def read_conversations(path: str | os.PathLike[str]) -> Iterator[tuple[int, int, Conversation]]:
    """(line number, conversation number in the line, conversation) of every conversation in ``path``, in
    file order. Blank lines hold none. A line that is not JSON, lacks ``"messages"``, or holds a
    conversation without an assistant turn (nothing in it would train) is refused, naming the line."""
    path = os.fspath(path)
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise SftInputError(f"SFT data {path}: cannot open ({exc.strerror}); give a jsonl of "
                            "{\"messages\": [...]} lines") from None
    with handle:
        for line_no, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SftInputError(f"{path}:{line_no}: not JSON ({exc.msg} at column {exc.colno}); each line must "
                                    "be one {\"messages\": [...]} object") from None
            for k, conversation in enumerate(split_conversations(_check_messages(path, line_no, record))):
                if not any(m["role"].lower() == "assistant" for m in conversation):
                    roles = ", ".join(m["role"] for m in conversation)
                    raise SftInputError(f"{path}:{line_no}: conversation {k + 1} has no assistant turn (roles: "
                                        f"{roles}); nothing in it would train: add the reply or remove it")
                yield line_no, k, conversation


def conversation_sample(tokens: np.ndarray, targets: np.ndarray, pad: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, labels, loss mask) of one conversation as ``SFTDataset`` gives its tokens: the labels are
    the targets shifted by one with ``pad`` after the last; the loss mask is 0 where a label is ``pad`` or
    ``IGNORE_INDEX``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    labels = np.append(np.asarray(targets, dtype=np.int64)[1:], np.int64(pad))
    loss_mask = ((labels != pad) & (labels != IGNORE_INDEX)).astype(np.float32)
    return tokens, labels, loss_mask


def _ids(result: Any, what: str) -> np.ndarray:
    arr = np.asarray(result, dtype=np.int64)
    return arr[0] if arr.ndim == 2 and arr.shape[0] == 1 else arr


def tokenize(tokenizer: ConversationTokenizer, conversation: Conversation, where: str
             ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, targets) of one conversation through the tokenizer's own ``tokenize_conversation``; a
    tokenizer with no chat template is named in one line."""
    try:
        got = tokenizer.tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)
    except (ValueError, AssertionError, AttributeError, TypeError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "chat_template" in text or "chat template" in text:
            raise SftInputError(f"the tokenizer has no chat template ({text[:120]}); give a tokenizer whose "
                                "tokenizer_config.json holds \"chat_template\", or another "
                                "--sft-tokenizer-prompt-format") from None
        raise SftInputError(f"{where}: the tokenizer refused the conversation: {text[:200]}") from None
    tokens, targets = (_ids(x, "tokens") for x in got)
    if tokens.ndim != 1 or tokens.shape != targets.shape or not tokens.size:
        raise SftInputError(f"{where}: tokenize_conversation gave {tokens.shape} tokens and {targets.shape} targets; "
                            "expected two equal 1-D arrays")
    return tokens, targets


def check_chat_template(tokenizer: Any) -> None:
    """Refuse, in one line, a tokenizer that cannot format a conversation: Megatron's ``SFTTokenizer``
    under ``--sft-tokenizer-prompt-format default`` uses the tokenizer's own template."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # MegatronTokenizer -> SFTTokenizer
    config = getattr(inner, "_prompt_config", None)
    if config is not None and not getattr(config, "custom_chat_template", None):
        raise SftInputError("the tokenizer has no chat template: --sft-tokenizer-prompt-format default uses the "
                            "tokenizer's own \"chat_template\" (tokenizer_config.json), and it has none; add one or "
                            "choose another --sft-tokenizer-prompt-format")


@dataclass
class SftCorpus:
    """Every conversation of an SFT jsonl, tokenized: flat tokens and targets, one document per
    conversation (``lengths``/``starts``), the line each came from, and how many were cut to ``seq_len``.

    Held in memory (4 bytes a token for each of tokens and targets): the intake tokenizes the file once
    at start-up, on every rank, like ``SFTDataset`` reads the whole jsonl through HF ``datasets``."""

    path: str
    seq_len: int
    pad: int
    tokens: np.ndarray
    targets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    lines: np.ndarray
    #: conversations longer than ``seq_len`` (cut to it, as ``SFTDataset`` cuts them), and their tokens before
    truncated: int = 0
    truncated_tokens: int = 0
    digest: str = field(default="")

    @classmethod
    def build(cls, path: str | os.PathLike[str], tokenizer: ConversationTokenizer, seq_len: int) -> SftCorpus:
        """Read and tokenize every conversation of ``path`` (``read_conversations``, ``tokenize``)."""
        path = os.fspath(path)
        check_chat_template(tokenizer)
        pad = int(tokenizer.pad)
        toks: list[np.ndarray] = []
        tgts: list[np.ndarray] = []
        lines: list[int] = []
        truncated = truncated_tokens = 0
        h = hashlib.sha256()
        for line_no, k, conversation in read_conversations(path):
            tokens, targets = tokenize(tokenizer, conversation, f"{path}:{line_no} conversation {k + 1}")
            if tokens.size > seq_len:  # SFTDataset keeps the first seq_length tokens of the window
                truncated += 1
                truncated_tokens += int(tokens.size)
                tokens, targets = tokens[:seq_len], targets[:seq_len]
            toks.append(tokens)
            tgts.append(targets)
            lines.append(line_no)
            h.update(tokens.tobytes())
            h.update(targets.tobytes())
        if not toks:
            raise SftInputError(f"{path}: holds no conversation; give a jsonl of {{\"messages\": [...]}} lines")
        lengths = np.fromiter((t.size for t in toks), dtype=np.int64, count=len(toks))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        return cls(path, int(seq_len), pad, np.concatenate(toks).astype(TOKEN_DTYPE),
                   np.concatenate(tgts).astype(TOKEN_DTYPE), lengths, starts,
                   np.asarray(lines, dtype=np.int64), truncated, truncated_tokens, h.hexdigest()[:32])

    @property
    def num_conversations(self) -> int:
        return int(self.lengths.size)

    def source(self) -> IndexedSource:
        """The conversations as a ``reader.IndexedSource`` (what ``DocumentReader`` splits, shuffles and
        streams; its prefix is the jsonl path)."""
        return IndexedSource(self.path, self.lengths, self.starts, self.tokens, itemsize=1)  # starts count tokens

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, loss mask) of conversation ``doc`` (file order), as ``SFTDataset`` gives them."""
        a = int(self.starts[doc])
        b = a + int(self.lengths[doc])
        return conversation_sample(self.tokens[a:b], self.targets[a:b], self.pad)

    def piece(self, doc: int, offset: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``length`` tokens from ``offset`` of conversation ``doc``: its inputs, labels and loss mask."""
        if not (0 <= offset and offset + length <= int(self.lengths[doc])):
            raise ValueError(f"{self.path}: tokens [{offset}, {offset + length}) are outside conversation {doc} of "
                             f"{int(self.lengths[doc])} tokens")
        tokens, labels, mask = self.sample(doc)
        return tokens[offset:offset + length], labels[offset:offset + length], mask[offset:offset + length]

    def truncation_note(self) -> str | None:
        """One line saying how many conversations were cut to the window (None: none was)."""
        if not self.truncated:
            return None
        return (f"{self.path}: {self.truncated} of {self.num_conversations} conversations are longer than --seq-length "
                f"{self.seq_len} and were cut to it, as Megatron's SFTDataset cuts them "
                f"({self.truncated_tokens - self.truncated * self.seq_len} tokens not trained)")


def jsonl_line_lengths(path: str | os.PathLike[str], tokenizer: ConversationTokenizer) -> list[list[int]]:
    """Token count of every conversation of an SFT jsonl (uncut), line by line: what ``wlb analyze --sft``
    plans (Megatron's grouping keeps a line's conversations in one sample)."""
    lines: dict[int, list[int]] = {}
    for n, k, c in read_conversations(path):
        tokens = tokenize(tokenizer, c, f"{os.fspath(path)}:{n} conversation {k + 1}")[0]
        lines.setdefault(n, []).append(int(tokens.size))
    return list(lines.values())


def jsonl_lengths(path: str | os.PathLike[str], tokenizer: ConversationTokenizer) -> np.ndarray:
    """Token count of every conversation of an SFT jsonl (file order, uncut)."""
    return np.asarray([n for line in jsonl_line_lengths(path, tokenizer) for n in line], dtype=np.int64)
