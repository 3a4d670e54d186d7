"""The steps and providers of ``megatron_wlb.megatron.entry.launcher`` (a thin ``pretrain_gpt``): Megatron's own
``pretrain`` loop, our data, sharding and per-token loss.

Imports Megatron at the top: the launcher imports this module only after ``apply()`` (and, under the CPU
harness, its redirects), so that its ``--help`` runs without Megatron.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.training import get_args, get_timers, pretrain
from megatron.training.arguments import core_transformer_config_from_args

try:  # megatron-core >= 0.19: pretrain takes a config container built from the parsed args
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args
except ImportError:  # older releases: pretrain parses the args itself
    gpt_config_from_args = pretrain_cfg_container_from_args = parse_and_validate_args = None

from megatron_wlb.megatron.hooks.cp_hooks import upload_micro_batch

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}


def get_batch(data_iterator: Any, model: Any = None) -> tuple[Any, ...]:
    """(tokens, labels, loss_mask, position_ids, packed_seq_params) of this rank's next micro-batch,
    already planned for this CP rank by the iterator: one upload, no device-to-host sync."""
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



def pretrain_gpt() -> None:
    """Megatron's ``pretrain`` with this module's providers (the megatron-core >= 0.19 config container or the
    older API); ``apply()`` has run."""
    if "cfg_container" in inspect.signature(pretrain).parameters:  # megatron-core >= 0.19
        args = parse_and_validate_args(args_defaults=ARGS_DEFAULTS)
        container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)
    else:
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=ARGS_DEFAULTS)


__all__ = ["datasets_provider", "forward_step", "get_batch", "loss_func", "model_provider", "pretrain_gpt"]
