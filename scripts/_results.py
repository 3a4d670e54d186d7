"""Shared by the benchmark scripts: write a result as OUT.json and OUT.md (and print the Markdown), and
write a summary table into the results page (``docs/results.md``, ``--page``) after its marker."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

#: the generated results page every benchmark's ``--page`` writes its block into (the README links it)
RESULTS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "results.md"


def write_result(out: str | Path, result: dict, to_markdown: Callable[[dict], str]) -> None:
    """``out`` is a path without suffix; its folder is created if needed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    md = to_markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)


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
