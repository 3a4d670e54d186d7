"""Run configurations: a model, a 4D layout, a window and packing/sharding choices, from YAML.

The shipped files live in the package (``configs/*.yaml``, the paper's Table 1
layouts), read through ``importlib.resources`` so they work from a wheel and stay editable in a
checkout; ``load_config`` takes a path or the stem of one of those files (``"7b_128k"``).
"""

from __future__ import annotations

import inspect
import math
import re
import types
import typing
from collections.abc import Collection
from dataclasses import MISSING, dataclass, fields, replace
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any, Literal

from megatron_wlb.costmodel import MODELS, ModelShape, ParallelLayout, check_expert_layout, get_model
from megatron_wlb.packing.base import PACKERS
from megatron_wlb.packing.presets import DEFAULT_PRESET, PRESET_NAMES, preset_default, preset_overrides, with_preset
from megatron_wlb.packing.types import PackingConfig
from megatron_wlb.requirements import require


def shipped_config_dir() -> Traversable:
    """Where the shipped configs are: ``megatron_wlb/configs`` in an installed wheel (setup.py maps the
    checkout's top-level ``configs/`` there), else the checkout's ``configs/`` (source tree, editable install)."""
    installed = resources.files("megatron_wlb") / "configs"
    if installed.is_dir():
        return installed
    return resources.files("megatron_wlb").joinpath("..", "configs")


#: the shipped configs (a Traversable: the checkout's top-level configs/, or the installed wheel's copy)
CONFIG_DIR = shipped_config_dir()
#: the packers, from the registry (``packing.base.register_packer``)
PACKER_NAMES: tuple[str, ...] = tuple(PACKERS)
#: the run shape (top level: never a --wlb-* flag; Megatron's own flags in training), then the sections
_RUN_SHAPE_KEYS = ("name", "description", "model", "seq_len", "layout", "micro_batches", "virtual_stages")
_SECTIONS = ("packing", "cp", "cost", "logging", "sft")
_TOP_KEYS = (*_RUN_SHAPE_KEYS, *_SECTIONS)
#: PackingConfig fields that describe the run, not a packing choice: set from the config's top level
#: (seq_len, micro_batches, layout.dp) or, under Megatron, from its own flags (--seq-length,
#: --global-batch-size, DP, --seed); never a ``--wlb-*`` flag
RUN_FIELDS = {"seq_len": "--seq-length", "n": "--global-batch-size", "dp": "the data-parallel size",
              "seed": "--seed", "pipeline_stages": "--pipeline-model-parallel-size (layout.pp)",
              "virtual_stages": "--num-virtual-stages-per-pipeline-rank (virtual_stages)"}


# -- knobs: typed dataclass fields as YAML keys and command-line flags ------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """``name -> text``: the ``- ``name``: text`` bullets of a dataclass docstring (the help text), else the
    ``#:`` comment lines right above the field in the class body."""
    docs = _docstring_bullets(cls)
    try:
        source = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return docs
    comment: list[str] = []
    for line in source:
        stripped = line.strip()
        if stripped.startswith("#:"):
            comment.append(stripped[2:].strip())
            continue
        m = re.match(r"([a-z_][a-z0-9_]*)\s*:", stripped)
        if m and comment and m.group(1) not in docs:
            text = " ".join(comment).replace("``", "`")
            docs[m.group(1)] = text if text.endswith(".") else text + "."
        comment = []
    return docs


