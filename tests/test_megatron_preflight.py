"""Start-up checks of the training loop's flags (megatron_wlb.megatron.args.preflight), on plain namespaces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_wlb.megatron.args.preflight import check_training_args


def args(**overrides):
    base = dict(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                calculate_per_token_loss=True, tp_comm_overlap=False, cuda_graph_impl="none",
                sequence_parallel=False, transformer_impl="transformer_engine", no_persist_layer_norm=True,
                reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    return SimpleNamespace(**{**base, **overrides})


def test_per_token_loss_is_switched_on_and_said():
    a = args(calculate_per_token_loss=False)
    notes = check_training_args(a, middle_stage_batches=True)
    assert a.calculate_per_token_loss is True
    assert any("--calculate-per-token-loss set" in n for n in notes)
    assert check_training_args(args(), middle_stage_batches=True) == []


@pytest.mark.parametrize("pp,vpp,refused", [(1, None, False), (2, None, False), (2, 2, True), (3, None, True),
                                            (4, None, True), (4, 2, True)])
def test_middle_stages_need_packed_params(pp, vpp, refused):
    a = args(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    assert check_training_args(a, middle_stage_batches=True) == []  # launcher / patched pretrain_gpt
    if refused:
        with pytest.raises(ValueError, match=f"middle stages \\(PP={pp}"):
            check_training_args(a, middle_stage_batches=False)
    else:
        check_training_args(a, middle_stage_batches=False)


@pytest.mark.parametrize("flag,value,message", [
    ("tp_comm_overlap", True, "--tp-comm-overlap"),
    ("cuda_graph_impl", "local", "CUDA graphs"),
    ("cuda_graph_impl", "transformer_engine", "CUDA graphs"),
])
def test_fixed_shape_features_are_refused(flag, value, message):
    with pytest.raises(ValueError, match=message):
        check_training_args(args(**{flag: value}), middle_stage_batches=True)


def test_local_spec_norm_limits_are_said_before_megatron_asserts(monkeypatch):
    import megatron_wlb.megatron.args.validation as wlb_args

    monkeypatch.setattr(wlb_args, "module_available", lambda name: False)  # no apex
    with pytest.raises(ValueError, match="--no-persist-layer-norm"):
        check_training_args(args(transformer_impl="local", no_persist_layer_norm=False), middle_stage_batches=True)
    with pytest.raises(ValueError, match="sequence parallelism"):
        check_training_args(args(transformer_impl="local", sequence_parallel=True), middle_stage_batches=True)
    check_training_args(args(transformer_impl="transformer_engine", sequence_parallel=True), middle_stage_batches=True)


def test_eod_flags_are_implied_and_said():
    notes = check_training_args(args(reset_position_ids=True, eod_mask_loss=True), middle_stage_batches=True)
    assert any("--reset-position-ids, --eod-mask-loss: implied" in n for n in notes)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as err:
        check_training_args(args(pipeline_model_parallel_size=4, tp_comm_overlap=True, cuda_graph_impl="local"),
                            middle_stage_batches=False)
    message = str(err.value)  # one line (a StartupError: the launcher exits with it, no traceback)
    assert "\n" not in message and "cannot train packed micro-batches: 3 problems: (1) " in message


def test_empty_split_builds_no_packed_iterator():
    from megatron_wlb.megatron.data.iterators import split_is_empty as _split_is_empty

    a = SimpleNamespace(data_path=["corpus"], split="98,2,0")
    assert _split_is_empty(a, "test") and not _split_is_empty(a, "valid") and not _split_is_empty(a, "train")
    assert not _split_is_empty(SimpleNamespace(data_path=["c"], split="98,2,0", test_data_path=["t"]), "test")


@pytest.mark.parametrize("split", ["nan,1,0", "inf,1,1", "1,-1,0"])
def test_split_refuses_non_finite_weights(split):
    from megatron_wlb.data.reader import parse_split

    with pytest.raises(ValueError, match="--split"):
        parse_split(split)


@pytest.mark.parametrize("weight", ["nan", "inf", "-1", "0"])
def test_blend_refuses_non_finite_weights(weight):
    from megatron_wlb.data.reader import weighted_prefixes as parse_data_path

    with pytest.raises(ValueError, match="must be a positive number"):
        parse_data_path([weight, "A", "1", "B"])
