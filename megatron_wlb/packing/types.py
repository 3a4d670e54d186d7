"""Plans a packer emits: document pieces in micro-batches in global batches, and its settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

OversizePolicy = Literal["split", "drop", "error"]
OVERSIZE_POLICIES: tuple[str, ...] = ("split", "drop", "error")
#: S_max / seq_len when ``max_seq_len`` is None (docs/packing.md explains the choice).
DEFAULT_MAX_SEQ_LEN_FACTOR = 1.5
#: attention kernels index a micro-batch's tokens with int32 (``cu_seqlens``): the most it may hold
MAX_MICRO_BATCH_TOKENS = 2**31 - 1


def resolve_max_seq_len(seq_len: int, max_seq_len: int | None = None) -> int:
    """The variable-length capacity S_max: ``max_seq_len``, or ``DEFAULT_MAX_SEQ_LEN_FACTOR`` x ``seq_len``."""
    return int(seq_len * DEFAULT_MAX_SEQ_LEN_FACTOR) if max_seq_len is None else max_seq_len


@dataclass(frozen=True, slots=True)
class DocPiece:
    """Tokens ``[offset, offset + length)`` of document ``doc_id``, read at iteration ``arrival``.

    A piece is a document for attention purposes: tokens attend only within their piece. A whole
    document is the piece with ``offset == 0`` and its full length.
    """

    doc_id: int
    offset: int
    length: int
    arrival: int


def piece_lengths(pieces: Sequence[DocPiece]) -> np.ndarray:
    """The pieces' token counts, in order, as int64."""
    return np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Document pieces packed into one micro-batch, in order; ``capacity`` bounds their tokens."""

    pieces: tuple[DocPiece, ...]
    capacity: int

    @property
    def tokens(self) -> int:
        return sum(p.length for p in self.pieces)

    @property
    def lengths(self) -> np.ndarray:
        return piece_lengths(self.pieces)

    def cu_seqlens(self) -> np.ndarray:
        """Cumulative piece boundaries ``[0, l0, l0 + l1, ...]``, the THD ``cu_seqlens``."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)


@dataclass(frozen=True)
class GlobalBatch:
    """One iteration's plan: ``dp * n`` micro-batches; DP rank r runs ``micro_batches[r*n:(r+1)*n]``."""

    iteration: int
    micro_batches: tuple[MicroBatch, ...]
    dp: int
    n: int
    plan_seconds: float = 0.0
    #: CPU seconds of this thread spent planning (wall time suffers when the machine is shared)
    plan_cpu_seconds: float = 0.0

    def __post_init__(self) -> None:
        if len(self.micro_batches) != self.dp * self.n:
            raise ValueError(f"a global batch holds dp*n = {self.dp * self.n} micro-batches, "
                             f"got {len(self.micro_batches)}")

    def for_dp_rank(self, rank: int) -> tuple[MicroBatch, ...]:
        if not 0 <= rank < self.dp:
            raise ValueError(f"dp rank {rank} is outside [0, {self.dp})")
        return self.micro_batches[rank * self.n:(rank + 1) * self.n]

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.micro_batches)

    def pieces(self) -> list[DocPiece]:
        return [p for mb in self.micro_batches for p in mb.pieces]


# -- the orders packers place pieces in (ties broken down to the piece, so every order is total) --------
def oldest_first_key(p: DocPiece) -> tuple[int, int, int]:
    """Arrival, then document and offset: the order of waiting pieces."""
    return (p.arrival, p.doc_id, p.offset)


def largest_first_key(p: DocPiece) -> tuple[int, int, int, int]:
    """Longest first, then oldest: the placement order of LPT-style packing."""
    return (-p.length, p.arrival, p.doc_id, p.offset)


def shortest_first_key(p: DocPiece) -> tuple[int, int, int, int]:
    """Shortest first, then oldest."""
    return (p.length, p.arrival, p.doc_id, p.offset)