def _docstring_bullets(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    current = None
    for line in (cls.__doc__ or "").splitlines():
        m = re.match(r"\s*- ``([a-z_]+)``(?: / ``[a-z_]+``)*: (.*)", line)
        if m:
            current = m.group(1)
            docs[current] = m.group(2).strip()
            for other in re.findall(r"``([a-z_]+)``", line.split(":", 1)[0])[1:]:
                docs.setdefault(other, docs[current])
        elif current and line.strip() and not line.strip().startswith("-") and line.startswith("      "):
            docs[current] += " " + line.strip()
        else:
            current = None
    return {k: v.replace("``", "`") for k, v in docs.items()}


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "none"
    if origin in (typing.Union, types.UnionType):
        alts = sorted(typing.get_args(hint), key=lambda a: typing.get_origin(a) is not Literal)
        return " or ".join(_describe(a) for a in alts)
    if origin is Literal:
        return ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is tuple:
        return "comma-separated integers (e.g. 8192,32768)"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _parse(hint: Any, value: Any) -> Any:
    """``value`` (from YAML, or a command-line string) as ``hint``; ValueError if it is not one."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        raise ValueError
    if origin in (typing.Union, types.UnionType):
        for alt in sorted(typing.get_args(hint), key=lambda a: typing.get_origin(a) is not Literal):
            try:
                return _parse(alt, value)
            except ValueError:
                continue
        raise ValueError
    if origin is Literal:
        for option in typing.get_args(hint):
            if value == option or (isinstance(value, str) and value.strip() == str(option)):
                return option
        raise ValueError
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.strip().lower() in ("true", "yes", "1")
        raise ValueError
    if hint is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
            return int(value)
        raise ValueError
    if hint is float:
        if isinstance(value, bool):
            raise ValueError
        number = float(value) if isinstance(value, (int, float, str)) else math.nan
        if not math.isfinite(number):
            raise ValueError
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if origin is tuple:
        items = value.replace(" ", "").split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise ValueError
        (item_hint, *_) = typing.get_args(hint)
        return tuple(_parse(item_hint, x) for x in items)
    raise ValueError


@dataclass(frozen=True)
class Knob:
    """One typed dataclass field as a YAML key (``name``) and a command-line flag (``--prefix-name``)."""

    owner: type
    name: str
    hint: Any
    default: Any
    help: str

    def flag(self, prefix: str = "--wlb-") -> str:
        return prefix + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple | None:
        """The allowed values when the type is a plain ``Literal`` (argparse ``choices``)."""
        return typing.get_args(self.hint) if typing.get_origin(self.hint) is Literal else None

    @property
    def expects(self) -> str:
        return _describe(self.hint)

    def convert(self, value: Any, where: str) -> Any:
        """``value`` as the field's type, without range checks (argparse's ``type=``)."""
        try:
            return _parse(self.hint, value)
        except (ValueError, TypeError, OverflowError):
            raise ValueError(f"{where}={value!r}: give {self.expects}") from None

    def parse(self, value: Any, where: str) -> Any:
        """``value`` converted to the field's type, validated by the owner dataclass when it can be
        alone (``PackingConfig`` ranges); the error names ``where`` (a flag or a YAML key)."""
        parsed = self.convert(value, where)
        if self.owner is PackingConfig:
            try:
                PackingConfig(seq_len=1, n=1, **{self.name: parsed})
            except ValueError as exc:
                raise ValueError(f"{where}={value!r}: {exc}") from None
        return parsed


def dataclass_knobs(cls: type, exclude: Collection[str] = ()) -> dict[str, Knob]:
    """Every field of dataclass ``cls`` (but ``exclude`` and dict-typed ones) as a ``Knob``, in order.

    Adding a typed field to the dataclass adds its YAML key and its flag: nothing else lists them.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        if f.name in exclude or hint is dict or typing.get_origin(hint) is dict:
            continue
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else None)
        out[f.name] = Knob(cls, f.name, hint, default, docs.get(f.name, ""))
    return out


#: the packer settings a config's ``packing:`` section and the ``--wlb-*`` flags may set
PACKING_KNOBS: dict[str, Knob] = dataclass_knobs(PackingConfig, exclude=set(RUN_FIELDS) - {"seed"})

#: Megatron-LM's argument names for a model shape (``hidden_size`` ...) -> ``ModelShape`` fields
MEGATRON_MODEL_KEYS = {"hidden_size": "hidden", "num_attention_heads": "num_heads",
                       "num_query_groups": "num_kv_heads", "ffn_hidden_size": "ffn_hidden", "vocab_size": "vocab",
                       "padded_vocab_size": "vocab", "moe_router_topk": "moe_topk",
                       "moe_ffn_hidden_size": "moe_ffn_hidden",
                       "moe_shared_expert_intermediate_size": "moe_shared_expert_hidden",
                       "moe_expert_capacity_factor": "moe_capacity_factor"}
#: Megatron-LM model flags the cost model cannot price: a config or a run that sets them is refused
UNSUPPORTED_MODEL_KEYS = {"multi_latent_attention": "multi-latent attention (MLA, --multi-latent-attention) is not "
                                                    "priced by the cost model; use standard attention (GQA/MHA)"}


