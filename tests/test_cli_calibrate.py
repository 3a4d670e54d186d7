"""``wlb calibrate``: the CPU smoke run goes through the whole measuring code path and writes a
profile that --profile readers accept (pack, analyze) and a kernel table that shard accepts; without
--smoke and without CUDA it refuses in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megatron_wlb.cli.main import main  # noqa: E402
from megatron_wlb.costmodel import PROFILE_FORMAT, build_cost_model, get_model, load_profile  # noqa: E402
from megatron_wlb.costmodel.shapes import ParallelLayout  # noqa: E402
from megatron_wlb.cp.efficiency import KernelEfficiency  # noqa: E402


@pytest.fixture(scope="module")
def smoke_profile(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cal") / "profile.json"
    assert main(["calibrate", "--smoke", "--out", str(out)]) == 0
    return out


def test_smoke_writes_the_profile_format_the_reader_takes(smoke_profile: Path):
    profile = load_profile(smoke_profile)
    assert profile["format"] == PROFILE_FORMAT and profile["tp"] == 1
    assert len(profile["attention"]["lengths"]) == len(profile["attention"]["bwd_s"]) >= 3
    assert all(t > 0 for t in profile["attention"]["fwd_s"] + profile["linear"]["bwd_s"])
    # the calibrated model prices a real shape from the tiny profile (rescaled by FLOPs)
    cost = build_cost_model(get_model("7b"), ParallelLayout(tp=8), profile=smoke_profile)
    import numpy as np

    lat = cost.workload(np.array([1024, 8192]))
    assert lat[1] > lat[0] > 0
    table = KernelEfficiency.from_json(smoke_profile.with_suffix(".efficiency.json"))
    assert table.q_lens.tolist() == [4, 8, 16] and table.kv_lens.tolist() == [8, 16]
    assert (table.table > 0).all()


def test_the_profile_feeds_analyze_pack_and_shard(smoke_profile: Path, tmp_path: Path, capsys):
    assert main(["analyze", "--profile", str(smoke_profile), "--config", "550m_64k", "--iterations", "1",
                 "--lengths", "wlbllm", "--out", str(tmp_path / "an")]) == 0
    assert (tmp_path / "an" / "report.md").exists()
    assert main(["pack", "--profile", str(smoke_profile), "--config", "550m_64k", "--iterations", "1",
                 "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["iterations"] == 1
    (tmp_path / "mb.jsonl").write_text("[100, 2000, 30000]\n")
    assert main(["shard", "--micro-batches", str(tmp_path / "mb.jsonl"), "--cp", "2", "--layout", "adaptive",
                 "--out", str(tmp_path / "o.jsonl"), "--profile",
                 str(smoke_profile.with_suffix(".efficiency.json"))]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_refuses_in_one_line(tmp_path: Path, capsys):
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no CUDA device" in err and "--smoke" in err
    assert not (tmp_path / "p.json").exists()
