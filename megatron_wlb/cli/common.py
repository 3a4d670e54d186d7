"""Checks the subcommands share, so that bad paths and numbers fail at once in one line naming the
flag and the value, before any work is done."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a file to write: not a directory, its parent creatable."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {p} is a directory; give a file name")
    parent = p.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {p}: {parent} is a file, not a directory")
    parent.mkdir(parents=True, exist_ok=True)
    return p


def output_dir(path: str | Path, flag: str = "--out") -> Path:
    """``path`` as a directory to write into (created), not an existing file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {p} is an existing file; give a directory")
    p.mkdir(parents=True, exist_ok=True)
    return p


def input_file(path: str | Path, flag: str) -> Path:
    """``path`` as an existing regular file to read."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {p} does not exist")
    if not p.is_file():
        raise ValueError(f"{flag} {p} is a directory, not a file")
    return p


def read_json_object(path: str | Path, flag: str) -> dict[str, Any]:
    """The JSON object in ``path``; a list, a syntax error or binary data is a one-line error."""
    p = input_file(path, flag)
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {p}: expected a JSON object with a \"format\" field, got a {type(data).__name__}")
    return data


def positive(value: int, flag: str, maximum: int | None = None) -> int:
    """``value`` if it is an integer >= 1 (and <= ``maximum``), else a one-line error."""
    if value < 1 or (maximum is not None and value > maximum):
        valid = f"1 .. {maximum}" if maximum is not None else "a positive integer"
        raise ValueError(f"{flag} {value}: must be {valid}")
    return value


def show_progress() -> bool:
    """Progress bars only on a terminal: in a log file they are noise."""
    return sys.stderr.isatty()


def cost_profile(path: str | Path | None, flag: str = "--profile") -> str | None:
    """``path`` after checking it is a ``megatron-wlb-profile/1`` file the cost model can read."""
    if path is None:
        return None
    from megatron_wlb.costmodel import PROFILE_FORMAT, load_profile

    fmt = read_json_object(path, flag).get("format")
    if fmt != PROFILE_FORMAT:
        raise ValueError(f"{flag} {path}: format {fmt!r}, expected {PROFILE_FORMAT!r} (a cost-model profile "
                         "written by `wlb calibrate`)")
    try:
        load_profile(path)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{flag} {path}: malformed profile ({type(exc).__name__}: {exc})") from None
    return str(path)
