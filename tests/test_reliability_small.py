"""Small reliability fixes (issue 22, items 4, 6, 7): no empty pieces from the cut policy, a corrupt or
altered checkpoint sidecar refused naming the file, overflowing blend weights, duplicate YAML keys,
absurd layout / micro-batch counts, calibrate --smoke flags and the int32 bound of a micro-batch."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_wlb.cli.main import main
from megatron_wlb.packing import PackingConfig, make_packer


# -- item 4: the cut policy with a first queue threshold of 1 ---------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_the_cut_policy_never_emits_an_empty_piece(seed):
    """L_1 = 1 makes every document an outlier; a forced 1-token one was cut into [1, 0] pieces (the
    Megatron adapter then died mid-run). Every document must come out once, in non-empty pieces."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, int(rng.integers(2, 300)), size=int(rng.integers(20, 200)))
    thresholds = (1, *sorted(set(rng.integers(2, 150, size=int(rng.integers(0, 3))).tolist())))
    cfg = PackingConfig(seq_len=100, n=int(rng.integers(1, 4)), dp=int(rng.integers(1, 3)), max_seq_len=150,
                        max_delay=int(rng.integers(0, 3)), cut=("any", "overlong")[seed % 2],
                        queue_thresholds=thresholds, fill=str(rng.choice(["read-ahead", "full"])))
    pieces = [p for b in make_packer("wlb", cfg).pack(lengths) for p in b.pieces()]
    assert min(p.length for p in pieces) >= 1
    covered = np.zeros(lengths.size, dtype=np.int64)
    for p in pieces:
        covered[p.doc_id] += p.length
    assert covered.tolist() == lengths.tolist()


# -- item 6: the checkpoint sidecar ------------------------------------------------------------------------
def _sidecar(tmp_path: Path) -> Path:
    from megatron_wlb.megatron.state.checkpoint_files import save_data_state

    state = {"stream_position": 12, "packer": {"waiting": [[3, 0, 40, 1], [5, 0, 7, 1]]}}
    return Path(save_data_state(str(tmp_path), 4, state, {"packing": "wlb"}))


@pytest.mark.parametrize("content, expect", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2]", "not a WLB data state"),
    (b'{"version": 2, "iteration": 4}', "not a WLB data state"),
])
def test_a_corrupt_sidecar_is_refused_naming_the_file(tmp_path, content, expect):
    from megatron_wlb.megatron.state.checkpoint_files import load_data_state

    path = _sidecar(tmp_path)
    path.write_bytes(content)
    with pytest.raises(ValueError, match=expect) as caught:
        load_data_state(str(tmp_path), 4)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_an_altered_sidecar_that_is_still_valid_json_is_refused(tmp_path):
    from megatron_wlb.megatron.state.checkpoint_files import load_data_state

    path = _sidecar(tmp_path)
    assert load_data_state(str(tmp_path), 4)["data"]["stream_position"] == 12  # intact: accepted
    payload = json.loads(path.read_text())
    payload["data"]["packer"]["waiting"].pop()  # a waiting piece removed: its tokens would never train
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="do not match its checksum") as caught:
        load_data_state(str(tmp_path), 4)
    assert str(path) in str(caught.value)


# -- item 7 ------------------------------------------------------------------------------------------------
def test_blend_weights_whose_sum_overflows_are_refused(tmp_path, capsys):
    from megatron_wlb.data.blend import parse_data_path
    from megatron_wlb.data.indexed import write_index
    from megatron_wlb.data.reader import DocumentReader

    with pytest.raises(ValueError, match="sum past the largest float"):
        parse_data_path("1e308 A 1e308 B")
    a, b = write_index(tmp_path / "a", np.array([5, 6, 7])), write_index(tmp_path / "b", np.array([8, 9]))
    for prefix in (a, b):
        np.zeros(100, dtype=np.uint16).tofile(f"{prefix}.bin")
    assert main(["pack", "--config", "550m_64k", "--data-path", "1e308", str(a), "1e308", str(b)]) == 2
    err = capsys.readouterr().err
    assert "sum past the largest float" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="sum past the largest float"):
        DocumentReader.from_data_path(["1e308", str(a), "1e308", str(b)])


