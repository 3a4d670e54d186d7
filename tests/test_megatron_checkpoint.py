"""Checkpoint and resume across a simulated restart: the token stream equals an uninterrupted run's."""

from __future__ import annotations

import os
import sysconfig
from argparse import Namespace

import numpy as np
import pytest

from megatron_wlb.data.reader import DocumentReader, byte_documents, write_indexed_dataset
from megatron_wlb.megatron.data.packed import WlbDataIterator
from megatron_wlb.megatron.state.checkpoint import DataStateRegistry, wrap_load_checkpoint, wrap_save_checkpoint
from megatron_wlb.megatron.state.checkpoint_files import SIDECAR_NAME, iteration_dir, load_data_state, save_data_state
from megatron_wlb.packing import make_packer
from megatron_wlb.packing.types import PackingConfig

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[30:50]
    docs = byte_documents([os.path.join(root, n) for n in names])
    return write_indexed_dataset(str(tmp_path_factory.mktemp("ckpt_data") / "text_document"), docs)


CFG = PackingConfig(seq_len=1024, n=4, dp=2, max_seq_len=2048, max_delay=3, queue_thresholds=(512, 1024))


def new_iterators(prefix, packer="wlb", seed=5, vp=1):
    """What every rank does at start-up: reader, stream, packer, one iterator per DP rank (x vp chunks)."""
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=seed)
    stream = reader.stream(40 * CFG.tokens_per_iteration)
    return [[WlbDataIterator(reader, stream, make_packer(packer, CFG), r) for _ in range(vp)] for r in range(CFG.dp)]


def run(iterators, steps):
    """Megatron's loop: each step, every DP rank reads n micro-batches; returns (rank, tokens) in order."""
    out = []
    for _ in range(steps):
        for r, chunks in enumerate(iterators):
            for _ in range(CFG.n):
                for it in chunks:  # every pipeline chunk reads the same micro-batch
                    mb = next(it)
                out.append((r, mb.tokens[0].copy(), mb.loss_mask[0].copy()))
    return out


def megatron_like_save(save_dir):
    """Stands for Megatron's save_checkpoint: writes the iteration directory and the tracker file."""
    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, flops, **kwargs):
        os.makedirs(iteration_dir(save_dir, iteration), exist_ok=True)
        with open(os.path.join(save_dir, TRACKER), "w") as f:
            f.write(str(iteration))
    return save_checkpoint


def megatron_like_load(load_dir):
    def load_checkpoint(model, optimizer, opt_param_scheduler, load_arg="load", strict=True, **kwargs):
        with open(os.path.join(load_dir, TRACKER)) as f:
            return int(f.read()), 0
    return load_checkpoint


@pytest.mark.parametrize("packer", ["wlb", "fixed-greedy", "original"])
def test_resume_repeats_and_loses_nothing(prefix, tmp_path, packer):
    n_steps, m_steps = 5, 7
    reference = run(new_iterators(prefix, packer), n_steps + m_steps)

    args = Namespace(save=str(tmp_path), load=str(tmp_path))
    # first run: every rank registers its iterators; rank 0 writes the sidecar after Megatron's save
    registries = [DataStateRegistry() for _ in range(CFG.dp)]
    first = new_iterators(prefix, packer)
    for reg, chunks in zip(registries, first):
        for it in chunks:
            reg.register(it)
    before = run(first, n_steps)
    pending = first[0][0].packer.pending()
    for r, reg in enumerate(registries):
        save = wrap_save_checkpoint(megatron_like_save(args.save), reg, lambda: args, lambda r=r: r == 0,
                                    lambda: {"packing": packer})
        save(n_steps, None, None, None, 0)
    payload = load_data_state(iteration_dir(args.save, n_steps), n_steps)
    assert payload["settings"] == {"packing": packer} and payload["data"]["packer"]["iteration"] == n_steps
    if packer == "wlb":
        assert pending > 0, "the wlb packer should hold queued documents at the checkpoint (else the test is weak)"

    # restart: new objects everywhere; Megatron loads the checkpoint before building data iterators
    second = new_iterators(prefix, packer)
    for chunks in second:
        reg = DataStateRegistry()
        iteration, _ = wrap_load_checkpoint(megatron_like_load(args.load), reg, lambda: args)(None, None, None)
        assert iteration == n_steps and reg.pending_iteration == n_steps
        for it in chunks:
            reg.register(it)
    after = run(second, m_steps)

    assert len(before) + len(after) == len(reference)
    for (r0, t0, m0), (r1, t1, m1) in zip(before + after, reference):
        assert r0 == r1 and np.array_equal(t0, t1) and np.array_equal(m0, m1)
    # and a run that did NOT restore its state would differ (the check above can fail)
    fresh = run(new_iterators(prefix, packer), m_steps)
    assert any(not np.array_equal(a[1], b[1]) for a, b in zip(fresh, after))


