"""``wlb``: the command line. Each subcommand lives in its own module of this package and
provides ``add_parser(subparsers)`` (which sets ``func``) so the dispatcher stays one screen."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from megatron_wlb import __version__

# Subcommand modules, in the order `wlb --help` lists them.
SUBCOMMANDS = ("pack", "bench", "shard", "simulate", "reproduce", "analyze")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wlb",
        description="Workload-balanced 4D parallelism (WLB-LLM) for Megatron-LM: pack documents, "
                    "shard them over context parallelism, and simulate what it buys.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-wlb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module_name = f"megatron_wlb.cli.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"wlb {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
