"""The streaming engine every packer shares: intake, oversize policy, validation, state.

A packer reads documents in arrival order from a finite sequence of lengths and emits one
``GlobalBatch`` per iteration. Each iteration first takes in ``dp * n * seq_len`` tokens of new
documents (on average: an overshoot is credited to the next iteration), so every packer consumes
the stream at the same rate as Megatron's concat-and-cut; then the packer's ``_plan`` places the
new pieces and whatever it holds back. At the end of the stream it keeps emitting batches until
it holds nothing, so every token read is emitted exactly once.

``state_dict()`` captures everything needed to continue: a packer restored with
``load_state_dict`` and fed the same sequence emits exactly the iterations an uninterrupted one
would, which is how a Megatron checkpoint keeps the documents waiting in queues.
"""

from __future__ import annotations

import dataclasses
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from megatron_wlb.costmodel import CostModel, cost_model_from_state
from megatron_wlb.data.cut import window_pieces
from megatron_wlb.data.lengths import validate_lengths
from megatron_wlb.packing.metrics import SizePrice, piece_latency, size_price
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch, PackingConfig, resolved_knobs

#: 2: the fingerprint covers every field and the cost model; 3: a refitted cost model is saved;
#: 4: the stream's token offset is saved (``pieces="concat-and-cut"`` cuts at multiples of seq_len of it)
STATE_VERSION = 4


def _nothing_to_read(tokens: int, limit: int) -> list[DocPiece]:
    return []


def pieces_to_state(pieces: Sequence[DocPiece]) -> list[list[int]]:
    return [[p.doc_id, p.offset, p.length, p.arrival] for p in pieces]


def pieces_from_state(rows: Sequence[Sequence[int]]) -> list[DocPiece]:
    return [DocPiece(int(a), int(b), int(c), int(d)) for a, b, c, d in rows]


class StreamSource(Protocol):
    """Documents in arrival order, read through a moving window: ``window(start, stop)`` gives the
    lengths (int64, each >= 1) and ids of documents ``[start, stop)``, fewer at the end of the
    stream (none past it). A packer asks for windows at its position, which never moves back, so
    a lazy source may forget what lies before the last ``start`` asked for."""

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclasses.dataclass(frozen=True)
class ArraySource:
    """A ``StreamSource`` over whole arrays (what ``Packer.pack`` reads)."""

    lengths: np.ndarray
    ids: np.ndarray

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        return self.lengths[start:stop], self.ids[start:stop]


