"""``wlb``: the command line. Each subcommand lives in its own module of this package and
provides ``add_parser(subparsers)`` (which sets ``func``) so the dispatcher stays one screen.

Errors end in one line on stderr (``wlb CMD: error: ...``, exit status 2), never a traceback:
bad input raises ValueError / OSError with a message naming the value and what is valid; anything
else is reported as an internal error in one line (``WLB_TRACEBACK=1`` shows the traceback).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from megatron_wlb import __version__
from megatron_wlb.requirements import MissingDependency

# Subcommand modules, in the order `wlb --help` lists them.
SUBCOMMANDS = ("pack", "bench", "shard", "simulate", "reproduce", "analyze", "calibrate", "compare-loss")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wlb",
        description="Workload-balanced 4D parallelism (WLB-LLM) for Megatron-LM: pack documents, "
                    "shard them over context parallelism, and simulate what it buys.",
    )
    parser.add_argument("--version", action="version", version=f"megatron-wlb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        module_name = f"megatron_wlb.cli.{name.replace('-', '_')}"
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).add_parser(sub)
    return parser


def error_line(exc: BaseException) -> str:
    """The one-line message of ``exc``: input errors as they are, OS errors with the path."""
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in str(exc.args[-1]):
        text = f"{exc.filename}: {exc.strerror or exc}"
    elif isinstance(exc, (ValueError, OSError, MissingDependency)):
        text = str(exc)
    elif isinstance(exc, MemoryError):
        text = "out of memory (an input is too large: lower --cp, --iterations or the data size)"
    else:
        text = f"internal error {type(exc).__name__}: {exc} (set WLB_TRACEBACK=1 for the traceback)"
    return text.strip() or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"wlb {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout closed early (`wlb ... | head`): not an error of ours; silence the flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception as exc:
        if os.environ.get("WLB_TRACEBACK"):
            raise
        print(f"wlb {args.command}: error: {error_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