def sort_largest_first(pieces: Sequence[DocPiece]) -> list[DocPiece]:
    """``sorted(pieces, key=largest_first_key)``, with a numpy lexsort for long lists (the hot path)."""
    if len(pieces) < 64:
        return sorted(pieces, key=largest_first_key)
    n = len(pieces)
    offset = np.fromiter((p.offset for p in pieces), dtype=np.int64, count=n)
    doc_id = np.fromiter((p.doc_id for p in pieces), dtype=np.int64, count=n)
    arrival = np.fromiter((p.arrival for p in pieces), dtype=np.int64, count=n)
    length = piece_lengths(pieces)
    return [pieces[i] for i in np.lexsort((offset, doc_id, arrival, -length)).tolist()]


ReleasePolicy = Literal["global", "rank"]
RELEASE_POLICIES: tuple[str, ...] = ("global", "rank")
CutPolicy = Literal["none", "overlong", "any"]
CUT_POLICIES: tuple[str, ...] = ("none", "overlong", "any")
PieceSource = Literal["documents", "concat-and-cut"]
PIECE_SOURCES: tuple[str, ...] = ("documents", "concat-and-cut")
CostModelPolicy = Literal["static", "online"]
COST_MODEL_POLICIES: tuple[str, ...] = ("static", "online")


