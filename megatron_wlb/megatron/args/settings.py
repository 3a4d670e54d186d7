"""``WlbSettings``: the WLB-LLM options of one Megatron-LM run, read from Megatron's parsed args.

The flags (``--wlb-*``, see ``megatron_wlb.megatron.args.flags``) land on Megatron's ``args`` namespace as
``wlb_*`` attributes; ``WlbSettings.from_args(args)`` turns them into one frozen, validated object
that every hook (data, CP, checkpoint, logging) reads. Torch-free and Megatron-free on purpose.

The packer settings are not repeated here: they are the typed fields of ``PackingConfig``
(``megatron_wlb.config.PACKING_KNOBS``), so a field added there is a setting (``settings.<name>``) and a
YAML ``packing.<name>`` key without any list kept by hand; only those in ``USER_FLAGS`` (what a user
chooses) are ``--wlb-*`` flags too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from megatron_wlb.config import (
    PACKER_NAMES,
    PACKING_KNOBS,
    RUN_FIELDS,
    Knob,
    cp_sharding_names,
    knob_yaml_key,
)
from megatron_wlb.packing.presets import DEFAULT_PRESET, PRESET_NAMES, preset_default

__all__ = ["FLAG_KNOBS", "USER_FLAGS", "WlbSettings", "setting_source"]

#: the PackingConfig fields a WLB setting holds (the others come from Megatron's own flags)
FLAG_KNOBS: dict[str, Knob] = {k: v for k, v in PACKING_KNOBS.items() if k not in RUN_FIELDS}

#: the settings a user chooses, each a ``--wlb-*`` flag (megatron_wlb.megatron.args.flags); every other one (the
#: research knobs: queue thresholds, window, release, fill, ...) is a YAML key of ``--wlb-config`` or a preset's
USER_FLAGS: tuple[str, ...] = ("packer", "preset", "config", "cp_sharding", "pieces", "max_seq_len", "max_delay",
                               "cost_profile", "cost_model", "log_interval", "trace")


def setting_source(name: str) -> str:
    """Where a user sets ``name``: its ``--wlb-*`` flag, else its YAML key (errors name it)."""
    if name in USER_FLAGS:
        return "--wlb-" + name.replace("_", "-")
    return knob_yaml_key(name) if name in FLAG_KNOBS else name


@dataclass(frozen=True, init=False)
class WlbSettings:
    """WLB-LLM options of one run; defaults are the package's (the ``default`` preset; ``paper`` is the
    paper's Algorithm 1, docs/packing.md "Presets").

    - ``packer``: PP-level packer (original = Megatron's concat-and-cut, fixed-greedy,
      fixed-solver, wlb = variable-length packing with outlier delay).
    - ``preset``: the packer preset the knobs start from (default, paper); a knob given explicitly wins.
    - ``cp_sharding``: CP layout of each micro-batch (docs/cp.md).
    - ``cost_profile``: a calibrated cost-model profile JSON written by ``wlb calibrate`` (None = analytic model).
    - ``config``: a shipped config name or YAML path whose packing, cp, cost and logging sections supply the
      defaults (its run shape is checked against Megatron's flags; a settings file, those sections alone,
      serves a run of any shape).
    - ``log_interval``: log the packing metrics (and the measured ones) every this many iterations.
    - ``trace``: write a per-micro-batch timing trace, one JSON-lines file per rank (PATH-rank00000.jsonl,
      ...), for `wlb calibrate --from-trace` (None = no trace; the measured metrics are logged either way).
    - ``sft_samples``: with ``--sft``, ``megatron`` (Megatron's ``SFTDataset`` samples, regrouped by work) or
      ``whole`` (every conversation a document, none dropped); YAML ``sft.samples`` (docs/sft.md).

    Every ``PackingConfig`` knob (``FLAG_KNOBS``: ``max_seq_len``, ``queue_thresholds``,
    ``max_delay``, ...) is an attribute too; only values that differ from the preset's are stored
    (``packer_knobs``), so settings compare equal when they mean the same.
    """

    packer: str = "wlb"
    preset: str = DEFAULT_PRESET
    cp_sharding: str = "adaptive"
    cost_profile: str | None = None
    config: str | None = None
    log_interval: int = 1
    trace: str | None = None
    sft_samples: str = "megatron"
    packer_knobs: tuple[tuple[str, Any], ...] = ()

    def __init__(self, packer: str = "wlb", preset: str = DEFAULT_PRESET, cp_sharding: str = "adaptive",
                 cost_profile: str | None = None, config: str | None = None, log_interval: int = 1,
                 trace: str | None = None, sft_samples: str = "megatron", packer_knobs: tuple = (),
                 **knobs: Any) -> None:
        for name, value in (("packer", packer), ("preset", preset), ("cp_sharding", cp_sharding),
                            ("cost_profile", cost_profile), ("config", config), ("log_interval", log_interval),
                            ("trace", trace), ("sft_samples", sft_samples)):
            object.__setattr__(self, name, value)
        if preset not in PRESET_NAMES:
            raise ValueError(f"--wlb-preset={preset!r} is not a packer preset; choose one of {', '.join(PRESET_NAMES)}")
        knobs = {**dict(packer_knobs), **knobs}  # packer_knobs: what dataclasses.replace passes back
        unknown = sorted(set(knobs) - set(FLAG_KNOBS))
        if unknown:
            raise ValueError(f"unknown WLB setting(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(f.name for f in fields(self) if f.name != 'packer_knobs')}, "
                             f"{', '.join(FLAG_KNOBS)}")
        parsed = {}
        for name, value in knobs.items():
            knob = FLAG_KNOBS[name]
            value = knob.parse(value, setting_source(name))
            if value != preset_default(preset, name):
                parsed[name] = value
        object.__setattr__(self, "packer_knobs", tuple(sorted(parsed.items())))
        self._validate()

    def _validate(self) -> None:
        if self.packer not in PACKER_NAMES:
            raise ValueError(f"--wlb-packer={self.packer!r} is not a packer; choose one of "
                             f"{', '.join(PACKER_NAMES)}")
        names = cp_sharding_names()
        if self.cp_sharding not in names:
            raise ValueError(f"--wlb-cp-sharding={self.cp_sharding!r} is not a CP layout; choose one of "
                             f"{', '.join(names)}")
        value = self.log_interval
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--wlb-log-interval={value!r}: must be an integer >= 1")
        if self.sft_samples not in ("megatron", "whole"):
            raise ValueError(f"sft.samples={self.sft_samples!r}: choose megatron (Megatron's SFTDataset samples) or "
                             "whole (every conversation a document)")

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are not fields: the packer knobs
        if name in FLAG_KNOBS:
            return dict(object.__getattribute__(self, "packer_knobs")).get(
                name, preset_default(object.__getattribute__(self, "preset"), name))
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def knob_values(self) -> dict[str, Any]:
        """Every packer knob's value (the stored ones and PackingConfig's defaults)."""
        return {name: getattr(self, name) for name in FLAG_KNOBS}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting: the own fields, then the packer knobs."""
        return tuple(f.name for f in fields(cls) if f.name != "packer_knobs") + tuple(FLAG_KNOBS)

    @classmethod
    def from_args(cls, args: Any) -> WlbSettings:
        """Build from Megatron's parsed ``args`` (its ``wlb_*`` attributes; missing ones keep defaults)."""
        values: dict[str, Any] = {}
        for name in cls.names():
            value = getattr(args, f"wlb_{name}", None)  # our own flags, by name
            if value is not None:
                values[name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (tuples as lists), for logs and the checkpoint sidecar."""
        out = {name: getattr(self, name) for name in self.names()
               if name != "sft_samples" or self.sft_samples != "megatron"}  # as checkpoints before the key
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