def test_duplicate_yaml_keys_are_refused(tmp_path):
    from megatron_wlb.config import load_config

    path = tmp_path / "dup.yaml"
    path.write_text("model: 7b\nseq_len: 4096\nlayout: {tp: 1, cp: 1, pp: 1, dp: 1}\nseq_len: 8192\n")
    with pytest.raises(ValueError, match=r"dup\.yaml: not valid YAML.*duplicate key 'seq_len' \(line 4\)"):
        load_config(path)
    nested = tmp_path / "nested.yaml"
    nested.write_text("model: 7b\nseq_len: 4096\nlayout: {tp: 1, cp: 1, pp: 1, dp: 1}\n"
                      "packing:\n  max_delay: 2\n  max_delay: 5\n")
    with pytest.raises(ValueError, match="duplicate key 'max_delay'"):
        load_config(nested)


def test_yaml_merge_keys_load_as_in_plain_pyyaml():
    """Issue 49 (10): ``<<: *base`` was refused with PyYAML's "could not determine a constructor"; it merges, a
    key given beside it wins, and a key given twice beside it is still refused."""
    import yaml

    from megatron_wlb.config import load_yaml

    text = "base: &b {max_delay: 2, window: 4}\npacking:\n  <<: *b\n  window: 8\n"
    assert load_yaml(text) == yaml.safe_load(text) == {"base": {"max_delay": 2, "window": 4},
                                                       "packing": {"max_delay": 2, "window": 8}}
    with pytest.raises(yaml.YAMLError, match="duplicate key 'window'"):
        load_yaml(text + "  window: 9\n")


@pytest.mark.parametrize("body, expect", [
    ("layout: {tp: 1099511627776, cp: 1, pp: 1, dp: 1}\n", r"layout\.tp=1099511627776: must be at most 1048576"),
    ("layout: {tp: 1024, cp: 1024, pp: 1, dp: 2}\n", "makes a world of 2097152 ranks; at most 1048576"),
    ("layout: {tp: 1, cp: 1, pp: 1, dp: 1}\nmicro_batches: 1000000\n", "micro_batches=1000000: must be at most 4096"),
])
def test_absurd_layouts_and_micro_batch_counts_are_refused(tmp_path, body, expect):
    from megatron_wlb.config import load_config

    path = tmp_path / "big.yaml"
    path.write_text("model: 7b\nseq_len: 4096\n" + body)
    with pytest.raises(ValueError, match=expect):
        load_config(path)


