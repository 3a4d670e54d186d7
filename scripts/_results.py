"""Shared by the benchmark scripts: write a result as OUT.json and OUT.md, and print the Markdown."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def write_result(out: str | Path, result: dict, to_markdown: Callable[[dict], str]) -> None:
    """``out`` is a path without suffix; its folder is created if needed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    md = to_markdown(result)
    out.with_suffix(".md").write_text(md)
    print(md)