#: the Megatron-LM flags ``megatron_moe_fields`` reads
MOE_READ_KEYS = (*UNSUPPORTED_MODEL_KEYS, "kv_channels", "num_attention_heads", "hidden_size", "num_experts",
                 "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                 "moe_expert_capacity_factor", "moe_layer_freq")


def megatron_moe_fields(args: Any) -> dict[str, Any]:
    """The ``ModelShape`` fields beyond the dense ones from a Megatron-LM argument namespace: the MoE flags
    (``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
    ``--moe-shared-expert-intermediate-size``, ``--moe-layer-freq``, ``--moe-expert-capacity-factor``) and
    ``--kv-channels`` where it is not ``hidden / heads``; refuses the flags the cost model cannot price
    (``UNSUPPORTED_MODEL_KEYS``) in one line. A dense run gives ``{}``."""
    # the flags read, each None where args lack it (--moe-layer-freq: 1, Megatron's default)
    given: dict[str, Any] = {key: getattr(args, key, 1 if key == "moe_layer_freq" else None) for key in MOE_READ_KEYS}
    for key, why in UNSUPPORTED_MODEL_KEYS.items():
        if given[key]:
            raise ValueError(f"--{key.replace('_', '-')}: {why}")
    out: dict[str, Any] = {}
    kv, heads, hidden = given["kv_channels"], given["num_attention_heads"], given["hidden_size"]
    if kv and heads and hidden and int(kv) * int(heads) != int(hidden):
        out["kv_channels"] = int(kv)
    if not given["num_experts"]:
        return out
    out["num_experts"] = int(given["num_experts"])
    for megatron, name in (("moe_router_topk", "moe_topk"), ("moe_ffn_hidden_size", "moe_ffn_hidden"),
                           ("moe_shared_expert_intermediate_size", "moe_shared_expert_hidden"),
                           ("moe_expert_capacity_factor", "moe_capacity_factor")):
        value = given[megatron]
        if value is not None:
            out[name] = value
    freq = given["moe_layer_freq"]
    out["moe_layer_freq"] = tuple(int(f) for f in freq) if isinstance(freq, (list, tuple)) else int(freq)
    return out


def model_from_yaml(raw: Any, source: str) -> ModelShape:
    """A shipped model name, or a mapping with ``ModelShape`` fields or Megatron-LM's argument names."""
    if isinstance(raw, str):
        if raw not in MODELS:
            raise ValueError(f"{source}: model {raw!r} is not a shipped shape ({', '.join(MODELS)}); give one "
                             "of those or a mapping of the model's sizes")
        return get_model(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: model must be a name ({', '.join(MODELS)}) or a mapping, got {raw!r}")
    knobs = dataclass_knobs(ModelShape)
    values: dict[str, Any] = {"name": "custom"}
    for key, value in raw.items():
        if key in UNSUPPORTED_MODEL_KEYS:
            if value:
                raise ValueError(f"{source}: model.{key}={value!r}: {UNSUPPORTED_MODEL_KEYS[key]}")
            continue
        name = MEGATRON_MODEL_KEYS.get(key, key)
        if name not in knobs:
            raise ValueError(f"{source}: unknown model key {key!r}; valid: {', '.join(knobs)} (or Megatron's "
                             f"{', '.join(MEGATRON_MODEL_KEYS)})")
        if name in values and name != "name":
            raise ValueError(f"{source}: model key {key!r} sets {name!r} twice")
        values[name] = knobs[name].parse(value, f"model.{key}")
    if "num_kv_heads" not in values and "num_heads" in values:
        values["num_kv_heads"] = values["num_heads"]  # Megatron: no --num-query-groups = no GQA
    if "vocab" not in values:
        values["vocab"] = 32000
    required = {f.name for f in fields(ModelShape) if f.default is MISSING and f.default_factory is MISSING}
    missing = [k for k in knobs if k not in values and k in required]
    if missing:
        megatron = [m for m, f in MEGATRON_MODEL_KEYS.items() if f in missing and m != "padded_vocab_size"]
        raise ValueError(f"{source}: model is missing {', '.join(missing)}"
                         + (f" (Megatron names: {', '.join(megatron)})" if megatron else ""))
    try:
        return ModelShape(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: model: {exc}") from None


@dataclass(frozen=True)
class CpConfig:
    """The ``cp`` section: how each micro-batch is laid out over its CP ranks.

    - ``sharding``: the CP layout (docs/cp.md), or ``dynamic``: a CP group size and ranks per micro-batch over
      the DP x CP ranks (``cp.dynamic``; trains at any PP, planned and simulated at PP 1); ``--wlb-cp-sharding``,
      ``wlb simulate/shard --cp-sharding``.
    """

    sharding: str = "adaptive"


@dataclass(frozen=True)
class CostConfig:
    """The ``cost`` section: the cost model W(d) the packer and CP layouts balance.

    - ``profile``: a calibrated cost-model profile JSON (``wlb calibrate``; None = the analytic model);
      ``--wlb-cost-profile``, ``wlb ... --cost-profile``.

    The section's ``model`` (static / online) and ``refit_interval`` keys are the packer's
    ``PackingConfig.cost_model`` and ``refit_interval`` (``--wlb-cost-model``, YAML ``cost.refit_interval``;
    ``KNOB_SECTIONS``): the packer holds them, as it refits.
    """

    profile: str | None = None


@dataclass(frozen=True)
class LoggingConfig:
    """The ``logging`` section (Megatron training).

    - ``log_interval``: log the packing metrics every this many iterations; ``--wlb-log-interval``.
    - ``trace``: a per-micro-batch timing trace, one JSON-lines file per rank; ``--wlb-trace``.
    """

    log_interval: int = 1
    trace: str | None = None


@dataclass(frozen=True)
class SftConfig:
    """The ``sft`` section (``--sft`` training, docs/sft.md).

    - ``samples``: ``megatron`` trains exactly Megatron's ``SFTDataset`` samples (each jsonl line packed into
      ``--seq-length``: a conversation's last label the next one's first token, a line over the window cut and
      its later conversations dropped), regrouped by work; ``whole`` makes every conversation a document of its
      own (none dropped, each cut only at ``--seq-length``), counted and said at start-up.
    """

    samples: Literal["megatron", "whole"] = "megatron"


#: packer knobs (PackingConfig fields, ``--wlb-<field>`` flags) whose YAML key is in another section than
#: ``packing``: field -> (section, key); the cost model the packer balances is the cost section's
KNOB_SECTIONS: dict[str, tuple[str, str]] = {"cost_model": ("cost", "model"),
                                             "refit_interval": ("cost", "refit_interval")}


def knob_yaml_key(name: str) -> str:
    """The YAML key of packer knob ``name``: ``packing.<name>``, or its section's (``KNOB_SECTIONS``)."""
    section, key = KNOB_SECTIONS.get(name, ("packing", name))
    return f"{section}.{key}"


def knob_yaml(name: str, value: Any) -> dict[str, dict[str, Any]]:
    """The config mapping that sets packer knob ``name`` to ``value`` (``{"packing": {name: value}}``, ...)."""
    section, key = KNOB_SECTIONS.get(name, ("packing", name))
    return {section: {key: value}}


#: section key -> the WlbSettings field and ``--wlb-*`` flag it is (the flag drops ``--wlb-`` and ``-`` -> ``_``)
SECTION_SETTINGS: dict[tuple[str, str], str] = {("cp", "sharding"): "cp_sharding",
                                                 ("cost", "profile"): "cost_profile",
                                                 ("logging", "log_interval"): "log_interval",
                                                 ("logging", "trace"): "trace",
                                                 ("sft", "samples"): "sft_samples"}


@dataclass(frozen=True)
class RunConfig:
    """One training job: the run shape (top level), then the packing, CP, cost and logging sections.

    What the simulator, the CLI and the Megatron adapter share; frozen, validated by ``config_from_dict``.
    """

    name: str
    model: ModelShape
    layout: ParallelLayout
    seq_len: int
    packer: str
    packing: PackingConfig
    virtual_stages: int = 1
    #: the packer preset ``packing`` starts from (``packing.presets``); its other knobs were given explicitly
    preset: str = DEFAULT_PRESET
    cp: CpConfig = CpConfig()
    cost: CostConfig = CostConfig()
    logging: LoggingConfig = LoggingConfig()
    sft: SftConfig = SftConfig()

    @property
    def cp_sharding(self) -> str:
        """The CP layout (``cp.sharding``)."""
        return self.cp.sharding

    def settings(self) -> dict[str, Any]:
        """The cp / cost / logging sections as WlbSettings fields (``SECTION_SETTINGS``), those not default."""
        return _section_settings(self)

    def packing_overrides(self) -> dict[str, Any]:
        """The packer knobs this config sets beyond its preset (what ``--wlb-*`` flags must restate)."""
        return preset_overrides(self.preset, self.packing, PACKING_KNOBS)

    def under_preset(self, preset: str, **knobs: Any) -> RunConfig:
        """A copy under packer preset ``preset``: the knobs this config set explicitly, then ``knobs``, over it."""
        if preset not in PRESET_NAMES:
            raise ValueError(f"preset {preset!r} is not a packer preset; choose one of {', '.join(PRESET_NAMES)}")
        values = {name: preset_default(preset, name) for name in PACKING_KNOBS}
        return replace(self, preset=preset,
                       packing=replace(self.packing, **{**values, **self.packing_overrides(), **knobs}))

    @property
    def micro_batches(self) -> int:
        return self.packing.n

    def with_virtual_stages(self, virtual_stages: int) -> RunConfig:
        """A copy under another pipeline schedule (1 = 1F1B, > 1 = interleaved 1F1B), for the simulator
        and for the packer's schedule objective alike (``packing.virtual_stages``)."""
        return replace(self, virtual_stages=virtual_stages,
                       packing=replace(self.packing, virtual_stages=virtual_stages))

    def dense_counterpart(self) -> RunConfig:
        """The same job with the dense model of equal active parameters (``ModelShape.dense_counterpart``)
        and no expert parallelism: what an MoE config is compared against; a dense config is its own."""
        if not self.model.is_moe:
            return self
        return replace(self, name=f"{self.name}-dense", model=self.model.dense_counterpart(),
                       layout=replace(self.layout, ep=1))

    def with_packer(self, packer: str, **packing_overrides: Any) -> RunConfig:
        """A copy with another packer and/or packing settings (for comparisons)."""
        if packer not in PACKERS:
            raise ValueError(f"unknown packer {packer!r}; choose one of {', '.join(PACKER_NAMES)}")
        return replace(self, packer=packer, packing=replace(self.packing, **packing_overrides))


def list_configs() -> list[str]:
    """Names of the shipped configs (``7b_128k``, ...)."""
    return sorted(p.name[:-5] for p in CONFIG_DIR.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(name_or_path: str | Path) -> Path | Traversable:
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


def cp_sharding_names() -> tuple[str, ...]:
    """The CP shardings a config or ``--wlb-cp-sharding`` may name: the layouts inside a fixed CP group
    (``cp.layouts.LAYOUT_NAMES``), then ``dynamic`` (a CP group per micro-batch over the DP x CP ranks,
    ``cp.dynamic``)."""
    from megatron_wlb.cp.dynamic import DYNAMIC_SHARDING
    from megatron_wlb.cp.layouts import LAYOUT_NAMES

    layouts = tuple(LAYOUT_NAMES) if "per-document-te" in LAYOUT_NAMES else (*LAYOUT_NAMES, "per-document-te")
    return (*layouts, DYNAMIC_SHARDING)


#: the largest world (tp x cp x pp x dp) and micro-batches per DP rank per iteration a config may ask for
MAX_WORLD = 1 << 20
MAX_MICRO_BATCHES = 4096


def _positive_int(value: Any, where: str, at_most: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}={value!r}: must be a positive integer")
    if at_most is not None and value > at_most:
        raise ValueError(f"{where}={value!r}: must be at most {at_most}")
    return value


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` refusing a mapping with a key given twice (YAML would keep the last); merge keys
    (``<<: *base``) work as in plain PyYAML, a key given beside them overriding the merged one. pyyaml is
    imported here, on first use (``require`` names what to install)."""
    yaml = require("yaml", "reading a YAML config")

    class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[name-defined]
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # ``<<``: SafeLoader's flatten_mapping merges it (explicit keys win)
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    mark = key_node.start_mark
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (line {mark.line + 1}); give each key once", mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _section(cls: type, raw: Any, name: str, source: str, knob_keys: Collection[str] = ()) -> tuple[Any, dict]:
    """Section ``name`` (a mapping of ``cls``'s fields, and of the packer knobs ``knob_keys`` that live in it,
    ``KNOB_SECTIONS``) as (a ``cls``, {PackingConfig field: value}); one-line errors naming the key."""
    if raw is None:
        return cls(), {}
    knobs = dataclass_knobs(cls)
    valid = (*knobs, *knob_keys)
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: {name} must be a mapping of {', '.join(valid)}, got {raw!r}")
    unknown = [k for k in raw if k not in valid]
    if unknown:
        raise ValueError(f"{source}: unknown {name} key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    fields_of = {key: field for field, (section, key) in KNOB_SECTIONS.items() if section == name}
    packer_knobs = {fields_of[k]: PACKING_KNOBS[fields_of[k]].parse(v, f"{source}: {name}.{k}")
                    for k, v in raw.items() if k in knob_keys}
    return cls(**{k: knobs[k].parse(v, f"{source}: {name}.{k}") for k, v in raw.items() if k in knobs}), packer_knobs


@dataclass(frozen=True)
class RunChoices:
    """The packing, cp, cost and logging sections of a config: what a run chooses, whatever its shape.

    A YAML of these sections alone (no ``model``, ``seq_len``, ``layout``) is a settings file: ``--wlb-config``
    takes one for a run of any shape (Megatron's flags give it), the home of the knobs that are not flags.
    """

    name: str
    packer: str = "wlb"
    preset: str = DEFAULT_PRESET
    #: the packer knobs the sections give explicitly (PackingConfig fields), sorted
    knobs: tuple[tuple[str, Any], ...] = ()
    cp: CpConfig = CpConfig()
    cost: CostConfig = CostConfig()
    logging: LoggingConfig = LoggingConfig()
    sft: SftConfig = SftConfig()

    def settings(self) -> dict[str, Any]:
        """The cp / cost / logging sections as WlbSettings fields (``SECTION_SETTINGS``), those not default."""
        return _section_settings(self)

    def packing_overrides(self) -> dict[str, Any]:
        """The packer knobs these sections set beyond their preset."""
        return {name: value for name, value in self.knobs if value != preset_default(self.preset, name)}


def _section_settings(config: Any) -> dict[str, Any]:
    out = {}
    for (section, key), name in SECTION_SETTINGS.items():
        record = getattr(config, section)
        value = getattr(record, key)
        if value != getattr(type(record)(), key):
            out[name] = value
    return out


def choices_from_dict(raw: dict, source: str = "<dict>") -> RunChoices:
    """The packing, cp, cost and logging sections of a parsed config; one-line errors naming the key."""
    packing_raw = raw.get("packing") or {}
    if not isinstance(packing_raw, dict):
        raise ValueError(f"{source}: packing must be a mapping of packer settings, got {packing_raw!r}")
    valid = ("packer", "preset", *(k for k in PACKING_KNOBS if k not in KNOB_SECTIONS))
    for key in packing_raw:
        if key in KNOB_SECTIONS:
            raise ValueError(f"{source}: packing.{key} moved to {knob_yaml_key(key)} (the cost section)")
    unknown = [k for k in packing_raw if k not in valid]
    if unknown:
        raise ValueError(f"{source}: unknown packing key(s) {', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    packer = packing_raw.get("packer", "wlb")
    if packer not in PACKERS:
        raise ValueError(f"{source}: packing.packer={packer!r}; choose one of {', '.join(PACKER_NAMES)}")
    preset = packing_raw.get("preset", DEFAULT_PRESET)
    if preset not in PRESET_NAMES:
        raise ValueError(f"{source}: packing.preset={preset!r}; choose one of {', '.join(PRESET_NAMES)}")
    cost, cost_knobs = _section(CostConfig, raw.get("cost"), "cost", source,
                                [key for section, key in KNOB_SECTIONS.values() if section == "cost"])
    knobs = {**{k: PACKING_KNOBS[k].parse(v, f"{source}: packing.{k}")
                for k, v in packing_raw.items() if k not in ("packer", "preset")}, **cost_knobs}
    cp, _ = _section(CpConfig, raw.get("cp"), "cp", source)
    if cp.sharding not in cp_sharding_names():
        raise ValueError(f"{source}: cp.sharding={cp.sharding!r} is not a CP layout; choose one of "
                         f"{', '.join(cp_sharding_names())}")
    logging, _ = _section(LoggingConfig, raw.get("logging"), "logging", source)
    _positive_int(logging.log_interval, f"{source}: logging.log_interval")
    sft, _ = _section(SftConfig, raw.get("sft"), "sft", source)
    return RunChoices(name=str(raw.get("name", source)), packer=packer, preset=preset,
                      knobs=tuple(sorted(knobs.items())), cp=cp, cost=cost, logging=logging, sft=sft)


def _refuse_unknown_keys(raw: dict, source: str, valid: tuple[str, ...], where: str, alternative: str = "") -> None:
    """One line for a top-level key that ``valid`` lacks."""
    unknown = [k for k in raw if k not in valid]
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}{where}; "
                         f"valid keys: {', '.join(valid)}{alternative}")


def config_from_dict(raw: dict, source: str = "<dict>") -> RunConfig:
    """Validate a parsed config; every error is one line naming the key, the value and what is valid."""
    _refuse_unknown_keys(raw, source, _TOP_KEYS, "")
    for key in ("model", "seq_len", "layout"):
        if key not in raw:
            raise ValueError(f"{source}: missing required key {key!r}")
    layout_raw = raw["layout"]
    if not isinstance(layout_raw, dict) or set(layout_raw) - {"tp", "cp", "pp", "dp", "ep"}:
        raise ValueError(f"{source}: layout must map tp/cp/pp/dp to positive integers (and ep, for MoE), "
                         f"got {layout_raw!r}")
    try:
        layout = ParallelLayout(**{k: _positive_int(v, f"{source}: layout.{k}", MAX_WORLD)
                                   for k, v in layout_raw.items()})
    except ValueError as exc:
        raise ValueError(exc if str(exc).startswith(source) else f"{source}: {exc}") from None
    world = layout.tp * layout.cp * layout.pp * layout.dp
    if world > MAX_WORLD:
        raise ValueError(f"{source}: layout {layout_raw} makes a world of {world} ranks; at most {MAX_WORLD}")
    model = model_from_yaml(raw["model"], source)
    try:
        check_expert_layout(model, layout)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    choices = choices_from_dict(raw, source)
    packer, preset, cp, cost, logging = choices.packer, choices.preset, choices.cp, choices.cost, choices.logging
    knobs = with_preset(preset, **dict(choices.knobs))
    seq_len = _positive_int(raw["seq_len"], f"{source}: seq_len")
    if seq_len % (2 * layout.cp):
        raise ValueError(f"{source}: seq_len={seq_len} must be divisible by 2 x cp = {2 * layout.cp} "
                         "(Megatron asserts it)")
    micro_batches = _positive_int(raw.get("micro_batches", layout.pp), f"{source}: micro_batches", MAX_MICRO_BATCHES)
    virtual = _positive_int(raw.get("virtual_stages", 1), f"{source}: virtual_stages")
    if virtual > 1 and micro_batches % layout.pp:
        raise ValueError(f"{source}: interleaved 1F1B needs micro_batches ({micro_batches}) divisible by pp "
                         f"({layout.pp})")
    try:  # the packer's schedule objective runs the layout's pipeline
        packing = PackingConfig(seq_len=seq_len, n=micro_batches, dp=layout.dp, pipeline_stages=layout.pp,
                                virtual_stages=virtual, **knobs)
    except ValueError as exc:
        raise ValueError(f"{source}: packing: {exc}") from None
    return RunConfig(name=str(raw.get("name", source)), model=model, layout=layout, seq_len=seq_len,
                     packer=packer, packing=packing, virtual_stages=virtual, preset=preset, cp=cp, cost=cost,
                     logging=logging, sft=choices.sft)


def _read_config(name_or_path: str | Path) -> tuple[dict, str]:
    """The parsed YAML of a shipped name or a path (named, if it does not say), and where it came from."""
    path = resolve_config_path(name_or_path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    yaml = require("yaml", f"reading the run config {path}")
    try:
        raw = load_yaml(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"config {path}: not valid YAML{where} ({problem})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw.setdefault("name", path.name.rsplit(".", 1)[0])
    return raw, str(path)


def load_config(name_or_path: str | Path) -> RunConfig:
    """The config of a shipped name or a YAML path; every error is one line naming the file."""
    raw, source = _read_config(name_or_path)
    return config_from_dict(raw, source=source)


#: the keys of a settings file (``RunChoices``): a config without its run shape
SETTINGS_FILE_KEYS = ("name", "description", *_SECTIONS)


def load_choices(name_or_path: str | Path) -> RunConfig | RunChoices:
    """A whole run config, or a settings file (the packing / cp / cost / logging sections alone,
    ``RunChoices``) when the YAML gives none of ``model``, ``seq_len``, ``layout``."""
    raw, source = _read_config(name_or_path)
    if any(key in raw for key in ("model", "seq_len", "layout")):
        return config_from_dict(raw, source=source)
    _refuse_unknown_keys(raw, source, SETTINGS_FILE_KEYS, " in a settings file (no model, seq_len, layout)",
                         ", or a whole run config")
    return choices_from_dict(raw, source=source)
