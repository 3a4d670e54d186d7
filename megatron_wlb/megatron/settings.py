"""``WlbSettings``: the WLB-LLM options of one Megatron-LM run, read from Megatron's parsed args.

The flags (``--wlb-*``, see ``megatron_wlb.megatron.args``) land on Megatron's ``args`` namespace as
``wlb_*`` attributes; ``WlbSettings.from_args(args)`` turns them into one frozen, validated object
that every hook (data, CP, checkpoint, logging) reads. Torch-free and Megatron-free on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from megatron_wlb.packing.types import PackingConfig

PACKING_NAMES: tuple[str, ...] = ("original", "fixed-greedy", "fixed-solver", "wlb")

# The CP layouts megatron_wlb.cp.layouts provides; that module's LAYOUT_NAMES is authoritative when
# it is importable, this tuple is the fallback so that flags parse without it.
_FALLBACK_CP_SHARDINGS: tuple[str, ...] = ("per-sequence", "per-document", "per-document-te", "adaptive")


def cp_sharding_names() -> tuple[str, ...]:
    """The valid ``--wlb-cp-sharding`` values (``megatron_wlb.cp.layouts.LAYOUT_NAMES`` if present)."""
    try:
        from megatron_wlb.cp.layouts import LAYOUT_NAMES
    except ImportError:
        return _FALLBACK_CP_SHARDINGS
    names = tuple(LAYOUT_NAMES)
    # per-document-te is a Megatron-side choice (keep TE's own sharding and attention); it is valid
    # whether or not the layouts module lists it.
    return names if "per-document-te" in names else names + ("per-document-te",)


def parse_queue_thresholds(value: str | tuple[int, ...] | list[int]) -> str | tuple[int, ...]:
    """``"auto"`` or comma-separated increasing token counts (``"8192,32768"``) -> "auto" or a tuple."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        try:
            parsed = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
        except ValueError:
            raise ValueError(f"--wlb-queue-thresholds={value!r}: give 'auto' or comma-separated token counts "
                             "such as 8192,32768") from None
    else:
        parsed = tuple(int(t) for t in value)
    if not parsed or any(t < 1 for t in parsed) or any(a >= b for a, b in zip(parsed, parsed[1:])):
        raise ValueError(f"--wlb-queue-thresholds={value!r}: thresholds must be strictly increasing positive "
                         "token counts (L_1 < L_2 < ...), or 'auto'")
    return parsed


@dataclass(frozen=True)
class WlbSettings:
    """WLB-LLM options of one run; defaults are the paper's WLB-LLM setting.

    - ``packing``: PP-level packer (original = Megatron's concat-and-cut, fixed-greedy,
      fixed-solver, wlb = variable-length packing with outlier delay).
    - ``queue_thresholds`` / ``num_queues``: wlb's outlier queues (``"auto"`` derives them).
    - ``max_seq_len``: S_max, the variable-length micro-batch capacity (None = the packers' default,
      ``DEFAULT_MAX_SEQ_LEN_FACTOR`` x ``--seq-length``).
    - ``max_delay``: iterations a document may wait beyond its arrival.
    - ``window``: global batches the fixed packers balance together.
    - ``cp_sharding``: CP layout name (``cp_sharding_names()``).
    - ``cost_profile``: a calibrated cost-model profile JSON (None = analytic model).
    - ``config``: a ``configs/`` name or YAML path whose packing section supplies the defaults.
    - ``log_interval``: log the packing metrics every this many iterations.
    """

    packing: str = "wlb"
    queue_thresholds: str | tuple[int, ...] = "auto"
    num_queues: int = 2
    max_seq_len: int | None = None
    max_delay: int = PackingConfig.__dataclass_fields__["max_delay"].default
    window: int = 1
    cp_sharding: str = "adaptive"
    cost_profile: str | None = None
    config: str | None = None
    log_interval: int = 1

    def __post_init__(self) -> None:
        if self.packing not in PACKING_NAMES:
            raise ValueError(f"--wlb-packing={self.packing!r} is not a packer; choose one of "
                             f"{', '.join(PACKING_NAMES)}")
        object.__setattr__(self, "queue_thresholds", parse_queue_thresholds(self.queue_thresholds))
        names = cp_sharding_names()
        if self.cp_sharding not in names:
            raise ValueError(f"--wlb-cp-sharding={self.cp_sharding!r} is not a CP layout; choose one of "
                             f"{', '.join(names)}")
        for name, flag, minimum in (("num_queues", "--wlb-num-queues", 1), ("max_delay", "--wlb-max-delay", 0),
                                    ("window", "--wlb-window", 1), ("log_interval", "--wlb-log-interval", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{flag}={value!r}: must be an integer >= {minimum}")
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool)
                                             or not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"--wlb-max-seq-len={self.max_seq_len!r}: must be a positive token count "
                             "(or leave it unset to use --seq-length)")

    @classmethod
    def from_args(cls, args: Any) -> WlbSettings:
        """Build from Megatron's parsed ``args`` (its ``wlb_*`` attributes; missing ones keep defaults)."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            attr = f"wlb_{f.name}"
            if hasattr(args, attr) and getattr(args, attr) is not None:
                values[f.name] = getattr(args, attr)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (thresholds as a list), for logs and the checkpoint sidecar."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["queue_thresholds"] != "auto":
            out["queue_thresholds"] = list(out["queue_thresholds"])
        return out
