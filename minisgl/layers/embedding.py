from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.layers.fused import fused_kernels
from minisgl.layers.linear import invariant_linear


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range; the vocab is padded to a multiple of tp size."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.vocab_local = -(-vocab_size // tp.size)
        self.start = tp.rank * self.vocab_local
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, expected {self.vocab_size}")
        part = loaded[self.start : self.start + self.vocab_local]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.vocab_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for every vocab shard, gathered across ranks, padding rows trimmed. On CUDA,
    2..`skinny_max_rows` rows (a speculative verify step) take the skinny GEMM
    (`minisgl.kernels.gemv.skinny`) instead of cuBLAS."""

    batch_invariant = False  # `minisgl.layers.linear.set_batch_invariant`

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        tie_to: VocabParallelEmbedding | None,
        skinny_max_rows: int = 0,
    ) -> None:
        super().__init__(vocab_size, hidden)
        if tie_to is not None:
            self.weight = tie_to.weight
        self.skinny_max_rows = skinny_max_rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fused = fused_kernels(hidden)
        rows = hidden.shape[0] if hidden.dim() == 2 and hidden.stride(-1) == 1 else 0
        few = 2 <= rows <= min(self.skinny_max_rows, 16)
        if self.batch_invariant:
            logits = invariant_linear(hidden, self.weight)  # [N, vocab_local]
        elif fused is not None and few:
            logits = fused.skinny(hidden, self.weight)  # [N, vocab_local]
        else:
            logits = F.linear(hidden, self.weight)  # [N, vocab_local]
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]
