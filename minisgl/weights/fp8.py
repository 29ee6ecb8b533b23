"""What FP8 checkpoints carry beside their weights: KV-cache scales (taken out of the tensor
stream for the KV pool), static activation scales (dropped: activations are quantized per token
at run time) and `weight_scale_inv` (DeepSeek / HF FineGrainedFP8 naming of the multiplier that
everyone else calls `weight_scale`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

# compressed-tensors / vLLM exports: self_attn.{k,v}_scale; AutoFP8: self_attn.kv_scale (one for
# both); older compressed-tensors: self_attn.{k,v}_proj.output_scale.
_KV_SCALE_RE = re.compile(
    r"^model\.layers\.(?P<layer>\d+)\.self_attn\."
    r"(?:(?P<kv>k|v)_scale|kv_scale|(?P<proj>k|v)_proj\.output_scale)$"
)


class KVScales(NamedTuple):
    """A checkpoint's KV-cache scales: one per layer (K and V)."""

    k: torch.Tensor  # [num_layers] fp32
    v: torch.Tensor  # [num_layers] fp32


class FP8CheckpointFilter:
    """Wraps a checkpoint's (name, tensor) stream: KV scales are collected, not passed on."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._k: dict[int, float] = {}
        self._v: dict[int, float] = {}

    def __call__(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _KV_SCALE_RE.match(name)
            if m is not None:
                self._record(int(m["layer"]), m["kv"] or m["proj"], tensor)
                continue
            if name.endswith(".input_scale"):
                continue
            if name.endswith(".weight_scale_inv"):
                name = name.removesuffix("_inv")
            yield name, tensor

    def _record(self, layer: int, which: str | None, tensor: torch.Tensor) -> None:
        if tensor.numel() != 1:
            raise ValueError(
                f"KV-cache scale of layer {layer} has {tensor.numel()} values; only one per "
                "layer (per-tensor) is supported"
            )
        value = float(tensor.float().item())
        for kv, store in (("k", self._k), ("v", self._v)):
            if which in (None, kv):
                store[layer] = value

    def kv_scales(self) -> KVScales | None:
        """The checkpoint's KV scales; None when it has none."""
        if not self._k and not self._v:
            return None
        layers = range(self.num_layers)
        missing = [i for i in layers if i not in self._k or i not in self._v]
        if missing:
            raise ValueError(f"the checkpoint has KV-cache scales but none for layers {missing}")
        return KVScales(
            torch.tensor([self._k[i] for i in layers], dtype=torch.float32),
            torch.tensor([self._v[i] for i in layers], dtype=torch.float32),
        )
