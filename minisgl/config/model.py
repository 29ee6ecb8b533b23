from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.config.quant import QuantConfig, checkpoint_quant


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | llama3 | linear | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, read once from a HF config dict."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    # FP8 weights: the checkpoint's own format, then what the engine resolved (`config.quant`).
    quant: QuantConfig | None = None
    # Rows (2..16) up to which unquantized linear layers on CUDA take the skinny GEMM; 0: never
    # (resolved from the engine's `skinny_max_rows` with `quant`).
    skinny_max_rows: int = 0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim


# Which flags each architecture family implies (one decoder class covers them all).
_FAMILY_FLAGS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
}


def _rope_from_dict(d: dict[str, Any]) -> RopeConfig:
    # transformers 5 nests everything under `rope_parameters`; 4.x used rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", d.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    return RopeConfig(
        theta=float(theta),
        kind=str(kind),
        factor=float(merged.get("factor", 1.0) or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(
            merged.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
    )


def _eos_ids(d: dict[str, Any], extra: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (d.get("eos_token_id"), extra):
        if src is None:
            continue
        for t in src if isinstance(src, (list, tuple)) else [src]:
            if int(t) not in ids:
                ids.append(int(t))
    return tuple(ids)


def model_config_from_dict(d: dict[str, Any], generation_eos: Any = None) -> ModelConfig:
    """Build a ModelConfig from a HF `config.json` dict (plus generation_config's eos ids)."""
    archs = d.get("architectures") or []
    if not archs:
        raise ValueError("model config: `architectures` is missing; cannot pick a model class")
    arch = archs[0]
    if arch not in _FAMILY_FLAGS:
        raise ValueError(
            f"model config: architecture {arch!r} is not supported; supported: "
            f"{sorted(_FAMILY_FLAGS)}"
        )
    flags = _FAMILY_FLAGS[arch]
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    moe = None
    if arch == "Qwen3MoeForCausalLM":
        moe = MoEConfig(
            num_experts=int(d.get("num_experts") or d["num_local_experts"]),
            top_k=int(d["num_experts_per_tok"]),
            intermediate_size=int(d["moe_intermediate_size"]),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        )
    dtype = d.get("torch_dtype") or d.get("dtype") or "float32"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        intermediate_size=int(d.get("intermediate_size", 0)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_dict(d),
        max_position=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=flags.get("qkv_bias", False) or bool(d.get("attention_bias", False)),
        qk_norm=flags.get("qk_norm", False),
        hidden_act=str(d.get("hidden_act", "silu")),
        dtype=str(dtype).replace("torch.", ""),
        eos_token_ids=_eos_ids(d, generation_eos),
        moe=moe,
        quant=checkpoint_quant(d),
        raw=d,
    )
