"""Building blocks of the models: tensor-parallel linears, embeddings, norms, RoPE, attention."""

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.attention import ForwardContext, PagedAttention
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "ForwardContext",
    "MergedColumnParallelLinear",
    "PagedAttention",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "default_weight_loader",
    "silu_and_mul",
]
