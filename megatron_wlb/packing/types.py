"""Plans a packer emits: document pieces in micro-batches in global batches, and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

OversizePolicy = Literal["split", "drop", "error"]
OVERSIZE_POLICIES: tuple[str, ...] = ("split", "drop", "error")
#: S_max / seq_len when ``max_seq_len`` is None (docs/packing.md explains the choice).
DEFAULT_MAX_SEQ_LEN_FACTOR = 1.5


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
        return np.fromiter((p.length for p in self.pieces), dtype=np.int64, count=len(self.pieces))

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


@dataclass(frozen=True)
class PackingConfig:
    """Settings shared by every packer.

    - ``seq_len``: Megatron's ``--seq-length``; the fixed packers' micro-batch capacity and the
      token budget: every iteration reads ``dp * n * seq_len`` tokens of new documents (on
      average), so all packers consume the stream at the same rate.
    - ``n``: micro-batches per DP rank per iteration (the paper uses n = PP).
    - ``max_seq_len``: the variable-length packer's capacity (paper S_max); ``None`` means
      ``DEFAULT_MAX_SEQ_LEN_FACTOR`` (1.5) x seq_len: with exactly seq_len there is no slack to
      balance (the token budget fills every micro-batch), see docs/packing.md.
    - ``oversize``: documents longer than a packer's capacity are ``split`` into pieces of at most
      the capacity, ``drop``-ped (counted in ``Packer.dropped``), or rejected with an ``error``.
    - ``window``: the fixed packers balance ``window`` global batches at a time (paper: 1/2/4/8).
    - ``queue_thresholds``: wlb's outlier queue thresholds L_1 < ... < L_n, or ``"auto"``.
    - ``num_queues``: how many queues ``"auto"`` builds.
    - ``max_delay``: no document waits more than this many iterations beyond its arrival.
    - ``extra``: packer-specific knobs: ``outlier_fraction`` (wlb auto thresholds, default 0.7),
      ``solver_nodes`` (fixed-solver node limit, default 0).
    - ``solver_time_limit``: seconds the MILP solver may spend per window.
    """

    seq_len: int
    n: int
    dp: int = 1
    max_seq_len: int | None = None
    oversize: OversizePolicy = "split"
    window: int = 1
    queue_thresholds: tuple[int, ...] | Literal["auto"] = "auto"
    num_queues: int = 2
    max_delay: int = 8
    solver_time_limit: float = 1.0
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PackingConfig.{name} must be a positive integer, got {value!r}")

        positive_int("seq_len", self.seq_len)
        positive_int("n", self.n)
        positive_int("dp", self.dp)
        positive_int("window", self.window)
        positive_int("num_queues", self.num_queues)
        if self.max_seq_len is not None:
            positive_int("max_seq_len", self.max_seq_len)
            if self.max_seq_len < self.seq_len:
                raise ValueError(f"max_seq_len={self.max_seq_len} is below seq_len={self.seq_len}; "
                                 "the variable-length capacity must be at least the fixed one")
        if self.oversize not in OVERSIZE_POLICIES:
            raise ValueError(f"oversize={self.oversize!r}; valid policies: {', '.join(OVERSIZE_POLICIES)}")
        if isinstance(self.max_delay, bool) or not isinstance(self.max_delay, int) or self.max_delay < 0:
            raise ValueError(f"max_delay must be a non-negative integer of iterations, got {self.max_delay!r}")
        if not self.solver_time_limit > 0:
            raise ValueError(f"solver_time_limit must be positive seconds, got {self.solver_time_limit!r}")
        if self.queue_thresholds != "auto":
            th = tuple(self.queue_thresholds)
            if not th or any(not isinstance(t, (int, np.integer)) or t < 1 for t in th) or \
                    any(a >= b for a, b in zip(th, th[1:])):
                raise ValueError(f"queue_thresholds must be 'auto' or strictly increasing positive "
                                 f"integers, got {self.queue_thresholds!r}")
            object.__setattr__(self, "queue_thresholds", tuple(int(t) for t in th))

    @property
    def capacity_var(self) -> int:
        """The variable-length capacity (max_seq_len, defaulting to 1.5 x seq_len)."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return int(self.seq_len * DEFAULT_MAX_SEQ_LEN_FACTOR)

    @property
    def micro_batches_per_iteration(self) -> int:
        return self.dp * self.n

    @property
    def tokens_per_iteration(self) -> int:
        return self.dp * self.n * self.seq_len
