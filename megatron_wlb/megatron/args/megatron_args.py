"""One typed, read-only view of Megatron's ``args`` namespace: the attributes megatron_wlb reads.

``MegatronArgs.of(args)`` copies every field below from Megatron's ``args`` (``None`` where this release, or a
stand-in namespace, has no such attribute), once, where args enter our code; the rest of the adapter reads the
view, not the namespace. Writes (``validate_wlb_args``
turning on ``variable_seq_lengths``, ``check_training_args`` setting ``calculate_per_token_loss``, the data hook's
``do_train``) still go to Megatron's own ``args``; a view built before a write does not see it.

Which release has which field (megatron-core 0.16.1 / 0.19.2 / main 0.20): every field is an attribute of all three
once ``validate_args`` ran, except those ``MAY_BE_ABSENT`` names (one place, with why); those read ``None`` when
absent. ``missing_fields`` names any other field a release lacks: start-up stops on it in one line
(``training_hooks.wrap_validate_args``) rather than read ``None`` for a flag Megatron dropped or renamed. The
properties give the values as the adapter uses them (parallel sizes as ints, unset meaning 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: the training, validation and test splits, and their own data-path flags (``--{split}-data-path``)
SPLITS = ("train", "valid", "test")


#: the fields some supported release lacks, or Megatron sets only later in start-up: field -> why (they read ``None``
#: while absent); every other field must be there once ``validate_args`` ran (``MegatronArgs.missing_fields``)
MAY_BE_ABSENT: dict[str, str] = {
    **dict.fromkeys(("defer_npy_index_mmap", "fast_cache_load", "dataloader_inter_document_masking"),
                    "not in megatron-core 0.16"),
    "sequence_packing_scheduler": "Megatron-LM main after PR #6742, dev",
    "padded_vocab_size": "set when Megatron builds the tokenizer, after validate_args",
    "do_valid": "set when Megatron builds its data loaders", "do_test": "set when Megatron builds its data loaders",
    "wlb_pieces": "ours: absent without megatron_wlb's flags (a stand-in or stock namespace)",
    "wlb_reset_data_stream": "ours: absent without megatron_wlb's flags (a stand-in or stock namespace)",
}


@dataclass(frozen=True)
class MegatronArgs:
    """The attributes of Megatron's ``args`` that megatron_wlb reads (``None``: not set / not in this release).
    Those typed ``Any`` are numbers Megatron always sets (an ``int(...)`` of a missing one fails, as it did)."""

    # -- parallel layout
    tensor_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    data_parallel_size: Any = None
    expert_model_parallel_size: int | None = None
    sequence_parallel: bool | None = None
    cp_comm_type: Any = None
    # -- batch and schedule
    seq_length: Any = None
    micro_batch_size: Any = None
    global_batch_size: Any = None
    rampup_batch_size: Any = None
    train_iters: Any = None
    train_samples: int | None = None
    eval_iters: int | None = None
    eval_interval: int | None = None
    consumed_train_samples: int | None = None
    skip_train: bool | None = None
    do_valid: bool | None = None
    do_test: bool | None = None
    # -- data
    data_path: Any = None
    train_data_path: Any = None
    valid_data_path: Any = None
    test_data_path: Any = None
    split: str | None = None
    seed: Any = None
    mmap_bin_files: bool | None = None
    data_cache_path: str | None = None
    mock_data: bool | None = None
    dataloader_type: str | None = None
    multiple_validation_sets: bool | None = None
    full_validation: bool | None = None
    num_dataset_builder_threads: int | None = None
    object_storage_cache_path: str | None = None
    mid_level_dataset_surplus: float | None = None
    allow_ambiguous_pad_tokens: bool | None = None
    defer_npy_index_mmap: bool | None = None
    fast_cache_load: bool | None = None
    dataloader_inter_document_masking: bool | None = None
    reset_position_ids: bool | None = None
    reset_attention_mask: bool | None = None
    eod_mask_loss: bool | None = None
    sft: bool | None = None
    sft_tokenizer_prompt_format: str | None = None
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    fim_data: bool | None = None
    yaml_cfg: str | None = None
    # -- model
    num_layers: Any = None
    hidden_size: Any = None
    ffn_hidden_size: Any = None
    num_attention_heads: Any = None
    group_query_attention: bool | None = None
    num_query_groups: Any = None
    padded_vocab_size: Any = None
    vocab_size: Any = None
    swiglu: bool | None = None
    num_experts: int | None = None
    moe_token_dispatcher_type: str | None = None
    max_position_embeddings: Any = None
    position_embedding_type: str | None = None
    transformer_impl: str | None = None
    no_persist_layer_norm: bool | None = None
    # -- flags our packing cannot honour, or that replace our path
    calculate_per_token_loss: bool | None = None
    tp_comm_overlap: bool | None = None
    enable_cuda_graph: bool | None = None
    external_cuda_graph: bool | None = None
    cuda_graph_impl: str | None = None
    sequence_packing_scheduler: str | None = None
    # -- checkpoints (``checkpoint``: where the sidecar is written and read)
    save: str | None = None
    load: str | None = None
    non_persistent_ckpt_type: str | None = None
    non_persistent_global_ckpt_dir: str | None = None
    # -- ours (``--wlb-pieces``: read before our settings are resolved; ``--wlb-reset-data-stream``: an action)
    wlb_pieces: str | None = None
    wlb_reset_data_stream: bool | None = None

    @classmethod
    def missing_fields(cls, args: Any) -> list[str]:
        """The fields Megatron's ``args`` (after ``validate_args``) lacks that every supported release has: a flag
        this release dropped or renamed (empty when all are there)."""
        return [f.name for f in dataclasses.fields(cls) if f.name not in MAY_BE_ABSENT and not hasattr(args, f.name)]

    @classmethod
    def of(cls, args: Any) -> MegatronArgs:
        """The view of ``args`` (a Megatron namespace, any object with such attributes, or a view already)."""
        if isinstance(args, cls):
            return args
        return cls(**{f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)})

    # -- the parallel sizes as the adapter uses them (unset: 1)
    @property
    def tp(self) -> int:
        return int(self.tensor_model_parallel_size or 1)

    @property
    def cp(self) -> int:
        return int(self.context_parallel_size or 1)

    @property
    def pp(self) -> int:
        return int(self.pipeline_model_parallel_size or 1)

    @property
    def vpp(self) -> int:
        """Virtual pipeline stages per stage (1 without interleaving)."""
        return int(self.virtual_pipeline_model_parallel_size or 1)

    @property
    def dp(self) -> int:
        return int(self.data_parallel_size or 1)

    @property
    def ep(self) -> int:
        return int(self.expert_model_parallel_size or 1)

    @property
    def sp(self) -> int:
        """The sequence-parallel factor: TP under ``--sequence-parallel`` (TP > 1), else 1."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    def data_path_of(self, split_name: str) -> Any:
        """``--{train,valid,test}-data-path`` of one split (None if not given)."""
        if split_name not in SPLITS:
            raise ValueError(f"no split {split_name!r} (one of {', '.join(SPLITS)})")
        return {"train": self.train_data_path, "valid": self.valid_data_path, "test": self.test_data_path}[split_name]


__all__ = ["MAY_BE_ABSENT", "SPLITS", "MegatronArgs"]