def test_virtual_pipeline_chunks_share_one_state(prefix, tmp_path):
    its = new_iterators(prefix, vp=2)
    reg = DataStateRegistry()
    for it in its[0]:
        reg.register(it)
    run([its[0]], 2)
    assert reg.state() == its[0][0].state_dict()
    # a chunk iterator that is never read (unpatched middle-stage chunk) does not hold the state back
    idle = new_iterators(prefix)[0][0]
    reg.register(idle)
    assert reg.state() == its[0][0].state_dict() and idle.packer.iteration == 0
    next(its[0][0])  # one chunk reads ahead: mid-iteration, and the chunks now disagree
    with pytest.raises(RuntimeError, match="mid-iteration"):
        reg.state()


def test_resume_refuses_what_it_cannot_restore(prefix, tmp_path):
    its = new_iterators(prefix)
    run([its[0]], 3)
    state = its[0][0].state_dict()
    # other data settings (here: the seed) are named in the error
    other = new_iterators(prefix, seed=6)[0][0]
    with pytest.raises(ValueError, match="other data settings"):
        other.load_state_dict(state)
    # the same dataset at another path (moved to another mount) resumes
    moved = dict(state, reader=dict(state["reader"], prefixes=["/elsewhere/" + os.path.basename(prefix)]))
    its[1][0].load_state_dict(moved)
    assert its[1][0].packer.position == state["stream_position"]
    # a shorter stream than the checkpoint consumed
    short = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=5)
    tiny = WlbDataIterator(short, short.stream(1000), make_packer("wlb", CFG), 0)
    with pytest.raises(ValueError, match="does not start with"):
        tiny.load_state_dict(state)
    # a checkpoint at iteration > 0 without our sidecar: fail, say what to do
    args = Namespace(save=str(tmp_path), load=str(tmp_path))
    megatron_like_save(args.save)(3, None, None, None, 0)
    load = wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args)
    with pytest.raises(RuntimeError, match="holds no wlb_packer_state.json.*pass --wlb-reset-data-stream"):
        load(None, None, None)
    # a sidecar from another iteration
    save_data_state(iteration_dir(args.save, 3), 2, state)
    with pytest.raises(ValueError, match="written at iteration 2"):
        load_data_state(iteration_dir(args.save, 3), 3)
    assert load_data_state(str(tmp_path / "nowhere")) is None
    # loading a pretrained checkpoint (another load_arg) leaves the data state alone
    assert load(None, None, None, "pretrained_checkpoint") == (3, 0)
    assert os.path.isfile(os.path.join(iteration_dir(args.save, 3), SIDECAR_NAME))


def test_resume_with_other_wlb_settings_is_refused_naming_them(tmp_path):
    args = Namespace(save=str(tmp_path), load=str(tmp_path))
    saved = {"packing": "wlb", "max_delay": 8, "cp_sharding": "adaptive", "log_interval": 1}
    os.makedirs(iteration_dir(args.save, 3), exist_ok=True)
    with open(os.path.join(args.save, TRACKER), "w") as f:
        f.write("3")
    save_data_state(iteration_dir(args.save, 3), 3, {"stream_position": 0}, saved)

    def load(now):
        return wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args,
                                    lambda: now)(None, None, None)

    assert load({**saved, "log_interval": 10})[0] == 3  # logging may change on resume
    with pytest.raises(RuntimeError, match=r"other WLB settings \(max_delay: 8 -> 4\)"):
        load({**saved, "max_delay": 4})


