"""The support table (docs/support.md, linked from the README) says what the version gate
(megatron_wlb/megatron/args/version.py) admits and what
setup.py's [megatron] extra installs: every admitted series, the releases CI trains with, each patched
checkout's commit and the main commit trained, and nothing the gate refuses (the extra installs every admitted
series that is not checkout-only)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_wlb.megatron.args.version import (
    CHECKOUT_ONLY_SERIES,
    MAIN_COMMIT,
    MOVING_CHECKOUTS,
    PATCHED_CHECKOUTS,
    SUPPORTED_SERIES,
    TESTED_RELEASES,
    is_supported,
)

ROOT = Path(__file__).resolve().parents[1]


def support_rows() -> list[list[str]]:
    """The cells of docs/support.md's first table (header and rule left out)."""
    assert "docs/support.md" in (ROOT / "README.md").read_text(), "the README does not link the support table"
    text = (ROOT / "docs" / "support.md").read_text()
    lines = []
    for line in text[text.index("| Megatron |"):].splitlines():
        if not line.startswith("|"):
            break
        lines.append(line)
    assert len(lines) >= 3, "no support table in docs/support.md"
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def series_named(cell: str) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for a, b in re.findall(r"(?<![\d.])(\d+)\.(\d+)(?:\.(?:\d+|x))?", cell)}


def test_the_readme_table_lists_exactly_what_the_gate_admits():
    rows = support_rows()
    named = set().union(*(series_named(row[0]) for row in rows))
    assert named == set(SUPPORTED_SERIES), f"table names {sorted(named)}, the gate admits {sorted(SUPPORTED_SERIES)}"
    first_cells = " ".join(row[0] for row in rows)
    for release in TESTED_RELEASES:
        assert release in first_cells, f"CI trains with {release}; the table does not name it"
    for tag, commit in PATCHED_CHECKOUTS.items():
        (row,) = [r for r in rows if tag in r[0]]
        assert commit in row[0], f"the {tag} row does not name its commit {commit}"
        assert "apply_patches.sh" in row[1]
    (main,) = [r for r in rows if "**main**" in r[0]]
    assert MAIN_COMMIT in main[0] and "launcher" in main[1]
    for name, commit in MOVING_CHECKOUTS.items():  # main after PR #6742 and dev: what CI trains the launcher over
        (row,) = [r for r in rows if commit in r[0]]
        assert "launcher" in row[1] and "CP2-PP2" in row[2], f"the {name} row does not say how CI trains it"


def test_the_megatron_extra_installs_what_the_gate_admits():
    setup = (ROOT / "setup.py").read_text()
    spec = SpecifierSet(re.search(r'"megatron-core([^"]+)"', setup).group(1))
    for minor in range(14, 22):
        for patch in (0, 1, 2):
            version = f"0.{minor}.{patch}"
            installable = is_supported(version) and (0, minor) not in CHECKOUT_ONLY_SERIES
            assert (Version(version) in spec) == installable, version
