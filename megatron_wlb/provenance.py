"""Provenance of a measurement: which machine produced it, and the result written where it can be reread
(benchmarks, the GPU kit, traces and reports record them).

A floor module: it imports nothing of the package, so the CLI, the Megatron adapter and the benchmark
scripts all take it from here.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

__all__ = ["machine", "markdown_table", "replace_text", "write_result"]


def machine() -> str:
    """One line naming this machine's CPU, cores, Python and load (benchmarks record it)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ""
    if hasattr(os, "getloadavg"):
        load = f", load average {os.getloadavg()[0]:.1f} at start (shared machine)"
    return f"{cpu}, {os.cpu_count()} cores visible, Python {platform.python_version()}, {platform.system()}{load}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> list[str]:
    """A Markdown table's lines: ``header``, the rule (``align``: ``r`` right-aligns that column, anything
    else leaves it plain; default all plain), then one line per row of already formatted cells."""
    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|",
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def replace_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` beside it, then rename it into place: a run killed while writing leaves the
    previous version, not half a file (the GPU kit rewrites its results after every measured point)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_result(out: str | Path, result: dict, to_markdown: Callable[[dict], str], echo: bool = True) -> None:
    """Write ``result`` as OUT.json and ``to_markdown(result)`` as OUT.md (and print it, unless not ``echo``);
    ``out`` is a path without suffix, its folder created if needed; each file replaced whole (``replace_text``)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = to_markdown(result)
    replace_text(out.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    replace_text(out.with_suffix(".md"), md)
    if echo:
        print(md)