def test_reset_data_stream_restarts_only_the_data_counted_and_logged(tmp_path):
    """--wlb-reset-data-stream: other --wlb-* settings are accepted, no data state is restored (the stream starts
    at its first document), Megatron's iteration is kept, and the reset is logged and counted into later saves."""
    args = Namespace(save=str(tmp_path), load=str(tmp_path), wlb_reset_data_stream=True)
    megatron_like_save(args.save)(3, None, None, None, 0)
    save_data_state(iteration_dir(args.save, 3), 3, {"stream_position": 7}, {"packing": "wlb", "max_delay": 8},
                    data_stream_resets=1)
    registry, lines = DataStateRegistry(), []
    load = wrap_load_checkpoint(megatron_like_load(args.load), registry, lambda: args,
                                lambda: {"packing": "wlb", "max_delay": 4}, lines.append)
    assert load(None, None, None) == (3, 0)
    assert registry.pending is None and registry.data_stream_resets == 2
    assert len(lines) == 1 and "--wlb-reset-data-stream" in lines[0] and "iteration 3" in lines[0]
    assert "reset 2" in lines[0]
    # without the flag the changed setting is refused, naming the flag instead of --finetune
    args.wlb_reset_data_stream = False
    with pytest.raises(RuntimeError, match=r"max_delay: 8 -> 4.*pass --wlb-reset-data-stream"):
        wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args,
                             lambda: {"packing": "wlb", "max_delay": 4})(None, None, None)
    # a later save carries the count on
    its = new_iterators_for(tmp_path)
    registry.register(its)
    next(its)
    for _ in range(its.n - 1):
        next(its)
    wrap_save_checkpoint(megatron_like_save(args.save), registry, lambda: args, lambda: True)(4, None, None, None, 0)
    assert load_data_state(iteration_dir(args.save, 4), 4)["data_stream_resets"] == 2


def new_iterators_for(tmp_path) -> WlbDataIterator:
    docs = byte_documents([__file__])
    prefix = write_indexed_dataset(str(tmp_path / "self_text_document"), docs)
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=1)
    cfg = PackingConfig(seq_len=1024, n=2, dp=1, max_seq_len=2048)
    return WlbDataIterator(reader, reader.stream(20 * cfg.tokens_per_iteration), make_packer("wlb", cfg), 0)


@pytest.mark.parametrize("new_dp", [1, 4])
def test_another_dp_size_at_the_same_global_batch_continues_the_saved_plans(prefix, new_dp):
    """Saved at DP2 x 4; resumed at DP1 x 8 or DP4 x 2: the ranks together read exactly the micro-batches the
    uninterrupted DP2 run reads, in its order (the saved plans, dealt to the new ranks)."""
    from dataclasses import replace

    steps, more = 3, 4
    reference = run(new_iterators(prefix), steps + more)
    first = new_iterators(prefix)
    run(first, steps)
    state = first[0][0].state_dict()
    cfg = replace(CFG, dp=new_dp, n=CFG.dp * CFG.n // new_dp)
    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=5)
    stream = reader.stream(40 * CFG.tokens_per_iteration)
    resumed = [WlbDataIterator(reader, stream, make_packer("wlb", cfg), r) for r in range(new_dp)]
    for it in resumed:
        it.load_state_dict(state)
        assert it.n == cfg.n
    after = []
    for _ in range(more):
        for it in resumed:
            after.extend(next(it).tokens[0].copy() for _ in range(it.n))
    expected = [t for _, t, _ in reference[steps * CFG.dp * CFG.n:]]
    assert len(after) == len(expected) and all(np.array_equal(a, b) for a, b in zip(after, expected))
    # another number of micro-batches per iteration cannot continue the plans
    from megatron_wlb.megatron.data.packed import PlanLayoutError
    from megatron_wlb.megatron.state.checkpoint import plan_layout_refusal

    other = WlbDataIterator(reader, stream, make_packer("wlb", replace(CFG, dp=1, n=4)), 0)
    with pytest.raises(PlanLayoutError, match=r"planned 8 micro-batches per iteration \(DP 2 x 4\), this run 4"):
        other.load_state_dict(state)
    margs = Namespace(data_parallel_size=1, global_batch_size=4, micro_batch_size=1)
    refusal = plan_layout_refusal(state, margs)
    assert refusal is not None and "resume with --global-batch-size 8 (now 4)" in refusal
    assert plan_layout_refusal(state, Namespace(data_parallel_size=4, global_batch_size=8, micro_batch_size=1)) is None


