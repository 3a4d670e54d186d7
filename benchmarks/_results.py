"""Shared by the benchmark scripts: write a result as OUT.json and OUT.md (and print the Markdown), and
write a summary table into the results page (``benchmarks/results.md``, ``--page``) after its marker."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megatron_wlb.provenance import write_result

__all__ = ["RESULTS_PAGE", "record", "replace_block", "replace_readme_table", "write_result"]

#: the generated results page every benchmark's ``--page`` writes its block into (the README links it)
RESULTS_PAGE = Path(__file__).resolve().parents[1] / "benchmarks" / "results.md"


def replace_readme_table(path: Path, marker: str, table: str) -> None:
    """Replace the Markdown table right after the line ``marker`` in the page at ``path`` with
    ``table`` (the lines starting with ``|`` there; none is fine)."""
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.strip() == marker), None)
    if start is None:
        raise SystemExit(f"{path}: no {marker} line to write the table after")
    stop = start + 1
    while stop < len(lines) and lines[stop].startswith("|"):
        stop += 1
    path.write_text("".join(lines[:start + 1]) + table + "".join(lines[stop:]))


def replace_block(path: Path, begin: str, end: str, text: str) -> None:
    """Replace what lies between the markers ``begin`` and ``end`` of the page at ``path`` with ``text``; a page
    without them stops the benchmark in one line."""
    page = path.read_text()
    a, b = page.find(begin), page.find(end)
    if a < 0 or b < a:
        raise SystemExit(f"{path}: no {begin} ... {end} block")
    path.write_text(page[:a + len(begin)] + "\n" + text + "\n" + page[b:])


def record(out: str | Path, result: dict, to_markdown: Callable[[dict], str],
           write_page: Callable[[dict, Path], None] | None = None) -> int:
    """Write ``result`` as OUT.json and OUT.md, and with ``write_page`` (a benchmark run with ``--page``)
    its block into the results page; the benchmark's exit status (0)."""
    write_result(out, result, to_markdown)
    if write_page is not None:
        write_page(result, RESULTS_PAGE)
    return 0
