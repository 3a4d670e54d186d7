"""Packed micro-batches for Megatron's training loop: packer plan -> this rank's host batch.

``WlbDataIterator`` is the iterator Megatron pulls micro-batches from, one per rank. Every rank
builds the same reader (``megatron_wlb.data.reader``), stream and packer, so every rank computes the
same global plan without communication (``plan_digest``); DP rank r takes
``GlobalBatch.for_dp_rank(r)``, i.e. exactly ``num_microbatches`` micro-batches per iteration on
every TP/CP/PP rank. Each micro-batch is laid out over the CP group right here, on the host
(``cp.plan.layout_micro_batch``, with the iteration's plan), and yielded as this rank's one host
record, a ``cp.plan.RankMicroBatch`` (its rows of the packed tokens, positions and attention
metadata). ``cp.device.upload`` moves it to the device once (``cp_hooks.upload_micro_batch``).

Token convention (see ``docs/megatron.md``): a piece of d tokens gives d input tokens; ``labels[i]``
is the next token of the same piece; the last token of every piece has ``loss_mask`` 0 (label 0);
position ids restart at 0 for every piece (also for the later pieces of a split document); padding
segments hold token 0 with loss_mask 0. The balanced concat-and-cut intake (``gpt_samples``) reads
each piece's tokens, labels and loss mask from Megatron's own samples instead (``PieceReadFn``):
the label of a window's last input is then the window's next token, as in a stock job.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_wlb.cp.dynamic_steps import DynamicPool, slot_steps, step_batch
from megatron_wlb.cp.layouts import ShardLayout, layout_digest
from megatron_wlb.cp.plan import CPSharding, Packed, RankMicroBatch, layout_micro_batch, micro_batch_lengths, rank_batch
from megatron_wlb.data.reader import (
    ORDER_NUMPY_SHUFFLE,
    DocumentReader,
    DocumentStream,
    OutOfVocabulary,
    StreamCursor,
)
from megatron_wlb.data.samples import SamplePieceCursor, SampleStream
from megatron_wlb.megatron.args.validation import RunRefusal
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.types import GlobalBatch, MicroBatch

STREAM_STATE_VERSION = 2  # 2: the stream digest hashes ids and lengths apart (a lazy stream)
ReadFn = Callable[[int, int, int], np.ndarray]


#: (doc_id, offset, length) -> a piece's tokens, labels and loss mask, as the data source gives them
PieceReadFn = Callable[[int, int, int], Packed]


def pack_tokens(read: ReadFn, micro_batch: MicroBatch, segment_lengths: np.ndarray,
                read_piece: PieceReadFn | None = None) -> Packed:
    """The micro-batch's tokens, labels and loss mask over ``segment_lengths`` (its pieces, then padding
    segments, as ``cp.plan.micro_batch_lengths`` gives them). ``read(doc_id, offset, length)`` returns a
    piece's tokens (labels: the next token of the piece, the last one masked); ``read_piece`` (when
    given) returns its tokens, labels and loss mask whole."""
    size = int(np.sum(segment_lengths))
    tokens = np.zeros(size, dtype=np.int64)
    labels = np.zeros(size, dtype=np.int64)
    loss_mask = np.zeros(size, dtype=np.float32)
    at = 0
    for p in micro_batch.pieces:
        if read_piece is not None:
            got_tokens, got_labels, got_mask = read_piece(p.doc_id, p.offset, p.length)
            if got_tokens.size != p.length:
                raise ValueError(f"piece {p.doc_id}: read {got_tokens.size} tokens for a piece of {p.length}")
            tokens[at:at + p.length], labels[at:at + p.length] = got_tokens, got_labels
            loss_mask[at:at + p.length] = got_mask
            at += p.length
            continue
        chunk = read(p.doc_id, p.offset, p.length)
        if chunk.size != p.length:
            raise ValueError(f"document {p.doc_id}: read {chunk.size} tokens for a piece of {p.length}")
        tokens[at:at + p.length] = chunk
        labels[at:at + p.length - 1] = chunk[1:]
        loss_mask[at:at + p.length - 1] = 1.0
        at += p.length
    return tokens, labels, loss_mask


def segment_lengths(micro_batch: MicroBatch, sharding: CPSharding) -> np.ndarray:
    """The packed sequence's segments of ``micro_batch``: its pieces, then ``sharding``'s padding."""
    return micro_batch_lengths([p.length for p in micro_batch.pieces], sharding.sequence_multiple,
                               sharding.empty_tokens)


def rank_micro_batch(read: ReadFn, micro_batch: MicroBatch, sharding: CPSharding,
                     read_piece: PieceReadFn | None = None, layout: ShardLayout | None = None) -> RankMicroBatch:
    """``sharding``'s CP rank's host record of ``micro_batch``: its tokens read, laid out by ``layout``
    (None: laid out now)."""
    segments = segment_lengths(micro_batch, sharding)
    return rank_batch(segments, sharding, layout=layout, packed=pack_tokens(read, micro_batch, segments, read_piece),
                      micro_batch=micro_batch)


def plan_digest(batch: GlobalBatch) -> str:
    """sha256 of a global plan (every piece of every micro-batch, in order): equal on all ranks."""
    h = hashlib.sha256()
    h.update(f"{batch.iteration}:{batch.dp}:{batch.n}".encode())
    for mb in batch.micro_batches:
        h.update(b"|")
        h.update(np.asarray([[p.doc_id, p.offset, p.length, p.arrival] for p in mb.pieces],
                            dtype=np.int64).tobytes())
    return h.hexdigest()


class WlbDataIterator(Iterator[RankMicroBatch]):
    """Yields this rank's ``RankMicroBatch`` es, ``packer.config.n`` per iteration, in plan order.

    Every rank holds an identical packer fed the identical stream, so the plan of every iteration is
    the same everywhere (``plan_digest``). ``state_dict``/``load_state_dict`` carry the packer's
    state (waiting queues, stream position) and a digest of the stream consumed so far, so a restart
    resumes exactly where the saved run was: no document lost or repeated. ``on_batch`` (optional)
    is called with every new ``GlobalBatch`` (the logging hook uses it; with dynamic CP also with its plan,
    ``dynamic_plan=``); ``sharding`` says how this
    rank's micro-batches are cut over its CP group (default: no CP).
    """

    def __init__(self, reader: DocumentReader | None, stream: DocumentStream | SampleStream, packer: Any,
                 dp_rank: int, sharding: CPSharding | None = None,
                 on_batch: Callable[..., None] | None = None, read: ReadFn | None = None,
                 read_piece: PieceReadFn | None = None, sample_identity: Any = None,
                 dynamic: DynamicPool | None = None):
        if read is None and read_piece is None:
            if reader is None:
                raise ValueError("WlbDataIterator needs a DocumentReader or a read(doc_id, offset, length) function")
            read = reader.read
        self.reader = reader
        self.read: ReadFn = read if read is not None else _no_token_read
        #: Megatron's own samples (the balanced concat-and-cut intake): pieces read with their labels and loss mask
        self.read_piece = read_piece
        #: what keys the documents behind Megatron's samples (``sample_agreement.SampleIdentity``; None: the
        #: reader's stream ids are the documents), agreed every step with the plan
        self.sample_identity = sample_identity
        self.sharding = sharding if sharding is not None else CPSharding()
        #: dynamic CP: this rank's slot of its DP x CP pool; every iteration's pieces are planned over the pool
        #: (``cp.dynamic_steps``) and this slot runs its step's group micro-batch (or an empty one)
        self.dynamic = dynamic
        self._steps: tuple[Any, ...] = ()
        self.stream = stream
        self.packer = packer
        self.dp_rank = int(dp_rank)
        #: the run's DP size: the packer's, unless a checkpoint planned for another one (``load_state_dict``)
        self.dp_size = int(packer.config.dp)
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {self.dp_size}) of the packer's config")
        self.on_batch = on_batch
        self.yielded = 0
        #: the micro-batch yielded last (what the step timing attributes a forward step to), and the
        #: host seconds its ``__next__`` took (planning the iteration on its first micro-batch included)
        self.last: RankMicroBatch | None = None
        self.last_seconds = 0.0
        self.current: GlobalBatch | None = None
        self._mine: tuple[MicroBatch, ...] = ()
        #: the CP layouts of ``_mine`` (CP > 1: built with the iteration's plan, so that the CP ranks can agree
        #: on them before the step; empty: each is built with its micro-batch)
        self._cp_layouts: tuple[ShardLayout, ...] = ()
        #: (layout name, ``cp.layouts.layout_digest``) of each of this rank's micro-batches of the current
        #: iteration (CP > 1 only): what ``agreement.check_plan_agreement`` compares over each CP group
        self.layouts: tuple[tuple[str, int], ...] = ()
        self._cursor = 0
        self._batches: Iterator[GlobalBatch] | None = None
        self._source: StreamCursor | SamplePieceCursor | None = None  # the stream window the packer reads

    @property
    def n(self) -> int:
        """Micro-batches per DP rank per iteration (of this run's DP size)."""
        return self.packer.config.micro_batches_per_iteration // self.dp_size

    def _next_batch(self) -> GlobalBatch:
        if self._batches is None:
            if self._source is None:
                self._source = self.stream.cursor()
            self._batches = self.packer.pack_source(self._source)
        return self._take(next(self._batches))  # StopIteration ends training data

    def _take(self, batch: GlobalBatch) -> GlobalBatch:
        """Make ``batch`` the iteration being read: this rank's share of it (the packer's own deal, or, for a
        checkpoint planned for another DP size at the same global batch, the same plan in its order cut into
        dp_size equal shares), with CP its micro-batches laid out now (``layouts``, agreed before the step)."""
        self.current = batch
        self._mine = batch.micro_batches[self.dp_rank * self.n:(self.dp_rank + 1) * self.n]
        plan = None
        if self.dynamic is not None:  # the whole global batch's pieces over the pool, this slot's steps
            pieces = [p for mb in batch.micro_batches for p in mb.pieces]  # the planner's order
            try:
                plan = self.dynamic.plan([mb.lengths for mb in batch.micro_batches], self.n,
                                         self.packer.cost)  # the packer's model: an online refit included
                self._steps = slot_steps(plan, self.dynamic.slot, self.n)
            except ValueError as exc:  # every rank plans alike: each stops here, in one line
                raise RunRefusal(f"megatron_wlb: iteration {batch.iteration}: {exc}") from None
            capacity = max(mb.capacity for mb in batch.micro_batches)
            self._mine = tuple(MicroBatch(tuple(pieces[d] for d in step.docs) if step is not None else (), capacity)
                               for step in self._steps)
        if self.sharding.cp_size > 1:
            self._cp_layouts = tuple(layout_micro_batch(segment_lengths(mb, self.sharding), self.sharding)
                                     for mb in self._mine)
            self.layouts = tuple((layout.name, layout_digest(layout)) for layout in self._cp_layouts)
        self._cursor = 0
        if self.on_batch is not None and plan is not None:  # dynamic CP: with the plan the log reports
            self.on_batch(batch, dynamic_plan=plan)
        elif self.on_batch is not None:
            self.on_batch(batch)
        return batch

    @property
    def position(self) -> int:
        """Micro-batches of the current iteration read so far (the last one's index is ``position - 1``)."""
        return self._cursor

    @property
    def iteration(self) -> int:
        """The iteration of the plan being read (-1 before the first)."""
        return -1 if self.current is None else self.current.iteration

    def next_plan(self) -> GlobalBatch:
        """Advance to the next iteration's plan without building its tensors (tests, dry runs)."""
        if self._cursor < len(self._mine):
            raise RuntimeError(f"{len(self._mine) - self._cursor} micro-batches of iteration "
                               f"{self.iteration} are still unread")
        batch = self._next_batch()
        self._cursor = len(self._mine)
        return batch

    def prepare(self) -> GlobalBatch | None:
        """Plan the next iteration now if the current one has been read (else keep it); returns the
        plan the next micro-batches come from, or None when the stream has ended. The plan agreement
        check (``agreement.wrap_train_step``) calls it before every training step."""
        if self._cursor >= len(self._mine):
            try:
                self._next_batch()
            except StopIteration:
                return None
        return self.current

    @property
    def remaining_in_iteration(self) -> int:
        """Micro-batches of the current iteration not read yet (0 before the first and at its end)."""
        return len(self._mine) - self._cursor

    def produce(self) -> RankMicroBatch:
        """The next micro-batch, built (packing a new iteration first when one ends), without making it
        ``last`` (``prefetch.PrefetchingIterator`` builds one ahead on its thread). A token id the model's
        vocabulary cannot hold, met as it is read, stops the run in one line."""
        try:
            return self._produce()
        except OutOfVocabulary as exc:
            raise RunRefusal(f"megatron_wlb: iteration {self.iteration}: {exc}") from None

    def _produce(self) -> RankMicroBatch:
        if self._cursor >= len(self._mine):
            self._next_batch()
        at = self._cursor
        self._cursor += 1
        self.yielded += 1
        if self.dynamic is not None:
            mine = self._mine[at]
            lengths = mine.lengths
            step = self._steps[at]
            if step is not None:  # the planner numbers the global batch's pieces; this step's are mine's, in order
                step = replace(step, docs=tuple(range(len(mine.pieces))))
            record = step_batch(step, self.dynamic.slot, lengths,
                                lambda _docs, segments: pack_tokens(self.read, mine, segments, self.read_piece),
                                empty_tokens=self.sharding.empty_tokens, rank_multiple=self.dynamic.rank_multiple)
            return replace(record, micro_batch=mine)
        return rank_micro_batch(self.read, self._mine[at], self.sharding, read_piece=self.read_piece,
                                layout=self._cp_layouts[at] if self._cp_layouts else None)

    def __next__(self) -> RankMicroBatch:
        start = time.perf_counter()
        self.last = self.produce()
        self.last_seconds = time.perf_counter() - start
        return self.last

    # -- checkpointing ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state between iterations (raises if an iteration is half consumed)."""
        if self._cursor < len(self._mine):
            raise RuntimeError(f"cannot save the data state mid-iteration: {self._cursor} of {len(self._mine)} "
                               f"micro-batches of iteration {self.iteration} were read; save between steps")
        position = int(self.packer.position)
        source = self._source
        digest = source.digest(position) if source is not None and position >= source.start else \
            self.stream.digest(position)
        state = {
            "version": STREAM_STATE_VERSION,
            "reader": self.reader.describe() if self.reader is not None else None,
            "stream_position": position,
            "stream_digest": digest,
            "packer": self.packer.state_dict(),
        }
        if self.sample_identity is not None and str(digest).startswith("samples:"):
            # Megatron's samples up to the saved one, witnessed: a longer run (another dataset description)
            # resumes when its order agrees there
            state["sample_order"] = self.sample_identity.order_witness(int(str(digest).split(":")[3]))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the packer and check that this run's stream starts with the saved run's documents."""
        if state.get("version") != STREAM_STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r}; this build reads {STREAM_STATE_VERSION}")
        if self.reader is not None and state.get("reader") is not None:
            saved = {**state["reader"], "order": saved_order(state["reader"])}
            self.reader.use_order(saved["order"])  # the checkpoint's epoch order goes on, whichever this build's
            if _reader_key(saved) != _reader_key(self.reader.describe()):
                raise ValueError("the checkpoint's data state was saved with other data settings: saved "
                                 f"{saved}, now {self.reader.describe()}; resume with the same --data-path, "
                                 "--split and --seed")
        position = int(state["stream_position"])
        source: StreamCursor | SamplePieceCursor
        if isinstance(self.stream, SampleStream):  # Megatron's samples: open a cursor at the saved sample and piece
            witness, identity = state.get("sample_order"), self.sample_identity
            source = self.stream.resume_cursor(
                position, state["stream_digest"],
                None if witness is None or identity is None else lambda sample: identity.same_order(witness))
        else:  # read on from the saved position (the documents before it are hashed)
            source = self.stream.cursor()
        if not isinstance(source, SamplePieceCursor) and source.digest(position) != state["stream_digest"]:
            raise ValueError(f"this run's document stream does not start with the {position} documents the "
                             "checkpoint consumed; resume with the same data, split, seed and an equal or larger "
                             "--train-iters")
        self._adopt_planned_layout(state["packer"].get("config") or {})
        self.packer.load_state_dict(state["packer"])
        self._source = source
        self._batches = None
        self.current = None
        self._mine = ()
        self.layouts = ()
        self._cursor = 0

    def _adopt_planned_layout(self, saved: dict[str, Any]) -> None:
        """Keep planning for the checkpoint's (dp, n) when this run has another DP size at the same global
        batch (dp * n micro-batches per iteration): the packer then makes the plans the saved run would have,
        and each rank takes its share of them. Another global batch is refused (``PlanLayoutError``)."""
        config = self.packer.config
        if "dp" not in saved or (int(saved["dp"]), int(saved["n"])) == (config.dp, config.n):
            return
        planned = int(saved["dp"]) * int(saved["n"])
        if planned != config.micro_batches_per_iteration:
            raise PlanLayoutError(int(saved["dp"]), int(saved["n"]), self.dp_size,
                                  config.micro_batches_per_iteration // self.dp_size)

        self.packer = make_packer(self.packer.name, replace(config, dp=int(saved["dp"]), n=int(saved["n"])),
                                  self.packer.cost)


def _no_token_read(doc_id: int, offset: int, length: int) -> np.ndarray:
    raise RuntimeError("this iterator reads whole pieces (read_piece), not document tokens")


class PlanLayoutError(ValueError):
    """A checkpoint's plans cannot continue on this run's layout: another number of micro-batches per iteration."""

    def __init__(self, saved_dp: int, saved_n: int, dp: int, n: int):
        self.saved_dp, self.saved_n, self.dp, self.n = saved_dp, saved_n, dp, n
        super().__init__(f"the checkpoint planned {saved_dp * saved_n} micro-batches per iteration (DP {saved_dp} x "
                         f"{saved_n}), this run {dp * n} (DP {dp} x {n}): its plans cannot be dealt to this layout")


def saved_order(described: dict[str, Any]) -> str:
    """The epoch order a checkpoint's reader state names (one saved before the orders had names: the numpy
    shuffle it was trained in)."""
    return str(described.get("order", ORDER_NUMPY_SHUFFLE))


def _reader_key(described: dict[str, Any]) -> dict[str, Any]:
    """What must match on resume: the reader's settings, with file names but not their directories
    (a dataset moved to another mount is the same data; its document counts are compared too)."""
    key = dict(described)
    key["prefixes"] = [os.path.basename(str(p)) for p in described.get("prefixes", [])]
    return key


def dumps_state(state: dict[str, Any]) -> str:
    """Canonical JSON of a data state (identical bytes on every rank holding the same state)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"))
