"""Run by torchrun from tests/megatron_train_runs.py (the test_megatron_train*.py files): Megatron's training loop
on CPU, plus records.

Usage: ``torchrun ... tests/megatron_train_probe.py [--pretrain-gpt PATH] [--tiny-gpt] <flags>`` with
``WLB_PROBE_OUT`` naming a directory. It runs exactly what ``megatron_wlb.megatron.entry.cpu`` runs and
writes, per rank, ``rank{R}.json``:

- ``losses``: ``{iteration: lm loss}`` as ``train_step`` returned it (last pipeline stage only);
- ``grad_norms``: ``{iteration: grad norm}`` as ``train_step`` returned it (full precision; Megatron's log line
  prints three decimals);
- ``doc_tokens``: tokens of each stream document that reached the model after CP sharding, per data
  iterator (first model chunk first), counted on TP rank 0 of the last pipeline stage from the rows
  each upload carries (``RankMicroBatch.rows`` mapped to the pieces' documents);
- ``plans``: every global plan the first iterator made: ``[[doc_id, length], ...]`` per iteration;
- ``pieces``: the same plans' pieces as ``[doc_id, offset, length]``;
- ``piece_data``: ``{doc_id: sha256 of its tokens, labels and loss mask}`` of every piece this rank's
  first iterator fed (what the data path handed the model, before CP sharding; under CP > 1 this rank's rows);
- ``piece_rows`` (with ``WLB_PROBE_PIECE_ROWS=1``): ``{doc_id: [positions in the piece, tokens, labels, loss
  mask]}`` of this rank's rows of every such piece (what the CP ranks together fed, gathered by the test);
- ``agreement``: the plan agreement checks this rank ran before its training steps, and their seconds;
- ``parallel``: this rank's tp/cp/pp/dp ranks; ``core_version``: the megatron-core that ran.

and ``rank{R}_grads.pt``: ``{parameter name: main_grad}`` after iteration 1 (what the optimizer used).
Everything runs under the ``__main__`` guard: Megatron's torch_dist writer spawns a process that re-imports it.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict


def main() -> None:
    """Install the records, then run exactly what ``megatron_wlb.megatron.entry.cpu`` runs."""
    argv = sys.argv[1:]
    if argv[:1] == ["--pretrain-gpt"]:  # the checkout's megatron must win over the installed one
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[1])))

    from megatron_wlb.megatron.entry import cpu

    cpu.install_cpu_redirects()

    import numpy as np
    import torch
    from megatron.training import training

    from megatron_wlb.megatron.data.packed import WlbDataIterator
    from megatron_wlb.megatron.hooks import cp_hooks

    OUT = os.environ["WLB_PROBE_OUT"]
    RANK = int(os.environ.get("RANK", "0"))
    from megatron.core import package_info

    record: dict = {"losses": {}, "grad_norms": {}, "doc_tokens": [], "plans": [], "pieces": [], "piece_data": {},
                    "piece_rows": {}, "parallel": {}, "core_version": str(package_info.__version__)}
    PIECE_ROWS = os.environ.get("WLB_PROBE_PIECE_ROWS") == "1"
    _iterator_index: dict[int, int] = {}

    # produce() builds every micro-batch, whether __next__ or the prefetch thread (megatron/data/prefetch.py) calls it
    _next = WlbDataIterator.produce
    _iterator_of: dict[int, int] = {}  # id(RankMicroBatch) -> index of the iterator that yielded it


    def _next_recorded(self):
        out = _next(self)
        which = _iterator_index.setdefault(id(self), len(_iterator_index))
        _iterator_of[id(out)] = which
        if which == 0:
            import hashlib

            whole = out.take(np.arange(int(out.segment_lengths.sum())), fill=-1)
            at = 0
            for piece in out.micro_batch.pieces:
                rows = np.flatnonzero((whole >= at) & (whole < at + piece.length))
                rows = rows[np.argsort(whole[rows])]
                h = hashlib.sha256()
                for arr in (out.tokens[0, rows], out.labels[0, rows], out.loss_mask[0, rows]):
                    h.update(np.ascontiguousarray(arr, dtype=np.float64).tobytes())
                record["piece_data"][str(piece.doc_id)] = h.hexdigest()
                if PIECE_ROWS:
                    record["piece_rows"][str(piece.doc_id)] = [
                        (whole[rows] - at).tolist(), out.tokens[0, rows].tolist(), out.labels[0, rows].tolist(),
                        out.loss_mask[0, rows].tolist()]
                at += piece.length
        if which == 0 and self._cursor == 1:
            record["plans"].append([[p.doc_id, p.length] for m in self.current.micro_batches for p in m.pieces])
            record["pieces"].append([[p.doc_id, p.offset, p.length] for m in self.current.micro_batches
                                     for p in m.pieces])
        return out


    WlbDataIterator.produce = _next_recorded  # type: ignore[method-assign]
    _upload = cp_hooks.upload_micro_batch


    def _upload_and_count(batch, *args, **kwargs):
        """Count each planned document's tokens in the rows this rank feeds the model (after CP sharding)."""
        from megatron.core import parallel_state as ps

        which = _iterator_of.pop(id(batch), None)
        out = _upload(batch, *args, **kwargs)
        if which is not None and kwargs.get("tokens", True) and ps.is_pipeline_last_stage(ignore_virtual=True) \
                and ps.get_tensor_model_parallel_rank() == 0:
            while len(record["doc_tokens"]) <= which:
                record["doc_tokens"].append(defaultdict(int))
            doc_of_token = np.full(int(batch.segment_lengths.sum()), -1, dtype=np.int64)
            at = 0
            for piece in batch.micro_batch.pieces:
                doc_of_token[at:at + piece.length] = piece.doc_id
                at += piece.length
            rows = batch.take(doc_of_token, fill=-1)
            assert np.array_equal(out[0]["tokens"][0].cpu().numpy()[rows < 0], np.zeros(int((rows < 0).sum())))
            ids, counts = np.unique(rows, return_counts=True)
            for i, c in zip(ids.tolist(), counts.tolist(), strict=True):
                if i >= 0:
                    record["doc_tokens"][which][i] += c
        return out


    cp_hooks.upload_micro_batch = _upload_and_count
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
        grad_norm = result[5] if len(result) > 5 else None
        record["grad_norms"][iteration] = None if grad_norm is None else float(grad_norm)
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
        from megatron_wlb.megatron import runtime

        record["agreement"] = {"checks": runtime().agreement_checks, "seconds": runtime().agreement_s,
                               "startup_seconds": runtime().startup_agreement_s}
        with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
            json.dump(record, f)


    training.train_step = _train_step_recorded
    # ``WLB_PROBE_RANK_DATA=R:PREFIX``: rank R reads PREFIX instead of --data-path's (a diverging copy)
    rank_data = os.environ.get("WLB_PROBE_RANK_DATA", "")
    if rank_data and int(rank_data.split(":", 1)[0]) == RANK:
        argv[argv.index("--data-path") + 1] = rank_data.split(":", 1)[1]
    # ``WLB_PROBE_RANK_FLAGS=R:FLAGS``: rank R is also given FLAGS (shell words; a later flag wins in argparse)
    rank_flags = os.environ.get("WLB_PROBE_RANK_FLAGS", "")
    if rank_flags and int(rank_flags.split(":", 1)[0]) == RANK:
        import shlex

        argv += shlex.split(rank_flags.split(":", 1)[1])
    cpu.main(argv)
    record["process_groups_released"] = not torch.distributed.is_initialized()
    _save()


_FINISHED = False


def _exit_without_teardown() -> None:
    """The last exit handler (registered first): once main() has returned and every other handler has run
    (Megatron's, multiprocessing's joins of the torch_dist writer's children), leave without the interpreter's
    teardown of torch and Megatron (about 3 s of CPU a rank on 2 cores, and nothing of it is tested: the
    process groups are released and the records written before). After an error, the usual exit (its code)."""
    if _FINISHED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":  # a spawned child (the torch_dist writer's manager) re-imports this file
    import atexit

    atexit.register(_exit_without_teardown)
    main()
    _FINISHED = True
