"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) whose MLPs are mixtures of experts, in every layer
or every `decoder_sparse_step`-th one, except `mlp_only_layers` (dense SwiGLU)."""

from __future__ import annotations

import re

from torch import nn

from minisgl.config import ModelConfig
from minisgl.layers.moe import SparseMoeBlock
from minisgl.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel

# `model.layers.3.mlp.experts.17.gate_proj.weight`: one expert's projection in HF checkpoints
# (and in GGUF files once the loader splits their stacked expert tensors); FP8 checkpoints add
# its `weight_scale`.
_EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<what>weight|weight_scale)$"
)

# proj -> (stacked parameter, part of it: 0 gate | 1 up; None for down)
_EXPERT_PARAMS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}

ShardId = str | int | tuple[int, int]


class Qwen3MoeModel(LlamaModel):
    def _mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        moe = cfg.moe
        if moe is None:
            raise ValueError("Qwen3MoeForCausalLM needs the MoE fields of the config (num_experts)")
        if not moe.is_moe_layer(layer):
            return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.quant)
        return SparseMoeBlock(
            cfg.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob,
            cfg.quant,
        )  # fmt: skip


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_class = Qwen3MoeModel

    def checkpoint_name(self, name: str) -> tuple[str, ShardId | None] | None:
        """Per-expert tensors (and FP8 scales) land in the layer's stacked expert parameters;
        the rest as Llama.

        Shard ids: `(expert, 0 | 1)` for gate | up, `expert` for down (see `MoEExperts`).
        """
        m = _EXPERT_RE.match(name)
        if m is None or m["proj"] not in _EXPERT_PARAMS:
            return super().checkpoint_name(name)
        param, part = _EXPERT_PARAMS[m["proj"]]
        expert = int(m["expert"])
        shard: ShardId = expert if part is None else (expert, part)
        suffix = "_scale" if m["what"] == "weight_scale" else ""
        return f"{m['prefix']}.{param}{suffix}", shard
