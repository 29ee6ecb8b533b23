"""The fused Triton MoE on a CUDA GPU against the torch reference (bf16, 1..8192 tokens)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    # Before importing the kernels: on CPU they must stay free for the interpreter tests.
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.kernels.moe.layer import fused_experts, fused_moe  # noqa: E402
from minisgl.kernels.moe.routing import fused_topk  # noqa: E402
from minisgl.kernels.moe.tiles import FusedMoEConfig, GemmTile, PairConfig, default_config  # noqa: E402
from minisgl.layers.moe import (  # noqa: E402
    Routing,
    SparseMoeBlock,
    moe_impl,
    moe_reference,
    select_experts,
)

DEVICE = "cuda"
TOKENS = (1, 2, 3, 8, 16, 64, 100, 256, 1000, 2048, 4096, 8192)
# Qwen3-30B-A3B's layer: experts, top-k, hidden, moe_intermediate_size
QWEN3_30B = (128, 8, 2048, 768)


@pytest.fixture(scope="module")
def qwen3_30b_weights() -> tuple[torch.Tensor, torch.Tensor]:
    return random_weights(*QWEN3_30B, dtype=torch.bfloat16, seed=0)


def random_weights(
    experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device=DEVICE) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device=DEVICE) * inter**-0.5
    return w13.to(dtype), w2.to(dtype)


def rel_err(out: torch.Tensor, truth: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "NaN/Inf in the fused output"
    return ((out.float() - truth).abs().max() / truth.abs().max()).item()


def check(
    tokens: int, w13: torch.Tensor, w2: torch.Tensor, top_k: int, tol: float, seed: int
) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(tokens, w13.shape[2], generator=gen, device=DEVICE).to(w13.dtype)
    logits = torch.randn(tokens, w13.shape[0], generator=gen, device=DEVICE)
    routing = select_experts(logits, top_k, renormalize=True)
    out = fused_experts(x, w13, w2, routing.weights, routing.ids)
    truth = moe_reference(x.float(), w13.float(), w2.float(), routing)  # same inputs, fp32 math
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, truth) <= tol


@pytest.mark.parametrize("tokens", TOKENS)
def test_qwen3_30b_shape_bf16(tokens: int, qwen3_30b_weights) -> None:
    w13, w2 = qwen3_30b_weights
    check(tokens, w13, w2, QWEN3_30B[1], tol=1e-2, seed=tokens)


@pytest.mark.parametrize("case", range(6))
def test_random_shapes_bf16(case: int) -> None:
    rng = random.Random(case)
    experts = rng.randint(4, 160)
    top_k = rng.randint(1, min(8, experts))
    hidden = rng.choice([128, 1000, 2048, 4096])
    inter = rng.choice([64, 200, 768, 1536])
    w13, w2 = random_weights(experts, top_k, hidden, inter, torch.bfloat16, seed=case)
    for tokens in (1, rng.randint(2, 300), rng.randint(300, 8192)):
        check(tokens, w13, w2, top_k, tol=1e-2, seed=tokens)


def test_fp32_is_exact_math() -> None:
    w13, w2 = random_weights(16, 4, 256, 128, torch.float32, seed=1)
    for tokens in (1, 300):
        check(tokens, w13, w2, 4, tol=1e-4, seed=tokens)


@pytest.mark.parametrize("block_m", [16, 32, 64, 128])
def test_every_block_height(block_m: int, qwen3_30b_weights) -> None:
    w13, w2 = qwen3_30b_weights
    gen = torch.Generator(device=DEVICE).manual_seed(block_m)
    x = torch.randn(513, 2048, generator=gen, device=DEVICE).to(torch.bfloat16)
    routing = select_experts(torch.randn(513, 128, generator=gen, device=DEVICE), 8, True)
    cfg = FusedMoEConfig(block_m, GemmTile(64, 64), GemmTile(64, 64))
    out = fused_experts(x, w13, w2, routing.weights, routing.ids, cfg)
    truth = moe_reference(x.float(), w13.float(), w2.float(), routing)
    assert rel_err(out, truth) <= 1e-2


# Pair-path tiles around the defaults, including the sweep's extremes (benchmark.tune moe).
PAIR_TILES = [GemmTile(8, 1024, 4, 1), GemmTile(16, 256, 4, 1), GemmTile(32, 512, 8, 1),
              GemmTile(8, 256, 4, 1)]  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 8, 33])
@pytest.mark.parametrize("tile", PAIR_TILES, ids=str)
def test_pair_path_routes_and_matches(tokens: int, tile: GemmTile, qwen3_30b_weights) -> None:
    """The pair path from router logits (routing inside its gate/up kernel) against the fp32
    reference, at every tile worth tuning and past the sizes it is chosen for."""
    w13, w2 = qwen3_30b_weights
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=gen, device=DEVICE).to(torch.bfloat16)
    logits = torch.randn(tokens, 128, generator=gen, device=DEVICE)
    out = fused_moe(x, w13, w2, logits, 8, True, PairConfig(tile, tile))
    truth = moe_reference(x.float(), w13.float(), w2.float(), select_experts(logits, 8, True))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, truth) <= 1e-2


def test_batch1_decode_takes_the_pair_path() -> None:
    assert isinstance(default_config(1, 8, 128), PairConfig)


def test_topk_matches_reference() -> None:
    logits = torch.randn(4096, 128, device=DEVICE)
    weights, ids = fused_topk(logits, 8, True)
    ref = select_experts(logits, 8, True)
    assert torch.equal(ids.long().sort(-1).values, ref.ids.sort(-1).values)
    torch.testing.assert_close(weights.sort(-1).values, ref.weights.sort(-1).values)


@pytest.mark.parametrize("batch", [1, 64])
def test_cuda_graph_replay_matches_eager(qwen3_30b_weights, batch: int) -> None:
    """Decode runs as replayed CUDA graphs (batch 1 takes the pair path): nothing in the fused
    path may sync or reallocate, and every replay matches eager and the fp32 reference."""
    w13, w2 = qwen3_30b_weights
    x = torch.randn(batch, 2048, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(batch, 128, device=DEVICE)
    fused_moe(x, w13, w2, logits, 8, True)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, logits, 8, True)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x, w13, w2, logits, 8, True), rtol=0, atol=0)
        truth = moe_reference(x.float(), w13.float(), w2.float(), select_experts(logits, 8, True))
        assert rel_err(out, truth) <= 1e-2


def test_layer_uses_the_fused_kernel_and_matches_transformers() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    assert moe_impl("cuda") is fused_moe
    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16,
                         num_experts_per_tok=4, norm_topk_prob=True)  # fmt: skip
    # fp32: bf16 router logits tie often, and the two top-k implementations break ties apart.
    hf = Qwen3MoeSparseMoeBlock(cfg).to(DEVICE).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.05)
    with torch.device(DEVICE):
        ours = SparseMoeBlock(256, 16, 4, 128, True)
    params = dict(ours.named_parameters())
    for name, t in hf.state_dict().items():
        params[name].weight_loader(params[name], t)  # type: ignore[attr-defined]
    x = torch.randn(300, 256, device=DEVICE)
    with torch.no_grad():
        got, want = ours(x), hf(x[None])[0]
    assert rel_err(got, want) <= 1e-4


def test_reference_routing_type() -> None:
    r = select_experts(torch.randn(3, 8, device=DEVICE), 2, True)
    assert isinstance(r, Routing) and r.weights.dtype == torch.float32
