"""Named packer presets: the research toggles of ``PackingConfig`` set together, in one table.

A preset is a set of ``PackingConfig`` field values; a config's ``packing.preset`` (YAML), ``--wlb-preset``
(Megatron) or ``--preset`` (``wlb pack``) picks one, and any knob given explicitly overrides it. The
presets (docs/packing.md "Presets" lists what each sets and its benchmark row):

- ``default``: the package's packer, every extension on (``PackingConfig``'s defaults; the plans
  pinned by ``tests/data/packing_default_plans.json``).
- ``paper``: the paper's Algorithm 1 as published: a full queue releases its R oldest outliers, only as
  a group of R (``release: paper``), no fill rule (``fill: off``: an iteration reads its budget and no
  more), and the micro-batches run in placement order (``schedule_order: false``). What stays ours,
  since the paper gives no value or has no such bound: the automatic queue thresholds (a), the delay
  bound ``max_delay`` (b) with a forced outlier going out with its nearest queue-mates, the release of
  R = dp * n across the global batch (c) and S_max = 1.5 x seq_len.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any

from megatron_wlb.packing.types import PackingConfig

DEFAULT_PRESET = "default"
#: preset name -> the PackingConfig fields it sets (everything else keeps PackingConfig's default)
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "default": MappingProxyType({}),
    "paper": MappingProxyType({"release": "paper", "fill": "off", "schedule_order": False}),
})
PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)


def preset_values(name: str) -> dict[str, Any]:
    """The fields preset ``name`` sets; a one-line error naming the valid presets."""
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is not a packer preset; choose one of {', '.join(PRESET_NAMES)}")
    return dict(PRESETS[name])


def preset_default(name: str, field: str) -> Any:
    """Field ``field``'s value under preset ``name`` when not given explicitly."""
    values = preset_values(name)
    if field in values:
        return values[field]
    for f in fields(PackingConfig):
        if f.name == field:
            return f.default
    raise KeyError(field)


def with_preset(name: str, **explicit: Any) -> dict[str, Any]:
    """The PackingConfig keyword arguments of preset ``name`` with ``explicit`` knobs over it."""
    return {**preset_values(name), **explicit}


def preset_overrides(name: str, config: PackingConfig, names: Any = None) -> dict[str, Any]:
    """The knobs of ``config`` (among ``names``, default every field with a default) that differ from
    preset ``name``: what a config must state besides the preset's name."""
    out = {}
    for f in fields(PackingConfig):
        if (names is None or f.name in names) and f.name not in ("seq_len", "n"):
            value = getattr(config, f.name)
            if value != preset_default(name, f.name):
                out[f.name] = value
    return out