@pytest.mark.parametrize("flags, expect", [
    (["--lengths", "abc"], "takes no --lengths"),
    (["--tp", "0"], "takes no --tp"),
    (["--backend", "foo"], "--backend 'foo': choose one of auto, torch-varlen, flash-attn, reference"),
    (["--backend", "flash-attn"], "takes no --backend"),
])
def test_calibrate_smoke_refuses_flags_it_would_ignore(tmp_path, capsys, flags, expect):
    pytest.importorskip("torch")
    rc = main(["calibrate", "--smoke", "--out", str(tmp_path / "p.json"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.json").exists()


def test_a_micro_batch_past_int32_is_refused():
    from megatron_wlb.cp.plan import micro_batch_lengths

    assert micro_batch_lengths([2**31 - 8, 3], 4).sum() == 2**31 - 4
    with pytest.raises(ValueError, match=r"a micro-batch of 2147483652 tokens .* int32"):
        micro_batch_lengths([2**31 - 2, 3], 4)
    with pytest.raises(ValueError, match=r"max_seq_len=3000000000 .* int32"):
        PackingConfig(seq_len=2_000_000_000, n=1)


@pytest.mark.parametrize("leave, released", [(None, True), (SystemExit(0), True), (SystemExit(None), True),
                                             (SystemExit(1), False), (SystemExit("megatron_wlb: bad flag"), False),
                                             (RuntimeError("crash"), False)])
def test_megatrons_early_exits_release_the_process_groups(monkeypatch, leave, released):
    """Issue 49 (6): --exit-interval, --exit-duration-in-mins and --exit-signal-handler leave Megatron's ``pretrain``
    by ``sys.exit(0)``, past ``release_process_groups``; every rank leaves there alike, so they are released (not
    on an error: another rank might never reach the barrier)."""
    pytest.importorskip("torch")
    from megatron_wlb.megatron.entry import launcher

    calls: list[int] = []
    monkeypatch.setattr(launcher, "release_process_groups", lambda: calls.append(1))
    with pytest.raises(type(leave)) if leave is not None else contextlib.nullcontext():
        with launcher.released_at_exit():
            if leave is not None:
                raise leave
    assert calls == ([1] if released else [])


def test_the_end_of_training_names_what_the_packer_still_holds(monkeypatch, capsys):
    """Issue 49 (3): pieces still waiting when training ends were never trained and nothing said so. A wlb packer
    that delays outliers holds some after its first plans; the launcher's exit path prints them (tokens, pieces,
    documents), and nothing when nothing waits."""
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from megatron_wlb.megatron.entry import launcher
    from megatron_wlb.megatron.state import process as state
    from megatron_wlb.megatron.state.checkpoint import DataStateRegistry
    from megatron_wlb.packing import make_packer
    from megatron_wlb.packing.base import ArraySource
    from megatron_wlb.packing.types import PackingConfig

    packer = make_packer("wlb", PackingConfig(seq_len=1024, n=2, dp=1, max_seq_len=1536))
    plans = packer.pack_source(ArraySource(np.array([60, 1000, 900, 30, 1400, 20, 1300, 40] * 20), np.arange(160)))
    next(plans)
    assert packer.pending() > 0
    registry = DataStateRegistry()
    registry.iterators.append(SimpleNamespace(packer=packer))
    monkeypatch.setattr(state._RUNTIME, "registry", registry)
    monkeypatch.setattr(launcher, "release_process_groups", lambda: None)
    with launcher.released_at_exit():
        pass
    out = capsys.readouterr().out
    assert f"training ended with {packer.pending()} tokens read but not trained ({len(packer.waiting)} pieces" in out
    registry.iterators[0] = SimpleNamespace(packer=make_packer("wlb", PackingConfig(seq_len=1024, n=2, dp=1)))
    with launcher.released_at_exit():
        pass
    assert "training ended" not in capsys.readouterr().out


@pytest.mark.parametrize("name", ["fixed-greedy", "original", "fixed-solver", "whole-document", "wlb"])
def test_every_packer_names_the_pieces_it_still_holds(monkeypatch, name):
    """Issue 57 (9): the original packer's held tokens were reported as "(0 pieces of 0 documents ...: )": every
    packer's ``held()`` pieces are its ``pending()`` tokens, and the report names them."""
    from types import SimpleNamespace

    from megatron_wlb.megatron.state import process as state
    from megatron_wlb.megatron.state.checkpoint import DataStateRegistry
    from megatron_wlb.packing.base import ArraySource

    packer = make_packer(name, PackingConfig(seq_len=1024, n=2, dp=1, max_seq_len=1536))
    plans = packer.pack_source(ArraySource(np.array([60, 1000, 900, 30, 1400, 20, 1300, 43] * 20), np.arange(160)))
    next(plans)
    held = packer.held()
    assert sum(p.length for p in held) == packer.pending() > 0
    registry = DataStateRegistry()
    registry.iterators.append(SimpleNamespace(packer=packer))
    monkeypatch.setattr(state._RUNTIME, "registry", registry)
    report = state.untrained_report()
    documents = len({p.doc_id for p in held})
    assert report is not None and f"{packer.pending()} tokens read but not trained ({len(held)} pieces of " \
        f"{documents} documents or samples waiting for a later iteration: " in report and ": )" not in report
