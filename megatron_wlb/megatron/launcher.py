"""A thin ``pretrain_gpt`` for WLB-LLM: Megatron's own ``pretrain`` loop, our data, sharding and loss.

For installs that have Megatron's training code (``megatron/training``, shipped in the megatron-core
wheel from 0.19) but no Megatron-LM checkout:

    torchrun --nproc-per-node 8 -m megatron_wlb.megatron.launcher <Megatron flags> --wlb-packer wlb ...

Every rank (every TP rank and every pipeline stage) reads its own copy of the packed micro-batch from
the ``WlbDataIterator`` that ``apply()`` builds on every rank, already planned for its CP rank, so
there is no TP broadcast of variable-length tensors and no middle-stage special case: each stage
uploads the same rows and the same ``WlbPackedSeqParams``; stages that do not embed or compute the
loss simply ignore the tokens or labels. The loss is per token
(``--calculate-per-token-loss`` is required): Megatron then divides the summed loss by the tokens of
the whole global batch, so every token weighs the same whatever micro-batch it was packed into.

Megatron is imported inside the functions (``# lazy``): ``--help`` runs without importing it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import megatron_wlb.megatron as wlb
from megatron_wlb.megatron import state as wlb_state
from megatron_wlb.megatron.args import asks_for_help, wlb_help
from megatron_wlb.megatron.validation import exit_on_startup_error


def get_batch(data_iterator: Any, model: Any = None) -> tuple[Any, ...]:
    """(tokens, labels, loss_mask, position_ids, packed_seq_params) of this rank's next micro-batch,
    already planned for this CP rank by the iterator: one upload, no device-to-host sync."""
    from megatron_wlb.megatron.cp_hooks import upload_micro_batch  # lazy: --help runs without importing Megatron

    batch, params = upload_micro_batch(next(data_iterator))
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"], params


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: Any = None):
    """Per-token loss: (summed loss, tokens, report); Megatron divides by the global batch's tokens."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1).to(loss.dtype)])}
    return loss, num_tokens, report


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False):
    """Megatron's forward-step contract: (output tensor, loss function of it)."""
    from megatron.training import get_timers  # lazy: --help runs without importing Megatron

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, position_ids, params = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, None, labels=labels, packed_seq_params=params)
    return output, partial(loss_func, loss_mask, model=model)


def datasets_provider(train_val_test_num_samples: Any, vp_stage: int | None = None):
    """No Megatron datasets: ``apply()``'s iterator hook builds our packed iterators on every rank."""
    return None, None, None


datasets_provider.is_distributed = True  # type: ignore[attr-defined]  # called on every rank


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: Any = None, pg_collection: Any = None):
    """A GPTModel with Megatron's local (non-TE) or TE layer spec from the run's args (core < 0.19 API)."""
    from megatron.core.models.gpt import GPTModel  # lazy: --help runs without importing Megatron
    from megatron.core.models.gpt.gpt_layer_specs import (  # lazy: --help runs without importing Megatron
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.training import get_args  # lazy: --help runs without importing Megatron
    from megatron.training.arguments import core_transformer_config_from_args  # lazy: --help needs no Megatron

    args = get_args()
    config = config if config is not None else core_transformer_config_from_args(args)
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                          args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        normalization=args.normalization)
    kwargs: dict[str, Any] = {}
    if "vp_stage" in inspect.signature(GPTModel.__init__).parameters:
        kwargs["vp_stage"] = vp_stage
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                    parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, **kwargs)


ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}


def main(argv: Sequence[str] | None = None) -> None:
    """Apply the WLB-LLM hooks and run Megatron's ``pretrain`` with this module's providers; a start-up problem
    (flags, data) exits with its one-line message (``args.StartupError``)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]

    if asks_for_help(sys.argv[1:]):  # ours only: Megatron's --help crashes on 0.19.2 (upstream)
        print(wlb_help("python -m megatron_wlb.megatron.launcher"), end="")
        return
    with exit_on_startup_error(), released_at_exit():
        _pretrain()


@contextmanager
def released_at_exit() -> Iterator[None]:
    """``release_process_groups`` once training returns, or leaves by Megatron's own early exits (``sys.exit(0)``
    of ``--exit-interval``, ``--exit-duration-in-mins``, ``--exit-signal-handler``: every rank leaves at the same
    iteration, so every rank meets the barrier); not on an error, where another rank may never arrive."""
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            _report_untrained()
            release_process_groups()
        raise
    _report_untrained()
    release_process_groups()


def _report_untrained() -> None:
    """Rank 0 says what the packer still held when training ended (issue 49: it was skipped without a word)."""
    report = wlb_state.untrained_report()
    if report is not None:
        wlb_state.print_rank0(report)


def release_process_groups() -> None:
    """Once training has returned: every rank meets, then the process groups are destroyed, so that gloo's
    worker threads do not outlive the interpreter. Megatron's ``pretrain`` leaves them up, and an exit with
    them alive can abort ("terminate called without an active exception", SIGABRT; pytorch#190489)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _pretrain() -> None:
    """`apply()`, then Megatron's ``pretrain`` (the megatron-core >= 0.19 config container or the older API)."""
    wlb.apply(middle_stage_batches=True)  # also makes the dataset-helper build safe (startup.py)
    from megatron.core.enums import ModelType  # lazy: --help runs without importing Megatron
    from megatron.training import pretrain  # lazy: --help runs without importing Megatron

    if "cfg_container" in inspect.signature(pretrain).parameters:  # megatron-core >= 0.19
        from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # lazy
        from megatron.training.arguments import parse_and_validate_args  # lazy: --help runs without importing Megatron

        args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
        container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    else:
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=ARGS_DEFAULTS)


if __name__ == "__main__":
    main()
