"""Run configurations: a model, a 4D layout, a window and packing/sharding choices, from YAML.

The shipped files live in the package (``megatron_wlb/configs/*.yaml``, the paper's Table 1
layouts), read through ``importlib.resources`` so they work from a wheel and stay editable in a
checkout; ``load_config`` takes a path or the stem of one of those files (``"7b_128k"``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import yaml

from megatron_wlb.costmodel import ModelShape, ParallelLayout, get_model
from megatron_wlb.packing.types import PackingConfig

#: the shipped configs (a Traversable: a plain folder in a checkout or an installed wheel)
CONFIG_DIR = resources.files("megatron_wlb") / "configs"
PACKER_NAMES = ("original", "fixed-greedy", "fixed-solver", "wlb")
_TOP_KEYS = {"name", "model", "seq_len", "layout", "micro_batches", "virtual_stages", "packing",
             "cp_sharding", "description"}
_PACKING_KEYS = {"packer", "max_seq_len", "queue_thresholds", "num_queues", "max_delay", "window",
                 "oversize", "solver_time_limit", "seed"}


@dataclass(frozen=True)
class RunConfig:
    """One training job's shape: what the simulator, the CLI and the Megatron adapter share."""

    name: str
    model: ModelShape
    layout: ParallelLayout
    seq_len: int
    packer: str
    packing: PackingConfig
    cp_sharding: str = "adaptive"
    virtual_stages: int = 1

    @property
    def micro_batches(self) -> int:
        return self.packing.n

    def with_packer(self, packer: str, **packing_overrides) -> RunConfig:
        """A copy with another packer and/or packing settings (for comparisons)."""
        if packer not in PACKER_NAMES:
            raise ValueError(f"unknown packer {packer!r}; choose one of {', '.join(PACKER_NAMES)}")
        return replace(self, packer=packer, packing=replace(self.packing, **packing_overrides))


def list_configs() -> list[str]:
    """Names of the shipped configs (``7b_128k``, ...)."""
    return sorted(p.name[:-5] for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(name_or_path: str | Path):
    """A user's YAML file, or the shipped config of that name (a Traversable with ``read_text``)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        if not path.is_file():
            raise ValueError(f"config {str(path)!r} is a directory, not a YAML file")
        return path
    candidate = CONFIG_DIR / f"{name_or_path}.yaml"
    if "/" not in str(name_or_path) and candidate.is_file():
        return candidate
    raise FileNotFoundError(f"no config {str(name_or_path)!r}: not a YAML file, and not one of "
                            f"{', '.join(list_configs()) or '(none found in ' + str(CONFIG_DIR) + ')'}")


def config_from_dict(raw: dict, source: str = "<dict>") -> RunConfig:
    """Validate a parsed config; every error names the key, the value and what is valid."""
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{source}: unknown keys {sorted(unknown)}; valid keys: {sorted(_TOP_KEYS)}")
    for key in ("model", "seq_len", "layout"):
        if key not in raw:
            raise ValueError(f"{source}: missing required key {key!r}")
    layout_raw = raw["layout"]
    if not isinstance(layout_raw, dict) or set(layout_raw) - {"tp", "cp", "pp", "dp"}:
        raise ValueError(f"{source}: layout must map tp/cp/pp/dp to integers, got {layout_raw!r}")
    layout = ParallelLayout(**layout_raw)
    model = get_model(raw["model"]) if isinstance(raw["model"], str) else ModelShape(**raw["model"])
    packing_raw = dict(raw.get("packing") or {})
    unknown = set(packing_raw) - _PACKING_KEYS
    if unknown:
        raise ValueError(f"{source}: unknown packing keys {sorted(unknown)}; valid: {sorted(_PACKING_KEYS)}")
    packer = packing_raw.pop("packer", "wlb")
    if packer not in PACKER_NAMES:
        raise ValueError(f"{source}: packing.packer={packer!r}; choose one of {', '.join(PACKER_NAMES)}")
    thresholds = packing_raw.pop("queue_thresholds", "auto")
    if thresholds != "auto":
        thresholds = tuple(thresholds)
    seq_len = raw["seq_len"]
    if isinstance(seq_len, int) and seq_len % (2 * layout.cp):
        raise ValueError(f"{source}: seq_len={seq_len} must be divisible by 2 x cp = {2 * layout.cp} "
                         "(Megatron asserts it)")
    packing = PackingConfig(seq_len=seq_len, n=raw.get("micro_batches", layout.pp), dp=layout.dp,
                            queue_thresholds=thresholds, **packing_raw)
    virtual = raw.get("virtual_stages", 1)
    if not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"{source}: virtual_stages must be a positive integer, got {virtual!r}")
    if virtual > 1 and packing.n % layout.pp:
        raise ValueError(f"{source}: interleaved 1F1B needs micro_batches ({packing.n}) divisible by pp ({layout.pp})")
    return RunConfig(name=raw.get("name", source), model=model, layout=layout, seq_len=seq_len,
                     packer=packer, packing=packing, cp_sharding=raw.get("cp_sharding", "adaptive"),
                     virtual_stages=virtual)


def load_config(name_or_path: str | Path) -> RunConfig:
    """The config of a shipped name or a YAML path; every error is one line naming the file."""
    path = resolve_config_path(name_or_path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"config {path}: not valid YAML{where} ({problem})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw.setdefault("name", path.name.rsplit(".", 1)[0])
    return config_from_dict(raw, source=str(path))
