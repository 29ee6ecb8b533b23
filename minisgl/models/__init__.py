"""Model architectures, keyed by the HF `architectures` name."""

from __future__ import annotations

from torch import nn

from minisgl.config import ModelConfig


def model_class(architecture: str) -> type[nn.Module]:
    from minisgl.models.llama import LlamaForCausalLM

    registry: dict[str, type[nn.Module]] = {
        "LlamaForCausalLM": LlamaForCausalLM,
        "MistralForCausalLM": LlamaForCausalLM,
        "Qwen2ForCausalLM": LlamaForCausalLM,
        "Qwen3ForCausalLM": LlamaForCausalLM,
    }
    if architecture == "Qwen3MoeForCausalLM":
        from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    if architecture not in registry:
        raise ValueError(f"architecture {architecture!r} is not supported")
    return registry[architecture]


def build_model(cfg: ModelConfig) -> nn.Module:
    return model_class(cfg.architecture)(cfg)


__all__ = ["build_model", "model_class"]