@dataclass(frozen=True)
class PackingConfig:
    """Settings shared by every packer (each field is validated; an error names the bad value)."""

    #: Megatron's ``--seq-length``: the fixed packers' micro-batch capacity and the token budget
    #: (every iteration reads ``dp * n * seq_len`` tokens of new documents on average).
    seq_len: int
    #: micro-batches per DP rank per iteration (the paper uses n = PP)
    n: int
    #: data-parallel ranks; a global batch holds ``dp * n`` micro-batches
    dp: int = 1
    #: wlb's micro-batch capacity (paper S_max); None = 1.5 x seq_len (docs/packing.md)
    max_seq_len: int | None = None
    #: documents longer than a packer's capacity: "split" into pieces, "drop" (counted), or "error"
    oversize: OversizePolicy = "split"
    #: the fixed packers balance this many global batches at a time (paper: 1/2/4/8)
    window: int = 1
    #: wlb's outlier queue thresholds L_1 < ... < L_n, or "auto" (derived from the stream)
    queue_thresholds: tuple[int, ...] | Literal["auto"] = "auto"
    #: how many queues "auto" may build
    num_queues: int = 2
    #: hard bound: no token waits more than this many iterations beyond its arrival (wlb)
    max_delay: int = 8
    seed: int = 0
    #: wlb auto thresholds: an outlier is a document whose latency reaches this fraction of an
    #: ordinary micro-batch's mean latency (ordinary = built from non-outlier documents)
    outlier_fraction: float = 0.7
    #: wlb: when a queued outlier reaches its delay bound, release its queue-mates with it
    flush_on_force: bool = True
    #: wlb: a queue releases "global" (dp * n outliers, one per micro-batch) or "rank" (n) at a time
    release: ReleasePolicy = "global"
    #: wlb: a queue releases R outliers of similar length (including its oldest) rather than its R
    #: oldest, so a release does not mix e.g. 80K and 190K documents
    group_by_work: bool = True
    #: wlb: while pieces wait, every iteration trains on at least this fraction of the token budget
    #: (dp * n * seq_len): waiting pieces are released early (oldest first) to reach it; 0 = off
    min_fill: float = 0.5
    #: wlb: delay only when it pays: a queued outlier goes out as soon as the iteration's ordinary
    #: documents can balance it, rather than waiting for a group of R (docs/packing.md (i))
    release_when_balanced: bool = True
    #: wlb: every iteration trains at least this fraction of the token budget while the stream lasts:
    #: when delayed outliers leave room, ordinary documents are read ahead from the stream to fill it
    #: (they arrive at once, so no delay; later budgets read that much less); where that runs out of room
    #: for the outliers it would queue, waiting pieces are released early to reach it and the iteration
    #: is placed again; 0 = off
    fill_target: float = 0.95
    #: wlb: whether fill_target may read ahead of the iteration's budget; None = yes, except for
    #: Megatron's own samples in training (``--wlb-pieces concat-and-cut``), where it is off so that no
    #: sample is trained before the iteration Megatron's sampler gives it; false = never
    read_ahead: bool | None = None
    #: fixed-solver: HiGHS branch-and-bound nodes per window (0 = root node only); deterministic
    solver_nodes: int = 0
    #: fixed-solver: windows whose MILP has more integer columns (one per piece length and bin it
    #: may use) than this keep the greedy plan (a deterministic work bound: plans never depend on wall time)
    solver_max_columns: int = 20_000
    #: wlb: deal each iteration's micro-batches to DP ranks and order them within a rank to
    #: minimise the slowest rank's pipeline-schedule time (contents and delays unchanged)
    schedule_order: bool = True
    #: pipeline stages of the schedule objective; None = n (the paper's N = PP)
    pipeline_stages: int | None = None
    #: model chunks per stage (interleaved 1F1B when > 1) for the schedule objective
    virtual_stages: int = 1
    #: wlb: cut an outlier that reaches its delay bound without companions: "none" (default; no
    #: document that fits S_max is cut), "overlong" (only pieces of documents longer than S_max),
    #: "any" (any such outlier); cuts are counted and reported
    cut_policy: CutPolicy = "none"
    #: what the packers place: "documents" (each document whole, split only by the oversize policy:
    #: the paper's WLB-LLM) or "concat-and-cut" (the stream cut every seq_len tokens; in Megatron
    #: training, megatron-core's own GPTDataset samples as its sampler gives them, regrouped for balance)
    pieces: PieceSource = "documents"
    #: the cost model the packer balances: "static" (the configured one: analytic, or a calibrated
    #: profile) or "online" (start from it; in Megatron's loop, refit W(d) every refit_interval
    #: iterations from the run's own measured step times, agreed across ranks; docs/megatron.md)
    cost_model: CostModelPolicy = "static"
    #: online cost model: iterations between refits
    refit_interval: int = 10

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PackingConfig.{name} must be a positive integer, got {value!r}")

        positive_int("seq_len", self.seq_len)
        positive_int("n", self.n)
        positive_int("dp", self.dp)
        positive_int("window", self.window)
        positive_int("num_queues", self.num_queues)
        positive_int("virtual_stages", self.virtual_stages)
        positive_int("solver_max_columns", self.solver_max_columns)
        positive_int("refit_interval", self.refit_interval)
        if self.cost_model not in COST_MODEL_POLICIES:
            raise ValueError(f"cost_model={self.cost_model!r}; valid: {', '.join(COST_MODEL_POLICIES)}")
        if self.pipeline_stages is not None:
            positive_int("pipeline_stages", self.pipeline_stages)
        if self.virtual_stages > 1 and self.n % self.stages:
            raise ValueError(f"virtual_stages={self.virtual_stages} (interleaved 1F1B) needs n={self.n} divisible "
                             f"by pipeline_stages={self.stages}")
        if self.max_seq_len is not None:
            positive_int("max_seq_len", self.max_seq_len)
            if self.max_seq_len < self.seq_len:
                raise ValueError(f"max_seq_len={self.max_seq_len} is below seq_len={self.seq_len}; "
                                 "the variable-length capacity must be at least the fixed one")
        capacity = resolve_max_seq_len(self.seq_len, self.max_seq_len)
        if capacity > MAX_MICRO_BATCH_TOKENS:
            raise ValueError(f"max_seq_len={capacity} (seq_len={self.seq_len}): attention kernels index a "
                             f"micro-batch's tokens with int32, so at most {MAX_MICRO_BATCH_TOKENS} (2**31 - 1)")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize={self.oversize!r}; valid policies: {', '.join(OVERSIZE_POLICIES)}")
        if isinstance(self.max_delay, bool) or not isinstance(self.max_delay, int) or self.max_delay < 0:
            raise ValueError(f"max_delay must be a non-negative integer of iterations, got {self.max_delay!r}")
        frac = self.outlier_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not frac > 0:
            raise ValueError(f"outlier_fraction={frac!r}: must be a positive number (fraction of an ordinary "
                             "micro-batch's mean latency that makes a document an outlier)")
        if not isinstance(self.flush_on_force, bool):
            raise ValueError(f"flush_on_force={self.flush_on_force!r}: must be true or false")
        if not isinstance(self.group_by_work, bool):
            raise ValueError(f"group_by_work={self.group_by_work!r}: must be true or false")
        if isinstance(self.min_fill, bool) or not isinstance(self.min_fill, (int, float)) or \
                not 0 <= self.min_fill <= 1:
            raise ValueError(f"min_fill={self.min_fill!r}: must be a fraction of the token budget in [0, 1]")
        if isinstance(self.fill_target, bool) or not isinstance(self.fill_target, (int, float)) or \
                not 0 <= self.fill_target <= 1:
            raise ValueError(f"fill_target={self.fill_target!r}: must be a fraction of the token budget in [0, 1]")
        if not isinstance(self.release_when_balanced, bool):
            raise ValueError(f"release_when_balanced={self.release_when_balanced!r}: must be true or false")
        if not isinstance(self.schedule_order, bool):
            raise ValueError(f"schedule_order={self.schedule_order!r}: must be true or false")
        if self.release not in RELEASE_POLICIES:
            raise ValueError(f"release={self.release!r}: 'global' (dp * n outliers at a time) or 'rank' (n at a time)")
        if self.cut_policy not in CUT_POLICIES:
            raise ValueError(f"cut_policy={self.cut_policy!r}; valid policies: {', '.join(CUT_POLICIES)}")
        if self.pieces not in PIECE_SOURCES:
            raise ValueError(f"pieces={self.pieces!r}; valid: {', '.join(PIECE_SOURCES)}")
        if self.pieces == "concat-and-cut" and self.cut_policy != "none":
            raise ValueError(f"cut_policy={self.cut_policy!r} with pieces='concat-and-cut': concat-and-cut's pieces "
                             "are trained exactly as Megatron cuts them, so no further cut is allowed; use "
                             "cut_policy='none'")
        nodes = self.solver_nodes
        if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 0:
            raise ValueError(f"solver_nodes={nodes!r}: must be a non-negative integer (HiGHS branch-and-bound "
                             "nodes per window; 0 = root node only)")
        if self.queue_thresholds != "auto":
            th = tuple(self.queue_thresholds)
            if not th or any(not isinstance(t, (int, np.integer)) or t < 1 for t in th) or \
                    any(a >= b for a, b in zip(th, th[1:])):
                raise ValueError(f"queue_thresholds must be 'auto' or strictly increasing positive "
                                 f"integers, got {self.queue_thresholds!r}")
            object.__setattr__(self, "queue_thresholds", tuple(int(t) for t in th))

    @property
    def capacity_var(self) -> int:
        """The variable-length capacity S_max (``resolve_max_seq_len``: max_seq_len, default 1.5 x seq_len)."""
        return resolve_max_seq_len(self.seq_len, self.max_seq_len)

    def queue_threshold_problem(self) -> str | None:
        """Why the fixed queue thresholds cannot work (the largest exceeds S_max: no piece could reach
        that queue), or None. The wlb packer refuses such a config; the Megatron start-up check names it."""
        th = self.queue_thresholds
        cap = self.capacity_var
        if th == "auto" or th[-1] <= cap:
            return None
        return (f"{th[-1]} exceeds the wlb micro-batch capacity max_seq_len={cap}, so no piece can ever reach "
                f"that queue; use thresholds <= {cap} or 'auto'")

    @property
    def stages(self) -> int:
        """Pipeline stages of the schedule objective (``pipeline_stages``, default n)."""
        return self.n if self.pipeline_stages is None else self.pipeline_stages

    @property
    def micro_batches_per_iteration(self) -> int:
        return self.dp * self.n

    @property
    def tokens_per_iteration(self) -> int:
        return self.dp * self.n * self.seq_len
