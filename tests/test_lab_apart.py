"""The product and the lab apart (issue 34): the package never imports the benchmarks (``benchmarks/``) nor the
scripts; the benchmarks import the package. Checked on the source, by the import statements themselves."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_package_imports_no_benchmark_and_no_script():
    lab = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} | {p.stem for p in (ROOT / "scripts").glob("*.py")}
    assert "_results" in lab and "bench_paired" in lab  # the scan sees the lab
    offenders = {str(p.relative_to(ROOT)): sorted(_imported(p) & lab)
                 for p in (ROOT / "megatron_wlb").rglob("*.py") if _imported(p) & lab}
    assert not offenders, offenders


def test_every_benchmark_is_one_command_over_the_package():
    for path in (ROOT / "benchmarks").glob("bench_*.py"):
        text = path.read_text()
        assert "megatron_wlb" in text, f"{path.name} does not use the package"
        assert '__name__ == "__main__"' in text, f"{path.name} is not runnable as one command"