class Packer(ABC):
    """Base of all packers. Subclasses set ``name`` and implement ``_plan`` and ``pending``."""

    name: ClassVar[str] = ""
    #: whether the packer cuts documents itself (Megatron's concat-and-cut); the others keep each
    #: document whole unless the oversize policy splits it.
    cuts_documents: ClassVar[bool] = False

    def __init__(self, config: PackingConfig, cost: CostModel | None = None):
        self.config = config
        self.cost = cost
        self.position = 0          # documents consumed from the sequence
        self.iteration = 0         # global batches emitted
        self.dropped: list[tuple[int, int]] = []  # (doc_id, length) removed by cut="drop"
        self._credit = 0           # tokens read beyond earlier budgets
        self._refit: dict[str, Any] | None = None  # the refitted cost model's state (set_cost), saved with ours
        self.stream_tokens = 0     # tokens of the documents consumed (where the next document starts)
        #: during ``_plan``: read documents worth at least ``tokens`` more from the stream, at most
        #: ``limit`` (they arrive this iteration; credited against later budgets); [] at the end
        self._read_ahead: Callable[[int, int], list[DocPiece]] = _nothing_to_read
        self._latency_table: np.ndarray | None = None  # ``latency`` of every length up to capacity

    def set_cost(self, cost: CostModel, state: dict[str, Any]) -> None:
        """Balance ``cost`` from the next plan on (the online refit); ``state`` rebuilds it on resume
        (``costmodel.cost_model_from_state`` over the configured model), so a resumed packer plans with
        the cost model the saved one had. Work statistics kept in the old model's seconds are rescaled."""
        old, self.cost, self._refit = self.cost, cost, state
        self._latency_table = None
        self._cost_changed(old)

    @property
    def size(self) -> SizePrice:
        """The cost model's price of a micro-batch as a whole (``metrics.SizePrice``; zero for an additive
        model): the placement loops add it to the sum of the pieces, so they balance what the machine pays."""
        return size_price(self.cost)

    def latency(self, lengths: np.ndarray | Sequence[int]) -> np.ndarray:
        """``piece_latency`` under this packer's cost model, looked up in a table of every length up to
        the capacity (built on first use, per cost model): the planning loops price the same lengths
        many times, and one lookup costs less than one pass through the cost model's arithmetic.
        Elementwise the same numbers as ``piece_latency`` (tested)."""
        d = np.asarray(lengths, dtype=np.int64)
        table = self._latency_table
        if table is None:
            table = self._latency_table = piece_latency(self.cost, np.arange(self.capacity + 1))
        if d.size and (int(d.max()) >= table.size or int(d.min()) < 0):
            return piece_latency(self.cost, d)  # beyond the table (an oversize piece), or invalid: the model says
        return table[d]

    def _cost_changed(self, old: CostModel | None) -> None:  # noqa: B027 - a hook: most packers keep no such state
        """Hook: bring state kept in the old cost model's units over to ``self.cost``."""

    # -- what subclasses provide -----------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Largest micro-batch, in tokens."""
        return self.config.seq_len

    @abstractmethod
    def _plan(self, new: list[DocPiece], final: bool) -> list[MicroBatch]:
        """Place ``new`` pieces (and held-back ones); return ``dp * n`` micro-batches.

        ``final`` is True once the stream is exhausted: the packer must then make progress on
        whatever it holds (release queues, place carried pieces) so that it eventually holds none.
        """

    @abstractmethod
    def pending(self) -> int:
        """Tokens read but not yet emitted."""

    def held(self) -> tuple[DocPiece, ...]:
        """The pieces read but not yet emitted (``pending()`` tokens): what a run that ends now has not trained."""
        return ()

    def _budgets_to_read(self) -> int:
        """How many iteration budgets to read before planning this iteration (lookahead).

        The default reads one budget per iteration. A packer that balances a window of ``k``
        global batches returns ``k`` at a window start and 0 inside the window; the pieces of the
        j-th budget get ``arrival = iteration + j``, so delay (emitted - arrival) stays honest.
        """
        return 1

    def _min_intake(self) -> int:
        """Tokens to read this iteration even while earlier overshoot is being repaid (default 0).

        The debt is kept: it is repaid by the part of the budget not read, so the stream rate
        stays that of concat-and-cut over the run.
        """
        return 0

    def diagnostics(self) -> dict[str, Any]:
        """What the packer counted while planning, beyond the plans (JSON-ready; none by default):
        wlb's current thresholds and forced splits, fixed-solver's HiGHS statuses, ..."""
        return {}

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        return None

    # -- the stream ------------------------------------------------------------------------------
    def pack(self, lengths: Sequence[int] | np.ndarray,
             doc_ids: Sequence[int] | np.ndarray | None = None) -> Iterator[GlobalBatch]:
        """Yield global batches from ``self.position`` to the end of ``lengths``, then flush.

        ``doc_ids`` default to the index in ``lengths``. Feed a restored packer the same sequence.
        """
        lengths = validate_lengths(lengths)
        if doc_ids is None:
            ids = np.arange(lengths.size, dtype=np.int64)
        else:
            ids = np.asarray(doc_ids, dtype=np.int64)
            if ids.shape != lengths.shape:
                raise ValueError(f"doc_ids has {ids.size} entries but lengths has {lengths.size}")
        if self.position > lengths.size:
            raise ValueError(f"packer state is at document {self.position} but the stream has only "
                             f"{lengths.size}; restore it on the stream it was saved from")
        return self.pack_source(ArraySource(lengths, ids))

    def pack_source(self, source: StreamSource) -> Iterator[GlobalBatch]:
        """``pack`` over a ``StreamSource`` read from ``self.position`` on (a lazy stream holds only
        a window of documents; the caller checks that a restored packer's source is the saved one)."""
        while True:
            new: list[DocPiece] = []
            for j in range(self._budgets_to_read()):
                new.extend(self._intake(source, arrival=self.iteration + j))
            final = source.window(self.position, self.position + 1)[0].size == 0
            if final and not new and self.pending() == 0:
                return
            start, cpu_start = time.perf_counter(), time.thread_time()
            if self.config.read_ahead is not False:
                self._read_ahead = lambda tokens, limit: self._read_more(source, tokens, limit)
            try:
                micro_batches = self._plan(new, final)
            finally:
                self._read_ahead = _nothing_to_read
            elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
            batch = GlobalBatch(self.iteration, tuple(micro_batches), self.config.dp, self.config.n,
                                plan_seconds=elapsed, plan_cpu_seconds=cpu)
            if final and batch.tokens == 0 and self.pending() > 0:
                raise RuntimeError(f"{self.name} packer made no progress while flushing "
                                   f"{self.pending()} pending tokens")
            self.iteration += 1
            yield batch

    def _intake(self, source: StreamSource, arrival: int | None = None) -> list[DocPiece]:
        """Read one iteration budget of documents (less what earlier iterations read ahead)."""
        budget = max(self.config.tokens_per_iteration - self._credit, self._min_intake())
        pieces, read = self._read(source, budget, self.iteration if arrival is None else arrival)
        self._credit = max(0, self._credit + read - self.config.tokens_per_iteration)
        return pieces

    def _read_more(self, source: StreamSource, tokens: int, limit: int) -> list[DocPiece]:
        """Read ahead: documents worth at least ``tokens`` more but never more than ``limit`` in all
        (none if the next document alone exceeds it), arriving this iteration; what they hold is
        credited against later budgets, so the stream rate stays that of concat-and-cut."""
        pieces, read = self._read(source, max(1, tokens), self.iteration, limit)
        self._credit += read
        return pieces

    def _read(self, source: StreamSource, budget: int, arrival: int,
              limit: int | None = None) -> tuple[list[DocPiece], int]:
        """The next documents until they hold ``budget`` tokens (the last may overshoot, up to
        ``limit`` tokens in all), as pieces (the oversize policy, or the concat-and-cut intake);
        returns them and the tokens read."""
        start = self.position
        head = source.window(start, start + 64)[0]
        if head.size == 0 or (limit is not None and int(head[0]) > limit):
            return [], 0
        # Grow a window until its cumulative length covers the budget (avoids a full-array cumsum).
        span = max(64, 2 * budget // max(1, int(head.mean())))
        while True:
            lengths, ids = source.window(start, start + span)
            csum = np.cumsum(lengths)
            if csum[-1] >= budget or lengths.size < span:
                break
            span *= 2
        k = int(np.searchsorted(csum, budget, side="left")) + 1  # docs until the budget is covered
        k = min(k, csum.size)
        if limit is not None:
            k = min(k, int(np.searchsorted(csum, limit, side="right")))  # >= 1: the first fits
        read = int(csum[k - 1])
        self.position = start + k
        offset, self.stream_tokens = self.stream_tokens, self.stream_tokens + read
        if self.config.pieces == "concat-and-cut" and not self.cuts_documents:
            return self._window_pieces(lengths[:k], ids[:k], arrival, offset), read
        return self._apply_oversize(lengths[:k], ids[:k], arrival), read

    def _window_pieces(self, lengths: np.ndarray, ids: np.ndarray, arrival: int, offset: int) -> list[DocPiece]:
        """``pieces="concat-and-cut"``: the documents cut where Megatron's GPTDataset cuts them (every
        ``seq_len`` tokens of the stream; the first starts at stream token ``offset``)."""
        doc, start, size = window_pieces(lengths, offset, self.config.seq_len)
        doc_ids = ids[doc].tolist()
        return [DocPiece(d, o, n, arrival) for d, o, n in zip(doc_ids, start.tolist(), size.tolist())]

    def _apply_oversize(self, lengths: np.ndarray, ids: np.ndarray, arrival: int) -> list[DocPiece]:
        cap = self.capacity
        policy = self.config.oversize
        if lengths.size == 0 or int(lengths.max()) <= cap or (self.cuts_documents and policy == "split"):
            # A cutting packer (concat-and-cut) splits long documents itself at micro-batch edges.
            return [DocPiece(i, 0, n, arrival) for i, n in zip(ids.tolist(), lengths.tolist())]
        pieces: list[DocPiece] = []
        for doc_id, n in zip(ids.tolist(), lengths.tolist()):
            if n <= cap:
                pieces.append(DocPiece(doc_id, 0, n, arrival))
            elif policy == "split":
                pieces.extend(DocPiece(doc_id, off, min(cap, n - off), arrival) for off in range(0, n, cap))
            elif policy == "drop":
                self.dropped.append((doc_id, n))
            else:
                raise ValueError(f"document {doc_id} has {n} tokens, more than the {self.name} packer's "
                                 f"capacity {cap}; use cut='split' or 'drop', or raise the capacity")
        return pieces

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; restore with ``load_state_dict`` on a packer of the same config."""
        return {
            "version": STATE_VERSION,
            "packer": self.name,
            "config": settings_fingerprint(self.config, self.cost),
            "cost": self._refit,
            "position": self.position,
            "iteration": self.iteration,
            "credit": self._credit,
            "stream_tokens": self.stream_tokens,
            "dropped": [list(d) for d in self.dropped],
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"packer state version {state.get('version')!r}; this build reads {STATE_VERSION}")
        if state.get("packer") != self.name:
            raise ValueError(f"state was saved by the {state.get('packer')!r} packer, not {self.name!r}")
        if state.get("cost") is not None:  # a refitted cost model: rebuild it before comparing fingerprints
            if self.cost is None:
                raise ValueError("packer state holds a refitted cost model, but this packer has none to refit")
            self.set_cost(cost_model_from_state(state["cost"], self.cost), state["cost"])
        saved, now = state.get("config") or {}, settings_fingerprint(self.config, self.cost)
        moved = layout_change(saved, now)
        if moved is not None:
            raise LayoutChanged(*moved)
        diff = fingerprint_difference(saved, now)
        if diff:
            raise ValueError(f"packer state was saved with different settings, refusing to resume: {diff}")
        self.position = int(state["position"])
        self.iteration = int(state["iteration"])
        self._credit = int(state["credit"])
        self.stream_tokens = int(state["stream_tokens"])
        self.dropped = [(int(a), int(b)) for a, b in state["dropped"]]
        self._load_extra_state(state["extra"])


#: lengths at which the fingerprint samples the cost model (a calibrated profile changes them)
_PROBE_LENGTHS = (1, 1024, 8192, 65536, 131072, 262144)


def settings_fingerprint(config: PackingConfig, cost: CostModel | None) -> dict[str, Any]:
    """Everything a restored packer must share with the saved one to replay identically: every
    ``PackingConfig`` field and the cost model (its description and its latency at a few lengths,
    which the auto thresholds and every placement depend on). JSON-serialisable."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    out["cost"] = "d**2 (no cost model)" if cost is None else cost.describe()
    probe = piece_latency(cost, np.asarray(_PROBE_LENGTHS))
    overhead = 0.0 if cost is None else float(cost.microbatch_overhead)
    size = size_price(cost)  # a micro-batch's price as a whole: probed only where there is one (older states)
    whole = [size.tokens_sq, size.tokens_pairs] if size else []
    out["cost_probe"] = [f"{x:.12g}" for x in [*probe.tolist(), overhead, *whole]]
    return out


def fingerprint_difference(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """'' when equal, else one line naming each differing setting: ``name: saved X, now Y``.

    The cost model's description names its layout; its DP size is left out of the comparison (a micro-batch
    costs the same at any DP size, and ``cost_probe`` compares the latencies themselves), so the saved plans
    can continue at another DP size (``megatron.data.WlbDataIterator``); ``dp`` and ``n`` are compared.
    ``max_seq_len`` None compares as its resolved value (``types.resolved_knobs``)."""
    def comparable(key: str, value: Any) -> Any:
        return re.sub(r"-DP\d+", "", value) if key == "cost" and isinstance(value, str) else value

    saved, now = resolved_knobs(saved), resolved_knobs(now)

    keys = sorted(set(saved) | set(now))
    parts = [f"{k}: saved {saved.get(k, '<absent>')!r}, now {now.get(k, '<absent>')!r}"
             for k in keys if comparable(k, saved.get(k, "<absent>")) != comparable(k, now.get(k, "<absent>"))]
    return "; ".join(parts)


#: a cost model's parallel layout as its description names it (``ParallelLayout``: ``TP1-CP2-PP1-DP2[-EP2]``)
LAYOUT_NAME = re.compile(r"\bTP\d+-CP\d+-PP\d+-DP\d+(?:-EP\d+)?\b")


class LayoutChanged(ValueError):  # noqa: N818 - a refusal, named for what it finds
    """A packer state saved on another parallel layout than this run's, beyond its DP size: its queues,
    thresholds and plans are priced by that layout's cost model (``saved`` and ``now``: the layouts' names)."""

    def __init__(self, saved: str, now: str):
        self.saved, self.now = saved, now
        super().__init__(f"the packer state was saved on the layout {saved}, this run is {now}")


def layout_change(saved: dict[str, Any], now: dict[str, Any]) -> tuple[str, str] | None:
    """(saved layout, this run's) when two ``settings_fingerprint``s' cost models name layouts that differ beyond
    their DP size (another TP, CP, PP or EP: the latencies every plan was priced with change); None otherwise."""
    found = [LAYOUT_NAME.search(str(side.get("cost", ""))) for side in (saved, now)]
    if found[0] is None or found[1] is None:
        return None
    names = (found[0].group(), found[1].group())
    if re.sub(r"-DP\d+", "", names[0]) == re.sub(r"-DP\d+", "", names[1]):
        return None
    return names


PACKERS: dict[str, type[Packer]] = {}


def register_packer(cls: type[Packer]) -> type[Packer]:
    """Class decorator: make a packer available to ``make_packer`` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty name")
    PACKERS[cls.name] = cls
    return cls
