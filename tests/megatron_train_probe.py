"""Run by torchrun from tests/test_megatron_train.py: Megatron's training loop on CPU, plus records.

Usage: ``torchrun ... tests/megatron_train_probe.py [--pretrain-gpt PATH] [--tiny-gpt] <flags>`` with
``WLB_PROBE_OUT`` naming a directory. It runs exactly what ``megatron_wlb.megatron.cpu`` runs and
writes, per rank, ``rank{R}.json``:

- ``losses``: ``{iteration: lm loss}`` as ``train_step`` returned it (last pipeline stage only);
- ``doc_tokens``: tokens of each stream document that reached the model after CP sharding, per data
  iterator (first model chunk first), counted on TP rank 0 of the last pipeline stage (our launcher
  only: the tokens carry a ``doc_ids`` row through the same sharding as every [1, T] tensor);
- ``plans``: every global plan the first iterator made: ``[[doc_id, length], ...]`` per iteration;
- ``parallel``: this rank's tp/cp/pp/dp ranks; ``core_version``: the megatron-core that ran.

and ``rank{R}_grads.pt``: ``{parameter name: main_grad}`` after iteration 1 (what the optimizer used).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

argv = sys.argv[1:]
if argv[:1] == ["--pretrain-gpt"]:  # the checkout's megatron must win over the installed one
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))

from megatron_wlb.megatron import cpu  # noqa: E402

cpu.install_cpu_redirects()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.training import training  # noqa: E402

from megatron_wlb.megatron import cp_hooks  # noqa: E402
from megatron_wlb.megatron.data import WlbDataIterator  # noqa: E402

OUT = os.environ["WLB_PROBE_OUT"]
RANK = int(os.environ.get("RANK", "0"))
from megatron.core import package_info  # noqa: E402

record: dict = {"losses": {}, "doc_tokens": [], "plans": [], "parallel": {},
                "core_version": str(package_info.__version__)}
_iterator_index: dict[int, int] = {}

_next = WlbDataIterator.__next__


def _next_with_doc_ids(self):
    if self._cursor >= len(self._mine):
        self._next_batch()
    mb = self._mine[self._cursor]
    out = _next(self)
    total = out["tokens"].shape[1]
    ids = np.full(total, -1, dtype=np.int64)
    at = 0
    for piece in mb.pieces:
        ids[at:at + piece.length] = piece.doc_id
        at += piece.length
    out["doc_ids"] = torch.from_numpy(ids)[None]
    out["_iterator"] = _iterator_index.setdefault(id(self), len(_iterator_index))
    if out["_iterator"] == 0 and self._cursor == 1:
        record["plans"].append([[p.doc_id, p.length] for m in self.current.micro_batches for p in m.pieces])
    return out


WlbDataIterator.__next__ = _next_with_doc_ids
_shard = cp_hooks.get_batch_on_this_cp_rank


def _shard_and_count(batch, *args, **kwargs):
    from megatron.core import parallel_state as ps

    which = batch.pop("_iterator", None)
    out = _shard(batch, *args, **kwargs)
    if which is not None and "doc_ids" in out and ps.is_pipeline_last_stage(ignore_virtual=True) \
            and ps.get_tensor_model_parallel_rank() == 0:
        while len(record["doc_tokens"]) <= which:
            record["doc_tokens"].append(defaultdict(int))
        ids, counts = np.unique(out["doc_ids"].numpy(), return_counts=True)
        for i, c in zip(ids.tolist(), counts.tolist(), strict=True):
            if i >= 0:
                record["doc_tokens"][which][i] += c
    return out


cp_hooks.get_batch_on_this_cp_rank = _shard_and_count
_train_step = training.train_step


def _train_step_recorded(*args, **kwargs):
    from megatron.core import parallel_state as ps

    result = _train_step(*args, **kwargs)
    iteration = len(record["losses"]) + 1
    loss_dict = result[0]
    if loss_dict and "lm loss" in loss_dict:
        value = loss_dict["lm loss"]
        record["losses"][iteration] = float(value[0] / value[1]) if torch.is_tensor(value) and value.numel() == 2 \
            else float(value)
    else:
        record["losses"][iteration] = None
    if iteration == 1:
        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        grads = {}
        for chunk_index, chunk in enumerate(model):
            for name, param in chunk.named_parameters():
                grad = getattr(param, "main_grad", None)
                grads[f"{chunk_index}.{name}"] = (grad if grad is not None else param.grad).detach().clone()
        torch.save(grads, os.path.join(OUT, f"rank{RANK}_grads.pt"))
        record["parallel"] = {"tp": ps.get_tensor_model_parallel_rank(), "cp": ps.get_context_parallel_rank(),
                              "pp": ps.get_pipeline_model_parallel_rank(), "dp": ps.get_data_parallel_rank()}
    _save()
    return result


def _save() -> None:
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump(record, f)


training.train_step = _train_step_recorded
cpu.main(argv)
_save()
