"""megatron-wlb as Megatron-LM main's own sequence-packing scheduler (megatron_wlb/megatron/hooks/main_schedule.py).

The contract of main's ``get_groups_and_subsamples`` (every sample exactly once; per micro-batch one list of
sample ids per DPxCP rank, the CP ranks of a DP rank alike, as ``dp_balanced`` lays them out; micro-batches within
the window), without Megatron; then, from a Megatron-LM main checkout at ``version.MAIN_COMMIT`` (the repository
$MEGATRON_LM names, skipped without one): selection through main's own enum and ``scheduler_map``, and main's
``wrap_data_iterator`` -> ``run()`` at DP2 on gloo with ``sequence_packing_scheduler="wlb"`` (CPU redirects of
``megatron_wlb.megatron.entry.cpu``: ``run()`` asks ``torch.cuda.current_device()`` and moves tensors with ``.cuda()``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.common import resolve_lengths
from megatron_wlb.config import load_config
from megatron_wlb.costmodel import build_cost_model
from megatron_wlb.megatron.args.version import MOVING_CHECKOUTS
from megatron_wlb.megatron.hooks.main_schedule import plan_sample_groups
from megatron_wlb.packing.metrics import slowest_rank_schedule_time
from megatron_wlb.packing.types import DocPiece, GlobalBatch, MicroBatch
from megatron_wlb.packing.wlb import place_whole_batch

ROOT = Path(__file__).resolve().parents[1]


def _lengths(count: int, seed: int, high: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return (rng.pareto(1.2, count) * high / 8 + 1).clip(1, high).astype(int).tolist()


def _next_fit(lengths: list[int], window: int) -> list[list[int]]:
    """main's dp_balanced grouping before the DP split (next-fit in arrival order), for comparison."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > window:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


