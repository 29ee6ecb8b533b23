"""Qwen3-MoE against transformers on tiny random models (fp32, CPU), and its expert sharding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.config import model_config_from_dict
from minisgl.distributed import TPInfo, reset_tp_info, set_tp_info
from minisgl.layers.moe import MoEExperts, Routing, SparseMoeBlock, moe_reference, select_experts
from minisgl.models.llama import LlamaMLP
from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM

VOCAB = 256
NUM_TOKENS = 12
TOP_LOGPROBS = 20
VARIANTS = {
    # every layer MoE, top-k renormalised
    "sparse": {"decoder_sparse_step": 1, "norm_topk_prob": True},
    # layer 0 dense, raw softmax weights
    "mlp-only-0": {"mlp_only_layers": [0], "norm_topk_prob": False},
}


def tiny_config(**overrides: Any) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
        **overrides,
    )  # fmt: skip


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that next-token distributions are peaked (greedy is stable)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.02 if "norm" in name else 0.08
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))


def save_tiny(path: Path, seed: int, **overrides: Any) -> Any:
    from transformers import Qwen3MoeForCausalLM as HFQwen3Moe

    hf = HFQwen3Moe(tiny_config(**overrides)).eval()
    randomize(hf, seed)
    hf.save_pretrained(path, safe_serialization=True)
    # transformers 5 writes the expert count as `num_local_experts`; Hub checkpoints (and
    # ModelConfig) use `num_experts`. Write both, as a Hub config would read.
    cfg = json.loads((path / "config.json").read_text())
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    (path / "config.json").write_text(json.dumps(cfg))
    save_word_tokenizer(path)
    return hf


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer so `LLM` can detokenize (prompts here are token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = [1, 2, 5, 9, 17, 30, 44, 63, 80][:n]
    return [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for length in lens]


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(path, seed=len(request.param), **VARIANTS[request.param])
    llm = LLM(str(path), dtype="float32", device="cpu", num_pages=2048)
    return request.param, hf, llm, prompts(9, seed=7)


def test_layers_follow_the_config(setup):
    name, _, llm, _ = setup
    kinds = [type(layer.mlp) for layer in llm.engine.model.model.layers]
    want = [LlamaMLP, SparseMoeBlock] if name == "mlp-only-0" else [SparseMoeBlock] * 2
    assert kinds == want


def test_prefill_logprobs_match_transformers(setup):
    _, hf, llm, batch = setup
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=TOP_LOGPROBS)
    outs = llm.generate(batch, params, use_tqdm=False)
    for ids, out in zip(batch, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], dim=-1)  # [V]
        top = out["top_logprobs"][0]  # [(id, logprob)] best first
        want_ids = ref.topk(TOP_LOGPROBS).indices.tolist()
        assert [i for i, _ in top] == want_ids
        got = torch.tensor([lp for _, lp in top])
        torch.testing.assert_close(got, ref[want_ids], atol=1e-4, rtol=0)


def test_batched_greedy_equals_transformers(setup):
    _, hf, llm, batch = setup
    expected = [hf_greedy(hf, ids, NUM_TOKENS) for ids in batch]  # each prompt alone
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(batch, params, use_tqdm=False)  # all prompts in one batch
    assert [o["token_ids"] for o in outs] == expected


def test_sparse_step_places_moe_layers():
    from minisgl.config.model import MoEConfig

    moe = MoEConfig(8, 2, 32, True, sparse_step=2, mlp_only_layers=(3,))
    assert [moe.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def tiny_model_config() -> Any:
    d = tiny_config().to_dict() | {"num_experts": 8, "architectures": ["Qwen3MoeForCausalLM"]}
    return model_config_from_dict(d)


@pytest.mark.parametrize(
    ("checkpoint", "ours"),
    [
        ("L.mlp.experts.5.gate_proj.weight", ("L.mlp.experts.gate_up_proj", (5, 0))),
        ("L.mlp.experts.5.up_proj.weight", ("L.mlp.experts.gate_up_proj", (5, 1))),
        ("L.mlp.experts.7.down_proj.weight", ("L.mlp.experts.down_proj", 7)),
        ("L.mlp.experts.gate_up_proj", ("L.mlp.experts.gate_up_proj", None)),  # stacked
        ("L.mlp.gate.weight", ("L.mlp.gate.weight", None)),  # the router
        ("L.self_attn.k_proj.weight", ("L.self_attn.qkv_proj.weight", "k")),
    ],
)
def test_checkpoint_names(checkpoint, ours):
    model = Qwen3MoeForCausalLM(tiny_model_config())
    layer = "model.layers.1"
    name, shard = ours
    assert model.checkpoint_name(checkpoint.replace("L", layer)) == (
        name.replace("L", layer),
        shard,
    )
    assert name.replace("L", layer) in dict(model.named_parameters())


def hf_block(seed: int, **overrides: Any) -> Any:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(tiny_config(**overrides)).eval()
    randomize(block, seed)
    return block


def load_block(hf: Any, renormalize: bool) -> SparseMoeBlock:
    """Our block from HF's in-memory layout: stacked experts, loaders without shard ids."""
    ours = SparseMoeBlock(64, 8, 2, 32, renormalize)
    params = dict(ours.named_parameters())
    for name, t in hf.state_dict().items():
        params[name].weight_loader(params[name], t)  # type: ignore[attr-defined]
    return ours


