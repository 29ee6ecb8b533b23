"""Stream checkpoint tensors (safetensors, GGUF) or random ones into a model's parameters."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from minisgl.config import ModelConfig
from minisgl.weights.source import ModelNotFoundError, ModelSource

# GGUF's standard tensor names -> HF checkpoint names (per block: `blk.N.<gguf>`).
_GGUF_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    m = _BLOCK_RE.match(name)
    if m:
        layer, kind, suffix = m.groups()
        hf = _GGUF_BLOCK.get(kind)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    base, _, suffix = name.rpartition(".")
    hf = _GGUF_TOP.get(base)
    return None if hf is None else f"{hf}.{suffix}"


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves the two rotary halves of each q/k head; undo it.
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def iter_gguf(src: ModelSource, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(src.path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else ""
    for t in tqdm(reader.tensors, desc="Loading GGUF tensors", disable=None):
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute_qk(w, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute_qk(w, cfg.num_kv_heads)
        if "experts." in name:  # stacked [experts, ...]: split into HF's per-expert tensors
            for e in range(w.shape[0]):
                yield name.replace("experts.", f"experts.{e}."), w[e]
            continue
        yield name, w


def iter_safetensors(src: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(src.path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model: no *.safetensors files in {str(src.path)!r}")
    for f in tqdm(files, desc="Loading safetensors", disable=None):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, st.get_tensor(name)


@torch.no_grad()
def load_weights(model: nn.Module, src: ModelSource, cfg: ModelConfig) -> None:
    weights = iter_gguf(src, cfg) if src.is_gguf else iter_safetensors(src)
    loaded = model.load_weights(weights)  # type: ignore[operator]
    missing = {n for n, _ in model.named_parameters()} - loaded
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights from the config alone (benchmarks): small normal values, unit norms."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if "norm" in name:
            p.fill_(1.0)
            continue
        gen = torch.Generator(device=p.device).manual_seed(seed * 100_003 + i)
        p.normal_(0.0, 0.02, generator=gen)