# -- issue 37 D7: a job stopped between Megatron's tracker update and our sidecar ---------------------------
def test_a_checkpoint_without_its_sidecar_names_the_ckpt_step_that_resumes(tmp_path):
    """The tracker names iteration 4 but the job stopped before our sidecar: the refusal (one line) names
    Megatron's --ckpt-step with the newest earlier iteration whose sidecar exists, the reset as the last resort."""
    args = Namespace(save=str(tmp_path), load=str(tmp_path))
    for it in (1, 2):
        save_data_state(iteration_dir(args.save, it), it, {"stream_position": it})
    os.makedirs(iteration_dir(args.save, 3))  # a checkpoint that lost its sidecar too
    megatron_like_save(args.save)(4, None, None, None, 0)  # Megatron's save, then the kill
    with pytest.raises(RuntimeError) as caught:
        wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args)(None, None, None)
    message = str(caught.value)
    assert "\n" not in message and "iteration 4 but holds no wlb_packer_state.json" in message
    assert "resume from iteration 2" in message and "--ckpt-step 2" in message
    assert message.index("--ckpt-step 2") < message.index("last resort pass --wlb-reset-data-stream")
    # --ckpt-step 2 (Megatron loads iteration 2): its sidecar resumes
    registry = DataStateRegistry()
    load_two = wrap_load_checkpoint(lambda *a, **k: (2, 0), registry, lambda: args)
    assert load_two(None, None, None) == (2, 0) and registry.pending == {"stream_position": 2}
    # no earlier checkpoint holds one: the generic --ckpt-step remedy, still one line
    other = Namespace(save=str(tmp_path / "other"), load=str(tmp_path / "other"))
    megatron_like_save(other.save)(3, None, None, None, 0)
    with pytest.raises(RuntimeError) as caught:
        wrap_load_checkpoint(megatron_like_load(other.load), DataStateRegistry(), lambda: other)(None, None, None)
    message = str(caught.value)
    assert "\n" not in message and "resume from iteration" not in message
    assert "(--ckpt-step N), or start afresh without --load; as a last resort pass --wlb-reset-data-stream" in message


def test_a_balanced_run_stopped_before_its_sidecar_is_refused_not_resumed_as_stock(tmp_path):
    """Issue 49 (2): a --wlb-pieces concat-and-cut job killed between Megatron's save and the sidecar resumed as a
    stock Megatron run and skipped its waiting pieces; an earlier sidecar of the same run says it was ours, so the
    resume is refused naming --ckpt-step. A checkpoint directory with no sidecar at all is a stock run: it continues."""
    balanced = {"pieces": "concat-and-cut"}
    args = Namespace(save=str(tmp_path), load=str(tmp_path), consumed_train_samples=12)
    save_data_state(iteration_dir(args.save, 2), 2, {"stream_position": 2})
    megatron_like_save(args.save)(4, None, None, None, 0)  # Megatron's save, then the kill
    with pytest.raises(RuntimeError, match="resume from iteration 2, .*--ckpt-step 2"):
        wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args,
                             lambda: balanced)(None, None, None)
    stock = Namespace(save=str(tmp_path / "stock"), load=str(tmp_path / "stock"), consumed_train_samples=12)
    megatron_like_save(stock.save)(4, None, None, None, 0)
    logged: list[str] = []
    load = wrap_load_checkpoint(megatron_like_load(stock.load), DataStateRegistry(), lambda: stock, lambda: balanced,
                                log=logged.append)
    assert load(None, None, None)[0] == 4 and "a stock Megatron run" in logged[0]


