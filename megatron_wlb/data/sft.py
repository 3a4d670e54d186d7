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

``SftCorpus.build`` tokenizes the jsonl once, streaming, into the on-disk cache of ``data.sft_cache``
(Megatron ``.bin``/``.idx`` tokens and targets, keyed by the jsonl, the tokenizer and ``seq_length``), which
every process then memory-maps: what a rank holds does not grow with the number of conversations.

Pure: numpy and the standard library; the tokenizer is any object with Megatron's
``tokenize_conversation`` and ``pad`` (the adapter passes Megatron's own).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from megatron_wlb.data.reader import IndexedSource
from megatron_wlb.data.sft_cache import (
    CACHE_DTYPE,
    CACHE_FORMAT,
    WRITE_BATCH_TOKENS,
    CachedArrays,
    SftCacheError,
    cache_prefix,
    default_cache_dir,
    locked_build,
    map_cache,
    read_manifest,
    stale_reason,
    write_cache,
)

#: the target of a token no loss is computed on (Megatron's ``IGNORE_INDEX``)
IGNORE_INDEX = -100
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


def read_conversations(path: str | os.PathLike[str], on_line: Callable[[bytes], None] | None = None
                       ) -> Iterator[tuple[int, int, Conversation]]:
    """(line number, conversation number in the line, conversation) of every conversation in ``path``, in
    file order, read a line at a time (``on_line`` sees each line's bytes: the cache hashes and counts them).
    Blank lines hold none. A line that is not UTF-8 JSON, lacks ``"messages"``, or holds a conversation
    without an assistant turn (nothing in it would train) is refused, naming the line."""
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


def _first_conversation(path: str) -> Conversation | None:
    return next((c for _, _, c in read_conversations(path)), None)


@dataclass
class SftCorpus:
    """Every conversation of an SFT jsonl, tokenized: one document per conversation, tokens and targets
    memory-mapped from the on-disk cache (``data.sft_cache``: Megatron ``.bin``/``.idx`` files, lengths read
    from the mapped ``.idx``), and how many conversations were cut to ``seq_len``.

    ``build`` tokenizes the jsonl once into the cache (one process builds, the others starting with it wait
    and map its files); later starts map it without tokenizing. What a process holds beyond the maps does not
    grow with the number of conversations."""

    path: str
    seq_len: int
    pad: int
    arrays: CachedArrays
    #: conversations longer than ``seq_len`` (cut to it, as ``SFTDataset`` cuts them), and their tokens before
    truncated: int = 0
    truncated_tokens: int = 0
    #: whether this process tokenized the jsonl (False: it mapped a cache built before)
    built: bool = field(default=False)

    @classmethod
    def build(cls, path: str | os.PathLike[str], tokenizer: ConversationTokenizer, seq_len: int,
              cache_dir: str | None = None, identity_extra: str = "",
              print_fn: Callable[[str], None] | None = None) -> SftCorpus:
        """The corpus of ``path`` from its cache in ``cache_dir`` (default: ``cache/`` beside the jsonl),
        tokenized into it first (``read_conversations``, ``tokenize``) when the cache is missing or stale."""
        path = os.fspath(path)
        check_chat_template(tokenizer)
        first = _first_conversation(path)
        if first is None:
            raise SftInputError(f"{path}: holds no conversation; give a jsonl of {{\"messages\": [...]}} lines")
        identity = tokenizer_identity(tokenizer, identity_extra)
        first_tokens, first_targets = (a[:seq_len] for a in tokenize(tokenizer, first, f"{path}: conversation 1"))
        prefix = cache_prefix(cache_dir or default_cache_dir(path), path, identity, seq_len)
        built: list[bool] = []
        found: list[CachedArrays] = []  # the cache mapped and checked by the last ``usable``

        def usable() -> str | None:
            found.clear()
            manifest = read_manifest(prefix)
            if manifest is None:
                return "missing"
            stale = stale_reason(manifest, path)
            if stale is not None:
                return stale
            cached = map_cache(prefix)  # a damaged cache is refused here
            n = int(cached.lengths[0])
            same = np.array_equal(cached.tokens[:n], first_tokens) and np.array_equal(cached.targets[:n], first_targets)
            if not same:
                return "the tokenizer gives the first conversation other tokens than the cache holds"
            found.append(cached)
            return None

        def build(why: str | None) -> None:
            if why != "missing" and print_fn is not None:
                print_fn(f"megatron_wlb: SFT cache {prefix}: stale ({why}); rebuilding it")
            _tokenize_into(prefix, path, tokenizer, int(seq_len), identity, print_fn)
            built.append(True)

        locked_build(prefix, usable, build)
        arrays = found[0] if found else map_cache(prefix)  # its checks (a scan of the .idx) run once a start
        m = arrays.manifest
        if m.get("tokenizer") != identity or m.get("seq_len") != int(seq_len) or m.get("pad") != int(tokenizer.pad):
            raise SftCacheError(f"SFT cache {prefix}.json: built for another tokenizer or --seq-length "
                                f"({m.get('seq_len')}); remove {prefix}.* to rebuild it")
        return cls(path, int(seq_len), int(tokenizer.pad), arrays, int(m["truncated"]), int(m["truncated_tokens"]),
                   bool(built))

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each conversation (int32, a view of the mapped ``.idx``)."""
        return self.arrays.lengths

    @property
    def tokens(self) -> np.ndarray:
        return self.arrays.tokens

    @property
    def targets(self) -> np.ndarray:
        return self.arrays.targets

    @property
    def num_conversations(self) -> int:
        return int(self.arrays.lengths.size)

    def source(self) -> IndexedSource:
        """The conversations as a ``reader.IndexedSource`` (what ``DocumentReader`` splits, shuffles and
        streams; its prefix is the jsonl path): views of the cache's maps, its token id range the manifest's."""
        m = self.arrays.manifest
        return IndexedSource(self.path, self.arrays.lengths, self.arrays.starts, self.arrays.tokens,
                             itemsize=np.dtype(CACHE_DTYPE).itemsize,
                             token_range=(int(m["token_min"]), int(m["token_max"])))

    def sample(self, doc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, loss mask) of conversation ``doc`` (file order), as ``SFTDataset`` gives them."""
        a = int(self.arrays.starts[doc]) // np.dtype(CACHE_DTYPE).itemsize
        b = a + int(self.arrays.lengths[doc])
        return conversation_sample(self.arrays.tokens[a:b], self.arrays.targets[a:b], self.pad)

    def piece(self, doc: int, offset: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``length`` tokens from ``offset`` of conversation ``doc``: its inputs, labels and loss mask."""
        if not (0 <= offset and offset + length <= int(self.arrays.lengths[doc])):
            raise ValueError(f"{self.path}: tokens [{offset}, {offset + length}) are outside conversation {doc} of "
                             f"{int(self.arrays.lengths[doc])} tokens")
        tokens, labels, mask = self.sample(doc)
        return tokens[offset:offset + length], labels[offset:offset + length], mask[offset:offset + length]

    def truncation_note(self) -> str | None:
        """One line saying how many conversations were cut to the window (None: none was)."""
        if not self.truncated:
            return None
        return (f"{self.path}: {self.truncated} of {self.num_conversations} conversations are longer than --seq-length "
                f"{self.seq_len} and were cut to it, as Megatron's SFTDataset cuts them "
                f"({self.truncated_tokens - self.truncated * self.seq_len} tokens not trained)")


def _tokenize_into(prefix: str, path: str, tokenizer: ConversationTokenizer, seq_len: int, identity: str,
                   print_fn: Callable[[str], None] | None) -> None:
    """Stream ``path`` through the tokenizer into the cache at ``prefix`` (``sft_cache.write_cache``): one
    batch of conversations in memory at a time, the jsonl hashed as it is read, a progress line every
    ``PROGRESS_SECONDS``."""
    st = os.stat(path)
    digest = hashlib.sha256()
    read = [0]
    counts = {"truncated": 0, "truncated_tokens": 0, "token_min": 2**31, "token_max": -1}
    began = last = time.monotonic()

    def on_line(raw: bytes) -> None:
        digest.update(raw)
        read[0] += len(raw)

    def batches() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        nonlocal last
        lengths: list[int] = []
        toks: list[np.ndarray] = []
        tgts: list[np.ndarray] = []
        held = done = 0
        for line_no, k, conversation in read_conversations(path, on_line):
            tokens, targets = tokenize(tokenizer, conversation, f"{path}:{line_no} conversation {k + 1}")
            if tokens.size > seq_len:  # SFTDataset keeps the first seq_length tokens of the window
                counts["truncated"] += 1
                counts["truncated_tokens"] += int(tokens.size)
                tokens, targets = tokens[:seq_len], targets[:seq_len]
            if tokens.size:
                counts["token_min"] = min(counts["token_min"], int(tokens.min()))
                counts["token_max"] = max(counts["token_max"], int(tokens.max()))
            lengths.append(int(tokens.size))
            toks.append(tokens)
            tgts.append(targets)
            held += int(tokens.size)
            if held >= WRITE_BATCH_TOKENS:
                done += len(lengths)
                yield np.asarray(lengths), np.concatenate(toks), np.concatenate(tgts)
                lengths, toks, tgts, held = [], [], [], 0
            now = time.monotonic()
            if print_fn is not None and now - last >= PROGRESS_SECONDS:
                last = now
                print_fn(f"megatron_wlb: tokenizing {path} into the SFT cache: {done + len(lengths):,} conversations, "
                         f"{100 * read[0] / max(st.st_size, 1):.1f}% of the file in {now - began:.0f} s")
        if lengths:
            yield np.asarray(lengths), np.concatenate(toks), np.concatenate(tgts)

    def manifest(conversations: int, total: int) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, "jsonl": os.path.abspath(path), "jsonl_bytes": st.st_size,
                "jsonl_mtime_ns": st.st_mtime_ns, "jsonl_sha256": digest.hexdigest(), "tokenizer": identity,
                "seq_len": seq_len, "pad": int(tokenizer.pad), "conversations": conversations, "tokens": total,
                **counts}

    write_cache(prefix, batches(), manifest)
    if print_fn is not None:
        print_fn(f"megatron_wlb: SFT cache {prefix}: {path} tokenized in {time.monotonic() - began:.1f} s")


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
