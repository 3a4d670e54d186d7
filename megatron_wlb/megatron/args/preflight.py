"""Start-up checks of a Megatron training run's flags against what variable-length packing needs.

``validate_wlb_args`` (args.py) checks the ``--wlb-*`` settings against Megatron's flags; this module
checks the rest of the training loop: how the loss is normalised, whether middle pipeline stages
get packed-sequence metadata, and flags that assume fixed-length samples. It runs after Megatron's
own ``validate_args`` (``apply()``'s hook) and either adjusts a flag (saying so) or raises a
one-line ValueError (``args.StartupError``) listing every problem with what to change.
"""

from __future__ import annotations

import sys
from typing import Any

from megatron_wlb.megatron.args.megatron_args import MegatronArgs
from megatron_wlb.megatron.args.validation import configuration_error, module_available
from megatron_wlb.megatron.hooks import table as hooks

#: Megatron flags that our packing already implies (positions restart at every document piece, attention
#: never crosses a piece, the last token of a piece has no label): accepted, with a note.
IMPLIED_FLAGS = {
    "reset_position_ids": "--reset-position-ids",
    "reset_attention_mask": "--reset-attention-mask",
    "eod_mask_loss": "--eod-mask-loss",
}


def _cuda_graphs(a: MegatronArgs) -> bool:
    return bool(a.enable_cuda_graph or a.external_cuda_graph or a.cuda_graph_impl not in (None, "none"))


def _torch_norm_handles_sequence_parallel() -> bool:
    """Whether the CPU harness taught Megatron's torch norm sequence parallelism (cpu.py)."""
    return "megatron.core.transformer.torch_norm" in sys.modules and hooks.is_installed("WrappedTorchNorm.__new__")


def check_training_args(args: Any, *, middle_stage_batches: bool) -> list[str]:
    """Check (and where safe, set) Megatron's ``args`` for WLB-LLM training; returns notes to print.

    ``middle_stage_batches``: the entry point gives middle pipeline stages (and every virtual stage)
    this micro-batch's packed-sequence params (our launcher, the patched ``pretrain_gpt.py``).
    Without it, a run whose pipeline has middle stages is refused: their attention would get no
    document boundaries and attend across documents, silently.
    """
    notes: list[str] = []
    problems: list[str] = []
    a = MegatronArgs.of(args)  # read before the write below (calculate_per_token_loss, which it does not read again)
    pp = a.pp
    vpp = a.virtual_pipeline_model_parallel_size
    if not a.calculate_per_token_loss:
        # Megatron would divide each micro-batch's loss by its own token count and by N: a token's weight
        # would depend on how full its micro-batch is (our micro-batches hold 0..S_max tokens).
        args.calculate_per_token_loss = True
        notes.append("--calculate-per-token-loss set: packed micro-batches differ in length, so the loss is "
                     "summed per token and divided by the global batch's tokens (each token weighs the same)")
    has_middle = pp > 2 or (pp > 1 and vpp not in (None, 1))
    if has_middle and not middle_stage_batches:
        problems.append(f"pipeline with middle stages (PP={pp}, virtual stages {vpp or 1}) but this entry point "
                        "gives middle stages no packed-sequence params, so their attention would cross document "
                        "boundaries: launch with `python -m megatron_wlb.megatron.entry.launcher`, or patch "
                        "pretrain_gpt.py (scripts/apply_patches.sh), or call apply(middle_stage_batches=True) "
                        "from a get_batch that returns cp_hooks.packed_seq_params_from_iterator() on middle stages")
    if a.tp_comm_overlap:
        problems.append("--tp-comm-overlap needs fixed-shape userbuffers (seq_length x micro-batch); packed "
                        "micro-batches vary in length: remove --tp-comm-overlap")
    if _cuda_graphs(a):
        problems.append("CUDA graphs capture fixed shapes; packed micro-batches vary in length: remove "
                        "--enable-cuda-graph / --external-cuda-graph / --cuda-graph-impl")
    if a.sequence_parallel and a.transformer_impl == "local":
        if not module_available("apex") and not _torch_norm_handles_sequence_parallel():
            problems.append("--sequence-parallel with --transformer-impl local: without apex, Megatron's local "
                            "spec normalises with WrappedTorchNorm, which does not support sequence parallelism; "
                            "use --transformer-impl transformer_engine or drop --sequence-parallel")
    if not a.no_persist_layer_norm and a.transformer_impl == "local":
        if not module_available("apex"):
            problems.append("--transformer-impl local without apex normalises with WrappedTorchNorm, which "
                            "refuses persist_layer_norm (Megatron's default): add --no-persist-layer-norm")
    implied = [flag for attr, flag in IMPLIED_FLAGS.items() if getattr(a, attr)]
    if a.wlb_pieces == "concat-and-cut":
        notes.append("--wlb-pieces concat-and-cut: training Megatron's own GPTDataset samples (labels, loss mask and "
                     "position ids as its flags make them), regrouped per document into balanced micro-batches")
    elif implied:
        notes.append(f"{', '.join(implied)}: implied by WLB packing (positions restart at every document, attention "
                     "stays inside documents, a document's last token has no label); nothing else to do")
    if problems:
        raise configuration_error(problems, "this run cannot train packed micro-batches")
    return notes
