"""Plans a packer emits: document pieces in micro-batches in global batches, and its settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

CutPolicy = Literal["split", "overlong", "any", "drop", "error"]
#: what is cut, one enum: (the oversize policy for documents longer than a packer's capacity, which forced
#: outliers wlb cuts: extension (g))
CUT_POLICIES: dict[str, tuple[str, str]] = {
    "split": ("split", "none"),        # a document over the capacity split into pieces; nothing else (default)
    "overlong": ("split", "overlong"),  # and wlb cuts a forced outlier that is a piece of such a document
    "any": ("split", "any"),           # and wlb cuts any forced outlier its group cannot balance
    "drop": ("drop", "none"),          # a document over the capacity dropped (counted)
    "error": ("error", "none"),        # a document over the capacity is an error
}
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


ReleasePolicy = Literal["balanced", "grouped", "oldest", "paper"]
#: wlb's release policies: (which R outliers a full queue releases, whether a queued outlier also goes out
#: alone once the iteration can balance it) -- the (e) x (i) switches of ``packing.wlb`` in one name
RELEASE_POLICIES: dict[str, tuple[bool, bool]] = {
    "balanced": (True, True),   # R of similar work, and any outlier the iteration can balance (default)
    "grouped": (True, False),   # R of similar work, only as a group of R
    "oldest": (False, True),    # the R oldest, and any outlier the iteration can balance
    "paper": (False, False),    # the R oldest, only as a group of R: the paper's Algorithm 1
}
#: wlb ``fill: full``: the intake's floor while it repays an overshoot (``PackingConfig.intake_fill``)
INTAKE_FILL = 0.5
FillPolicy = Literal["full", "read-ahead", "waiting", "off"]
#: wlb's fill policies: (read ordinary documents ahead to ``fill_target``, top up from waiting pieces to it)
FILL_POLICIES: dict[str, tuple[bool, bool]] = {
    "full": (True, True),          # read ahead, then top up from waiting pieces (default)
    "read-ahead": (True, False),   # read ahead only
    "waiting": (False, True),      # waiting pieces only, released early (the read-ahead off)
    "off": (False, False),         # no fill rule
}
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
    #: what is cut: "split" (a document longer than a packer's capacity is split into pieces; nothing that
    #: fits is cut: the default), "overlong" / "any" (split, and wlb also cuts a forced outlier its group
    #: cannot balance: only pieces of documents longer than S_max / any; counted), "drop" (a document over
    #: the capacity is dropped, counted), "error"
    cut: CutPolicy = "split"
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
    #: wlb: which queued outliers go out (R = dp * n at a time, one per micro-batch): "balanced" (R of
    #: similar length, and any outlier as soon as the iteration's ordinary documents can balance it),
    #: "grouped" (R of similar length only), "oldest" (the R oldest, and any outlier the iteration can
    #: balance), "paper" (the R oldest only: Algorithm 1); a forced outlier goes out with its nearest queue-mates
    release: ReleasePolicy = "balanced"
    #: wlb: how iterations are kept full while pieces wait: "full" (ordinary documents read ahead from the
    #: stream, then waiting pieces, until fill_target x the token budget; the iteration placed again),
    #: "read-ahead" (the read-ahead only), "waiting" (waiting pieces only, released early, oldest first),
    #: "off"
    fill: FillPolicy = "full"
    #: wlb: the fill policy's target: this fraction of the token budget (dp * n * seq_len) per iteration
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
    #: what the packers place: "documents" (each document whole, split only as ``cut`` says:
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
        if self.cut not in CUT_POLICIES:
            raise ValueError(f"cut={self.cut!r}; valid policies: {', '.join(CUT_POLICIES)}")
        if isinstance(self.max_delay, bool) or not isinstance(self.max_delay, int) or self.max_delay < 0:
            raise ValueError(f"max_delay must be a non-negative integer of iterations, got {self.max_delay!r}")
        frac = self.outlier_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not frac > 0:
            raise ValueError(f"outlier_fraction={frac!r}: must be a positive number (fraction of an ordinary "
                             "micro-batch's mean latency that makes a document an outlier)")
        if isinstance(self.fill_target, bool) or not isinstance(self.fill_target, (int, float)) or \
                not 0 <= self.fill_target <= 1:
            raise ValueError(f"fill_target={self.fill_target!r}: must be a fraction of the token budget in [0, 1]")
        if self.fill not in FILL_POLICIES:
            raise ValueError(f"fill={self.fill!r}; valid policies: {', '.join(FILL_POLICIES)}")
        if not isinstance(self.schedule_order, bool):
            raise ValueError(f"schedule_order={self.schedule_order!r}: must be true or false")
        if self.release not in RELEASE_POLICIES:
            raise ValueError(f"release={self.release!r}; valid policies: {', '.join(RELEASE_POLICIES)}")
        if self.pieces not in PIECE_SOURCES:
            raise ValueError(f"pieces={self.pieces!r}; valid: {', '.join(PIECE_SOURCES)}")
        if self.pieces == "concat-and-cut" and self.cut_policy != "none":
            raise ValueError(f"cut={self.cut!r} with pieces='concat-and-cut': concat-and-cut's pieces "
                             "are trained exactly as Megatron cuts them, so no further cut is allowed; use "
                             "cut='split'")
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
    def oversize(self) -> str:
        """A document longer than a packer's capacity: "split", "drop" or "error" (``cut``)."""
        return CUT_POLICIES[self.cut][0]

    @property
    def cut_policy(self) -> str:
        """wlb (g): which forced outliers are cut: "none", "overlong" or "any" (``cut``)."""
        return CUT_POLICIES[self.cut][1]

    @property
    def group_by_work(self) -> bool:
        """wlb (e): a full queue releases R outliers of similar length (with its oldest), not its R oldest."""
        return RELEASE_POLICIES[self.release][0]

    @property
    def release_when_balanced(self) -> bool:
        """wlb (i): a queued outlier also goes out as soon as the iteration can still be balanced with it."""
        return RELEASE_POLICIES[self.release][1]

    @property
    def read_ahead_fill(self) -> float:
        """wlb (h): the read-ahead's target fraction of the token budget (0 = no read-ahead fill)."""
        return self.fill_target if FILL_POLICIES[self.fill][0] else 0.0

    @property
    def waiting_fill(self) -> float:
        """wlb (f): the fraction of the token budget topped up from waiting pieces (0 = none)."""
        return self.fill_target if FILL_POLICIES[self.fill][1] else 0.0

    @property
    def intake_fill(self) -> float:
        """wlb (f), the intake side: after a document longer than the budget the intake is in debt; it
        still reads enough for the iteration to reach this fraction of the budget with what waits:
        ``fill_target`` with ``fill: waiting``, at most ``INTAKE_FILL`` with ``fill: full`` (the read-ahead
        fills the rest), 0 otherwise."""
        if self.fill == "waiting":
            return self.fill_target
        return min(INTAKE_FILL, self.fill_target) if self.fill == "full" else 0.0

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


def resolved_knobs(fp: Mapping[str, Any], seq_len: int | None = None) -> dict[str, Any]:
    """Knob values ``fp`` (a packer's settings fingerprint, a checkpoint's ``--wlb-*`` settings) with
    ``max_seq_len`` resolved (None = 1.5 x ``seq_len``, given or in ``fp``), so equal settings compare equal."""
    out = dict(fp)
    seq_len = out.get("seq_len", seq_len)
    if "max_seq_len" in out and out["max_seq_len"] is None and isinstance(seq_len, int):
        out["max_seq_len"] = resolve_max_seq_len(seq_len)
    return out
