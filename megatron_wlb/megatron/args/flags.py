"""The ``--wlb-*`` flags: an extra_args_provider that composes with Megatron's, and the settings they give.

Megatron's ``parse_args(extra_args_provider)`` has one provider slot (pretrain_gpt.py fills it with
ModelOpt's when that is installed), so ``compose_providers`` chains ours after whichever one is
passed. ``settings_from_args`` resolves the settings (``--wlb-config`` supplies defaults, explicit flags
win); the start-up checks of Megatron's args against them are ``validation.validate_wlb_args``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from megatron_wlb.config import (
    PACKER_NAMES,
    SECTION_SETTINGS,
    Knob,
    RunChoices,
    RunConfig,
    cp_sharding_names,
    field_docs,
    knob_yaml_key,
    list_configs,
    load_choices,
)
from megatron_wlb.megatron.args.settings import FLAG_KNOBS, USER_FLAGS, WlbSettings
from megatron_wlb.packing.presets import DEFAULT_PRESET, PRESET_NAMES
from megatron_wlb.packing.types import DEFAULT_MAX_SEQ_LEN_FACTOR

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# setting -> flag, for the settings a user chooses (``settings.USER_FLAGS``); the other settings are YAML keys
# of --wlb-config. Every flag defaults to None so that "not given" is distinguishable from a value equal to
# the default (needed to let --wlb-config fill in what the command line leaves out).
FLAGS: dict[str, str] = {name: "--wlb-" + name.replace("_", "-") for name in USER_FLAGS}
#: WlbSettings field -> its YAML key, for the settings a config section gives
SETTING_YAML_KEYS: dict[str, str] = {name: f"{section}.{key}" for (section, key), name in SECTION_SETTINGS.items()}
#: the settings that are YAML keys only: their old ``--wlb-*`` flag is refused naming the key
YAML_ONLY: tuple[str, ...] = tuple(name for name in WlbSettings.names() if name not in FLAGS)


def flag_table() -> list[tuple[str, str, str, str]]:
    """(flag, YAML key or "", default, help) of every ``--wlb-*`` flag, generated from the code
    (docs/megatron.md's table is checked against it)."""
    d = WlbSettings()
    own_docs = field_docs(WlbSettings)
    choices = {"packer": PACKER_NAMES, "cp_sharding": cp_sharding_names(), "preset": PRESET_NAMES}
    yaml_keys = {"packer": "packing.packer", "preset": "packing.preset",
                 **{name: f"{section}.{key}" for (section, key), name in SECTION_SETTINGS.items()}}
    rows = []
    for name in FLAGS:
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
    for (flag, _, default, text), name in zip(flag_table(), FLAGS):
        knob = FLAG_KNOBS.get(name)
        kind = _flag_type(knob, flag) if knob else (int if name == "log_interval" else str)
        options = choices.get(name) or (knob.choices if knob and knob.choices else None)
        g.add_argument(flag, type=kind, choices=options, default=None, metavar=metavars.get(name),
                       help=f"{text} (default {default})".replace("%", "%%"))
    for name in YAML_ONLY:  # research knobs, flags no more: refused with their YAML key
        g.add_argument("--wlb-" + name.replace("_", "-"), action=_YamlOnly, nargs="?", help=argparse.SUPPRESS,
                       default=None, dest=f"wlb_yaml_only_{name}")
    # an action on resume, not a setting (it is neither saved nor compared): megatron_wlb.megatron.state.checkpoint
    g.add_argument("--wlb-reset-data-stream", action="store_true",
                   help="on resume (--load), restart only the data stream at its first document, with the "
                        "--wlb-* settings given now; the optimizer, iteration and LR schedule resume from the "
                        "checkpoint (--finetune resets them too). Counted in the checkpoint and logged. It "
                        "applies once: resuming from a checkpoint saved after a reset given the same data flags "
                        "and --wlb-* settings, it is ignored (logged), so a requeue script may keep it")
    return parser


class _YamlOnly(argparse.Action):
    """A setting that is a YAML key, not a flag: the parser's one-line error names the key."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = option_string or self.option_strings[0]
        parser.error(yaml_only_hint(flag[len("--wlb-"):].replace("-", "_")))


def yaml_only_hint(name: str) -> str:
    """The one-line refusal of ``--wlb-<name>`` for a setting that is a YAML key only."""
    key = SETTING_YAML_KEYS.get(name) or knob_yaml_key(name)
    section, field = key.split(".", 1)
    return (f"--wlb-{name.replace('_', '-')} is not a flag: set {key} in the YAML of --wlb-config (a settings file "
            f"'{section}: {{{field}: ...}}' serves a run of any shape)")


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
        try:
            return knob.convert(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = knob.name
    return convert


def config_flags(run: RunConfig) -> list[str]:
    """The ``--wlb-*`` flags that reproduce a RunConfig's packing choices without ``--wlb-config``
    (whose start-up check demands the config's exact layout): for launchers that rescale a layout.
    Raises ValueError when the config sets a knob that is a YAML key only (``YAML_ONLY``)."""
    out = ["--wlb-packer", run.packer, "--wlb-cp-sharding", run.cp.sharding]
    for name, value in run.settings().items():
        if name not in FLAGS:
            raise ValueError(f"{run.name} sets {SETTING_YAML_KEYS[name]}, which no --wlb-* flag gives: for another "
                             "layout, pass a settings file (its packing, cp, cost, logging and sft sections) to "
                             "--wlb-config")
        if name != "cp_sharding":
            out += [FLAGS[name], _show(value)]
    if run.preset != DEFAULT_PRESET:
        out += ["--wlb-preset", run.preset]
    overrides = {name: value for name, value in run.packing_overrides().items() if name in FLAG_KNOBS}
    yaml_only = [knob_yaml_key(name) for name in overrides if name not in FLAGS]
    if yaml_only:
        raise ValueError(f"{run.name} sets {', '.join(yaml_only)}, which no --wlb-* flag gives: for another layout, "
                         "pass a settings file (its packing, cp, cost and logging sections) to --wlb-config")
    for name, value in overrides.items():
        out += [FLAGS[name], _show(value)]
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
    given = {k: getattr(args, f"wlb_{k}", None) for k in FLAGS}  # our own flags, by name
    return {k: v for k, v in given.items() if v is not None}


def settings_from_args(args: Any) -> WlbSettings:
    """``WlbSettings`` from Megatron's args: ``--wlb-config`` values first, explicit flags over them."""
    given = explicit_flags(args)
    base: dict[str, Any] = {}
    if given.get("config"):
        cfg = load_run_config(given["config"])
        base = {"packer": cfg.packer, "preset": cfg.preset, **cfg.settings(),
                **{name: value for name, value in cfg.packing_overrides().items() if name in FLAG_KNOBS}}
    return WlbSettings(**{**base, **given})


def load_run_config(name_or_path: str) -> RunConfig | RunChoices:
    """``megatron_wlb.config.load_choices`` (a run config, or a settings file of its sections alone) with errors
    that name the flag and the valid configs."""
    try:
        return load_choices(name_or_path)
    except ValueError as exc:
        raise ValueError(f"--wlb-config {name_or_path}: {exc}") from None
    except FileNotFoundError:
        raise ValueError(f"--wlb-config {name_or_path!r} is neither a YAML file nor one of the shipped configs "
                         f"({', '.join(list_configs())}); pass one of those names or a path to a .yaml file") from None


# -- the docs' flag table, generated ------------------------------------------------------------------
DOCS_BEGIN = "<!-- wlb-flags:begin (generated by `python -m megatron_wlb.megatron.args.flags --write-docs`) -->"
DOCS_END = "<!-- wlb-flags:end -->"


def flag_table_markdown() -> str:
    """docs/megatron.md's ``--wlb-*`` table: flag, YAML key of a config, default, meaning."""
    lines = ["| flag | config YAML key | default | meaning |", "|---|---|---|---|"]
    for flag, key, default, text in flag_table():
        cells = [f"`{flag}`", f"`{key}`" if key else "", f"`{default}`", text]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "YAML keys only (`--wlb-config`, a preset; their meaning: [packing.md](packing.md)): "
              + ", ".join(f"`{SETTING_YAML_KEYS.get(name) or knob_yaml_key(name)}`" for name in YAML_ONLY) + "."]
    return "\n".join(lines)


def _docs_block(text: str) -> tuple[int, int]:
    begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {DOCS_BEGIN!r} ... {DOCS_END!r} block")
    return begin + len(DOCS_BEGIN), end


def main(argv: list[str] | None = None) -> int:
    """``--write-docs [FILE]`` rewrites the flag table in docs/megatron.md, ``--check-docs`` fails if stale."""
    parser = argparse.ArgumentParser(prog="python -m megatron_wlb.megatron.args.flags")
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
        print(f"{target}: the --wlb-* table is stale; run python -m megatron_wlb.megatron.args.flags --write-docs",
              file=sys.stderr)
        return 1
    else:
        print(flag_table_markdown() if not opts.check_docs else f"{target}: current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