def megatron_saved_args(checkpoint_dir, fmt, **args):
    """What Megatron's save leaves for its ``args``: a torch_dist checkpoint's common.pt, or a legacy checkpoint's
    rank-0 file (here with one tensor beside them, as the model's)."""
    import torch

    name = "common.pt" if fmt == "torch_dist" else os.path.join("mp_rank_00", "model_optim_rng.pt")
    path = os.path.join(checkpoint_dir, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"args": Namespace(**args), "iteration": 1, "model": {"w": torch.zeros(4)}}, path)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_balanced_run_stopped_before_its_first_sidecar_is_refused_by_its_saved_args(tmp_path, fmt):
    """Issue 57 (1): killed between Megatron's first save and our first sidecar, no earlier sidecar says the run was
    ours and it resumed as a stock Megatron run, its waiting pieces never trained. The checkpoint's saved args carry
    our --wlb-* flags: refused in one line naming --wlb-reset-data-stream. A stock run's saved args (no --wlb-*
    attribute) still continue."""
    balanced = {"pieces": "concat-and-cut"}
    args = Namespace(save=str(tmp_path / "ours"), load=str(tmp_path / "ours"), consumed_train_samples=8)
    megatron_like_save(args.save)(1, None, None, None, 0)  # Megatron's save, then the kill
    megatron_saved_args(iteration_dir(args.save, 1), fmt, seq_length=64, wlb_pieces="concat-and-cut",
                        wlb_packer=None, wlb_reset_data_stream=False)
    with pytest.raises(RuntimeError) as caught:
        wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args,
                             lambda: balanced)(None, None, None)
    message = str(caught.value)
    assert "\n" not in message and "iteration 1 but holds no wlb_packer_state.json" in message
    assert "--ckpt-step N" in message and "start afresh without --load" in message
    assert ("pass --wlb-reset-data-stream to continue Megatron's samples from consumed_train_samples without the "
            "tokens the packer held back") in message
    stock = Namespace(save=str(tmp_path / "stock"), load=str(tmp_path / "stock"), consumed_train_samples=8)
    megatron_like_save(stock.save)(1, None, None, None, 0)
    megatron_saved_args(iteration_dir(stock.save, 1), fmt, seq_length=64)
    logged: list[str] = []
    load = wrap_load_checkpoint(megatron_like_load(stock.load), DataStateRegistry(), lambda: stock, lambda: balanced,
                                log=logged.append)
    assert load(None, None, None)[0] == 1 and "a stock Megatron run" in logged[0]


def test_reset_data_stream_in_the_balanced_mode_says_what_continues_and_what_is_dropped(tmp_path):
    """Issue 49 (8): with Megatron's samples the reset said "restarts at its first document" while the samples
    continue at consumed_train_samples, and did not say which waiting pieces it drops."""
    args = Namespace(save=str(tmp_path), load=str(tmp_path), wlb_reset_data_stream=True, consumed_train_samples=12)
    megatron_like_save(args.save)(3, None, None, None, 0)
    saved = {"packer": {"extra": {"waiting": [[1, 0, 100, 0], [2, 50, 30, 1]]}}}
    save_data_state(iteration_dir(args.save, 3), 3, saved, {"pieces": "concat-and-cut", "max_delay": 8})
    lines: list[str] = []
    load = wrap_load_checkpoint(megatron_like_load(args.load), DataStateRegistry(), lambda: args,
                                lambda: {"pieces": "concat-and-cut", "max_delay": 4}, lines.append)
    assert load(None, None, None) == (3, 0)
    assert "consumed_train_samples (12)" in lines[0] and "first document" not in lines[0]
    assert "the 130 tokens of the 2 pieces the checkpoint's packer held back are not trained" in lines[0]


