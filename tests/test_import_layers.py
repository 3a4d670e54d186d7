"""The package's floors only go down: the import graph of ``megatron_wlb`` read with ``ast`` (no import runs).

Levels, lowest first: ``schedule`` and ``data``, ``costmodel``, ``packing``, ``cp``, ``sim``. A module imports
only from a lower level (or its own package), every import among these packages sits at the top of its
module (none placed inside a function to dodge a cycle), and their modules form no cycle (``CHECKED``). An import of
``a.b.c`` also runs the ``__init__`` of ``a.b`` and ``a``, so those count as imported from another package.
No module of the whole package (the Megatron adapter and the cli included) is in a cycle, counting the imports
placed inside functions: a lazy import delays a cycle, it does not remove it (issue 60: ``main_checks`` <->
``main_schedule``, broken by their shared names moving below both, ``main_names``).

The Megatron adapter's sub-packages have floors too (``ADAPTER_LEVELS``, lowest first): ``args`` (Megatron's args and
ours), ``data`` (the data path), ``state`` (the run's state), ``hooks`` (the table and its replacements), ``entry`` (the
ways in). A module of one imports only from its own sub-package or a lower one, function-level imports included; the
arrows against that order still in the code are named in ``ADAPTER_UP`` (each to be moved away, never added to: the
test fails on a new one, and on a listed one that is gone, so the list only shrinks). No module sits at the adapter's
top level beside ``__init__`` (``apply()`` and the public API), which may import every sub-package.

``python tests/test_import_layers.py`` prints the arrows between packages (who imports whom, how often).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_wlb"
LEVELS = {"schedule": 0, "data": 0, "costmodel": 1, "packing": 2, "cp": 3, "sim": 4}
#: the packages whose modules are checked for nested imports and cycles (costmodel: shapes and table, then
#: fit, then model, then refit, since the fit moved into ``costmodel/fit.py``)
CHECKED = {"schedule", "data", "costmodel", "packing", "cp", "sim"}
ADAPTER = "megatron"
#: the Megatron adapter's sub-packages, lowest first (issue 60 item 3)
ADAPTER_LEVELS = {"args": 0, "data": 1, "state": 2, "hooks": 3, "entry": 4}
#: (importing module, imported module) of the adapter against ADAPTER_LEVELS, each with why it is still there
ADAPTER_UP = {
    # preflight asks whether our TorchNorm hook is installed (hooks.table.is_installed)
    ("args.preflight", "hooks.table"): "preflight reads the hooks table",
    # the data builder prints on rank 0 through the process state, and pins a TP batch through cp_hooks
    ("data.iterators", "state.process"): "print_rank0",
    ("data.iterators", "hooks.cp_hooks"): "pinned_batch_fields (function-level: torch)",
    # the run-state modules that install wrappers of their own rebind them as the hooks do
    ("state.agreement", "hooks.rebind"): "wrapping",
    ("state.checkpoint", "hooks.rebind"): "wrapping",
    ("state.timing", "hooks.rebind"): "wrapping",
    ("state.timing", "hooks.table"): "install of the timing phase",
    ("state.wlb_logging", "hooks.rebind"): "wrapping",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> list[tuple[str, str, bool, int]]:
    """(importing module, imported module, inside a function, line) of every import within megatron_wlb."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        nested = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                  for node in ast.walk(fn) if isinstance(node, ast.Import | ast.ImportFrom)}
        src = module_name(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
                # ``from megatron_wlb.packing import wlb`` imports the module megatron_wlb.packing.wlb
                targets += [f"{node.module}.{a.name}" for a in node.names
                            if (PACKAGE.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py")
                            .exists()]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            out.extend((src, t, id(node) in nested, node.lineno) for t in targets
                       if t == "megatron_wlb" or t.startswith("megatron_wlb."))
    return out


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def graph(edges: list[tuple[str, str, bool, int]]) -> dict[str, set[str]]:
    """Module -> modules it runs on import, parents' ``__init__`` included across packages."""
    out: dict[str, set[str]] = {}
    for src, dst, _, _ in edges:
        parts = dst.split(".")
        targets = {dst} | {".".join(parts[:k]) for k in range(2, len(parts))}
        out.setdefault(src, set()).update(t for t in targets if t != src and not src.startswith(t + "."))
    return out


def cycles(g: dict[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module among ``nodes`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, set()) & nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def layered(module: str) -> bool:
    return package_of(module) in LEVELS


def checked(module: str) -> bool:
    return package_of(module) in CHECKED


def test_no_import_inside_a_function_among_the_layered_packages():
    nested = [f"{s}:{line} imports {d}" for s, d, inside, line in imports() if inside and checked(s) and layered(d)]
    assert nested == []


def test_every_arrow_between_packages_goes_down():
    up = sorted({f"{s}:{line} -> {d}" for s, d, _, line in imports()
                 if layered(s) and layered(d) and package_of(s) != package_of(d)
                 and LEVELS[package_of(d)] >= LEVELS[package_of(s)]})
    assert up == []


def test_no_cycle_among_the_layered_modules():
    edges = imports()
    nodes = {module_name(p) for p in PACKAGE.rglob("*.py")}
    assert cycles(graph(edges), {m for m in nodes if checked(m)}) == []


def test_no_cycle_among_all_modules_function_level_imports_included():
    edges = imports()
    assert cycles(graph(edges), {module_name(p) for p in PACKAGE.rglob("*.py")}) == []


def adapter_part(module: str) -> tuple[str, str] | None:
    """(sub-package, module within it) of an adapter module in a sub-package, else None (the adapter's and the
    sub-packages' ``__init__``: a sub-package's holds only its docstring, ``from sub import module`` names it too)."""
    parts = module.split(".")
    if len(parts) < 4 or parts[1] != ADAPTER:
        return None
    return parts[2], ".".join(parts[2:])


def adapter_arrows_up(edges: list[tuple[str, str, bool, int]]) -> set[tuple[str, str]]:
    """(importing, imported) adapter modules where the imported sub-package is not below or equal to the importer's."""
    up = set()
    for src, dst, _, _ in edges:
        a, b = adapter_part(src), adapter_part(dst)
        if a is None or b is None or a[0] == b[0]:
            continue
        if ADAPTER_LEVELS[b[0]] > ADAPTER_LEVELS[a[0]]:
            up.add((a[1], b[1]))
    return up


def test_the_adapter_is_its_sub_packages_only():
    adapter = PACKAGE / ADAPTER
    assert sorted(p.name for p in adapter.glob("*.py")) == ["__init__.py"]
    subs = sorted(p.parent.name for p in adapter.glob("*/__init__.py"))
    assert subs == sorted(ADAPTER_LEVELS)
    for sub in subs:  # a short docstring saying what it owns, and no code (nothing imported on the way down)
        tree = ast.parse((adapter / sub / "__init__.py").read_text())
        assert ast.get_docstring(tree) and len(tree.body) == 1, sub


def test_every_adapter_arrow_goes_down_its_sub_packages():
    up = adapter_arrows_up(imports())
    assert sorted(up - set(ADAPTER_UP)) == [], "an adapter import against ADAPTER_LEVELS"
    assert sorted(set(ADAPTER_UP) - up) == [], "gone from the code: remove it from ADAPTER_UP"


def test_the_adapter_order_checker_sees_an_arrow_up():
    edges = [("megatron_wlb.megatron.args.settings", "megatron_wlb.megatron.entry.launcher", True, 3),
             ("megatron_wlb.megatron.entry.launcher", "megatron_wlb.megatron.args.settings", False, 4),
             ("megatron_wlb.megatron", "megatron_wlb.megatron.entry.cpu", False, 5)]
    assert adapter_arrows_up(edges) == {("args.settings", "entry.launcher")}


def test_the_checker_sees_a_cycle_and_an_import_inside_a_function():
    g = {"megatron_wlb.packing.a": {"megatron_wlb.sim.b"}, "megatron_wlb.sim.b": {"megatron_wlb.packing.a"}}
    assert cycles(g, set(g)) == [sorted(g)]
    assert any(inside for s, d, inside, _ in imports() if s.startswith("megatron_wlb.megatron"))
    # a cycle closed by an import inside a function is a cycle
    lazy = [("megatron_wlb.megatron.a", "megatron_wlb.megatron.b", False, 1),
            ("megatron_wlb.megatron.b", "megatron_wlb.megatron.a", True, 9)]
    assert cycles(graph(lazy), {"megatron_wlb.megatron.a", "megatron_wlb.megatron.b"}) == \
        [["megatron_wlb.megatron.a", "megatron_wlb.megatron.b"]]


if __name__ == "__main__":
    arrows = Counter((package_of(s) or "(root)", package_of(d) or "(root)") for s, d, _, _ in imports()
                     if package_of(s) != package_of(d))
    for (a, b), n in sorted(arrows.items()):
        mark = " UP" if a in LEVELS and b in LEVELS and LEVELS[b] >= LEVELS[a] else ""
        print(f"{a:>10} -> {b:<12} {n:3d}{mark}")
    parts = [(adapter_part(s), adapter_part(d)) for s, d, _, _ in imports()]
    inner = Counter((a[0], b[0]) for a, b in parts if a and b and a[0] != b[0])
    print("the adapter's sub-packages:")
    for (a, b), n in sorted(inner.items()):
        print(f"{a:>10} -> {b:<12} {n:3d}{' UP' if ADAPTER_LEVELS[b] > ADAPTER_LEVELS[a] else ''}")
    sys.exit(0)


def test_the_cli_imports_the_package_at_the_top():
    """The cli sits above every layer, so none of its imports can close a cycle: a package import inside a cli
    function is only for a module that pulls in torch or megatron-core (``cp.attention``, ``megatron.*``)."""
    lazy_ok = ("megatron_wlb.cp.attention", "megatron_wlb.megatron")
    nested = [(src, target, line) for src, target, inside, line in imports()
              if src.startswith("megatron_wlb.cli.") and inside and not target.startswith(lazy_ok)]
    assert not nested, nested
