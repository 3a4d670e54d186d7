"""Fine-tuning conversations as documents: Megatron's SFT jsonl, as Megatron's ``SFTDataset`` trains it.

Megatron-LM's ``SFTDataset`` (``megatron/training/datasets/sft_dataset.py``, 0.19) reads a jsonl whose every
line holds ``{"messages": [{"role": ..., "content": ...}, ...]}``; a line may hold several conversations,
each starting at a ``system`` turn (``split_conversations``). Each conversation goes through the tokenizer's
``tokenize_conversation(conversation, return_target=True, add_generation_prompt=False)`` (the chat template;
targets outside the trained turns are ``IGNORE_INDEX``). ``SFTDataset.__getitem__`` packs one line's
conversations into one sample of ``seq_length`` tokens: under CP > 1 each conversation padded to a multiple
of 2 x CP, the line cut at the window (a conversation crossing it cut, the later ones dropped), then padded;
inputs ``tokens[:-1]``, labels ``targets[1:]`` (a conversation's last label is the NEXT conversation's first
target, or the pad), loss mask 0 where a label is the pad id or ``IGNORE_INDEX``.

``SAMPLES_MEGATRON`` (the default): every document is one conversation's segment of such a sample
(``line_segments``: its ``cu_seqlens`` span, its CP padding included), with exactly that sample's inputs,
labels and loss mask; only the padding after a line's last conversation (pad inputs, masked labels) is not
carried. The packer then regroups the segments by work. ``SAMPLES_WHOLE``: every conversation is a document
of its own, whole (cut only at ``seq_length``), its last label the pad: no conversation is dropped, none is
cut at another's end, counted and said by the caller (``SftCorpus.note``).

``SftCorpus.build`` tokenizes the jsonl once, streaming, into the on-disk cache of ``data.sft_cache``
(keyed by the jsonl's content and the tokenizer), which every process then memory-maps: what a rank holds
does not grow with the number of conversations.

Pure: numpy and the standard library; the tokenizer is any object with Megatron's
``tokenize_conversation`` and ``pad`` (the adapter passes Megatron's own).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from megatron_wlb.data.reader import IndexedSource, split_ranges
from megatron_wlb.data.sft_cache import (
    CACHE_DTYPE,
    CACHE_FORMAT,
    WRITE_BATCH_TOKENS,
    CachedArrays,
    SftCacheError,
    cache_prefix,
    default_cache_dir,
    file_sha256,
    locked_build,
    map_cache,
    read_manifest,
    write_cache,
)

#: the target of a token no loss is computed on (Megatron's ``IGNORE_INDEX``)
IGNORE_INDEX = -100
#: the roles Megatron's SFT prompt templates and ``SFTDataset`` know, spelled as they match them (exactly:
#: ``User`` passes ``tokenize_conversation``'s masking but no template formats it, and ``System`` starts no
#: conversation in ``SFTDataset._split_conversations``)
ROLES = ("system", "user", "assistant", "tool")
#: ``SftCorpus`` documents: Megatron's ``SFTDataset`` samples' conversations (the default), or each whole
SAMPLES_MEGATRON = "megatron"
SAMPLES_WHOLE = "whole"
SAMPLE_MODES = (SAMPLES_MEGATRON, SAMPLES_WHOLE)

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
        if msg["role"] not in ROLES:
            raise SftInputError(f"{where}: message {k + 1} has role {msg['role']!r}; use one of {', '.join(ROLES)} "
                                "(lowercase, as Megatron's SFT prompt templates match them)")
    return messages


def read_lines(path: str | os.PathLike[str], on_line: Callable[[bytes], None] | None = None
               ) -> Iterator[tuple[int, list[Conversation]]]:
    """(line number, the line's conversations) of every non-blank line of ``path``, in file order, read a line
    at a time (``on_line`` sees each line's bytes). A line that is not UTF-8 JSON, lacks ``"messages"``, or
    holds a conversation without an assistant turn (nothing in it would train) is refused, naming the line."""
    path = os.fspath(path)
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise SftInputError(f"SFT data {path}: cannot open ({exc.strerror}); give a jsonl of "
                            "{\"messages\": [...]} lines") from None
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            if on_line is not None:
                on_line(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise SftInputError(f"{path}:{line_no}: not UTF-8 (byte {exc.start + 1}); save the jsonl as "
                                    "UTF-8") from None
            except json.JSONDecodeError as exc:
                raise SftInputError(f"{path}:{line_no}: not JSON ({exc.msg} at column {exc.colno}); each line must "
                                    "be one {\"messages\": [...]} object") from None
            conversations = split_conversations(_check_messages(path, line_no, record))
            for k, conversation in enumerate(conversations):
                if not any(m["role"] == "assistant" for m in conversation):
                    roles = ", ".join(m["role"] for m in conversation)
                    raise SftInputError(f"{path}:{line_no}: conversation {k + 1} has no assistant turn (roles: "
                                        f"{roles}); nothing in it would train: add the reply or remove it")
            yield line_no, conversations


def read_conversations(path: str | os.PathLike[str], on_line: Callable[[bytes], None] | None = None
                       ) -> Iterator[tuple[int, int, Conversation]]:
    """(line number, conversation number in the line, conversation) of every conversation in ``path``, in
    file order (``read_lines``, its checks)."""
    for line_no, conversations in read_lines(path, on_line):
        for k, conversation in enumerate(conversations):
            yield line_no, k, conversation


def conversation_sample(tokens: np.ndarray, targets: np.ndarray, pad: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs, labels, loss mask) of one conversation as ``SFTDataset`` gives its tokens: the labels are
    the targets shifted by one with ``pad`` after the last; the loss mask is 0 where a label is ``pad`` or
    ``IGNORE_INDEX``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    labels = np.append(np.asarray(targets, dtype=np.int64)[1:], np.int64(pad))
    return tokens, labels, loss_mask_of(labels, pad)


@dataclass
class LineCounts:
    """What a line's sample leaves out: conversations cut at the window or dropped after it, and the tokens
    of the jsonl's conversations no document carries."""

    conversations: int = 0
    cut: int = 0
    dropped: int = 0
    untrained_tokens: int = 0

    def add(self, other: LineCounts) -> None:
        self.conversations += other.conversations
        self.cut += other.cut
        self.dropped += other.dropped
        self.untrained_tokens += other.untrained_tokens


def line_segments(conversations: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int, cp: int = 1
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], LineCounts]:
    """(inputs, labels) of each conversation's segment of the sample ``SFTDataset.__getitem__`` makes of one
    line's (tokens, targets), in order, and what the sample leaves out. As it does: under ``cp`` > 1 each
    conversation padded with ``pad`` to a multiple of 2 x ``cp`` (the padding part of its segment), the line
    cut at ``seq_len`` (the conversation crossing it cut, later ones dropped; the last label then the pad),
    labels the targets shifted by one (a conversation's last label is the next one's first target)."""
    toks: list[np.ndarray] = []
    tgts: list[np.ndarray] = []
    bounds = [0]
    n = 0
    cut = False
    counts = LineCounts(conversations=len(conversations))
    granularity = 2 * cp if cp > 1 else 1
    for tokens, targets in conversations:
        toks.append(np.asarray(tokens, dtype=np.int64))
        tgts.append(np.asarray(targets, dtype=np.int64))
        n += len(tokens)
        if n % granularity:
            fill = np.full(granularity - n % granularity, pad, dtype=np.int64)
            toks.append(fill)
            tgts.append(fill)
            n += fill.size
        bounds.append(n)
        if n >= seq_len + 1:
            cut = True
            break
    all_tokens = np.concatenate(toks)
    all_targets = np.concatenate(tgts)
    if cut:
        all_tokens = all_tokens[:seq_len]
        all_targets = all_targets[:seq_len]
        bounds[-1] = seq_len
    all_targets = np.append(all_targets, np.int64(pad))  # what follows the last position: the pad
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for k, (b, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if e > b:
            out.append((all_tokens[b:e], all_targets[b + 1:e + 1]))
        kept = max(0, min(e, seq_len) - b)
        whole = len(conversations[k][0])
        if kept < whole:
            counts.untrained_tokens += whole - kept
            if kept:
                counts.cut += 1
            else:
                counts.dropped += 1
    for tokens, _ in conversations[len(bounds) - 1:]:
        counts.dropped += 1
        counts.untrained_tokens += len(tokens)
    return out, counts


def whole_segments(conversations: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int
                   ) -> tuple[list[tuple[np.ndarray, np.ndarray]], LineCounts]:
    """``SAMPLES_WHOLE``: (inputs, labels) of each conversation alone (``conversation_sample``), cut to its
    first ``seq_len`` tokens, and how many were cut."""
    counts = LineCounts(conversations=len(conversations))
    out = []
    for tokens, targets in conversations:
        if len(tokens) > seq_len:
            counts.cut += 1
            counts.untrained_tokens += len(tokens) - seq_len
        inputs, labels, _ = conversation_sample(tokens[:seq_len], targets[:seq_len], pad)
        out.append((inputs, labels))
    return out, counts


def line_documents(conversations: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int,
                   samples: str = SAMPLES_MEGATRON, cp: int = 1
                   ) -> tuple[list[tuple[np.ndarray, np.ndarray]], LineCounts]:
    """The documents ``--sft`` trains of one line's (tokens, targets) under ``samples``: ``line_segments``
    (``SAMPLES_MEGATRON``, padded for ``cp``) or ``whole_segments`` (``SAMPLES_WHOLE``), and what they leave out."""
    if samples == SAMPLES_MEGATRON:
        return line_segments(conversations, seq_len, pad, cp)
    if samples == SAMPLES_WHOLE:
        return whole_segments(conversations, seq_len, pad)
    raise SftInputError(f"SFT samples {samples!r}: choose one of {', '.join(SAMPLE_MODES)}")


def planned_documents(lines: Iterable[Sequence[int]], seq_len: int, samples: str = SAMPLES_MEGATRON, cp: int = 1
                      ) -> tuple[np.ndarray, LineCounts]:
    """Token counts of the documents ``--sft`` trains (file order) of lines of conversations of these token
    counts, and what they leave out: each line through ``line_documents``, the function training cuts a line
    with (the lengths and counts depend on the token counts only, so placeholder tokens stand in)."""
    out: list[int] = []
    totals = LineCounts()
    for line in lines:
        pairs = [(np.zeros(int(n), dtype=np.int64), np.zeros(int(n), dtype=np.int64)) for n in line]
        segments, counts = line_documents(pairs, int(seq_len), -1, samples, cp)
        out.extend(int(tokens.size) for tokens, _ in segments)
        totals.add(counts)
    return np.asarray(out, dtype=np.int64), totals


def samples_note(path: str, seq_len: int, samples: str, counts: LineCounts) -> str | None:
    """One line saying what the documents of ``samples`` leave out of ``path``'s conversations (None: nothing)."""
    c = counts
    if not (c.cut or c.dropped):
        return None
    if samples == SAMPLES_WHOLE:
        return (f"{path}: sft.samples whole: {c.conversations} conversations each a document; {c.cut} longer "
                f"than --seq-length {seq_len} cut to it ({c.untrained_tokens} tokens not trained)")
    return (f"{path}: as Megatron's SFTDataset packs each line into --seq-length {seq_len}: {c.cut} of "
            f"{c.conversations} conversations cut at the window and {c.dropped} dropped after it "
            f"({c.untrained_tokens} tokens not trained; sft.samples whole keeps each conversation)")


def loss_mask_of(labels: np.ndarray, pad: int) -> np.ndarray:
    """``SFTDataset``'s loss mask of ``labels``: 0 where a label is ``pad`` or ``IGNORE_INDEX``."""
    return ((labels != pad) & (labels != IGNORE_INDEX)).astype(np.float32)


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
        orphan = next((k for k, m in enumerate(conversation) if m.get("role") == "assistant"
                       and (k == 0 or conversation[k - 1].get("role") not in ("user", "tool"))), None)
        if isinstance(exc, AssertionError) and orphan is not None:
            raise SftInputError(f"{where}: message {orphan + 1} is an assistant turn that follows no user or tool "
                                "turn, which Megatron's SFTTokenizer cannot mask; put the user turn it answers "
                                "before it") from None
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


#: a conversation of every role, tokenized into the tokenizer's identity (its template and masking show)
_PROBE: Conversation = [{"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": "What is 2 + 2?"},
                        {"role": "assistant", "content": "4"},
                        {"role": "tool", "content": "{\"result\": 4}"},
                        {"role": "assistant", "content": "It is 4."}]
#: seconds between two progress lines of a cache build
PROGRESS_SECONDS = 30.0


def tokenizer_identity(tokenizer: ConversationTokenizer, extra: str = "") -> str:
    """What identifies a tokenizer for the cache's key: its class, pad id and vocabulary size, the tokens and
    targets it gives a probe conversation of every role (its template and masking), and ``extra`` (the
    adapter's: the tokenizer files' digest and prompt format). ``SftCorpus.build`` also checks the jsonl's
    first conversation against the cache (the vocabulary the data uses)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    h = hashlib.sha256()
    h.update(json.dumps([type(tokenizer).__qualname__, type(inner).__module__, type(inner).__qualname__,
                         int(tokenizer.pad), getattr(tokenizer, "vocab_size", None), extra]).encode())
    try:
        tokens, targets = tokenize(tokenizer, _PROBE, "the tokenizer's identity probe")
    except SftInputError as exc:
        h.update(str(exc).encode())  # a tokenizer refusing the tool role is an identity too
    else:
        h.update(tokens.tobytes())
        h.update(targets.tobytes())
    return h.hexdigest()


def _first_conversation(path: str) -> tuple[int, Conversation] | None:
    return next(((line_no, c) for line_no, _, c in read_conversations(path)), None)


@dataclass
class SftCorpus:
    """The documents of an SFT jsonl, tokenized (``SAMPLES_MEGATRON``: each a conversation's segment of
    ``SFTDataset``'s sample of its line; ``SAMPLES_WHOLE``: each a whole conversation), inputs and labels
    memory-mapped from the on-disk cache (``data.sft_cache``: Megatron ``.bin``/``.idx`` files, lengths read
    from the mapped ``.idx``), and what the samples leave out (``counts``).

    ``build`` tokenizes the jsonl once into the cache (one process builds, the others starting with it wait
    and map its files); later starts map it without tokenizing. What a process holds beyond the maps does not
    grow with the number of conversations."""

    path: str
    seq_len: int
    pad: int
    arrays: CachedArrays
    samples: str = SAMPLES_MEGATRON
    counts: LineCounts = field(default_factory=LineCounts)
    #: whether this process tokenized the jsonl (False: it mapped a cache built before)
    built: bool = field(default=False)

    @classmethod
    def build(cls, path: str | os.PathLike[str], tokenizer: ConversationTokenizer, seq_len: int,
              cache_dir: str | None = None, identity_extra: str = "",
              print_fn: Callable[[str], None] | None = None, samples: str = SAMPLES_MEGATRON,
              context_parallel: int = 1) -> SftCorpus:
        """The corpus of ``path`` from its cache in ``cache_dir`` (default: ``cache/`` beside the jsonl),
        tokenized into it first (``read_lines``, ``tokenize``) when there is none for the jsonl's content, the
        tokenizer, ``seq_len`` and ``samples`` (``context_parallel``: the CP size ``SFTDataset`` pads for)."""
        path = os.fspath(path)
        if samples not in SAMPLE_MODES:
            raise SftInputError(f"SFT samples {samples!r}: choose one of {', '.join(SAMPLE_MODES)}")
        cp = int(context_parallel) if samples == SAMPLES_MEGATRON else 1
        check_chat_template(tokenizer)
        first = _first_conversation(path)
        if first is None:
            raise SftInputError(f"{path}: holds no conversation; give a jsonl of {{\"messages\": [...]}} lines")
        identity = tokenizer_identity(tokenizer, identity_extra)
        first_tokens = tokenize(tokenizer, first[1], f"{path}:{first[0]} conversation 1")[0]
        content = file_sha256(path)  # the cache is keyed by the jsonl's bytes, not its size and mtime
        prefix = cache_prefix(cache_dir or default_cache_dir(path), path,
                              [content, identity, int(seq_len), samples, cp])
        built: list[bool] = []
        found: list[CachedArrays] = []  # the cache mapped and checked by the last ``usable``

        def usable() -> str | None:
            found.clear()
            if read_manifest(prefix) is None:
                return "missing"
            cached = map_cache(prefix)  # a damaged cache is refused here (its digest, sizes and counts)
            n = min(int(cached.lengths[0]), first_tokens.size)
            if not np.array_equal(cached.tokens[:n], first_tokens[:n]):
                return "the tokenizer gives the first conversation other tokens than the cache holds"
            found.append(cached)
            return None

        def build(why: str | None) -> None:
            if why != "missing" and print_fn is not None:
                print_fn(f"megatron_wlb: SFT cache {prefix}: stale ({why}); rebuilding it")
            _tokenize_into(prefix, path, tokenizer, int(seq_len), [content, identity, samples, cp], print_fn)
            built.append(True)

        locked_build(prefix, usable, build)
        arrays = found[0] if found else map_cache(prefix)
        m = arrays.manifest
        if [m.get("jsonl_sha256"), m.get("tokenizer"), m.get("seq_len"), m.get("pad"), m.get("samples"),
                m.get("context_parallel")] != [content, identity, int(seq_len), int(tokenizer.pad), samples, cp]:
            raise SftCacheError(f"SFT cache {prefix}.json: built from another jsonl, tokenizer, --seq-length or "
                                f"sample mode; remove {prefix}.* to rebuild it")
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and int(m["token_max"]) >= int(vocab):
            raise SftInputError(f"{path}: the tokenizer gave token id {m['token_max']}, outside its own vocabulary of "
                                f"{vocab}; check --tokenizer-model")
        counts = LineCounts(int(m["conversations"]), int(m["cut"]), int(m["dropped"]), int(m["untrained_tokens"]))
        return cls(path, int(seq_len), int(tokenizer.pad), arrays, samples, counts, bool(built))

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each document (int32, a view of the mapped ``.idx``)."""
        return self.arrays.lengths

    @property
    def tokens(self) -> np.ndarray:
        return self.arrays.tokens

    @property
    def labels(self) -> np.ndarray:
        return self.arrays.labels

    @property
    def num_documents(self) -> int:
        return int(self.arrays.lengths.size)

    @property
    def num_lines(self) -> int:
        return int(self.arrays.lines.size) - 1

    def source(self, split: str = "1,0,0", split_name: str = "train") -> tuple[IndexedSource, int]:
        """The documents of one split, split by jsonl LINES as Megatron splits ``SFTDataset`` (``--split``),
        as a ``reader.IndexedSource`` (what ``DocumentReader`` shuffles and streams; its prefix is the jsonl
        path) and the index of its first document. Views of the cache's maps; the token ids are scanned by
        ``DocumentReader.check_vocabulary``, not read from the manifest."""
        which = ("train", "valid", "test").index(split_name)
        first, end = split_ranges(self.num_lines, split)[which]
        if end <= first:
            raise SftInputError(f"{self.path}: the {split_name} split of --split {split} holds no line (of "
                                f"{self.num_lines}); raise its share or add data")
        a, b = int(self.arrays.lines[first]), int(self.arrays.lines[end])
        return IndexedSource(self.path, self.arrays.lengths[a:b], self.arrays.starts[a:b], self.arrays.tokens,
                             itemsize=np.dtype(CACHE_DTYPE).itemsize), a

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, loss mask) of document ``doc`` (file order), as ``SFTDataset`` gives them."""
        a = int(self.arrays.starts[doc]) // np.dtype(CACHE_DTYPE).itemsize
        b = a + int(self.arrays.lengths[doc])
        labels = np.asarray(self.arrays.labels[a:b], dtype=np.int64)
        return np.asarray(self.arrays.tokens[a:b], dtype=np.int64), labels, loss_mask_of(labels, self.pad)

    def piece(self, doc: int, offset: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``length`` tokens from ``offset`` of document ``doc``: its inputs, labels and loss mask."""
        if not (0 <= offset and offset + length <= int(self.arrays.lengths[doc])):
            raise ValueError(f"{self.path}: tokens [{offset}, {offset + length}) are outside document {doc} of "
                             f"{int(self.arrays.lengths[doc])} tokens")
        tokens, labels, mask = self.sample(doc)
        return tokens[offset:offset + length], labels[offset:offset + length], mask[offset:offset + length]

    def note(self) -> str | None:
        """One line saying what the documents leave out of the jsonl's conversations (None: nothing)."""
        return samples_note(self.path, self.seq_len, self.samples, self.counts)


def _tokenize_into(prefix: str, path: str, tokenizer: ConversationTokenizer, seq_len: int, key: list[Any],
                   print_fn: Callable[[str], None] | None) -> None:
    """Stream ``path`` through the tokenizer into the cache at ``prefix`` (``sft_cache.write_cache``): one
    batch of lines in memory at a time, each line's documents by ``line_documents``,
    a progress line every ``PROGRESS_SECONDS``."""
    content, identity, samples, cp = key
    size = os.path.getsize(path)
    read = [0]
    totals = LineCounts()
    extremes = {"token_min": 2**31, "token_max": -1}
    pad = int(tokenizer.pad)
    began = last = time.monotonic()

    def on_line(raw: bytes) -> None:
        read[0] += len(raw)

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        nonlocal last
        lengths: list[int] = []
        per_line: list[int] = []
        toks: list[np.ndarray] = []
        labs: list[np.ndarray] = []
        held = 0
        for line_no, conversations in read_lines(path, on_line):
            pairs = [tokenize(tokenizer, c, f"{path}:{line_no} conversation {k + 1}")
                     for k, c in enumerate(conversations)]
            segments, counts = line_documents(pairs, seq_len, pad, samples, cp)
            totals.add(counts)
            per_line.append(len(segments))
            for tokens, labels in segments:
                extremes["token_min"] = min(extremes["token_min"], int(tokens.min()))
                extremes["token_max"] = max(extremes["token_max"], int(tokens.max()))
                lengths.append(int(tokens.size))
                toks.append(tokens)
                labs.append(labels)
                held += int(tokens.size)
            if held >= WRITE_BATCH_TOKENS:
                yield np.asarray(lengths), np.concatenate(toks), np.concatenate(labs), np.asarray(per_line)
                lengths, per_line, toks, labs, held = [], [], [], [], 0
            now = time.monotonic()
            if print_fn is not None and now - last >= PROGRESS_SECONDS:
                last = now
                print_fn(f"megatron_wlb: tokenizing {path} into the SFT cache: {totals.conversations:,} conversations, "
                         f"{100 * read[0] / max(size, 1):.1f}% of the file in {now - began:.0f} s")
        if per_line:
            empty = np.zeros(0, dtype=np.int64)
            yield (np.asarray(lengths), np.concatenate(toks) if toks else empty,
                   np.concatenate(labs) if labs else empty, np.asarray(per_line))

    def manifest(documents: int, total: int, lines: int) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, "jsonl": os.path.abspath(path), "jsonl_bytes": size, "jsonl_sha256": content,
                "tokenizer": identity, "seq_len": seq_len, "pad": pad, "samples": samples, "context_parallel": cp,
                "documents": documents, "tokens": total, "lines": lines, "conversations": totals.conversations,
                "cut": totals.cut, "dropped": totals.dropped, "untrained_tokens": totals.untrained_tokens,
                **extremes}

    write_cache(prefix, batches(), manifest)
    if print_fn is not None:
        print_fn(f"megatron_wlb: SFT cache {prefix}: {path} tokenized in {time.monotonic() - began:.1f} s")


def jsonl_line_lengths(path: str | os.PathLike[str], tokenizer: ConversationTokenizer) -> list[list[int]]:
    """Token count of every conversation of an SFT jsonl (uncut), line by line: what ``wlb analyze --sft``
    lays out as Megatron's grouping (one sample a line) and cuts into ``--sft``'s documents
    (``planned_documents``)."""
    lines: dict[int, list[int]] = {}
    for n, k, c in read_conversations(path):
        tokens = tokenize(tokenizer, c, f"{os.fspath(path)}:{n} conversation {k + 1}")[0]
        lines.setdefault(n, []).append(int(tokens.size))
    return list(lines.values())


def jsonl_lengths(path: str | os.PathLike[str], tokenizer: ConversationTokenizer) -> np.ndarray:
    """Token count of every conversation of an SFT jsonl (file order, uncut)."""
    return np.asarray([n for line in jsonl_line_lengths(path, tokenizer) for n in line], dtype=np.int64)