# -- issue 37 D15: --wlb-reset-data-stream left in a requeue script applies once ----------------------------
def test_reset_data_stream_applies_once_and_is_ignored_after_it(tmp_path):
    args = Namespace(save=str(tmp_path), load=str(tmp_path), wlb_reset_data_stream=True,
                     data_path=["1.0", "/data/a_text_document"], split="98,2,0", seed=1234)
    now = {"packing": "wlb", "max_delay": 4}
    megatron_like_save(args.save)(3, None, None, None, 0)
    save_data_state(iteration_dir(args.save, 3), 3, {"stream_position": 7}, {"packing": "wlb", "max_delay": 8})

    def load(registry, lines):
        return wrap_load_checkpoint(megatron_like_load(args.load), registry, lambda: args, lambda: now,
                                    lines.append)(None, None, None)

    first, lines = DataStateRegistry(), []
    assert load(first, lines) == (3, 0) and first.pending is None and first.data_stream_resets == 1
    assert first.data_stream_reset == {"iteration": 3, "data_flags": {
        "data_path": ["1.0", "/data/a_text_document"], "train_data_path": None, "valid_data_path": None,
        "test_data_path": None, "split": "98,2,0", "seed": 1234}}
    assert len(lines) == 1 and "restarts at its first document" in lines[0]
    # training goes on after the reset and saves at iteration 5: the sidecar records the reset
    its = new_iterators_for(tmp_path)
    first.register(its)
    for _ in range(its.n):
        next(its)
    wrap_save_checkpoint(megatron_like_save(args.save), first, lambda: args, lambda: True, lambda: now)(
        5, None, None, None, 0)
    saved = load_data_state(iteration_dir(args.save, 5), 5)
    assert saved["data_stream_reset"] == first.data_stream_reset and saved["data_stream_resets"] == 1
    # the requeued job resumes from 5 with the same command line: the flag is ignored, the stream continues
    again, lines = DataStateRegistry(), []
    assert load(again, lines) == (5, 0)
    assert again.pending == saved["data"] and again.data_stream_resets == 1
    assert len(lines) == 1 and "--wlb-reset-data-stream ignored" in lines[0] and "iteration 3" in lines[0]
    # with another data flag (or setting) the flag asks for a new reset, and gets it
    args.seed = 99
    changed, lines = DataStateRegistry(), []
    assert load(changed, lines) == (5, 0) and changed.pending is None and changed.data_stream_resets == 2
    assert changed.data_stream_reset["iteration"] == 5 and "ignored" not in lines[0]


def test_version_2_sidecars_still_resume(tmp_path):
    """Sidecars written before the reset record (version 2) keep resuming, checksum checked."""
    import json

    from megatron_wlb.megatron.state.checkpoint_files import VERSION_KEYS, sidecar_checksum

    payload = {"version": 2, "iteration": 4, "settings": None, "data": {"stream_position": 3},
               "data_stream_resets": 1}
    payload["sha256"] = sidecar_checksum(payload)
    assert payload["sha256"] != sidecar_checksum({**payload, "version": 3, "data_stream_reset": None})
    path = tmp_path / SIDECAR_NAME
    path.write_text(json.dumps(payload))
    loaded = load_data_state(str(tmp_path), 4)
    assert loaded["data"] == {"stream_position": 3} and loaded["data_stream_reset"] is None
    assert loaded["fingerprint"] is None
    path.write_text(json.dumps({**payload, "data_stream_resets": 0}))
    with pytest.raises(ValueError, match="do not match its checksum"):
        load_data_state(str(tmp_path), 4)
    assert sorted(VERSION_KEYS) == [2, 3, 4]


def test_a_checkpoint_planned_on_another_layout_says_what_changed_and_what_resumes(prefix):
    """Issue 57 (7): a dynamic-CP checkpoint of a DP2 x CP2 pool resumed as DP4 x CP1 (the same 4 ranks) was refused
    with 560 characters of cost vectors and no way forward; now one line naming both layouts, the flag that
    resumes and --wlb-reset-data-stream. Another DP size alone still resumes."""
    from dataclasses import replace

    from megatron_wlb.costmodel import AnalyticCostModel, ParallelLayout, get_model
    from megatron_wlb.megatron.args.validation import StartupError

    reader = DocumentReader([(prefix, 1.0)], split="1,0,0", seed=5)

    def iterator(config, layout):
        packer = make_packer("wlb", config, AnalyticCostModel(get_model("550m"), layout))
        return WlbDataIterator(reader, reader.stream(40 * CFG.tokens_per_iteration), packer, 0)

    saved = iterator(CFG, ParallelLayout(cp=2, dp=2))
    for _ in range(2 * CFG.n):
        next(saved)
    state = saved.state_dict()
    dp4 = replace(CFG, dp=4, n=CFG.n // 2)  # the same global batch over 4 DP ranks
    with pytest.raises(StartupError) as caught:
        DataStateRegistry(pending=state, pending_iteration=2).register(iterator(dp4, ParallelLayout(cp=1, dp=4)))
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400, message
    assert ("the checkpoint at iteration 2 was planned on the layout TP1-CP2-PP1-DP2, this run is TP1-CP1-PP1-DP4"
            in message and "resume on it (--context-parallel-size 2, any DP size at the same global batch)" in message
            and "pass --wlb-reset-data-stream" in message and "cost_probe" not in message)
    DataStateRegistry(pending=state, pending_iteration=2).register(iterator(dp4, ParallelLayout(cp=2, dp=4)))
