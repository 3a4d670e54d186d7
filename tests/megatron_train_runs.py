"""The Megatron training runs the test_megatron_train*.py files share: one run of ``tests/megatron_train_probe.py`` as
a one-node world (``train``), what it left behind (``Run``) and the checks every layout's run must pass.

Each test launches ``tests/megatron_train_probe.py`` as a one-node world (tests/rank_launch.py: the ranks
torchrun starts, without its agent; ``megatron_wlb.megatron.entry.cpu`` plus records: losses, iteration-1
gradients, tokens of every document that reached the model) on a tiny GPT and real text (the standard
library as a byte-level .bin/.idx).

Two ways in: ``megatron_wlb.megatron.entry.launcher`` over the installed megatron-core's
``megatron.training`` (0.19.x ships it; CI installs 0.19.2), and the pinned Megatron-LM checkout's
patched ``pretrain_gpt.py`` (core_v0.16.1), run wherever ``MEGATRON_LM`` (conftest's one lookup)
names a git repository holding the pinned commit; the test checks out and patches a copy.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from rank_launch import run_ranks

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "megatron_train_probe.py"
TIMEOUT = 420


def _training_code_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


if not _training_code_installed():
    reason = ("megatron.training is not installed: pip install --no-deps --ignore-requires-python "
              "megatron-core==0.19.2 (see the README's test command)")
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


@dataclass
class Run:
    """What one training run left behind (per rank records, merged)."""

    log: str
    ranks: dict[int, dict]
    out: Path

    @property
    def losses(self) -> dict[int, float]:
        """lm loss per iteration (from a last-stage rank; all of them agree)."""
        for record in self.ranks.values():
            if record["losses"] and all(v is not None for v in record["losses"].values()):
                return {int(k): v for k, v in record["losses"].items()}
        raise AssertionError(f"no rank recorded losses; log tail:\n{self.log[-3000:]}")

    def grads(self, rank: int = 0) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"rank{rank}_grads.pt")

    def doc_tokens(self) -> list[dict[int, int]]:
        """Tokens per document that reached the model, per data iterator (model chunk), summed over the
        ranks that count (TP rank 0 of the last stage, every CP and DP rank)."""
        merged: list[dict[int, int]] = []
        for record in self.ranks.values():
            for which, counts in enumerate(record["doc_tokens"]):
                while len(merged) <= which:
                    merged.append({})
                for doc, n in counts.items():
                    merged[which][int(doc)] = merged[which].get(int(doc), 0) + n
        return merged

    def planned_tokens(self) -> dict[int, int]:
        """Tokens per document in the plans of the iterations trained (every DP rank's micro-batches)."""
        plans = next(r["plans"] for r in self.ranks.values() if r["plans"])
        planned: dict[int, int] = {}
        for plan in plans:
            for doc, length in plan:
                planned[doc] = planned.get(doc, 0) + length
        return planned


def train(tmp_path: Path, name: str, corpus: str | None, *flags: str, env: dict | None = None,
          pretrain_gpt: str | None = None, expect_ok: bool = True) -> Run:
    """Run the probe as the ranks of a one-node world (``rank_launch.run_ranks``: torchrun's worker environment,
    without its agent) with the layout in ``env`` (TP/CP/PP/VPP/DP) and ``flags`` (no
    ``--data-path`` where ``corpus`` is None: Megatron's mock data)."""
    from megatron_wlb.megatron.entry.cpu import layout_from_env, world_size

    env = {**os.environ, **(env or {})}
    layout, _ = layout_from_env(env)
    out = tmp_path / name
    out.mkdir()
    env["WLB_PROBE_OUT"] = str(out)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    entry = ["--pretrain-gpt", pretrain_gpt] if pretrain_gpt else []
    args = [str(PROBE), *entry, "--tiny-gpt", *(["--data-path", corpus] if corpus else []), *flags]
    proc = run_ranks(args, world_size(layout), env=env, cwd=tmp_path, timeout=TIMEOUT)
    log = proc.stdout + proc.stderr
    (out / "train.log").write_text(log)
    if expect_ok:
        assert proc.returncode == 0, f"training failed (rc {proc.returncode}); log tail:\n{log[-6000:]}"
    ranks = {}
    for path in out.glob("rank*.json"):
        ranks[int(path.stem[4:])] = json.loads(path.read_text())
    run = Run(log=log, ranks=ranks, out=out)
    if not expect_ok:
        run.returncode = proc.returncode  # type: ignore[attr-defined]
    return run


def assert_trains(run: Run, iterations: int = 4) -> None:
    losses = run.losses
    assert sorted(losses) == list(range(1, iterations + 1)), losses
    assert all(v == v and abs(v) < 1e3 for v in losses.values()), losses
    assert losses[iterations] < losses[1], f"the loss did not fall: {losses}"
    assert run.log.count(" iteration ") >= iterations  # Megatron's own iteration lines
    # the launcher destroys the process groups once training returns (an exit with gloo's threads alive can abort)
    assert all(r.get("process_groups_released") for r in run.ranks.values()), "a rank left its process groups up"


def assert_documents_once(run: Run) -> None:
    """Every planned document's tokens reached the model exactly once (per model chunk)."""
    planned = run.planned_tokens()
    seen = run.doc_tokens()
    assert planned and seen, "nothing recorded"
    for chunk, counts in enumerate(seen):
        differ = {d: (planned.get(d), counts.get(d)) for d in set(planned) | set(counts)
                  if planned.get(d) != counts.get(d)}
        assert not differ, f"model chunk {chunk}: (planned, seen) tokens of the documents that differ: {differ}"


def assert_trace(run: Run, ranks: int, chunks: int = 1, iterations: int = 4) -> None:
    """The timing trace (``--wlb-trace``) has exactly one row per micro-batch per chunk per rank, each
    with a measured forward and backward, the planned documents, and one iteration row per rank."""
    from collections import Counter

    from megatron_wlb.costmodel.trace import read_trace

    trace = read_trace(run.out / "trace.jsonl")
    assert len(trace.headers) == ranks
    n = Counter((r.iteration, r.rank, r.chunk) for r in trace.micro_batches)
    assert {k[0] for k in n} == set(range(iterations)) and {k[1] for k in n} == set(range(ranks))
    assert {k[2] for k in n} == set(range(chunks))
    assert len(n) == iterations * ranks * chunks
    counts = set(n.values())
    assert len(counts) == 1, f"ranks or chunks timed different numbers of micro-batches: {counts}"
    (per_chunk,) = counts
    for key in n:
        indices = sorted(r.micro_batch for r in trace.micro_batches if (r.iteration, r.rank, r.chunk) == key)
        assert indices == list(range(per_chunk)), f"{key}: micro-batch indices {indices}"
    assert all(r.fwd_s > 0 and r.bwd_s > 0 and r.layers >= 1 for r in trace.micro_batches)
    assert Counter((r.iteration, r.rank) for r in trace.iterations) == {(i, k): 1 for i in range(iterations)
                                                                        for k in range(ranks)}
    assert all(r.wall_s >= r.compute_s > 0 for r in trace.iterations)
    plans = next(r["plans"] for r in run.ranks.values() if r["plans"])
    for it, plan in enumerate(plans[:iterations]):
        traced = sorted(x for r in trace.micro_batches if r.iteration == it and r.pp == 0 and r.chunk == 0
                        and r.cp == 0 and r.tp == 0 for x in r.lengths)
        assert traced == sorted(length for _, length in plan), f"iteration {it}: traced lengths differ from the plan"
    assert run.log.count("[wlb] measured iteration") == iterations


# --- the launcher over the installed megatron.training -------------------------------------------------------


def stock_samples(corpus: str, tmp_path: Path, iterations: int, first: int = 0, dp: int = 2,
                  eod_mask_loss: bool = True, inter_document: bool = False) -> dict[int, tuple]:
    """What a stock job trains over ``iterations`` steps from ``first``: megatron-core's GPTDataset built as
    the run built it, read in the order of Megatron's own ``MegatronPretrainingSampler`` at DP ``dp``:
    piece id (position * seq_length + start) -> (iteration, sha256 of its tokens, labels and loss mask).
    ``inter_document``: masked with ``--dataloader-inter-document-masking`` instead of the ``--reset-*`` flags."""
    import hashlib
    import types

    import numpy as np

    from megatron_wlb.megatron.args.compat import install_python_shims

    install_python_shims()
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    from megatron_wlb.megatron.data.gpt_datasets import build_train_dataset
    from megatron_wlb.megatron.data.gpt_samples import MegatronSamples

    seq, gbs, train_iters = 256, 4, 4
    args = types.SimpleNamespace(seed=1234, seq_length=seq, data_path=[corpus], split="98,2,0",
                                 data_cache_path=str(tmp_path / f"stock_cache{'_inter' * inter_document}"),
                                 mmap_bin_files=True, reset_position_ids=not inter_document,
                                 reset_attention_mask=not inter_document, eod_mask_loss=eod_mask_loss,
                                 dataloader_inter_document_masking=inter_document,
                                 data_args_path=None, per_split_data_args_path=None, train_data_path=None,
                                 valid_data_path=None, test_data_path=None)
    samples = MegatronSamples(build_train_dataset(args, NullTokenizer(300), (train_iters * gbs, 0, 0)))
    out = {}
    for rank in range(dp):
        sampler = iter(MegatronPretrainingSampler(len(samples), first * gbs, 1, rank, dp))
        for _ in range(iterations * gbs // dp):
            (j,) = next(sampler)
            tokens, labels, mask, positions = samples.sample(j)
            starts = np.flatnonzero(positions == 0)
            for a, b in zip(starts.tolist(), np.append(starts[1:], seq).tolist()):
                h = hashlib.sha256()
                for arr in (tokens[a:b], labels[a:b], mask[a:b]):
                    h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
                out[j * seq + a] = (j // gbs, h.hexdigest())
    return out


def fed_pieces(run: Run) -> dict[int, str]:
    """Every piece that reached the model in ``run`` (any rank): id -> digest of its data (ranks agree)."""
    fed: dict[int, str] = {}
    for record in run.ranks.values():
        for doc, digest in record["piece_data"].items():
            assert fed.setdefault(int(doc), digest) == digest
    return fed


def assert_fed_stock_samples(run: Run, stock: dict[int, tuple[int, str]]) -> dict[int, str]:
    """Every piece that reached the model in ``run`` is a piece of a ``stock`` sample (``stock_samples``), with
    Megatron's own tokens, labels and loss mask; the pieces fed (``fed_pieces``)."""
    fed = fed_pieces(run)
    assert fed and set(fed) <= set(stock), f"pieces the stock job does not train: {sorted(set(fed) - set(stock))[:5]}"
    assert all(fed[k] == stock[k][1] for k in fed), "a piece's tokens, labels or loss mask differ from Megatron's"
    return fed
