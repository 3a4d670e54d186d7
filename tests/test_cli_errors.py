"""Bad input to ``wlb`` ends in one line on stderr naming the bad value, exit status 2, no traceback.

Each case is one of the adversarial inputs of issue 13 (directories as paths, an existing file as
``--out``, a JSON list as ``--cost-profile``, a YAML syntax error, a garbage ``.idx``, a huge ``--cp``,
``inf`` / 2**63 lengths, a CSV row, negative counts, micro-batches past int32)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.main import main


def write_indexed(prefix: Path, lengths: list[int], dtype=np.uint16, bin_bytes: int | None = None) -> Path:
    """A Megatron indexed dataset (one sequence per document), written with the .idx layout of
    megatron-core's _IndexWriter; ``bin_bytes`` overrides the .bin size (a truncated/padded file)."""
    from megatron_wlb.data.indexed import write_index

    write_index(prefix, np.asarray(lengths), dtype)
    size = int(np.sum(lengths)) * np.dtype(dtype).itemsize if bin_bytes is None else bin_bytes
    Path(f"{prefix}.bin").write_bytes(b"\0" * size)
    return prefix


def run_wlb(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile.txt").write_text("x\n")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "inf.json").write_text("[1, Infinity]")
    (tmp_path / "big.json").write_text(f"[1, {2**63}]")
    (tmp_path / "nan.txt").write_text("5\nnan\n")
    (tmp_path / "frac.json").write_text("[1.5, 2]")
    (tmp_path / "row.csv").write_text("100,200,300\n")
    (tmp_path / "broken.json").write_text("[1, 2")
    (tmp_path / "bad.yaml").write_text("name: x\nlayout: {tp: 1, cp: 2\n")
    (tmp_path / "mb.jsonl").write_text("[100, 200]\n")
    (tmp_path / "huge.jsonl").write_text(f"[{2**31}, 5]\n")
    (tmp_path / "garbage.idx").write_bytes(b"not an index at all, just bytes")
    (tmp_path / "only_bin.bin").write_bytes(b"\0" * 8)
    return tmp_path


CASES = [
    # (argv, substring the one-line error must contain)
    (["pack", "--lengths", "{d}/adir"], "is a directory"),
    (["pack", "--lengths", "{d}/inf.json"], "inf"),
    (["pack", "--lengths", "{d}/big.json"], str(2**63)),
    (["pack", "--lengths", "{d}/nan.txt"], "'nan' is not an integer"),
    (["pack", "--lengths", "{d}/frac.json"], "entry 0 is 1.5; lengths are whole token counts"),
    (["shard", "--micro-batches", "{d}/mb.jsonl", "--cp", "2", "--cp-sharding", "adaptive", "--out", "{d}/o.jsonl",
      "--tp", "3"], "--tp 3 does not divide the 32 attention heads"),
    (["pack", "--lengths", "{d}/row.csv"], "3 fields"),
    (["pack", "--lengths", "{d}/broken.json"], "broken.json: not valid JSON"),
    (["pack", "--lengths", "{d}/missing.json"], "does not exist"),
    (["pack", "--config", "{d}/bad.yaml"], "not valid YAML at line"),
    (["pack", "--config", "nonexistent_cfg"], "7b_128k"),
    (["pack", "--cost-profile", "{d}/list.json"], "got a list"),
    (["pack", "--cost-profile", "{d}/adir"], "is a directory"),
    (["pack", "--out", "{d}/adir"], "is a directory"),
    (["pack", "--iterations", "0"], "--iterations=0"),
    (["pack", "--data-prefix", "{d}/garbage"], "not a Megatron indexed-dataset index"),
    (["pack", "--data-prefix", "{d}/only_bin"], "only the .bin is there"),
    (["bench", "--out", "{d}/afile.txt", "--quick"], "is an existing file"),
    (["bench", "--scale-iterations", "-1"], "--scale-iterations -1"),
    (["bench", "--iterations", "0"], "--iterations 0"),
    (["shard", "--micro-batches", "{d}/mb.jsonl", "--cp", "2", "--cp-sharding", "adaptive", "--out", "{d}/adir"],
     "is a directory"),
    (["shard", "--micro-batches", "{d}/adir", "--cp", "2", "--cp-sharding", "adaptive", "--out", "{d}/o.jsonl"],
     "is a directory"),
    (["shard", "--micro-batches", "{d}/mb.jsonl", "--cp", str(2**40), "--cp-sharding", "adaptive", "--out",
      "{d}/o.jsonl"], "1 .. 65536"),
    (["shard", "--micro-batches", "{d}/mb.jsonl", "--cp", "2", "--cp-sharding", "adaptive", "--out", "{d}/o.jsonl",
      "--kernel-table", "{d}/list.json"], "got a list"),
    (["shard", "--micro-batches", "{d}/huge.jsonl", "--cp", "2", "--cp-sharding", "per-document", "--out",
      "{d}/o.jsonl"], "int32"),
    (["shard", "--micro-batches", "{d}/broken.json", "--cp", "2", "--cp-sharding", "adaptive", "--out",
      "{d}/o.jsonl"], "broken.json:1: not valid JSON"),
]


@pytest.mark.parametrize("argv, expect", CASES, ids=[" ".join(a[:3]) + f" [{i}]" for i, (a, _) in enumerate(CASES)])
def test_bad_input_gives_one_line_error(capsys, files: Path, argv: list[str], expect: str):
    rc, _, err = run_wlb(capsys, *[a.format(d=files) for a in argv])
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"wlb {argv[0]}: error: "), err
    assert "internal error" not in lines[0] and "Traceback" not in err
    assert expect in lines[0], lines[0]


