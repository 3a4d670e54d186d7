"""The GPU kit's one-call budget (issue 45), checked without staging a kit: megatron_wlb/kit.py's shares add up
within the budget (what a part leaves passes on), and a measuring script stopped at its deadline exits 0 with
what it measured written, flagged ``partial`` and ``stopped_at_deadline`` (tests/test_gpu_kit.py runs the
whole path in a dry run)."""

from __future__ import annotations

import json
from pathlib import Path

import conftest
import pytest

from megatron_wlb import kit
from megatron_wlb.cp import KernelEfficiency


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(out: Path, budget: float, use: float, clock: Clock) -> kit.Budget:
    """All three parts, each sized step using ``use`` of its share, each unsized step 1 s."""
    b = kit.Budget.start(out, budget, [1, 2, 3], clock)
    for part in (1, 2, 3):
        kit.Budget(out, clock).part(part)
        for name in ("env", *kit.STEPS[part]):
            limit, deadline = kit.Budget(out, clock).step(part, name)
            clock.now = min(deadline, clock.now + limit * use) if limit else clock.now + 1
            assert kit.Budget(out, clock).done(part, name, 0) == "ok"
        kit.Budget(out, clock).end(part)
    return b


@pytest.mark.parametrize("use", [1.0, 0.5, 0.0])
def test_the_shares_add_up_within_the_budget(tmp_path, use):
    clock = Clock()
    _run(tmp_path, 540, use, clock)
    data = json.loads((tmp_path / "budget.json").read_text())
    parts = [data["parts"][str(p)] for p in (1, 2, 3)]
    assert not data["partial"] and data["used_s"] <= 540
    for before, after in zip(parts, parts[1:]):  # one after another, none past the budget less its reserve
        assert after["start_s"] >= before["start_s"] + before["used_s"] - 1e-6
    for p in parts:
        assert p["start_s"] + p["share_s"] <= 540 - data["reserve_s"] + 1e-6
        sized = [s for s in p["steps"].values() if s["share_s"] is not None]
        assert all(s["start_s"] + s["share_s"] <= p["start_s"] + p["share_s"] + 1e-6 for s in sized)
        if use == 1.0:
            assert sum(s["share_s"] for s in sized) <= p["share_s"] + 1e-6
    if use == 1.0:  # every part used its share: the nominal split of the budget less the reserve
        assert sum(p["share_s"] for p in parts) == pytest.approx(540 - data["reserve_s"], abs=0.1)
        assert [p["share_s"] / (540 - data["reserve_s"]) for p in parts] == pytest.approx([0.2, 0.45, 0.35], abs=0.01)
    else:  # what part 1 left passed on
        nominal = (540 - data["reserve_s"] - parts[1]["start_s"]) * 0.45 / 0.80
        assert parts[1]["share_s"] == pytest.approx(nominal, abs=0.01) and parts[1]["share_s"] > 0.45 * 513


def test_a_single_part_gets_the_whole_budget_and_bad_budgets_are_refused(tmp_path):
    clock = Clock()
    kit.Budget.start(tmp_path, 100, [2], clock)
    assert kit.Budget(tmp_path, clock).part(2)["share_s"] == pytest.approx(100 - kit.reserve(100))
    with pytest.raises(ValueError, match="part 1 is not in this run's parts"):
        kit.Budget(tmp_path, clock).part(1)
    with pytest.raises(ValueError, match="--budget 0"):
        kit.Budget.start(tmp_path, 0, [1])
    with pytest.raises(ValueError, match="distinct parts among"):
        kit.Budget.start(tmp_path, 10, [1, 4])
    assert kit.main(["step", str(tmp_path), "3", "x"]) == 2  # one-line error: part 3 has not begun


def test_training_iterations_follow_the_share():
    gpu = [kit.iterations(s) for s in (0, 60, 100, 200, 10_000)]
    assert gpu == sorted(gpu) and gpu[0] == 10 and gpu[-1] == 400 and 10 < gpu[2] < gpu[3] < 400
    assert [kit.iterations(s, dry=True) for s in (0, 1000)] == [1, 2]


def test_a_step_stopped_at_its_deadline_is_recorded_as_such(tmp_path):
    clock = Clock()
    kit.Budget.start(tmp_path, 100, [2], clock)
    kit.Budget(tmp_path, clock).part(2)
    for name, rc, flag, want in (("calibrate", 124, None, "stopped"), ("profile_attention", 0, True, "stopped"),
                                 ("cp_latency", 0, False, "ok")):
        limit, _ = kit.Budget(tmp_path, clock).step(2, name)
        assert limit >= 1 + (kit.GRACE_S if kit.STEPS[2][name].result else 0)
        if flag is not None:
            kit.write_json(tmp_path / str(kit.STEPS[2][name].result), {"stopped_at_deadline": flag})
        assert kit.Budget(tmp_path, clock).done(2, name, rc) == want
    kit.Budget(tmp_path, clock).step(2, "calibrate")
    assert kit.Budget(tmp_path, clock).done(2, "calibrate", 1) == "failed"
    data = json.loads((tmp_path / "budget.json").read_text())["parts"]["2"]
    assert data["stopped_at_deadline"] and data["failed"] == "calibrate"


