"""FP8 (e4m3) weights on the CPU reference path: online quantization of a float checkpoint
(`quantization="fp8"`, one scale per output channel) and FP8 checkpoints written here in the HF
layouts (`quant_method: fp8` with 128 x 128 `weight_scale_inv`, or per-tensor `weight_scale`
with a static `input_scale`) and the compressed-tensors ones (per channel, per block), dense and
mixture-of-experts; tensor parallelism over gloo.

The reference is the float checkpoint of exactly the values the FP8 one stands for (e4m3 times
its scales), through the unquantized engine (itself checked against transformers elsewhere). On
a CPU an FP8 weight is those values in fp32, so the two agree to fp32 rounding; an unquantized
run of the original weights must differ from both (the quantization is real).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    FP8_LAYOUTS,
    prefill_logits,
    random_prompts,
    randomize,
    save_fp8_checkpoint,
    tiny_hf_config,
)

from minisgl import LLM, SamplingParams
from minisgl.kernels.fp8 import dequantize_weight, quantize_rows

VOCAB = 384
ATOL = 1e-4  # fp32 sums in another order, over logits of order 10
# Weight-only at every batch size: the comparisons isolate the weights' rounding. (Above
# `fp8_gemv_max_rows` rows activations round to e4m3 too: `test_activations_round_above_the_switch`.)
WEIGHT_ONLY = 1 << 30
OPTS: dict[str, Any] = {
    "num_pages": 1024, "skip_warmup": True, "dtype": "float32", "fp8_gemv_max_rows": WEIGHT_ONLY
}  # fmt: skip


def make(path: Path, **options: Any) -> LLM:
    return LLM(str(path), **{**OPTS, **options})


def save_model(cfg: Any, path: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def dense_128(vocab: int = VOCAB) -> Any:
    """Llama with every projection a whole number of 128 x 128 blocks, also at tp=2."""
    import transformers as tf

    return tf.LlamaConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
    )  # fmt: skip


def moe_128() -> Any:
    """Qwen3-MoE whose experts are whole 128 x 128 blocks (gate and up each one block row)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    out = {
        "dense": save_model(dense_128(), root / "dense"),
        "moe": save_model(moe_128(), root / "moe"),
    }
    # transformers 5 writes the expert count as num_local_experts; Hub configs say num_experts.
    cfg = json.loads((out["moe"] / "config.json").read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    (out["moe"] / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return random_prompts(1, VOCAB, seed=3, lo=50, hi=51)[0]


def assert_fp8_matches(fp8: LLM, reference: Path, original: Path, ids: list[int]) -> None:
    got = prefill_logits(fp8, ids)
    want = prefill_logits(make(reference), ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert (prefill_logits(make(original), ids) - want).abs().max() > 100 * ATOL


def test_online_fp8_is_the_per_channel_e4m3_model(models, ids, tmp_path):
    """quantization="fp8" on a float checkpoint: every decoder projection and expert becomes
    e4m3 with one scale per output channel (a per-row round trip of the float weight)."""
    for kind, path in models.items():
        ref = tmp_path / kind
        save_fp8_checkpoint(path, ref, "ct-channel")  # per row: the same values
        fp8 = make(path, quantization="fp8")
        assert fp8.engine.model_config.quant is not None
        assert_fp8_matches(fp8, ref / "dequantized", path, ids)


# MoE checkpoints ship per-block or per-channel scales.
CHECKPOINTS = [("dense", layout) for layout in FP8_LAYOUTS]
CHECKPOINTS += [("moe", "hf-block"), ("moe", "ct-channel"), ("moe", "ct-block")]


@pytest.mark.parametrize("kind,layout", CHECKPOINTS)
def test_fp8_checkpoint_loads_as_its_dequantized_model(models, ids, tmp_path, kind, layout):
    path = save_fp8_checkpoint(models[kind], tmp_path / "ckpt", layout)
    fp8 = make(path)  # an FP8 checkpoint is FP8 without asking
    quant = fp8.engine.model_config.quant
    assert quant is not None and quant.weight_block == (128 if layout.endswith("block") else None)
    assert_fp8_matches(fp8, path / "dequantized", models[kind], ids)


def test_fp8_checkpoint_kv_scales_with_an_fp8_kv_cache(models, tmp_path):
    path = save_fp8_checkpoint(models["dense"], tmp_path / "ckpt", "ct-block", kv_scales=True)
    pool = make(path, kv_cache_dtype="fp8_e4m3").engine.pool
    assert torch.allclose(pool.all_scales()[0, :, 0], torch.tensor([0.05, 0.1]))
    assert torch.allclose(pool.all_scales()[1, :, 0], torch.tensor([0.01, 0.02]))
    out = make(path, kv_cache_dtype="fp8_e4m3").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0]["token_ids"]) == 4


def test_fp8_weights_without_scales_are_refused(models, tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_fp8_checkpoint(models["dense"], tmp_path / "ckpt", "hf-block")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="without scales"):
        make(path)


def test_block_scales_that_a_shard_would_split_are_refused(tmp_path):
    """tp=2 of a 64-row k projection would cut a 128-row scale block in two."""
    cfg = dense_128()
    cfg.num_key_value_heads = 2
    path = save_fp8_checkpoint(save_model(cfg, tmp_path / "f"), tmp_path / "ckpt", "hf-block")
    with pytest.raises(Exception, match="inside a 128 x 128 block"):
        make(path, tp_size=2, num_pages=512)


def test_unsupported_checkpoint_quantization_is_refused(models, tmp_path):
    import shutil

    path = tmp_path / "bnb"  # (AWQ and GPTQ load: tests/weights/test_lowbit_loaders.py)
    shutil.copytree(models["dense"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bitsandbytes"):
        make(path)
    with pytest.raises(ValueError, match="quantization"):
        LLM(quantization="int2")


def test_gpus_below_compute_capability_8_9_are_refused_by_name():
    from minisgl.config.quant import fp8_capability_error

    error = fp8_capability_error("NVIDIA A100-SXM4-80GB", (8, 0), "FP8 weights")
    assert error is not None and "A100" in error and "8.0" in error and ">= 8.9" in error
    assert fp8_capability_error("NVIDIA L40S", (8, 9), "FP8 weights") is None
    assert fp8_capability_error("NVIDIA H200", (9, 0), "--kv-cache-dtype fp8_e4m3") is None


def test_per_row_quantization_round_trip_is_e4m3():
    """The online quantization's own numerics: every value within 2^-4 of the original
    (relative to its row's largest, scaled to 448), the largest of each row exact."""
    w = torch.randn(64, 100) * torch.logspace(-3, 2, 64)[:, None]
    q, s = quantize_rows(w)
    back = dequantize_weight(q, s, None, torch.float32)
    assert q.dtype == torch.float8_e4m3fn
    err = (back - w).abs() / w.abs().clamp_min(s[:, None] * 2**-6)  # e4m3's normal range
    assert err.max() <= 2**-4
    torch.testing.assert_close(back.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("block", [None, 128])
def test_activations_round_above_the_switch(block):
    """An FP8 linear layer (CPU reference path): up to `gemv_max_rows` rows x is used as it
    is; above, x is rounded to e4m3 per token (per token and 128 columns with block scales),
    as the FP8 tensor-core GEMMs take it."""
    from minisgl.config import QuantConfig
    from minisgl.kernels.fp8 import quantize_activations
    from minisgl.layers import ColumnParallelLinear
    from minisgl.layers.weight_format import dequantized
    from minisgl.weights.loader import finish_loading

    quant = QuantConfig(weight_block=block, gemv_max_rows=4)
    layer = ColumnParallelLinear(256, 128, quant=quant)
    w = torch.randn(128, 256) / 16
    layer.weight.weight_loader(layer.weight, w)
    finish_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale is not None
    w_deq = dequantized(layer.weight.data, layer.weight_scale.data, quant, torch.float32)
    assert not torch.equal(w_deq, w)
    x = torch.randn(9, 256) * torch.logspace(-2, 1, 9)[:, None]
    torch.testing.assert_close(layer(x[:4]), x[:4] @ w_deq.t(), atol=1e-5, rtol=1e-5)
    cols = 256 if block is None else 128
    parts = [quantize_activations(x[:, i : i + cols]) for i in range(0, 256, cols)]
    x_q = torch.cat([q.float() * s for q, s in parts], dim=1)
    torch.testing.assert_close(layer(x), x_q @ w_deq.t(), atol=1e-5, rtol=1e-5)
    assert (layer(x) - x @ w_deq.t()).abs().max() > 1e-3


# ---- tensor parallelism -------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)
TP_ATOL = 1e-5  # fp32: tp changes only the order of the sums


@pytest.mark.slow
@pytest.mark.parametrize("case", ["online", "hf-block", "kv-calibrated"])
def test_fp8_tp2_equals_tp1(models, tmp_path, case):
    """Online per-channel weights, weight-only; block-scaled weights with activations rounded
    per 128 columns above the default switch (shards do not cut those groups); an FP8 KV cache
    calibrated on each rank for the heads it holds."""
    if case == "online":
        path, options = models["dense"], {"quantization": "fp8"}
    elif case == "kv-calibrated":
        path = models["dense"]
        options = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "kv_cache_calibrate": 256}
    else:
        path = save_fp8_checkpoint(models["dense"], tmp_path / "c", case)
        options = {"fp8_gemv_max_rows": 1}
    prompts = random_prompts(3, VOCAB, seed=5, lo=3, hi=30)
    outs = []
    for tp in (1, 2):
        with LLM(str(path), **{**OPTS, "num_pages": 512, **options}, tp_size=tp) as llm:
            outs.append(llm.generate(prompts, GREEDY, use_tqdm=False))
    for r, o in zip(*outs):
        assert o["token_ids"] == r["token_ids"]
        assert max(abs(a - b) for a, b in zip(r["logprobs"], o["logprobs"])) <= TP_ATOL


def test_tiny_arch_shapes_that_are_not_blocks_quantize_per_channel(tiny_model_dir, ids):
    """Online FP8 needs no block alignment: the tiny test models (heads of 16-32) load."""
    path = tiny_model_dir("qwen3")
    fp8 = make(path, quantization="fp8")
    assert torch.isfinite(prefill_logits(fp8, ids[:20])).all()
    assert tiny_hf_config("qwen3").hidden_size == 64


def test_linear_kernel_switches_reach_the_model_config():
    """`skinny_max_rows` and `fp8_skinny` travel from the engine's config to the model's (the
    layers choose their kernels from it; left unset, models up to hidden size 1024 take the
    skinny GEMM up to 16 rows); a row count the skinny GEMM cannot take is refused by
    name."""
    from minisgl.config import EngineConfig, ModelConfig, RopeConfig, resolve_model_quantization

    shape = dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=1, num_kv_heads=1)
    mcfg = ModelConfig("LlamaForCausalLM", head_dim=8, intermediate_size=8, rms_norm_eps=1e-6,
                       rope=RopeConfig(), max_position=16, **shape)  # fmt: skip
    cfg = EngineConfig(device="cpu", quantization="fp8", fp8_skinny=True, skinny_max_rows=8)
    got = resolve_model_quantization(mcfg, cfg)
    assert got.skinny_max_rows == 8 and got.quant is not None and got.quant.skinny
    plain = resolve_model_quantization(mcfg, EngineConfig(device="cpu"))
    assert plain.skinny_max_rows == 16 and plain.quant is None  # a small model: on by its size
    large = resolve_model_quantization(replace(mcfg, hidden_size=4096), EngineConfig(device="cpu"))
    assert large.skinny_max_rows == 0
    off = resolve_model_quantization(mcfg, EngineConfig(device="cpu", skinny_max_rows=0))
    assert off.skinny_max_rows == 0
    with pytest.raises(ValueError, match="skinny_max_rows"):
        EngineConfig(skinny_max_rows=17)