def test_broken_pipe_is_quiet():
    """`wlb pack | head -1` ends with status 0 and no traceback (stdout closed early)."""
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(f"{sys.executable} -m megatron_wlb pack --config 550m_64k --iterations 1 | head -2",
                          shell=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    first, second = proc.stdout.splitlines()  # the budget line, then the first metric
    assert "Traceback" not in proc.stderr and second.strip().startswith("packer:"), proc.stderr


def test_version_and_python_dash_m(capsys):
    import megatron_wlb

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"megatron-wlb {megatron_wlb.__version__}"


def test_indexed_reader_and_bin_check(tmp_path: Path):
    from megatron_wlb.data.indexed import check_bin_matches_idx, read_idx_lengths

    prefix = write_indexed(tmp_path / "ok", [5, 7, 1])
    assert read_idx_lengths(prefix).tolist() == [5, 7, 1]
    assert read_idx_lengths(f"{prefix}.idx").tolist() == [5, 7, 1]
    check_bin_matches_idx(prefix)  # the right size: no error
    short = write_indexed(tmp_path / "short", [5, 7, 1], bin_bytes=2 * 13 - 2)
    with pytest.raises(ValueError, match=r"short\.bin: 24 bytes.*26 bytes.*truncated"):
        check_bin_matches_idx(short)
    padded = write_indexed(tmp_path / "padded", [5, 7, 1], dtype=np.int32, bin_bytes=4 * 13 + 4)
    with pytest.raises(ValueError, match="larger than its index"):
        check_bin_matches_idx(padded)
    (tmp_path / "nobin.idx").write_bytes((tmp_path / "ok.idx").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"nobin\.bin"):
        check_bin_matches_idx(tmp_path / "nobin")


def test_pack_reads_a_data_prefix(capsys, tmp_path: Path):
    prefix = write_indexed(tmp_path / "corpus", [3000, 60000, 200, 9000] * 50)
    rc, out, err = run_wlb(capsys, "pack", "--config", "550m_64k", "--data-prefix", str(prefix), "--json",
                           "--iterations", "2")
    assert rc == 0, err
    report = json.loads(out)
    assert report["lengths"] == f"prefix:{prefix}" and report["iterations"] == 2


def test_pack_and_bench_read_a_weighted_blend(capsys, tmp_path: Path):
    a = write_indexed(tmp_path / "a", [1001, 1003, 1005] * 200)   # odd lengths tag dataset a
    b = write_indexed(tmp_path / "b", [2000, 4000] * 300)          # even lengths tag dataset b
    plan = tmp_path / "plan.jsonl"
    rc, out, err = run_wlb(capsys, "pack", "--config", "550m_64k", "--data-path", "0.25", str(a), "0.75", str(b),
                           "--json", "--iterations", "3", "--out", str(plan))
    assert rc == 0, err
    assert json.loads(out)["lengths"] == f"data-path:0.25 {a} 0.75 {b}"
    lengths = [p[2] for line in plan.read_text().splitlines() for mb in json.loads(line)["micro_batches"] for p in mb]
    from_a = sum(n for n in lengths if n % 2)
    assert 0.15 < from_a / sum(lengths) < 0.35  # about a quarter of the tokens come from a
    rc, out, err = run_wlb(capsys, "bench", "--config", "550m_64k", "--quick", "--iterations", "2",
                           "--solver-iterations", "1", "--lengths", "wlbllm", "--data-path", "1", str(a), "1", str(b))
    assert rc == 0, err
    assert f"data-path:1 {a} 1 {b}" in out
    rc, _, err = run_wlb(capsys, "pack", "--config", "550m_64k", "--data-path", "nan", str(a))
    assert rc != 0 and "weight 'nan'" in err and len(err.strip().splitlines()) == 1


def test_shard_reads_a_pack_plan(capsys, tmp_path: Path):
    plan = tmp_path / "plan.jsonl"
    rc, _, err = run_wlb(capsys, "pack", "--config", "550m_64k", "--iterations", "2", "--out", str(plan))
    assert rc == 0, err
    batches = [json.loads(line) for line in plan.read_text().splitlines()]
    expect = [[p[2] for p in mb] for b in batches for mb in b["micro_batches"]]
    out = tmp_path / "shard.jsonl"
    rc, _, err = run_wlb(capsys, "shard", "--micro-batches", str(plan), "--cp", "2", "--cp-sharding", "per-document",
                         "--out", str(out))
    assert rc == 0, err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(expect)
    for row, lengths in zip(rows, expect):
        covered = sum(e - s for rank in row["ranks"] for s, e in rank)
        assert covered == sum(row["padded_lengths"]) >= sum(lengths)


@pytest.mark.parametrize("command", [["analyze", "--lengths", "wlbllm", "--config", "550m_64k", "--iterations", "1"],
                                     ["reproduce", "--iterations", "1", "--configs", "550m_64k"]])
@pytest.mark.parametrize("profile, expect", [("list.json", "expected a JSON object"),
                                             ("broken.json", "broken.json: not valid JSON")])
def test_profile_errors_of_the_simulator_commands(capsys, files: Path, command, profile, expect):
    rc, _, err = run_wlb(capsys, *command, "--cost-profile", str(files / profile), "--out", str(files / "out"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and expect in err, err


def test_bin_check_accepts_a_dataset_megatron_core_wrote(tmp_path: Path):
    pytest.importorskip("megatron.core")
    from megatron_wlb.data.indexed import check_bin_matches_idx, read_idx_lengths
    from megatron_wlb.data.reader import write_indexed_dataset

    prefix = write_indexed_dataset(str(tmp_path / "real_text_document"), [[1, 2, 3], [4, 5], list(range(70000))])
    check_bin_matches_idx(prefix)
    assert read_idx_lengths(prefix).tolist() == [3, 2, 70000]
    with open(f"{prefix}.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="larger than its index"):
        check_bin_matches_idx(prefix)


def test_no_subcommand_imports_another():
    """The subcommands share helpers through cli/common.py only: none imports another subcommand
    (no cycles), and common imports none of them."""
    import ast

    from megatron_wlb.cli.main import SUBCOMMANDS

    cli = Path(__file__).resolve().parents[1] / "megatron_wlb" / "cli"
    for path in sorted(cli.glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        others = {f"megatron_wlb.cli.{name}" for name in SUBCOMMANDS if name != path.stem}
        if path.stem != "main":  # the dispatcher loads the subcommands by name
            assert not imported & others, f"{path.name} imports {sorted(imported & others)}"


#: (argv, substring of the one-line error, the work function that must not have started: module, name)
BEFORE_WORK = [
    (["bench", "--lengths", "wlbllm", "--data-prefix", "{d}/missing", "--iterations", "2"],
     "--data-prefix {d}/missing: no {d}/missing.idx", ("megatron_wlb.cli.bench", "run_packer")),
    (["bench", "--lengths", "wlbllm,{d}/missing.json", "--iterations", "2"], "missing.json does not exist",
     ("megatron_wlb.cli.bench", "run_packer")),
    (["bench", "--data-path", "0.5", "{d}/garbage", "0.5", "{d}/garbage", "--iterations", "2"],
     "not a Megatron indexed-dataset index", ("megatron_wlb.cli.bench", "run_packer")),
    (["analyze", "--lengths", "wlbllm", "--config", "550m_64k", "--out", "{d}/o", "--json", "{d}/adir"],
     "--json {d}/adir is a directory", ("megatron_wlb.sim.report", "analyze")),
    (["analyze", "--lengths", "wlbllm", "--config", "550m_64k", "--out", "{d}/afile.txt"],
     "--out {d}/afile.txt is an existing file", ("megatron_wlb.sim.report", "analyze")),
    (["analyze", "--lengths", "wlbllm", "--config", "550m_64k", "--out", "{d}/o", "--seed", "-1"],
     "--seed -1", ("megatron_wlb.data.blend", "shuffle_documents")),
    (["simulate", "--config", "550m_64k", "--json", "{d}/adir"], "--json {d}/adir is a directory",
     ("megatron_wlb.sim.iteration", "simulate_stream")),
    (["simulate", "--config", "550m_64k", "--packer", "bogus"], "--packer bogus: choose one of",
     ("megatron_wlb.sim.iteration", "simulate_stream")),
    (["simulate", "--config", "550m_64k", "--cp-sharding", "bogus"], "--cp-sharding bogus: choose one of",
     ("megatron_wlb.sim.iteration", "simulate_stream")),
    (["simulate", "--config", "550m_64k", "--iterations", "0"], "--iterations 0",
     ("megatron_wlb.sim.iteration", "simulate_stream")),
    (["simulate", "--config", "550m_64k", "--cost-profile", "{d}/list.json"], "got a list",
     ("megatron_wlb.sim.iteration", "simulate_stream")),
    (["reproduce", "--configs", "550m_64k", "no_such_cfg", "--out", "{d}/o"], "no_such_cfg",
     ("megatron_wlb.sim.report", "reproduce")),
    (["reproduce", "--configs", "550m_64k", "--out", "{d}/afile.txt"], "--out {d}/afile.txt is an existing file",
     ("megatron_wlb.sim.report", "reproduce")),
]


@pytest.mark.parametrize("argv, expect, work", BEFORE_WORK,
                         ids=[" ".join(a[:3]) + f" [{i}]" for i, (a, _, _) in enumerate(BEFORE_WORK)])
def test_bad_input_fails_before_any_work(capsys, monkeypatch, files: Path, argv: list[str], expect: str, work):
    """Every input of bench / analyze / simulate / reproduce is checked before the work starts (the
    work function is replaced by one that records a call): one line naming the bad value."""
    import importlib

    calls = []

    def started(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("the work started before the inputs were checked")

    monkeypatch.setattr(importlib.import_module(work[0]), work[1], started)
    rc, _, err = run_wlb(capsys, *[a.format(d=files) for a in argv])
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line]
    assert rc == 2 and not calls, err
    assert len(lines) == 1 and lines[0].startswith(f"wlb {argv[0]}: error: "), err
    assert expect.format(d=files) in lines[0], lines[0]


def test_without_pyyaml_help_works_and_a_config_is_one_line(tmp_path):
    """pyyaml missing (a bare GPU machine): `python -m megatron_wlb --help` works, and reading a config says in
    one line which package to bring (issue 20, item 4)."""
    import subprocess
    import sys

    block = ("import runpy, sys; sys.modules['yaml'] = None; sys.argv = ['wlb', *sys.argv[1:]]; "
             "runpy.run_module('megatron_wlb', run_name='__main__')")
    run = [sys.executable, "-c", block]
    res = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "calibrate" in res.stdout, res.stderr
    res = subprocess.run([*run, "simulate", "--config", "7b_64k", "--iterations", "1"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "needs the Python package 'pyyaml'" in res.stderr and "pip install 'pyyaml>=6'" in res.stderr


def test_requirements_list_what_megatron_imports():
    from megatron_wlb.requirements import all_requirements

    names = {r.split(">")[0].split("=")[0] for r in all_requirements()}
    assert {"pyyaml", "packaging", "six", "regex", "pydantic", "pydantic-core", "annotated-types",
            "typing-inspection", "typing_extensions"} == names
