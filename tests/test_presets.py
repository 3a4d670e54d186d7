"""Packer presets (issue 34 item 2): the table, ``paper`` = Algorithm 1, explicit knobs over a preset in
YAML / ``--wlb-*`` flags / ``wlb pack``, shipped configs minimal, and the recorded preset rows consistent with the
frontier and docs/packing.md."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from megatron_wlb.config import (
    CONFIG_DIR,
    config_from_dict,
    list_configs,
    load_config,
)
from megatron_wlb.megatron.args.flags import add_wlb_args, one_line_errors, settings_from_args
from megatron_wlb.megatron.args.settings import WlbSettings
from megatron_wlb.packing import PackingConfig, make_packer
from megatron_wlb.packing.presets import PRESETS, preset_default, preset_values

ROOT = Path(__file__).resolve().parents[1]
RUN = {"model": "7b", "seq_len": 131072, "layout": {"tp": 8, "cp": 2, "pp": 4, "dp": 1}}


def test_preset_table_is_the_documented_one():
    assert {k: dict(v) for k, v in PRESETS.items()} == {
        "default": {}, "paper": {"release": "paper", "fill": "off", "schedule_order": False}}
    docs = (ROOT / "docs" / "packing.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `paper` |"))
    for field, value in PRESETS["paper"].items():
        shown = str(value).lower() if isinstance(value, bool) else value
        assert f"`{field}: {shown}`" in row, (field, row)
    with pytest.raises(ValueError, match="choose one of default, paper"):
        preset_values("papers")


def _release_stream() -> list[int]:
    lengths: list[int] = []
    for d in (62, 98, 64, 97, 63, 99):
        lengths += [d] + [5] * 30
    return lengths


def test_paper_preset_runs_algorithm_1():
    """A full queue (R = 2) releases its two oldest outliers, only as a group; no read-ahead or early
    release fills an iteration; the default groups by work (62 with 64) and reads ahead instead."""
    base = dict(seq_len=100, n=2, dp=1, max_seq_len=150, queue_thresholds=(60,), max_delay=20)
    outcome = {}
    for preset in ("paper", "default"):
        packer = make_packer("wlb", PackingConfig(**base, **preset_values(preset)))
        batches = list(packer.pack(_release_stream()))
        released = [sorted(p.length for p in b.pieces() if p.length >= 60) for b in batches]
        outcome[preset] = (next(r for r in released if r), [len(r) for r in released if r], packer)
    first, sizes, packer = outcome["paper"]
    assert first == [62, 98] and set(sizes[:-1]) == {2}  # the R oldest, R at a time (the last: end of stream)
    assert packer.read_ahead_tokens == 0 and packer.fill_releases == 0 and packer.balanced_releases == 0
    first, _, packer = outcome["default"]
    assert first != [62, 98] and packer.read_ahead_tokens > 0


def test_yaml_preset_with_explicit_knobs_over_it():
    run = config_from_dict({**RUN, "packing": {"preset": "paper", "schedule_order": True, "max_delay": 4}})
    p = run.packing
    assert (run.preset, p.release, p.fill, p.schedule_order, p.max_delay) == ("paper", "paper", "off", True, 4)
    assert run.packing_overrides() == {"schedule_order": True, "max_delay": 4}
    back = run.under_preset("default")
    assert (back.packing.release, back.packing.fill, back.packing.max_delay) == ("balanced", "full", 4)
    with pytest.raises(ValueError, match=r"packing.preset='fast'; choose one of default, paper"):
        config_from_dict({**RUN, "packing": {"preset": "fast"}})


def _parse(argv: list[str]) -> argparse.Namespace:
    return one_line_errors(add_wlb_args(argparse.ArgumentParser(prog="pretrain"))).parse_args(argv)


def test_flags_preset_and_explicit_flags(tmp_path: Path):
    s = settings_from_args(_parse(["--wlb-preset", "paper", "--wlb-max-delay", "4"]))
    assert (s.preset, s.release, s.fill, s.schedule_order, s.max_delay) == ("paper", "paper", "off", False, 4)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, "packing": {"preset": "paper", "max_delay": 3}}))
    s = settings_from_args(_parse(["--wlb-config", str(cfg), "--wlb-max-delay", "5"]))
    assert (s.release, s.fill, s.schedule_order, s.max_delay) == ("paper", "off", False, 5)
    # a flag's preset replaces the config's; the config's explicit knobs still apply
    s = settings_from_args(_parse(["--wlb-config", str(cfg), "--wlb-preset", "default"]))
    assert (s.release, s.fill, s.max_delay) == ("balanced", "full", 3)
    assert WlbSettings(preset="paper", release="paper") == WlbSettings(preset="paper")


@pytest.mark.parametrize("name", list_configs())
def test_shipped_configs_restate_no_default(name: str):
    raw = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
    run = load_config(name)
    stated = {"name": raw.get("name") == name, "micro_batches": raw.get("micro_batches") == run.layout.pp,
              "virtual_stages": raw.get("virtual_stages") == 1, "cp_sharding": raw.get("cp_sharding") == "adaptive"}
    assert not [k for k, same in stated.items() if k in raw and same]
    packing = raw.get("packing") or {}
    preset = packing.get("preset", "default")
    assert packing.get("packer", None) != "wlb" and packing.get("max_seq_len") != run.seq_len * 3 // 2
    assert not [k for k, v in packing.items() if k not in ("packer", "preset") and v == preset_default(preset, k)]


def test_recorded_preset_rows_match_the_frontier_and_the_docs():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_presets import table

    presets = json.loads((ROOT / "benchmarks" / "results" / "presets.json").read_text())
    assert presets["presets"] == {k: dict(v) for k, v in PRESETS.items()}
    frontier = json.loads((ROOT / "benchmarks" / "results" / "packing_frontier.json").read_text())
    wlb8 = {(t["stream"], t["dp"]): next(r for r in t["rows"] if r["label"] == "wlb, max_delay 8")
            for t in frontier["tables"]}
    for t in presets["tables"]:
        want = wlb8[(t["stream"], t["dp"])]
        got = t["rows"]["default"]
        assert got["schedule_ratio"] == pytest.approx(want["schedule_ratio"], abs=1e-9), t["stream"]
        assert got["mean_delay"] == pytest.approx(want["mean_delay"], abs=1e-9), t["stream"]
    docs = (ROOT / "docs" / "packing.md").read_text()
    assert table(presets) in docs, "docs/packing.md's preset table drifted: python benchmarks/bench_presets.py --docs"
    assert re.search(r"<!-- presets-table -->\n\| stream", docs)


def test_nested_sections_reach_megatron_and_flags_win(tmp_path: Path):
    profile = tmp_path / "p.json"
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, "cp": {"sharding": "per-document"}, "cost": {"profile": str(profile)},
                                   "logging": {"log_interval": 5, "trace": "t"}}))
    run = load_config(cfg)
    assert (run.cp.sharding, run.cost.profile, run.logging.log_interval, run.logging.trace) == \
        ("per-document", str(profile), 5, "t")
    s = settings_from_args(_parse(["--wlb-config", str(cfg), "--wlb-log-interval", "2"]))
    assert (s.cp_sharding, s.cost_profile, s.log_interval, s.trace) == ("per-document", str(profile), 2, "t")


def test_the_run_shape_is_never_a_flag(capsys):
    from megatron_wlb.megatron.args.settings import FLAG_KNOBS

    shape = {"seq_len", "n", "dp", "pipeline_stages", "virtual_stages"}
    assert not shape & set(FLAG_KNOBS) and not shape & set(WlbSettings.names())
    for flag in ("--wlb-seq-len", "--wlb-virtual-stages", "--wlb-dp"):
        with pytest.raises(SystemExit):
            _parse([flag, "2"])
    capsys.readouterr()


def test_the_packer_flag_is_named_as_in_yaml_and_the_cli(capsys):
    assert settings_from_args(_parse(["--wlb-packer", "fixed-greedy"])).packer == "fixed-greedy"
    with pytest.raises(SystemExit):
        _parse(["--wlb-packing", "wlb"])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--wlb-packing" in err, err  # no hidden old spelling: unknown
    with pytest.raises(ValueError, match="unknown WLB setting.* packing; valid: packer"):
        WlbSettings(packing="wlb")


def test_a_checkpoint_s_max_seq_len_compares_as_resolved():
    """``max_seq_len`` None (1.5 x seq_len) and the same length stated are one setting on resume; another is named."""
    from megatron_wlb.megatron.state.checkpoint import settings_difference
    from megatron_wlb.packing.base import fingerprint_difference, settings_fingerprint

    now = WlbSettings().to_dict()
    assert settings_difference({**now, "max_seq_len": 196608}, now, seq_len=131072) == []
    assert settings_difference({**now, "max_seq_len": 196608}, now, seq_len=65536) == ["max_seq_len: 196608 -> 98304"]
    fp = settings_fingerprint(PackingConfig(seq_len=1000, n=4), None)
    assert fingerprint_difference({**fp, "max_seq_len": 1500}, {**fp, "max_seq_len": None}) == ""
    assert "max_seq_len" in fingerprint_difference({**fp, "max_seq_len": 1400}, {**fp, "max_seq_len": None})


def test_the_cost_model_policy_lives_in_the_cost_section():
    run = config_from_dict({**RUN, "cost": {"model": "online", "refit_interval": 5}})
    assert (run.packing.cost_model, run.packing.refit_interval) == ("online", 5)
    with pytest.raises(ValueError, match=r"packing.cost_model moved to cost.model"):
        config_from_dict({**RUN, "packing": {"cost_model": "online"}})
    with pytest.raises(ValueError, match=r"unknown cost key\(s\) 'models'; valid: profile, model, refit_interval"):
        config_from_dict({**RUN, "cost": {"models": "online"}})
    with pytest.raises(ValueError, match=r"cost.model='later'"):
        config_from_dict({**RUN, "cost": {"model": "later"}})
