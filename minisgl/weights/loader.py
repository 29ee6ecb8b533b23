"""Stream checkpoint tensors (safetensors, GGUF; integer formats as `QWeight`s,
`minisgl.weights.lowbit`) or random ones into a model's parameters."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from minisgl.config import ModelConfig
from minisgl.distributed import tp_size_one
from minisgl.kernels.lowbit import QWeight
from minisgl.layers import default_weight_loader
from minisgl.weights.fp8 import FP8CheckpointFilter, KVScales
from minisgl.weights.lowbit import GGUF_KERNEL_TYPES, gguf_qweight, integer_modules, say_dequantized
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


def _unpermute_qk(w: Any, n_heads: int) -> Any:
    # llama.cpp's converter interleaves the two rotary halves of each q/k head; undo it (on
    # an integer weight: on its values, scales and mins alike).
    if isinstance(w, QWeight):
        return QWeight(*(_unpermute_qk(f, n_heads) for f in (w.q, w.scales, w.mins)))
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def _gguf_tensor(t: Any, name: str) -> torch.Tensor | QWeight:
    """A decoder projection's integer blocks as a QWeight; everything else (the embedding, the
    LM head, norms, experts, types without a kernel) dequantized to fp32."""
    import gguf

    kind = t.tensor_type.name
    projection = name.endswith("proj.weight") and "experts." not in name
    if projection and kind in GGUF_KERNEL_TYPES:
        return gguf_qweight(t.data, kind)
    if projection and kind not in ("F32", "F16", "BF16"):
        say_dequantized(kind)
    return torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())


def iter_gguf(src: ModelSource, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    import gguf

    reader = gguf.GGUFReader(str(src.path))
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else ""
    for t in tqdm(reader.tensors, desc="Loading GGUF tensors", disable=None):
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue
        w = _gguf_tensor(t, name)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute_qk(w, cfg.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute_qk(w, cfg.num_kv_heads)
        if "experts." in name:  # stacked [experts, ...]: split into HF's per-expert tensors
            for e in range(w.shape[0]):
                yield name.replace("experts.", f"experts.{e}."), w[e]
            continue
        yield name, w


def iter_safetensors(src: ModelSource) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    files = sorted(src.path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model: no *.safetensors files in {str(src.path)!r}")
    for f in tqdm(files, desc="Loading safetensors", disable=None):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, st.get_tensor(name)


def _checkpoint_tensors(src: ModelSource, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """(name, tensor or QWeight) in HF naming; integer modules as one QWeight each."""
    return iter_gguf(src, cfg) if src.is_gguf else integer_modules(iter_safetensors(src))


@torch.no_grad()
def load_weights(model: nn.Module, src: ModelSource, cfg: ModelConfig) -> KVScales | None:
    """Every parameter from the checkpoint; returns its KV-cache scales when it has them."""
    fp8 = FP8CheckpointFilter(cfg.num_layers)
    loaded = model.load_weights(fp8(_checkpoint_tensors(src, cfg)))  # type: ignore[operator]
    missing = {n for n, p in model.named_parameters() if not _derived(p)} - loaded
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    finish_loading(model)
    return fp8.kv_scales()


def _derived(param: nn.Parameter) -> bool:
    """A parameter its weight's loader fills when the checkpoint does not (FP8 scales)."""
    return bool(getattr(param, "derived", False))


def finish_loading(model: nn.Module) -> None:
    """Let every module check and convert what it loaded (`finish_loading()`, e.g. FP8 weights
    dequantized for the CPU path)."""
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights from the config alone (benchmarks): small normal values, unit norms.

    Each parameter's values are drawn for its full, unsharded shape from a generator seeded by
    its name, and its own weight loader takes this rank's shard, so every tensor-parallel size
    builds the same model. Drawing the full tensor costs tp_size times the random numbers of a
    shard, which is negligible next to a checkpoint read.
    """
    full_shapes = _unsharded_shapes(model)
    for name, p in model.named_parameters():
        if _derived(p):  # FP8 scales: set when their weight is quantized
            continue
        if "norm" in name:
            p.fill_(1.0)
            continue
        gen = torch.Generator(device=p.device).manual_seed(_param_seed(seed, name))
        # FP8 weights are drawn in fp32 and quantized by their loader.
        dtype = p.dtype if p.element_size() > 1 else torch.float32
        full = torch.empty(full_shapes[name], dtype=dtype, device=p.device)
        full.normal_(0.0, 0.02, generator=gen)
        loader = getattr(p, "weight_loader", default_weight_loader)
        loader(p, full)
    finish_loading(model)


def _param_seed(seed: int, name: str) -> int:
    # crc32, unlike hash(), is the same in every process.
    return seed * 4_294_967_311 + zlib.crc32(name.encode())


def _unsharded_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """Every parameter's shape at tp=1, from a copy of the model built on the meta device."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{type(model).__name__} has no `config`; dummy weights need one")
    with tp_size_one(), torch.device("meta"):
        unsharded = type(model)(config)
    return {name: p.shape for name, p in unsharded.named_parameters()}