@pytest.mark.parametrize("dp,cp,multiple", [(1, 1, 1), (2, 1, 1), (4, 2, 1), (2, 2, 3)])
def test_groups_keep_mains_contract(dp, cp, multiple):
    window = 4096
    lengths = _lengths(300, seed=dp * 10 + cp, high=3 * window // 2)
    ids = [1000 + i for i in range(len(lengths))]  # sample ids need not be 0..K-1
    groups = plan_sample_groups(list(zip(ids, lengths)), window, dp, cp, None, stages=2, multiple=multiple)
    assert len(groups) % multiple == 0
    seen: list[int] = []
    by_id = dict(zip(ids, lengths))
    for micro_batch in groups:
        assert len(micro_batch) == dp * cp
        for j, rank_ids in enumerate(micro_batch):
            assert rank_ids == micro_batch[(j // cp) * cp], "the CP ranks of one DP rank hold the same samples"
            assert rank_ids, "no micro-batch is empty"
            tokens = sum(by_id[i] for i in rank_ids)
            assert tokens <= window or len(rank_ids) == 1, "within the window, or one longer sample alone"
        seen.extend(i for j in range(0, dp * cp, cp) for i in micro_batch[j])
    assert sorted(seen) == ids, "every sample exactly once"


def test_balances_where_next_fit_does_not():
    """The 7B cost model at a 128K window, DP4, one global batch (4 x 4 x 128K tokens) of the embedded stream:
    wlb's slowest DP rank works less than next-fit's (main's dp_balanced grouping, dealt round robin as main
    deals it)."""
    run = load_config("7b_128k")
    window = 131072
    cost = build_cost_model(run.model, run.layout)
    stream = resolve_lengths("wlbllm")
    dp = 4
    lengths = stream[:int(np.searchsorted(np.cumsum(stream), dp * 4 * window)) + 1].tolist()
    plan = place_whole_batch(lengths, dp, window, cost, stages=4)
    nf = _next_fit(lengths, window)
    while len(nf) % dp:  # dp_balanced pads the count to a multiple of dp by splitting the last groups
        last = max(k for k, g in enumerate(nf) if len(g) > 1)
        nf.append([nf[last].pop()])
    per_rank = len(nf) // dp
    next_fit = [[nf[k * dp + r] for k in range(per_rank)] for r in range(dp)]
    wlb_time = _slowest_rank(plan, lengths, cost)
    assert wlb_time < 0.95 * _slowest_rank(next_fit, lengths, cost)
    assert len(plan[0]) <= 2 * per_rank


def _slowest_rank(plan: list[list[list[int]]], lengths: list[int], cost) -> float:
    """The project's scorer (packing.metrics): the slowest DP rank's 1F1B time, PP 4."""
    n = len(plan[0])
    mbs = tuple(MicroBatch(tuple(DocPiece(i, 0, lengths[i], 0) for i in mb), 131072) for rank in plan for mb in rank)
    return slowest_rank_schedule_time(cost, GlobalBatch(0, mbs, len(plan), n), stages=4)[0]


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_max_num_seqs_caps_the_samples_of_a_micro_batch(cap):
    """dev's ``max_num_seqs`` (``max_items`` here): no micro-batch holds more samples, every sample once."""
    lengths = _lengths(60, seed=cap, high=900)
    free = plan_sample_groups(list(enumerate(lengths)), 4096, 2, 1, None)
    assert max(len(r) for mb in free for r in mb) > cap
    groups = plan_sample_groups(list(enumerate(lengths)), 4096, 2, 1, None, max_items=cap)
    assert max(len(r) for mb in groups for r in mb) <= cap
    assert sorted(i for mb in groups for r in mb for i in r) == list(range(60))
    with pytest.raises(ValueError, match="max_items=0: must be an integer >= 1 or None"):
        plan_sample_groups(list(enumerate(lengths)), 4096, 2, 1, None, max_items=0)


def test_too_few_samples_is_one_clear_error():
    with pytest.raises(ValueError, match="cannot fill dp \\* n = 4 x 1 micro-batches"):
        place_whole_batch([10, 10, 10], 4, 100, None)
    with pytest.raises(ValueError, match="sample lengths\\[1\\] = 0"):
        place_whole_batch([10, 0], 1, 100, None)


# -- with a Megatron-LM main checkout -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def main_checkout(tmp_path_factory) -> Path:
    from conftest import megatron_checkout

    from megatron_wlb.megatron.args.version import MAIN_COMMIT

    return megatron_checkout(tmp_path_factory.mktemp("mlm") / "Megatron-LM-main", "main", commit=MAIN_COMMIT)


# the Megatron-LM commits whose own data_schedule takes our scheduler (version.MOVING_CHECKOUTS): the pinned main,
# main after PR #6742 (the scheduler a flag, its name checked by the config), dev (string-keyed scheduler_map)
@pytest.fixture(scope="module", params=sorted(MOVING_CHECKOUTS))
def moving_checkout(request, tmp_path_factory) -> tuple[str, Path]:
    """(name, checkout) of each of ``version.MOVING_CHECKOUTS`` from the repository MEGATRON_LM names (skipped,
    naming the commit, without one)."""
    from conftest import megatron_checkout

    dest = tmp_path_factory.mktemp("mlm") / f"Megatron-LM-{request.param}"
    return request.param, megatron_checkout(dest, request.param, commit=MOVING_CHECKOUTS[request.param])


MOVED = """
import sys
from megatron_wlb.megatron.args.compat import install_python_shims
install_python_shims()
from megatron_wlb.megatron.hooks import main_schedule
print(main_schedule.register())
print(main_schedule.register())
from megatron.core.datasets import data_schedule as D
key = D.PackingSchedulerEnum["WLB"] if hasattr(D, "PackingSchedulerEnum") else "wlb"   # main's / dev's lookup
cls = D.scheduler_map[key]
assert cls is main_schedule.scheduler_class(), cls
ids = [(i, n) for i, n in enumerate([900, 40, 700, 80, 300, 60, 500, 20, 650, 100, 30, 250])]
free = cls(1000, 1, 2, None, max_num_seqs=None).get_groups_and_subsamples(ids)   # dev passes max_num_seqs=
capped = cls(1000, 1, 2, None, max_num_seqs=2).get_groups_and_subsamples(ids)
assert max(len(r) for mb in free for r in mb) > 2 >= max(len(r) for mb in capped for r in mb), (free, capped)
try:
    cls(1000, 1, 2, None, min_cp_size=2)   # a keyword we do not know: refused naming it, no TypeError
except ValueError as exc:
    print("UNKNOWN", exc)
import dataclasses
from megatron.core.model_parallel_config import ModelParallelConfig
if "sequence_packing_scheduler" in {f.name for f in dataclasses.fields(ModelParallelConfig)}:
    print("CONFIG", ModelParallelConfig(sequence_packing_scheduler="wlb", max_seqlen_per_dp_cp_rank=1000)
          .sequence_packing_scheduler)
from megatron.training import arguments
sys.argv = ["pretrain_gpt.py", "--sequence-packing-scheduler", "wlb", "--max-seqlen-per-dp-cp-rank", "1000"]
try:
    print("PARSED", getattr(arguments.parse_args(None, True), "sequence_packing_scheduler", "no flag"))
except SystemExit as exc:
    print("EXIT", exc)
"""


@pytest.mark.slow
def test_registered_where_megatron_moved(moving_checkout):
    """register() on each checkout: our class is what main's / dev's own lookup finds (dev keys scheduler_map by
    strings: before, register() said "not registered"); dev's ``max_num_seqs=`` is taken and honoured (a cap on
    a micro-batch's samples), an unknown keyword is refused naming it (not a TypeError); where the config checks
    the name (main after #6742, dev) "wlb" passes it, and the flag's choices take "wlb", which without
    TransformerEngine >= 2.9 (main's TransformerConfig requires it for any scheduler) exits in one line."""
    name, checkout = moving_checkout
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{ROOT}", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", MOVED], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "registered: sequence_packing_scheduler='wlb' (WlbPackingScheduler)" in out and "(already)" in out, out
    assert "UNKNOWN megatron_wlb's WlbPackingScheduler does not know the keyword(s) min_cp_size" in out, out
    if name == "main":  # the pinned main: neither a config field nor a flag yet
        assert "CONFIG" not in out and "EXIT" not in out, out
    else:
        assert "CONFIG wlb" in out, out
        line = next(x for x in out.splitlines() if x.startswith("EXIT "))
        assert "--sequence-packing-scheduler wlb" in line and "TransformerEngine >= 2.9.0" in line, line
        assert "megatron_wlb.megatron.entry.launcher" in line, line


SELECTION = """
from megatron_wlb.megatron.args.compat import install_python_shims
install_python_shims()
from megatron.core.datasets import data_schedule as D
old_enum = D.PackingSchedulerEnum
import megatron_wlb.megatron as W
from megatron_wlb.megatron.hooks import main_schedule
W.apply(middle_stage_batches=True)   # what a main user's launcher calls
print(W.runtime().main_scheduler)
print(main_schedule.register())
from megatron.core.datasets import data_schedule as D
cls = D.scheduler_map[D.PackingSchedulerEnum["wlb".upper()]]   # wrap_data_iterator's own lookup
assert cls is main_schedule.scheduler_class() and issubclass(cls, D.BasePackingScheduler), cls
assert D.scheduler_map[D.PackingSchedulerEnum["DP_BALANCED"]] is D.DpBalancedScheduler
assert [m.value for m in D.PackingSchedulerEnum] == ["dp_balanced", "wlb"]
ids = [(i, n) for i, n in enumerate([900, 40, 700, 80, 300, 60, 500, 20, 650, 100, 30, 250])]
assert D.scheduler_map[old_enum.DP_BALANCED] is D.DpBalancedScheduler   # code holding the old enum still resolves
assert cls(1000, 1, 2, None).cost is None   # no Megatron args: the d**2 weight
from types import SimpleNamespace
from megatron.training import global_vars
global_vars._GLOBAL_ARGS = SimpleNamespace(num_attention_heads=8, hidden_size=256, num_layers=4, ffn_hidden_size=1024,
    padded_vocab_size=1000, tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=2,
    virtual_pipeline_model_parallel_size=None, data_parallel_size=2)
scheduler = cls(1000, 1, 2, None)   # as wrap_data_iterator constructs it, inside a Megatron run
assert scheduler.cost is not None and scheduler.stages == 2, (scheduler.cost, scheduler.stages)
print("groups", scheduler.get_groups_and_subsamples(ids))
print("OK")
"""


@pytest.mark.slow
def test_selected_through_mains_own_registry(main_checkout):
    """apply() on main registers ``wlb``; main's own lookup (enum from the config string, then scheduler_map)
    finds our class, and dp_balanced still resolves."""
    env = {**os.environ, "PYTHONPATH": f"{main_checkout}{os.pathsep}{ROOT}", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", SELECTION], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "registered: sequence_packing_scheduler='wlb' (WlbPackingScheduler)" in proc.stdout
    assert "(already)" in proc.stdout


@pytest.mark.slow
def test_register_without_data_schedule_says_why():
    """The installed megatron-core 0.19 has a data_schedule module without main's registry (only the hybrid-CP
    scheduler): apply()'s registration is a no-op naming what is missing (apply() then refuses, as on 0.19)."""
    code = ("import megatron_wlb.megatron as W\ntry:\n    W.apply()\nexcept RuntimeError:\n    pass\n"
            "print(W.runtime().main_scheduler)\n"
            "from megatron.core import package_info\nprint(package_info.__version__)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    message, version = proc.stdout.splitlines()[-2:]
    if not version.startswith("0.19"):
        pytest.skip(f"the installed megatron-core is {version}, not 0.19")
    assert message.startswith("not registered: this Megatron's megatron.core.datasets.data_schedule has no "
                              "BasePackingScheduler, DpBalancedScheduler, scheduler_map, wrap_data_iterator"), message


WINDOW = 1000
LOCAL = 12  # samples per DP rank


def _rank_lengths(rank: int) -> list[int]:
    return [[900, 40, 700, 80, 300, 60, 500, 20, 650, 100, 30, 250],
            [120, 820, 15, 610, 90, 330, 45, 770, 210, 55, 480, 160]][rank]


def _run_worker(rank: int, world: int, checkout: str) -> None:
    sys.path.insert(0, checkout)
    from megatron_wlb.megatron.entry.cpu import install_cpu_redirects

    install_cpu_redirects()
    from megatron.core import parallel_state

    from megatron_wlb.megatron.hooks import main_schedule

    parallel_state.initialize_model_parallel(1, 1)
    main_schedule.register()
    from megatron.core.datasets.data_schedule import wrap_data_iterator

    for scheduler in ("wlb", "dp_balanced"):
        _run_scheduler(rank, world, scheduler, wrap_data_iterator, main_schedule)


def _run_scheduler(rank: int, world: int, scheduler: str, wrap_data_iterator, main_schedule) -> None:
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core.datasets import data_schedule

    # main after #6742 and dev take unpacked samples (VarlenDataset's: their lengths, no cu_seqlens)
    unpacked = "padded_seq_len" in data_schedule.DpBalancedScheduler(WINDOW, 1, world, None).get_required_sample_keys()
    samples = []
    for i, n in enumerate(_rank_lengths(rank)):
        gid = rank * LOCAL + i
        tokens = torch.full((n,), gid + 1, dtype=torch.int64)  # every token names its sample
        sample = {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(n), "position_ids": torch.arange(n)}
        if unpacked:
            sample.update(original_seq_len=torch.tensor([n], dtype=torch.int32),
                          padded_seq_len=torch.tensor([n], dtype=torch.int32))
        else:
            sample["cu_seqlens"] = torch.tensor([0, n], dtype=torch.int32)
        samples.append(sample)
    config = SimpleNamespace(max_seqlen_per_dp_cp_rank=WINDOW, microbatch_group_size_per_vp_stage=None,
                             virtual_pipeline_model_parallel_size=None, sequence_packing_scheduler=scheduler,
                             pipeline_model_parallel_layout=None, mtp_num_layers=None)  # dev reads the last two
    iterator, micro_batches, token_sum, _ = wrap_data_iterator(iter(samples), config, LOCAL)
    got = []
    for _ in range(micro_batches):
        batch = next(iterator)
        cu = batch["cu_seqlens"].tolist()
        assert cu[-1] <= WINDOW, cu
        got.append(sorted(int(batch["tokens"][a]) - 1 for a in cu[:-1]))
    lengths = _rank_lengths(0) + _rank_lengths(1)
    groups = main_schedule.plan_sample_groups(list(enumerate(lengths)), WINDOW, 2, 1, None)
    expected = [[sorted(g[r]) for g in groups] for r in range(world)]  # every rank's micro-batches, planned here
    assert token_sum == float(sum(lengths))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, got)
    placed = sorted(i for rank_got in everyone for mb in rank_got for i in mb)
    assert placed == list(range(2 * LOCAL)), placed
    if scheduler == "wlb":
        assert everyone == expected, (everyone, expected)
    else:  # main's own scheduler on the same samples plans otherwise: the wlb comparison above can fail
        assert everyone != expected, everyone


@pytest.mark.slow
def test_mains_run_path_at_dp2(moving_checkout):
    """main's (pinned, after PR #6742) and dev's wrap_data_iterator -> run() (gather, reroute, pack) at DP2 on gloo
    with sequence_packing_scheduler="wlb": each rank's packed micro-batches carry exactly the samples our plan
    gives it, every sample once; then "dp_balanced" on the same samples, which plans otherwise (so the check can
    fail)."""
    from conftest import run_world

    run_world(_run_worker, 2, checkout=str(moving_checkout[1]))


@pytest.mark.slow
def test_bench_main_scheduler_one_command(main_checkout, tmp_path):
    """benchmarks/bench_main_scheduler.py end to end on one stream (main's dp_balanced from the checkout
    $MEGATRON_LM names): both plans checked and scored, the Markdown table written."""
    env = {**os.environ, "MEGATRON_LM": str(main_checkout), "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "main_scheduler"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_main_scheduler.py"), "--iterations", "2",
                           "--streams", "wlbllm", "--dp", "2", "--out", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(out.with_suffix(".json").read_text())
    (row,) = result["rows"]
    assert result["megatron_commit"] == main_checkout_commit(main_checkout)
    assert 0.9 < row["wlb"]["schedule_ratio"] < 3 and 0.9 < row["dp_balanced"]["schedule_ratio"] < 3
    assert row["dp_balanced_over_wlb"] == pytest.approx(row["dp_balanced"]["slowest_s"] / row["wlb"]["slowest_s"])
    assert "| wlbllm | 2 |" in out.with_suffix(".md").read_text()


def main_checkout_commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


# -- Megatron-LM dev's default_dynamic_cp against ours (benchmarks/bench_main_scheduler.py --dynamic-cp) -----------
def test_rank_groups_critical_path():
    """A sample held by several ranks is one CP group: its latency split over them, and they start together;
    ranks joined by nothing run as separate chains."""
    from conftest import load_script

    bench = load_script("bench_main_scheduler")
    latency = np.array([4.0, 3.0, 1.0, 1.0, 4.0])
    prices = {1: latency, 2: latency / 2}  # a sample's latency split evenly over its CP group, no all-gather
    free = {1: 0.0, 2: 0.0}
    # micro-batch 0: sample 0 over both ranks (2 each); micro-batch 1: ranks alone (3 and 1)
    assert bench.rank_groups_critical_path([[[0], [0]], [[1], [2]]], prices, free) == pytest.approx(5.0)
    # separate chains: rank 0 does 4 + 1, rank 1 does 1 + 4
    assert bench.rank_groups_critical_path([[[0], [3]], [[2], [4]]], prices, free) == pytest.approx(5.0)
    # joined in micro-batch 1 by sample 1: rank 1 waits for rank 0 (4), then both do 1.5 (+ 1 more on rank 1)
    assert bench.rank_groups_critical_path([[[0], [3]], [[1], [1, 2]]], prices, free) == pytest.approx(6.5)
    # the group's all-gather and a micro-batch's fixed cost: each holder of a 2-rank group pays 0.5 more, a lone
    # rank 0.25: 2 + 0.5 on both, then 3 + 0.25 and 1 + 0.25
    priced = {1: latency, 2: latency / 2 + 0.5}
    assert bench.rank_groups_critical_path([[[0], [0]], [[1], [2]]], priced, {1: 0.25, 2: 0.0}) == \
        pytest.approx(5.75)


@pytest.mark.slow
def test_bench_dynamic_cp_one_command(tmp_path):
    """benchmarks/bench_main_scheduler.py --dynamic-cp end to end on one stream: dev's default_dynamic_cp (from a dev
    checkout of the repository MEGATRON_LM names, skipped without one) and wlb plan the same global batches,
    both checked (every sample placed over the DP x CP ranks) and scored; the Markdown table written."""
    from conftest import megatron_checkout

    from megatron_wlb.megatron.args.version import DEV_COMMIT

    dev = megatron_checkout(tmp_path / "Megatron-LM-dev", "dev", commit=DEV_COMMIT)
    env = {**os.environ, "MEGATRON_LM": str(dev), "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "dynamic_cp"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_main_scheduler.py"), "--dynamic-cp",
                           "--iterations", "2", "--streams", "wlbllm", "--dp", "2", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    result = json.loads(out.with_suffix(".json").read_text())
    (row,) = result["rows"]
    assert result["megatron_commit"] == DEV_COMMIT and result["pp"] == 1
    for name in ("default_dynamic_cp", "wlb"):
        assert 0.999 <= row[name]["over_ideal"] < 3 and row[name]["micro_batches"] >= 1
    assert row["dynamic_over_wlb"] == pytest.approx(row["default_dynamic_cp"]["time_s"] / row["wlb"]["time_s"])
    assert "| wlbllm |" in out.with_suffix(".md").read_text()


def test_wlb_attention_serves_megatrons_own_thd_batches():
    """Main's packing path hands the core attention Megatron's own THD ``PackedSeqParams`` (no WLB shard): our
    attention computes document-causal attention over its padded ``cu_seqlens`` (what Megatron's local attention
    cannot), equal to causal attention run on each document alone."""
    from types import SimpleNamespace

    import torch

    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_wlb.megatron.hooks.attention import WlbCoreAttention

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    q, k, v = (torch.randn(16, 1, 4, 8, dtype=torch.float64) for _ in range(3))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=7, max_seqlen_kv=7)
    layer = SimpleNamespace(softmax_scale=8 ** -0.5, attn_mask_type=AttnMaskType.causal, cp_group=lambda: None)
    out = WlbCoreAttention._megatron_thd(layer, q, k, v, None, params)
    assert out.shape == (16, 1, 32)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        doc = torch.nn.functional.scaled_dot_product_attention(
            q[a:b, 0].transpose(0, 1), k[a:b, 0].transpose(0, 1), v[a:b, 0].transpose(0, 1), is_causal=True,
            scale=8 ** -0.5).transpose(0, 1).reshape(b - a, 32)
        assert torch.allclose(out[a:b, 0], doc, atol=1e-10), (a, b)


@pytest.mark.slow
def test_module_runner_registers_before_the_script(tmp_path):
    """``python -m megatron_wlb.megatron.hooks.main_schedule SCRIPT`` runs a checkout's script (its directory first on
    sys.path, as Python would) with ``wlb`` already registered; a missing script is one line naming it."""
    from conftest import megatron_checkout

    dev = megatron_checkout(tmp_path / "Megatron-LM-dev", "dev", commit=MOVING_CHECKOUTS["dev"])
    script = dev / "probe_wlb.py"
    script.write_text("import sys\nfrom megatron.core.datasets import data_schedule as D\n"
                      "from megatron_wlb.megatron.hooks import main_schedule\n"
                      "print(main_schedule.register())   # what apply() in the script does: the same class\n"
                      "print('SCRIPT', D.scheduler_map.get('wlb').__qualname__, sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "megatron_wlb.megatron.hooks.main_schedule", str(script), "--x", "1"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SCRIPT WlbPackingScheduler ['--x', '1']" in proc.stdout, proc.stdout
    assert "registered: sequence_packing_scheduler='wlb' (already)" in proc.stdout, proc.stdout
    assert "> megatron_wlb: registered: sequence_packing_scheduler='wlb'" in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "megatron_wlb.megatron.hooks.main_schedule",
                              str(tmp_path / "nope.py")], capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode != 0 and missing.stderr.count("\n") == 1 and "no such file" in missing.stderr
