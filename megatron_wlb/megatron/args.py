"""The ``--wlb-*`` flags: an extra_args_provider that composes with Megatron's, and start-up checks.

Megatron's ``parse_args(extra_args_provider)`` has one provider slot (pretrain_gpt.py fills it with
ModelOpt's when that is installed), so ``compose_providers`` chains ours after whichever one is
passed. ``validate_wlb_args`` runs after Megatron's own ``validate_args``: it resolves the
settings (``--wlb-config`` supplies defaults, explicit flags win), rejects combinations that cannot
work with a message saying what to change, and with pipeline parallelism turns on
``args.variable_seq_lengths`` (Megatron's validate_args forces it off) so that stages exchange
per-micro-batch shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from megatron_wlb.config import (
    PACKER_NAMES,
    RENAMED_KNOBS,
    RENAMED_SETTINGS,
    SECTION_SETTINGS,
    Knob,
    RunConfig,
    cp_sharding_names,
    field_docs,
    knob_yaml_key,
    megatron_moe_fields,
    renamed_knob_hint,
    renamed_value_hint,
)
from megatron_wlb.costmodel import CostModel
from megatron_wlb.megatron.settings import FLAG_KNOBS, WlbSettings
from megatron_wlb.packing.presets import DEFAULT_PRESET, PRESET_NAMES
from megatron_wlb.packing.types import DEFAULT_MAX_SEQ_LEN_FACTOR, PackingConfig, resolve_max_seq_len

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# setting -> flag, generated from WlbSettings' fields and PackingConfig's knobs. Every flag defaults
# to None so that "not given" is distinguishable from a value equal to the default (needed to let
# --wlb-config fill in what the command line leaves out).
FLAGS: dict[str, str] = {name: "--wlb-" + name.replace("_", "-") for name in WlbSettings.names()}


def flag_table() -> list[tuple[str, str, str, str]]:
    """(flag, YAML key or "", default, help) of every ``--wlb-*`` flag, generated from the code
    (docs/megatron.md's table is checked against it)."""
    d = WlbSettings()
    own_docs = field_docs(WlbSettings)
    choices = {"packer": PACKER_NAMES, "cp_sharding": cp_sharding_names(), "preset": PRESET_NAMES}
    yaml_keys = {"packer": "packing.packer", "preset": "packing.preset",
                 **{name: f"{section}.{key}" for (section, key), name in SECTION_SETTINGS.items()}}
    rows = []
    for name in WlbSettings.names():
        if name in FLAG_KNOBS:
            knob = FLAG_KNOBS[name]
            default = (f"{DEFAULT_MAX_SEQ_LEN_FACTOR:g} x --seq-length" if name == "max_seq_len"
                       else _show(knob.default))
            text = knob.help + (f" Values: {knob.expects}." if knob.choices is None else "")
            rows.append((FLAGS[name], knob_yaml_key(name), default, text))
        else:
            text = own_docs.get(name, "")
            if name in choices:
                text += f" One of: {', '.join(choices[name])}."
            rows.append((FLAGS[name], yaml_keys.get(name, ""), _show(getattr(d, name)), text))
    return rows


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def add_wlb_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--wlb-*`` flags to Megatron's parser (a no-op if they are already there)."""
    if "--wlb-packer" in parser._option_string_actions:  # composed twice: keep the first
        return parser
    g = parser.add_argument_group(title="WLB-LLM", description="workload-balanced packing and CP sharding "
                                  "(megatron_wlb; see docs/megatron.md)")
    choices = {"packer": PACKER_NAMES, "cp_sharding": cp_sharding_names(), "preset": PRESET_NAMES}
    metavars = {"cost_profile": "PATH", "config": "NAME|YAML", "trace": "PATH"}
    for (flag, _, default, text), name in zip(flag_table(), WlbSettings.names()):
        knob = FLAG_KNOBS.get(name)
        kind = _flag_type(knob, flag) if knob else (int if name == "log_interval" else str)
        options = choices.get(name) or (knob.choices if knob and knob.choices else None)
        g.add_argument(flag, type=kind, choices=options, default=None, metavar=metavars.get(name),
                       help=f"{text} (default {default})".replace("%", "%%"))
    for old in (*RENAMED_KNOBS, *RENAMED_SETTINGS):  # old spellings: refused with the hint to the new one
        g.add_argument("--wlb-" + old.replace("_", "-"), action=_Renamed, nargs="?", help=argparse.SUPPRESS,
                       default=None, dest=f"wlb_renamed_{old}")
    # an action on resume, not a setting (it is neither saved nor compared): megatron_wlb.megatron.checkpoint
    g.add_argument("--wlb-reset-data-stream", action="store_true",
                   help="on resume (--load), restart only the data stream at its first document, with the "
                        "--wlb-* settings given now; the optimizer, iteration and LR schedule resume from the "
                        "checkpoint (--finetune resets them too). Counted in the checkpoint and logged. It "
                        "applies once: resuming from a checkpoint saved after a reset given the same data flags "
                        "and --wlb-* settings, it is ignored (logged), so a requeue script may keep it")
    return parser


class _Renamed(argparse.Action):
    """An old ``--wlb-*`` spelling: the parser's one-line error names the new one (``config.RENAMED_KNOBS``,
    ``RENAMED_SETTINGS``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        old = (option_string or self.option_strings[0])[len("--wlb-"):].replace("-", "_")
        parser.error(renamed_knob_hint(old, "flag") or RENAMED_SETTINGS.get(old) or f"{option_string} was renamed")


HELP_FLAGS = ("-h", "--help")


def asks_for_help(argv: list[str]) -> bool:
    """Whether a command line asks for ``--help`` (before a ``--`` that ends the options)."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return any(a in HELP_FLAGS for a in options)


def wlb_help(prog: str) -> str:
    """Help for our ``--wlb-*`` flags alone. Megatron's own ``--help`` is not printed: megatron-core 0.19.2's
    crashes formatting a help string with a stray ``%`` (upstream), so its flags are named by pointer."""
    parser = argparse.ArgumentParser(prog=prog, usage=f"{prog} <Megatron-LM flags> [--wlb-* flags]",
                                     description="Megatron-LM's pretrain loop with WLB-LLM's packing and CP sharding.",
                                     epilog="Megatron's own flags: megatron/training/arguments.py of your Megatron-LM "
                                     "(its --help crashes in megatron-core 0.19.2, an upstream bug).",
                                     add_help=False)
    return add_wlb_args(parser).format_help()


def _flag_type(knob: Knob, flag: str) -> Callable[[str], Any]:
    """argparse ``type=``: the knob's type conversion; range checks happen in WlbSettings."""

    def convert(text: str) -> Any:
        hint = renamed_value_hint(knob.name, text)
        if hint:
            raise argparse.ArgumentTypeError(f"{text!r}: {hint}")
        try:
            return knob.convert(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = knob.name
    return convert


def config_flags(run: RunConfig) -> list[str]:
    """The ``--wlb-*`` flags that reproduce a RunConfig's packing choices without ``--wlb-config``
    (whose start-up check demands the config's exact layout): for launchers that rescale a layout."""
    out = ["--wlb-packer", run.packer, "--wlb-cp-sharding", run.cp.sharding]
    for name, value in run.settings().items():
        if name != "cp_sharding":
            out += [FLAGS[name], _show(value)]
    if run.preset != DEFAULT_PRESET:
        out += ["--wlb-preset", run.preset]
    for name, value in run.packing_overrides().items():
        if name in FLAG_KNOBS:
            out += [FLAG_KNOBS[name].flag(), _show(value)]
    return out


def compose_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One provider that applies each given one in order (``None`` entries are skipped)."""
    chain = [p for p in providers if p is not None]

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in chain:
            out = p(parser)
            parser = parser if out is None else out
        return parser

    provider.wlb_chain = tuple(chain)  # type: ignore[attr-defined]
    return provider


def escape_help_percents(parser: Any) -> Any:
    """Double every lone ``%`` in the parser's help texts, which argparse would read as a format (megatron-core
    0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` says "10%)", so ``--help`` died in argparse)."""
    import re

    for action in parser._actions:
        if isinstance(action.help, str):
            action.help = re.sub(r"%%|%\(\w+\)[a-zA-Z]|%", lambda m: "%%" if m.group() == "%" else m.group(),
                                 action.help)
    return parser


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A bad flag exits with one line (``prog: error: ...``), without the usage: Megatron's runs to hundreds of
    lines and hides the error."""
    def error(message: str) -> NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message} (--help lists the --wlb-* flags)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def wlb_extra_args_provider(existing: ArgsProvider | None = None) -> ArgsProvider:
    """Megatron's provider slot filled with ``existing`` (if any) followed by ours (and help texts that
    ``--help`` can print: ``escape_help_percents``; one-line flag errors: ``one_line_errors``)."""
    return compose_providers(existing, add_wlb_args, escape_help_percents, one_line_errors)


# -- resolving and validating ------------------------------------------------------------------------
def explicit_flags(args: Any) -> dict[str, Any]:
    """The settings given on the command line (``wlb_*`` attributes that are not None)."""
    return {k: getattr(args, f"wlb_{k}") for k in FLAGS if getattr(args, f"wlb_{k}", None) is not None}


def settings_from_args(args: Any) -> WlbSettings:
    """``WlbSettings`` from Megatron's args: ``--wlb-config`` values first, explicit flags over them."""
    given = explicit_flags(args)
    base: dict[str, Any] = {}
    if given.get("config"):
        cfg = load_run_config(given["config"])
        base = {"packer": cfg.packer, "preset": cfg.preset, **cfg.settings(),
                **{name: value for name, value in cfg.packing_overrides().items() if name in FLAG_KNOBS}}
    return WlbSettings(**{**base, **given})


def load_run_config(name_or_path: str) -> RunConfig:
    """``megatron_wlb.config.load_config`` with errors that name the flag and the valid configs."""
    from megatron_wlb.config import list_configs, load_config

    try:
        return load_config(name_or_path)
    except ValueError as exc:
        raise ValueError(f"--wlb-config {name_or_path}: {exc}") from None
    except FileNotFoundError:
        raise ValueError(f"--wlb-config {name_or_path!r} is neither a YAML file nor one of the shipped configs "
                         f"({', '.join(list_configs())}); pass one of those names or a path to a .yaml file") from None


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def num_microbatches_from_args(args: Any) -> int:
    """Micro-batches per DP rank per iteration: global_batch / (micro_batch x DP), as Megatron computes."""
    mbs, dp, gbs = int(args.micro_batch_size), int(args.data_parallel_size), int(args.global_batch_size)
    if gbs % (mbs * dp):
        raise ValueError(f"--global-batch-size {gbs} is not divisible by --micro-batch-size x DP = {mbs * dp}")
    return gbs // (mbs * dp)


class StartupError(ValueError):
    """A start-up problem (flags, data): the entry points exit with its one-line message, no traceback."""


def rejected_by_megatron(exc: BaseException) -> StartupError:
    """Megatron's own argument check that failed (an ``assert`` or ValueError of its ``validate_args``) as one line:
    its message (or the failed assertion's source line) and where it stands."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    what = " ".join(str(exc).split()) or (last.line if last is not None and last.line else type(exc).__name__)
    path = last.filename.replace(os.sep, "/") if last is not None else ""
    path = "megatron/" + path.rsplit("/megatron/", 1)[1] if "/megatron/" in path else os.path.basename(path)
    where = f" ({path}:{last.lineno})" if last is not None else ""
    return StartupError(f"megatron_wlb: Megatron's validate_args rejects these flags: {what}{where}")


@contextlib.contextmanager
def exit_on_startup_error() -> Iterator[None]:
    """Turn a ``StartupError`` into ``SystemExit`` with its message: an entry point exits with one line."""
    try:
        yield
    except StartupError as exc:
        raise SystemExit(str(exc)) from None


def configuration_error(problems: list[str], what: str = "invalid WLB-LLM configuration") -> StartupError:
    """One line naming every problem (each says what to change)."""
    listed = problems[0] if len(problems) == 1 else \
        f"{len(problems)} problems: " + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    return StartupError(f"megatron_wlb: {what}: {listed}")


#: ``cp_comm_type`` of our CP attention (``--wlb-cp-sharding`` other than per-document-te): K/V all-gathered
CP_COMM_TYPE = "all_gather"

#: Megatron flags (megatron-core 0.19, main after PR #6742, dev, PR #7000) whose own machinery would replace or
#: bypass what our hooks feed: ``args`` attribute -> (flag, what it does, our equivalent). Each is refused at
#: start-up (``bypass_problems``), before Megatron's own checks of it (``refuse_bypassing_flags``).
#: ``--dataloader-inter-document-masking`` is not here: it is honoured (our micro-batches attend per document;
#: the balanced concat-and-cut intake cuts Megatron's samples at GPTDataset's document boundaries).
BYPASSING_FLAGS: dict[str, tuple[str, str, str]] = {
    "sequence_packing_scheduler": (
        "--sequence-packing-scheduler", "hands packing to Megatron's own data_schedule (wrap_data_iterator), which "
        "our data iterator replaces", "--wlb-packer wlb (our packer through our iterator); Megatron's own path "
        "takes our scheduler without apply(): python -m megatron_wlb.megatron.main_schedule pretrain_gpt.py ... "
        "--sequence-packing-scheduler wlb"),
    "use_varlen_dataset": (
        "--use-varlen-dataset", "builds Megatron's VarlenDataset (one unpacked document per sample for its "
        "scheduler), which our data path replaces", "--wlb-packer wlb with --data-path (whole documents packed "
        "into variable-length micro-batches)"),
    "dynamic_context_parallel": (
        "--dynamic-context-parallel", "picks a CP group size per sample (default_dynamic_cp) over data our CP "
        "sharding replaces", "--wlb-cp-sharding adaptive (per-sequence or per-document sharding chosen per "
        "micro-batch over --context-parallel-size)"),
    "hybrid_context_parallel": (
        "--hybrid-context-parallel", "picks a CP group size per sample over data our CP sharding replaces",
        "--wlb-cp-sharding adaptive (per-sequence or per-document sharding chosen per micro-batch over "
        "--context-parallel-size)"),
    "max_seqlen_per_dp_cp_rank": (
        "--max-seqlen-per-dp-cp-rank", "caps what Megatron's own scheduler packs per rank, which our packer "
        "replaces", "--wlb-max-seq-len (a micro-batch's tokens over all CP ranks: this value x CP)"),
    "pipeline_p2p_fixed_shape": (
        "--pipeline-p2p-fixed-shape", "skips the pipeline stages' shape exchange, but our micro-batches differ in "
        "length", "nothing to set: WLB turns the shape exchange on (variable_seq_lengths) with PP > 1"),
}


def bypass_problems(args: Any) -> list[str]:
    """One problem per ``BYPASSING_FLAGS`` flag that ``args`` sets (each naming our equivalent); the shape flag
    only with pipeline parallelism, where shapes travel."""
    problems = []
    for attr, (flag, does, ours) in BYPASSING_FLAGS.items():
        value = getattr(args, attr, None)
        if value is None or value is False:
            continue
        if attr == "pipeline_p2p_fixed_shape" and int(getattr(args, "pipeline_model_parallel_size", 1) or 1) <= 1:
            continue
        given = flag if value is True else f"{flag} {value}"
        problems.append(f"{given} {does}; remove it (our equivalent: {ours})")
    return problems


def refuse_bypassing_flags(args: Any) -> None:
    """Raise a one-line ``StartupError`` naming every ``BYPASSING_FLAGS`` flag ``args`` sets (called before
    Megatron's own validate_args, whose checks of these flags would not name our equivalent)."""
    problems = bypass_problems(args)
    if problems:
        raise configuration_error(problems)


def validate_wlb_args(args: Any, *, te_available: bool | None = None, highspy_available: bool | None = None,
                      check_files: bool = True) -> WlbSettings:
    """Check Megatron's validated ``args`` against the WLB settings; raise a ``StartupError`` (a ValueError, one
    line) saying what to change.

    With pipeline parallelism sets ``args.variable_seq_lengths = True`` (micro-batches differ in
    length, so stages exchange shapes; dense models also get the unused MoE dispatcher switched
    to ``alltoall``, which TransformerConfig requires); with CP > 1 and our CP attention sets
    ``args.cp_comm_type`` to ``all_gather`` (what it does); returns the resolved settings.
    ``te_available`` / ``highspy_available`` default to import probes; ``check_files=False`` skips
    the check that every ``--data-path`` prefix has its .bin/.idx (flag-parsing tests).
    """
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        raise configuration_error([str(exc)]) from None
    problems: list[str] = []
    seq_length = int(args.seq_length)
    tp = int(getattr(args, "tensor_model_parallel_size", 1))
    cp = int(getattr(args, "context_parallel_size", 1))
    pp = int(getattr(args, "pipeline_model_parallel_size", 1))
    dp = int(getattr(args, "data_parallel_size", 1))

    if int(getattr(args, "micro_batch_size", 1)) != 1:
        problems.append(f"--micro-batch-size {args.micro_batch_size}: WLB packs variable-length THD micro-batches; "
                        "set --micro-batch-size 1 and put the batch size into --global-batch-size")
    if getattr(args, "rampup_batch_size", None):
        problems.append("--rampup-batch-size changes the number of micro-batches per iteration, which the packer "
                        "fixes at start-up; remove --rampup-batch-size")
    if settings.max_seq_len is not None and settings.max_seq_len < seq_length:
        problems.append(f"--wlb-max-seq-len {settings.max_seq_len} is below --seq-length {seq_length}; raise "
                        f"--wlb-max-seq-len to at least {seq_length} or leave it unset")
    # the largest micro-batch: wlb packs up to S_max, the fixed packers up to seq_length
    largest = resolve_max_seq_len(seq_length, settings.max_seq_len) if settings.packer == "wlb" else seq_length
    max_pos = getattr(args, "max_position_embeddings", None)
    if getattr(args, "position_embedding_type", None) == "learned_absolute" and max_pos and largest > max_pos:
        problems.append(f"--max-position-embeddings {max_pos} is below the largest packed micro-batch ({largest} "
                        f"tokens; position ids restart per document but a document may fill it); raise "
                        f"--max-position-embeddings to {largest} or lower --wlb-max-seq-len")
    knobs = settings.knob_values()
    if knobs["max_seq_len"] is not None and knobs["max_seq_len"] < seq_length:
        knobs["max_seq_len"] = None  # reported above
    try:  # cross-field checks of the packer's own config (each knob alone was checked when parsed)
        packing = PackingConfig(seq_len=seq_length, n=1, **knobs)
    except ValueError as exc:
        problems.append(f"the --wlb-* packer settings do not fit --seq-length {seq_length}: {exc}")
    else:
        threshold_problem = packing.queue_threshold_problem()
        if threshold_problem:
            problems.append(f"--wlb-queue-thresholds {_show(settings.queue_thresholds)}: {threshold_problem}")
    if seq_length % (2 * cp):
        problems.append(f"--seq-length {seq_length} must be divisible by 2 x --context-parallel-size = {2 * cp}")
    if settings.cp_sharding == "per-document-te":
        if te_available is None:
            te_available = module_available("transformer_engine")
        if not te_available:
            problems.append("--wlb-cp-sharding per-document-te keeps TransformerEngine's THD attention, but "
                            "transformer_engine is not installed; install TransformerEngine or choose "
                            "--wlb-cp-sharding per-document / adaptive (our all-gather CP attention)")
    if settings.packer == "fixed-solver":
        if highspy_available is None:
            highspy_available = module_available("highspy")
        if not highspy_available:
            problems.append("--wlb-packer fixed-solver needs the HiGHS MILP solver: pip install highspy, "
                            "or use --wlb-packer fixed-greedy / wlb")
    if settings.cost_profile is not None and not os.path.isfile(settings.cost_profile):
        problems.append(f"--wlb-cost-profile {settings.cost_profile}: no such file (make one with `wlb calibrate "
                        "--out PROFILE.json` on a GPU, or leave the flag out for the analytic model)")
    if getattr(args, "mock_data", False):
        problems.append("--mock-data has no documents to pack; give --data-path PREFIX (Megatron .bin/.idx)")
    elif not (getattr(args, "data_path", None) or getattr(args, "train_data_path", None)):
        problems.append("no --data-path: WLB reads documents from Megatron indexed datasets (PREFIX.bin/.idx); "
                        "give --data-path [WEIGHT] PREFIX ... or --train-data-path")
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        value = getattr(args, flag, None)
        if not value or not check_files:
            continue
        from megatron_wlb.data.blend import parse_data_path

        try:
            prefixes = [p for p, _ in parse_data_path(value)]
        except ValueError as exc:
            problems.append(str(exc))
            continue
        for prefix in prefixes:
            if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
                problems.append(f"--{flag.replace('_', '-')}: no {prefix}.bin/.idx; give the prefix of a Megatron "
                                "indexed dataset (made with tools/preprocess_data.py), without the extension")
    problems.extend(bypass_problems(args))
    for flag, attr in (("--sft", "sft"), ("--fim-data", "fim_data")):
        if getattr(args, attr, False):
            problems.append(f"{flag} replaces the data path WLB installs; remove {flag} or do not call "
                            "megatron_wlb.megatron.apply()")
    if settings.pieces == "concat-and-cut":
        from megatron_wlb.megatron.gpt_samples import masking_problem

        problem = masking_problem(args)
        if problem:
            problems.append(problem)
        if getattr(args, "dataloader_type", "single") == "cyclic":
            problems.append("--wlb-pieces concat-and-cut follows MegatronPretrainingSampler's order (--dataloader-type "
                            "single); --dataloader-type cyclic reshuffles samples differently: use single")
    if getattr(args, "dataloader_type", "single") == "external":
        problems.append("--dataloader-type external: WLB supplies the training iterator itself; use single or cyclic")
    cfg: RunConfig | None = None
    try:
        cfg = load_run_config(settings.config) if settings.config else None
    except ValueError as exc:
        problems.append(str(exc))
    if cfg is not None:
        lay = cfg.layout
        if (lay.tp, lay.cp, lay.pp, lay.dp) != (tp, cp, pp, dp) or cfg.seq_len != seq_length:
            problems.append(f"--wlb-config {settings.config} describes TP{lay.tp} CP{lay.cp} PP{lay.pp} DP{lay.dp} "
                            f"with --seq-length {cfg.seq_len}, but this run is TP{tp} CP{cp} PP{pp} DP{dp} with "
                            f"--seq-length {seq_length}; pick the config of this layout or pass --wlb-* flags instead")
        elif getattr(args, "global_batch_size", None) and int(args.global_batch_size) != cfg.packing.n * dp:
            problems.append(f"--wlb-config {settings.config} packs {cfg.packing.n} micro-batches per DP rank; "
                            f"set --global-batch-size {cfg.packing.n * dp} (= micro_batches x DP) "
                            "with --micro-batch-size 1")
    moe = bool(getattr(args, "num_experts", None))
    dispatcher = getattr(args, "moe_token_dispatcher_type", None)
    if pp > 1 and moe and dispatcher == "allgather":
        problems.append("pipeline stages exchange variable-length activations (variable_seq_lengths), which "
                        "Megatron's allgather MoE token dispatcher does not support; set "
                        "--moe-token-dispatcher-type alltoall")
    try:  # model flags the cost model cannot price (--multi-latent-attention)
        megatron_moe_fields(args)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        raise configuration_error(problems)
    comm = getattr(args, "cp_comm_type", None)
    if cp > 1 and settings.cp_sharding != "per-document-te" and comm is not None:
        # our CP attention all-gathers K/V (megatron_wlb.cp.attention), whatever --cp-comm-type says; Megatron-LM
        # dev's TransformerConfig refuses local attention at CP > 1 with any other value
        args.cp_comm_type = [CP_COMM_TYPE] * len(comm) if isinstance(comm, list) else CP_COMM_TYPE
    if pp > 1:
        # p2p must exchange each micro-batch's shape; Megatron's validate_args forces this off.
        args.variable_seq_lengths = True
        if not moe and dispatcher == "allgather":
            # TransformerConfig rejects variable_seq_lengths with the (default) allgather dispatcher
            # even for dense models, where the dispatcher is never used.
            args.moe_token_dispatcher_type = "alltoall"
    return settings


def packing_config_from_args(args: Any, settings: WlbSettings) -> PackingConfig:
    """The packer's config for this run: Megatron's seq_length, micro-batch count, DP size and seed,
    and every packer knob of the settings."""
    return PackingConfig(seq_len=int(args.seq_length), n=num_microbatches_from_args(args),
                         dp=int(args.data_parallel_size), seed=int(getattr(args, "seed", 0)),
                         pipeline_stages=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
                         virtual_stages=int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
                         **settings.knob_values())


def cost_model_from_args(args: Any, settings: WlbSettings) -> CostModel:
    """The cost model W(d) for this run's model flags and layout (calibrated if --wlb-cost-profile)."""
    from megatron_wlb.costmodel import ModelShape, ParallelLayout, build_cost_model

    heads = int(args.num_attention_heads)
    kv = int(args.num_query_groups) if getattr(args, "group_query_attention", False) and \
        getattr(args, "num_query_groups", None) else heads
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * int(args.hidden_size)
    vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 32000
    shape = ModelShape(name="megatron", hidden=int(args.hidden_size), num_layers=int(args.num_layers),
                       num_heads=heads, num_kv_heads=kv, ffn_hidden=int(ffn), vocab=int(vocab),
                       swiglu=bool(getattr(args, "swiglu", False)), **megatron_moe_fields(args))
    layout = ParallelLayout(tp=int(getattr(args, "tensor_model_parallel_size", 1)),
                            cp=int(getattr(args, "context_parallel_size", 1)),
                            pp=int(getattr(args, "pipeline_model_parallel_size", 1)),
                            dp=int(getattr(args, "data_parallel_size", 1)),
                            ep=int(getattr(args, "expert_model_parallel_size", 1) or 1))
    return build_cost_model(shape, layout, profile=settings.cost_profile)


# -- the docs' flag table, generated ------------------------------------------------------------------
DOCS_BEGIN = "<!-- wlb-flags:begin (generated by `python -m megatron_wlb.megatron.args --write-docs`) -->"
DOCS_END = "<!-- wlb-flags:end -->"


def flag_table_markdown() -> str:
    """docs/megatron.md's ``--wlb-*`` table: flag, YAML key of a config, default, meaning."""
    lines = ["| flag | config YAML key | default | meaning |", "|---|---|---|---|"]
    for flag, key, default, text in flag_table():
        cells = [f"`{flag}`", f"`{key}`" if key else "", f"`{default}`", text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _docs_block(text: str) -> tuple[int, int]:
    begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {DOCS_BEGIN!r} ... {DOCS_END!r} block")
    return begin + len(DOCS_BEGIN), end


def main(argv: list[str] | None = None) -> int:
    """``--write-docs [FILE]`` rewrites the flag table in docs/megatron.md, ``--check-docs`` fails if stale."""
    import sys
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m megatron_wlb.megatron.args")
    parser.add_argument("--write-docs", nargs="?", const="docs/megatron.md", default=None, metavar="FILE")
    parser.add_argument("--check-docs", nargs="?", const="docs/megatron.md", default=None, metavar="FILE")
    opts = parser.parse_args(argv)
    target = Path(opts.write_docs or opts.check_docs or "docs/megatron.md")
    text = target.read_text()
    begin, end = _docs_block(text)
    fresh = text[:begin] + "\n" + flag_table_markdown() + "\n" + text[end:]
    if opts.write_docs:
        target.write_text(fresh)
        print(f"wrote the --wlb-* table of {target}")
    elif fresh != text:
        print(f"{target}: the --wlb-* table is stale; run python -m megatron_wlb.megatron.args --write-docs",
              file=sys.stderr)
        return 1
    else:
        print(flag_table_markdown() if not opts.check_docs else f"{target}: current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