def test_the_deadline_stops_after_the_first_point(monkeypatch):
    clock = Clock()
    monkeypatch.setenv(kit.DEADLINE_ENV, str(clock.now + 5))
    deadline = kit.Deadline(max_seconds=10, clock=clock)
    assert deadline.at == clock.now + 5
    clock.now += 6
    assert not deadline.reached(0) and deadline.reached(1) and deadline.stopped
    monkeypatch.delenv(kit.DEADLINE_ENV)
    assert not kit.Deadline(clock=clock).reached(100)


def test_logs_of_steps_stopped_by_timeout_are_summarised(tmp_path):
    clock = Clock()
    kit.Budget.start(tmp_path, 100, [2, 3], clock)
    budget = kit.Budget(tmp_path, clock)
    budget.part(2)
    budget.step(2, "calibrate")
    budget.done(2, "calibrate", 124)
    (tmp_path / "calibrate.log").write_text(
        "calibrating smoke ...\nattention d=     16: fwd     0.100 ms  bwd     0.200 ms\n"
        "attention d=    128 as 8 documents: fwd     1.000 ms  bwd     2.000 ms\n"
        "linear  t=     32: fwd     0.050 ms  bwd     0.070 ms\n")
    calibrate = kit.summarize_calibrate(tmp_path)
    assert calibrate["partial"] and calibrate["stopped_at_deadline"] and calibrate["profile"] is None
    assert calibrate["attention"] == [{"d": 16, "fwd": 0.1, "bwd": 0.2}, {"d": 128, "docs": 8, "fwd": 1.0, "bwd": 2.0}]
    assert calibrate["linear"] == [{"t": 32, "fwd": 0.05, "bwd": 0.07}] and calibrate["table"] == []
    budget.end(2)
    budget.part(3)
    for name, rc in (("train_wlb", 0), ("train_stock", 124)):
        budget.step(3, name)
        budget.done(3, name, rc)
    (tmp_path / "train_wlb.log").write_text("megatron_wlb: packer wlb\n lm loss: 5.5 | elapsed time per iteration "
                                            "(ms): 12.5\n lm loss: 5.25 | elapsed time per iteration (ms): 11.0\n")
    (tmp_path / "train_stock.log").write_text("starting\n")  # stopped before its first iteration
    train = kit.summarize_train(tmp_path, dry=True)
    assert train["runs"]["train_wlb"] == {"losses": [5.5, 5.25], "ms_per_iteration": [12.5, 11.0], "wlb_lines": 1,
                                          "stopped_at_deadline": False}
    assert train["runs"]["train_stock"]["losses"] == [] and train["stopped_at_deadline"] and train["partial"]
    budget.step(3, "train_stock")
    budget.done(3, "train_stock", 0)  # ended by itself without a loss: an error
    with pytest.raises(ValueError, match="train_stock: no 'lm loss'"):
        kit.summarize_train(tmp_path, dry=True)


def test_scripts_stopped_at_their_deadline_keep_what_they_measured(tmp_path, monkeypatch):
    """The deadline already past: each script measures its first point, writes it flagged and exits 0; the
    partial efficiency table is refused by KernelEfficiency and cp_latency falls back to the placeholder."""
    monkeypatch.setenv(kit.DEADLINE_ENV, "1")
    check = conftest.load_script("gpu_kernel_check")
    assert check.main(["--smoke", "--out", str(tmp_path / "kc.json")]) == 0
    kc = json.loads((tmp_path / "kc.json").read_text())
    assert len(kc["cases"]) == 1 < kc["planned"] and kc["partial"] and kc["stopped_at_deadline"] and not kc["failed"]
    profile = conftest.load_script("gpu_profile_attention")
    assert profile.main(["--smoke", "--out", str(tmp_path / "eff.json")]) == 0
    eff = json.loads((tmp_path / "eff.json").read_text())
    assert eff["tflops"] == [[eff["tflops"][0][0]]] and eff["partial"] and eff["stopped_at_deadline"]
    with pytest.raises(ValueError, match="a partial table"):
        KernelEfficiency.from_json(tmp_path / "eff.json")
    latency = conftest.load_script("gpu_cp_latency")
    assert latency.main(["--smoke", "--efficiency", str(tmp_path / "eff.json"), "--out", str(tmp_path / "lat")]) == 0
    lat = json.loads((tmp_path / "lat.json").read_text())
    assert len(lat["cases"]) == 1 and lat["partial"] and lat["stopped_at_deadline"]
    assert lat["efficiency_table"].startswith("shipped placeholder") and len(lat["summary"]) == 1
    monkeypatch.delenv(kit.DEADLINE_ENV)
    assert profile.main(["--smoke", "--out", str(tmp_path / "eff.json")]) == 0  # no deadline: complete
    eff = json.loads((tmp_path / "eff.json").read_text())
    assert not eff["partial"] and not eff["stopped_at_deadline"]
    KernelEfficiency.from_json(tmp_path / "eff.json")
