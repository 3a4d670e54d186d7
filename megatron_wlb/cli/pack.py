"""``wlb pack``: run one packer over a length stream, print its metrics, optionally write the plan.

    wlb pack --lengths FILE|wlbllm|stdlib | --data-prefix PREFIX | --data-path W1 P1 ...  --config NAME|YAML
             [--packer P] [--iterations K] [--out plan.jsonl] [--data-cache-path DIR]
             [--preset P] [--max-delay D] [--max-seq-len S] [--pieces P] [--cost-model M] [--set KEY=VALUE ...]

An indexed corpus (``--data-prefix`` / ``--data-path``) is read as wlb's training reader reads it: checked
at start (the ``.bin`` size and the ``.idx`` pointers), memory-mapped and streamed through a moving
window, so memory does not grow with the corpus (the plans kept for the metrics grow with ``--iterations``).

``--out`` writes one JSON line per global batch: ``{"iteration": i, "micro_batches": [[[doc_id,
offset, length], ...], ...]}`` (micro-batch ``r * n + k`` is DP rank r's k-th).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from megatron_wlb.cli.common import (
    DATA_PREFIX_SCHEME,
    add_cache_arg,
    cost_profile,
    data_path_stream,
    legend_text,
    metric_line,
    open_stream,
    output_file,
    run_packer,
)
from megatron_wlb.config import PACKER_NAMES, PACKING_KNOBS, RunConfig, knob_yaml_key, load_config
from megatron_wlb.costmodel import CostModel, build_cost_model
from megatron_wlb.megatron.args.settings import USER_FLAGS
from megatron_wlb.packing import make_packer, summarize
from megatron_wlb.packing.presets import PRESET_NAMES
from megatron_wlb.sim.experiments import schedule_label


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pack", help="pack a length stream into global batches and print packing metrics",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="printed metrics, key [unit]: meaning (budget = DP x N x seq_len tokens "
                                     "per iteration):\n" + legend_text().replace("%", "%%"))
    stream = p.add_mutually_exclusive_group()
    stream.add_argument("--lengths", default="wlbllm",
                        help="length file (.json/.npy/.txt), 'wlbllm' (embedded) or 'stdlib' (default wlbllm)")
    stream.add_argument("--data-prefix", metavar="PREFIX", default=None,
                        help="a Megatron indexed dataset PREFIX.idx/.bin, in file order (read as training "
                             "reads it: checked, memory-mapped)")
    stream.add_argument("--data-path", nargs="+", metavar="W_OR_PREFIX", default=None,
                        help="a Megatron --data-path: 'PREFIX ...' or 'W1 PREFIX1 W2 PREFIX2 ...', one pass of "
                             "the stream wlb's training reader gives with --seed 1234 --split 1,0,0 (each dataset "
                             "shuffled, blended by weight; no weights: equal weights)")
    p.add_argument("--config", default="7b_128k", help="shipped config name or a YAML path (default 7b_128k)")
    p.add_argument("--cost-profile", default=None, help="calibrated cost-model profile JSON (default: analytic)")
    p.add_argument("--packer", choices=PACKER_NAMES, default=None, help="packer (default: the config's)")
    p.add_argument("--iterations", type=int, default=None, help="stop after K global batches (default: all)")
    p.add_argument("--out", default=None, help="write the plan as JSON lines")
    add_cache_arg(p)
    add_knob_options(p)
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.set_defaults(func=run)


#: the packer knobs a user chooses (``settings.USER_FLAGS``): an option each; every knob is a ``--set`` key
CHOSEN_KNOBS: tuple[str, ...] = tuple(name for name in PACKING_KNOBS if name in USER_FLAGS)
#: ``--set`` key (the YAML key, ``packing.max_delay``, ``cost.model``) -> packer knob
SET_KEYS: dict[str, str] = {knob_yaml_key(name): name for name in PACKING_KNOBS}


class _Given(argparse.Action):
    """Keeps a knob as given, in command-line order: (the option, its text) appended to ``args.knobs``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.knobs = [*namespace.knobs, (option_string or self.option_strings[0], str(values))]