@pytest.mark.parametrize("renormalize", [True, False])
def test_block_matches_transformers_block(renormalize):
    hf = hf_block(seed=3, norm_topk_prob=renormalize)
    ours = load_block(hf, renormalize)
    x = torch.randn(11, 64)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x[None])[0], atol=1e-5, rtol=1e-5)


def test_sharded_experts_sum_to_the_whole():
    """At tp=2 each rank loads its half of every expert's intermediate dimension from the
    per-expert checkpoint tensors; the two partial outputs (what the all-reduce adds) equal the
    unsharded layer."""
    hf = hf_block(seed=5, norm_topk_prob=True)
    full = load_block(hf, True)
    gate_up = hf.experts.gate_up_proj.detach()  # [E, 2I, H]
    down = hf.experts.down_proj.detach()  # [E, H, I]
    x = torch.randn(9, 64)
    routing = select_experts(full.gate(x), 2, True)
    partial = []
    for rank in range(2):
        set_tp_info(TPInfo(rank, 2))
        experts = MoEExperts(8, 64, 32)
        assert experts.gate_up_proj.shape == (8, 32, 64) and experts.down_proj.shape == (8, 64, 16)
        for e in range(8):
            gate, up = gate_up[e].chunk(2)  # [I, H] each, as a checkpoint stores them
            experts.gate_up_proj.weight_loader(experts.gate_up_proj, gate, (e, 0))
            experts.gate_up_proj.weight_loader(experts.gate_up_proj, up, (e, 1))
            experts.down_proj.weight_loader(experts.down_proj, down[e], e)
        stacked = MoEExperts(8, 64, 32)  # the whole stacks, as dummy weights and HF 5 give them
        stacked.gate_up_proj.weight_loader(stacked.gate_up_proj, gate_up)
        stacked.down_proj.weight_loader(stacked.down_proj, down)
        assert torch.equal(stacked.gate_up_proj, experts.gate_up_proj)
        assert torch.equal(stacked.down_proj, experts.down_proj)
        half = slice(rank * 16, (rank + 1) * 16)
        torch.testing.assert_close(experts.gate_up_proj[3, :16], gate_up[3, :32][half])
        torch.testing.assert_close(experts.gate_up_proj[3, 16:], gate_up[3, 32:][half])
        torch.testing.assert_close(experts.down_proj[3], down[3][:, half])
        partial.append(moe_reference(x, experts.gate_up_proj, experts.down_proj, routing))
        reset_tp_info()
    with torch.no_grad():
        torch.testing.assert_close(partial[0] + partial[1], full(x), atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_errors():
    experts = MoEExperts(4, 64, 32)
    with pytest.raises(ValueError, match="shape"):
        experts.gate_up_proj.weight_loader(experts.gate_up_proj, torch.zeros(16, 64), (0, 0))
    set_tp_info(TPInfo(0, 3))
    with pytest.raises(ValueError, match="does not divide by tp size 3"):
        MoEExperts(4, 64, 32)
    reset_tp_info()
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SparseMoeBlock(64, 4, 5, 32, True)


def test_reference_routing_renormalises():
    logits = torch.randn(6, 8)
    r = select_experts(logits, 3, renormalize=True)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(6))
    raw = select_experts(logits, 3, renormalize=False)
    assert torch.equal(r.ids, raw.ids) and (raw.weights.sum(-1) < 1).all()
    assert isinstance(r, Routing)


def test_dummy_weights_run(tmp_path):
    cfg = tiny_config().to_dict() | {"num_experts": 8, "architectures": ["Qwen3MoeForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights
    save_word_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_pages=256, load_format="dummy")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 3


def test_benchmark_config_is_qwen3_30b_a3b():
    from transformers import AutoConfig

    path = Path(__file__).parents[2] / "minisgl/benchmark/models/qwen3-30b-a3b"
    cfg = model_config_from_dict(json.loads((path / "config.json").read_text()))
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert shape == (48, 2048, 32, 4, 128)
    assert cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (128, 8, 768)
    assert cfg.moe.norm_topk_prob and cfg.vocab_size == 151936 and cfg.dtype == "bfloat16"
    hf = AutoConfig.from_pretrained(path)
    assert hf.num_experts == 128 and hf.moe_intermediate_size == 768
