"""Model shapes, parallel layouts and hardware rates: the inputs every cost estimate starts from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, enough of it to count FLOPs and bytes per layer.

    ``num_kv_heads < num_heads`` is grouped-query attention; ``swiglu`` means the MLP has three
    ``hidden x ffn_hidden`` matrices instead of two.
    """

    name: str
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab: int
    swiglu: bool = True

    def __post_init__(self) -> None:
        for field in ("hidden", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be a positive integer, got {value!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}; "
                "head_dim must be an integer"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (GQA groups)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of one layer's GEMMs: QKV, output projection and MLP."""
        qkv = self.hidden * (self.hidden + 2 * self.kv_hidden)
        out = self.hidden * self.hidden
        mlp = (3 if self.swiglu else 2) * self.hidden * self.ffn_hidden
        return 2.0 * (qkv + out + mlp)

    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs of one (query, key) pair in one layer: QK^T and PV over all heads."""
        return 4.0 * self.num_heads * self.head_dim

    def training_flops(self, document_lengths: Sequence[int] | np.ndarray) -> float:
        """Model FLOPs of one forward + backward (3 x forward) over documents of these lengths: every
        layer's GEMMs per token, causal attention per (query, key) pair of each document (never across
        documents), and the LM head; no recomputation. Megatron's own counter assumes every sample is
        ``seq_length`` tokens of one sequence, which packed documents are not."""
        d = np.asarray(document_lengths, dtype=np.float64)
        tokens = float(d.sum())
        pairs = float((d * (d + 1.0) / 2.0).sum())
        forward = (self.num_layers * (self.linear_flops_per_token() * tokens + self.attention_flops_per_pair() * pairs)
                   + 2.0 * self.hidden * self.vocab * tokens)
        return 3.0 * forward

    def parameters(self) -> int:
        per_layer = self.linear_flops_per_token() / 2.0
        return int(self.num_layers * per_layer + 2 * self.vocab * self.hidden)

    def to_dict(self) -> dict:
        return asdict(self)


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
}


def get_model(name: str) -> ModelShape:
    """Look up a named model shape (case-insensitive)."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of the four parallel dimensions. World size = tp * cp * pp * dp."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for field in ("tp", "cp", "pp", "dp"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{field} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def __str__(self) -> str:
        return f"TP{self.tp}-CP{self.cp}-PP{self.pp}-DP{self.dp}"


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
