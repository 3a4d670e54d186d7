"""Model shapes, parallel layouts and hardware rates: the inputs every cost estimate starts from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np

#: ``ModelShape`` fields of a mixture-of-experts model; a dense shape leaves them at these defaults
#: (and ``to_dict`` leaves them out, so a dense shape's dict is what it was before MoE)
MOE_DEFAULTS: dict[str, Any] = {"num_experts": None, "moe_topk": 2, "moe_ffn_hidden": None,
                                "moe_shared_expert_hidden": None, "moe_layer_freq": 1,
                                "moe_capacity_factor": None, "kv_channels": None}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, enough of it to count FLOPs and bytes per layer.

    ``num_kv_heads < num_heads`` is grouped-query attention; ``swiglu`` means the MLP has three
    ``hidden x ffn_hidden`` matrices instead of two. ``kv_channels``: the head dimension when it is not
    ``hidden / num_heads`` (Megatron's ``--kv-channels``; Qwen3's 128 at hidden 2048 and 32 heads).

    Mixture of experts (Megatron's names in brackets): ``num_experts`` routed experts (``--num-experts``;
    None = dense), each token routed to ``moe_topk`` of them (``--moe-router-topk``) through a router GEMM
    (``hidden x num_experts``), experts of FFN size ``moe_ffn_hidden`` (``--moe-ffn-hidden-size``, default
    ``ffn_hidden``), plus a shared expert of FFN size ``moe_shared_expert_hidden``
    (``--moe-shared-expert-intermediate-size``, all shared experts together) that every token passes.
    ``moe_layer_freq`` (``--moe-layer-freq``) says which layers are MoE as Megatron does: an int N makes
    layer i MoE when i % N == 0, a tuple of 0/1 of length ``num_layers`` gives each layer; the others
    keep the dense MLP of ``ffn_hidden``. ``moe_capacity_factor`` (``--moe-expert-capacity-factor``; None
    = dropless): each expert takes at most that factor times its fair share of the routed tokens; the cost
    model prices the full capacity (the busiest expert, which the other EP ranks and the pipeline wait
    for; exact with ``--moe-pad-expert-input-to-capacity``), so ``expert_load`` = top-k x capacity factor.

    Per-layer figures (``linear_flops_per_token``) are the mean over the layers when only some are MoE.
    """

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab: int
    swiglu: bool = True
    num_experts: int | None = None
    moe_topk: int = 2
    moe_ffn_hidden: int | None = None
    moe_shared_expert_hidden: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_capacity_factor: float | None = None
    kv_channels: int | None = None

    def __post_init__(self) -> None:
        for field in ("hidden", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be a positive integer, got {value!r}")
        for field in ("num_experts", "moe_ffn_hidden", "moe_shared_expert_hidden", "kv_channels"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"ModelShape.{field} must be a positive integer or None, got {value!r}")
        if self.kv_channels is None and self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "head_dim must be an integer (or give kv_channels, the head dimension)"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (GQA groups)"
            )
        self._check_moe()

    def _check_moe(self) -> None:
        freq = self.moe_layer_freq
        if isinstance(freq, list):  # a profile's or a checkpoint's JSON gives a list
            freq = tuple(freq)
            object.__setattr__(self, "moe_layer_freq", freq)
        if isinstance(freq, bool) or not isinstance(freq, (int, tuple)):
            raise ValueError(f"ModelShape.moe_layer_freq={freq!r}: give an int N (every Nth layer is MoE) or "
                             f"a list of 0/1, one per layer ({self.num_layers})")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"ModelShape.moe_layer_freq={freq!r}: an int must be >= 1 (1 = every layer is MoE)")
        if isinstance(freq, tuple) and (len(freq) != self.num_layers or any(f not in (0, 1) for f in freq)
                                        or any(isinstance(f, bool) for f in freq)):
            raise ValueError(f"ModelShape.moe_layer_freq={list(freq)!r}: a pattern must hold one 0 (dense) or 1 "
                             f"(MoE) per layer, {self.num_layers} of them")
        if isinstance(self.moe_topk, bool) or not isinstance(self.moe_topk, int) or self.moe_topk < 1:
            raise ValueError(f"ModelShape.moe_topk must be a positive integer, got {self.moe_topk!r}")
        cf = self.moe_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0
                               or cf == float("inf")):
            raise ValueError(f"ModelShape.moe_capacity_factor must be a positive number or None (dropless), "
                             f"got {cf!r}")
        if self.num_experts is None:
            moe_only = [f for f in ("moe_ffn_hidden", "moe_shared_expert_hidden", "moe_capacity_factor")
                        if getattr(self, f) is not None]
            if moe_only:
                raise ValueError(f"ModelShape.{moe_only[0]}={getattr(self, moe_only[0])!r} needs num_experts "
                                 "(a dense model has no experts)")
        elif self.moe_topk > self.num_experts:
            raise ValueError(f"ModelShape.moe_topk={self.moe_topk} routes each token to more experts than "
                             f"num_experts={self.num_experts}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        return self.num_kv_heads * self.head_dim

    # -- mixture of experts ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def moe_layer_pattern(self) -> tuple[int, ...]:
        """One flag per layer, 1 = MoE (Megatron's reading of ``--moe-layer-freq``); all 0 when dense."""
        if not self.is_moe:
            return (0,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return freq
        return tuple(1 if i % freq == 0 else 0 for i in range(self.num_layers))

    @cached_property
    def moe_layers(self) -> int:
        """How many layers are MoE (cached: the per-token figures read it on every call)."""
        return sum(self.moe_layer_pattern())

    @property
    def moe_fraction(self) -> float:
        """Share of the layers that are MoE (0.0 when dense)."""
        return self.moe_layers / self.num_layers

    @property
    def expert_ffn_hidden(self) -> int:
        return self.moe_ffn_hidden if self.moe_ffn_hidden is not None else self.ffn_hidden

    @property
    def expert_load(self) -> float:
        """Expert passes per token that an MoE layer pays for: top-k, times the capacity factor when one
        is set (the busiest expert's capacity); top-k when dropless."""
        cf = self.moe_capacity_factor
        return float(self.moe_topk) * (1.0 if cf is None else float(cf))

    def _mlp_matrices(self) -> int:
        return 3 if self.swiglu else 2

    def _attention_params(self) -> int:
        q_width = self.num_heads * self.head_dim
        return self.hidden * (q_width + 2 * self.kv_hidden) + q_width * self.hidden

    def _moe_layer_params(self, experts: float) -> float:
        """Parameters of one MoE layer's MLP part with ``experts`` routed experts counted: router,
        routed experts and the shared expert."""
        shared = self.moe_shared_expert_hidden or 0
        router = self.hidden * (self.num_experts or 0)
        return router + self._mlp_matrices() * self.hidden * (experts * self.expert_ffn_hidden + shared)

    def _mlp_params_per_layer(self, experts: float) -> float:
        """Mean over the layers of the MLP (or MoE) parameters with ``experts`` routed experts counted."""
        dense_mlp = self._mlp_matrices() * self.hidden * self.ffn_hidden
        moe = self.moe_layers
        return ((self.num_layers - moe) * dense_mlp + moe * self._moe_layer_params(experts)) / self.num_layers

    def _linear_flops(self, experts: float) -> float:
        if not self.is_moe:
            qkv = self.hidden * (self.hidden + 2 * self.kv_hidden) if self.kv_channels is None else None
            if qkv is not None:  # the dense expression, as it always was
                out = self.hidden * self.hidden
                mlp = (3 if self.swiglu else 2) * self.hidden * self.ffn_hidden
                return 2.0 * (qkv + out + mlp)
        return 2.0 * (self._attention_params() + self._mlp_params_per_layer(experts))

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's GEMMs: QKV, output projection and MLP; for MoE layers the
        router, ``expert_load`` routed experts and the shared expert (mean over the layers)."""
        return self._linear_flops(self.expert_load if self.is_moe else 0.0)

    def model_linear_flops_per_token(self) -> float:
        """``linear_flops_per_token`` with exactly top-k experts per token (no capacity padding): the
        model FLOPs an MFU counts."""
        return self._linear_flops(float(self.moe_topk) if self.is_moe else 0.0)

    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs of one (query, key) pair in one layer: QK^T and PV over all heads."""
        return 4.0 * self.num_heads * self.head_dim

    def training_flops(self, document_lengths: Sequence[int] | np.ndarray) -> float:
        """Model FLOPs of one forward + backward (3 x forward) over documents of these lengths: every
        layer's GEMMs per token (MoE: top-k experts), causal attention per (query, key) pair of each
        document (never across documents), and the LM head; no recomputation. Megatron's own counter
        assumes every sample is ``seq_length`` tokens of one sequence, which packed documents are not."""
        d = np.asarray(document_lengths, dtype=np.float64)
        tokens = float(d.sum())
        pairs = float((d * (d + 1.0) / 2.0).sum())
        forward = (self.num_layers * (self.model_linear_flops_per_token() * tokens
                                      + self.attention_flops_per_pair() * pairs)
                   + 2.0 * self.hidden * self.vocab * tokens)
        return 3.0 * forward

    def parameters(self) -> int:
        """All parameters (MoE: every expert), embeddings and LM head included."""
        if not self.is_moe:
            per_layer = self.linear_flops_per_token() / 2.0
            return int(self.num_layers * per_layer + 2 * self.vocab * self.hidden)
        per_layer = self._attention_params() + self._mlp_params_per_layer(float(self.num_experts or 0))
        return int(self.num_layers * per_layer + 2 * self.vocab * self.hidden)

    def active_parameters(self) -> int:
        """Parameters one token passes through (MoE: top-k routed experts); ``parameters`` when dense."""
        return int(self.num_layers * self.model_linear_flops_per_token() / 2.0 + 2 * self.vocab * self.hidden)

    def expert_parameters(self) -> int:
        """Parameters of the routed experts of all layers (sharded over expert parallelism); 0 when dense."""
        if not self.is_moe:
            return 0
        return int(self.moe_layers * self._mlp_matrices() * self.hidden * self.expert_ffn_hidden
                   * (self.num_experts or 0))

    def dense_counterpart(self) -> ModelShape:
        """The dense model of equal active parameters: this backbone (hidden, layers, heads, head
        dimension, vocabulary) with every layer's MLP a dense one of the active MLP parameters per layer
        (top-k routed experts, the shared expert and the router, mean over the layers), rounded to an
        integer FFN size. A dense shape is its own counterpart."""
        if not self.is_moe:
            return self
        ffn = round(self._mlp_params_per_layer(float(self.moe_topk)) / (self._mlp_matrices() * self.hidden))
        return ModelShape(f"{self.name}-dense", hidden=self.hidden, num_layers=self.num_layers,
                          num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, ffn_hidden=max(1, ffn),
                          vocab=self.vocab, swiglu=self.swiglu, kv_channels=self.kv_channels)

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict; a dense shape leaves out the MoE fields at their defaults."""
        out = asdict(self)
        if isinstance(out["moe_layer_freq"], tuple):
            out["moe_layer_freq"] = list(out["moe_layer_freq"])
        for key, default in MOE_DEFAULTS.items():
            if out[key] == default:
                del out[key]
        return out


# Llama-style shapes for the paper's model sizes. The paper does not list its 550M/30B shapes;
# these are the closest public Llama shapes with those parameter counts.
MODELS: dict[str, ModelShape] = {
    "550m": ModelShape("550m", hidden=1536, num_layers=16, num_heads=12, num_kv_heads=12,
                       ffn_hidden=4096, vocab=32000),
    "7b": ModelShape("7b", hidden=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                     ffn_hidden=11008, vocab=32000),
    "30b": ModelShape("30b", hidden=6656, num_layers=60, num_heads=52, num_kv_heads=52,
                      ffn_hidden=17920, vocab=32000),
    "70b": ModelShape("70b", hidden=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                      ffn_hidden=28672, vocab=32000),
    "405b": ModelShape("405b", hidden=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                       ffn_hidden=53248, vocab=128256),
    # Mixture-of-experts shapes from the public model cards (config.json on the Hugging Face hub).
    # Mixtral-8x7B-v0.1: hidden_size 4096, 32 layers, 32 heads, 8 KV heads, 8 local experts, 2 per token,
    # intermediate_size 14336 per expert, vocab 32000; every layer MoE, no shared expert, dropless.
    # 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ModelShape("mixtral-8x7b", hidden=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                               ffn_hidden=14336, vocab=32000, num_experts=8, moe_topk=2, moe_ffn_hidden=14336),
    # Qwen3-30B-A3B: hidden_size 2048, 48 layers, 32 heads of head_dim 128 (so 4096-wide attention), 4 KV
    # heads, 128 experts, 8 per token, moe_intermediate_size 768, vocab 151936; every layer MoE
    # (decoder_sparse_step 1, no mlp_only_layers), no shared expert. 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", hidden=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                                ffn_hidden=6144, vocab=151936, num_experts=128, moe_topk=8, moe_ffn_hidden=768,
                                kv_channels=128),
}


def check_expert_layout(model: ModelShape, layout: ParallelLayout) -> None:
    """Refuse expert parallelism Megatron would refuse: EP > 1 for a dense model, or experts that EP does
    not divide; one line naming the values."""
    if layout.ep > 1 and not model.is_moe:
        raise ValueError(f"layout ep={layout.ep} (expert parallelism) needs an MoE model; {model.name!r} has no "
                         "experts (set num_experts, or ep: 1)")
    if model.is_moe and (model.num_experts or 0) % layout.ep:
        raise ValueError(f"layout ep={layout.ep} does not divide num_experts={model.num_experts} (each EP rank "
                         "holds num_experts / ep experts)")


def get_model(name: str) -> ModelShape:
    """Look up a named model shape (case-insensitive)."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of the four parallel dimensions. World size = tp * cp * pp * dp.

    ``ep``: expert parallelism of an MoE model's expert layers (Megatron's
    ``--expert-model-parallel-size``), carved out of the ``tp x cp x dp`` GPUs of a pipeline stage as
    Megatron does (expert TP x EP x expert DP = tp x cp x dp): ``ep`` must divide ``tp x cp x dp``. The cost
    model prices the experts' all-to-alls with expert TP = ``tp`` (``CostModel.ep_comm``).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for field in ("tp", "cp", "pp", "dp", "ep"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{field} must be a positive integer, got {value!r}")
        if (self.tp * self.cp * self.dp) % self.ep:
            raise ValueError(f"ParallelLayout.ep={self.ep} must divide tp x cp x dp = {self.tp * self.cp * self.dp} "
                             "(expert parallelism takes its GPUs from a pipeline stage's TP, CP and DP groups)")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}-CP{self.cp}-PP{self.pp}-DP{self.dp}" + (f"-EP{self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class Hardware:
    """Achieved (not peak) rates of one GPU and its links.

    Defaults are an H100 SXM: bf16 dense peak 989 TFLOP/s, of which large GEMMs reach ~65% and
    flash-attention forward ~50%; NVLink 450 GB/s per direction within a node, 50 GB/s
    (400 Gb/s InfiniBand) per GPU across nodes. Backward costs ``bwd_*`` times the forward.
    """

    name: str = "H100-SXM (analytic)"
    gemm_tflops: float = 640.0
    attention_tflops: float = 480.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    collective_latency_s: float = 10e-6
    bwd_attention: float = 2.5
    bwd_linear: float = 2.0

    def __post_init__(self) -> None:
        for field in ("gemm_tflops", "attention_tflops", "intra_node_gbps", "inter_node_gbps",
                      "bwd_attention", "bwd_linear"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"Hardware.{field} must be positive, got {value!r}")

    def link_gbps(self, group_span: int) -> float:
        """Bandwidth of a collective over a group spanning ``group_span`` consecutive GPUs."""
        return self.intra_node_gbps if group_span <= self.gpus_per_node else self.inter_node_gbps


H100 = Hardware()


#: token or pair counts: a number (fractional per-GPU shares too) or an array of them
Counts = np.ndarray | float


def causal_pairs(q_len: Counts, kv_len: Counts) -> np.ndarray:
    """(query, key) pairs a causal query run of ``q_len`` queries ending at key ``kv_len`` attends."""
    q = np.asarray(q_len, dtype=np.float64)
    kv = np.asarray(kv_len, dtype=np.float64)
    if np.any(q > kv):
        raise ValueError("a query run cannot be longer than the keys it ends at (q_len > kv_len)")
    return q * kv - q * (q - 1.0) / 2.0


def head_ratio(model: ModelShape) -> float:
    """Forward FLOPs per token of the LM head over those of one layer's GEMMs: the simulator prices the
    head at this many layers' ``linear_compute`` (``sim.iteration``), and the trace fit does the same."""
    return 2.0 * model.hidden * model.vocab / model.linear_flops_per_token()