def add_knob_options(p: argparse.ArgumentParser) -> None:
    """``--preset``, an option per knob a user chooses (``CHOSEN_KNOBS``), and ``--set KEY=VALUE`` for any knob by
    its YAML key; each overrides the config's."""
    g = p.add_argument_group("packer settings (each overrides the config's; docs/packing.md)")
    g.add_argument("--preset", choices=PRESET_NAMES, default=None,
                   help="packer preset the knobs start from (default: the config's packing.preset; "
                        "docs/packing.md \"Presets\"); the knobs given here and in the config win")
    p.set_defaults(knobs=[])
    for name in CHOSEN_KNOBS:
        knob = PACKING_KNOBS[name]
        g.add_argument(knob.flag("--"), action=_Given, dest="knobs", metavar=None if knob.choices else "V",
                       choices=[str(c) for c in knob.choices] if knob.choices else None,
                       help=(knob.help.replace("`", "") + ("" if knob.choices else f" ({knob.expects})"))
                       .replace("%", "%%"))
    g.add_argument("--set", action=_Given, dest="knobs", metavar="KEY=VALUE",
                   help="set one packer knob by its YAML key, repeatable: " + ", ".join(SET_KEYS)
                   + " (e.g. --set packing.window=4096; docs/packing.md lists each)")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The packer knobs given on the command line (the chosen knobs' options, ``--set``), parsed and checked by
    their type; a bad key, a bad value or a knob given twice is a one-line error naming it."""
    options = {PACKING_KNOBS[name].flag("--"): name for name in CHOSEN_KNOBS}
    given: dict[str, tuple[str, str]] = {}
    for option, text in args.knobs:
        if option == "--set":
            key, sep, value = (part.strip() for part in text.partition("="))
            if not sep or key not in SET_KEYS:
                raise ValueError(f"--set {text!r}: give KEY=VALUE with KEY one of {', '.join(SET_KEYS)}")
            name, where = SET_KEYS[key], f"--set {key}"
        else:
            name, where, value = options[option], option, text
        if name in given:
            raise ValueError(f"{where}={value!r}: {knob_yaml_key(name)} is already given ({given[name][0]}); "
                             "give it once")
        given[name] = (where, value)
    return {name: PACKING_KNOBS[name].parse(value, where) for name, (where, value) in given.items()}


def build(args: argparse.Namespace) -> tuple[RunConfig, CostModel]:
    config = load_config(args.config)
    cost = build_cost_model(config.model, config.layout, profile=cost_profile(args.cost_profile, config=config))
    return config, cost


def run(args: argparse.Namespace) -> int:
    if args.iterations is not None and args.iterations < 1:
        raise ValueError(f"--iterations={args.iterations}: must be a positive number of global batches")
    config, cost = build(args)
    packing = config.under_preset(args.preset or config.preset, **overrides(args)).packing
    name = args.packer or config.packer
    packer = make_packer(name, packing, cost)
    source = (DATA_PREFIX_SCHEME + args.data_prefix if args.data_prefix else
              data_path_stream(args.data_path) if args.data_path else args.lengths)
    out = output_file(args.out) if args.out else None
    stream = open_stream(source, args.data_cache_path).source()
    if out is not None:
        with open(out, "w") as f:
            batches = run_packer(packer, stream, args.iterations, progress=name, out=f)
    else:
        batches = run_packer(packer, stream, args.iterations, progress=name)
    metrics = summarize(batches, cost, packing.seq_len, stages=packing.stages, virtual_stages=packing.virtual_stages)

    report = {"packer": name, "config": config.name, "lengths": source,
              "schedule": schedule_label(packing.virtual_stages), "documents_read": packer.position,
              "dropped": len(packer.dropped), **metrics.to_dict()}
    report.update(packer.diagnostics())
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"# budget = DP x N x seq_len = {packing.dp} x {packing.n} x {packing.seq_len:,} = "
              f"{packing.tokens_per_iteration:,} tokens per iteration; units and meanings: wlb pack --help")
        for key, value in report.items():
            print(metric_line(key, value))
    return 0
