"""Integer checkpoints (GGUF blocks, AWQ, GPTQ, compressed-tensors, --quantization int4/int8) load
exactly into the common layout and a layer's output matches the dequantized weight.

GGUF files are written by the `gguf` package (its quantizer where it has one, random blocks for
the K-quants) and read back by its reader; AWQ / GPTQ / compressed-tensors tensors are packed
here from known integers, scales and zero points, following each format's published layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl.config import QuantConfig
from minisgl.kernels.lowbit import QWeight, quantize_rtn
from minisgl.layers import ColumnParallelLinear, MergedColumnParallelLinear
from minisgl.weights.loader import _gguf_tensor
from minisgl.weights.lowbit import integer_modules

N, K = 64, 512
GGUF_QUANT = QuantConfig(source="gguf", weight_type="int")


def layer_output(parts: list[QWeight | torch.Tensor], x: torch.Tensor, quant=GGUF_QUANT):
    """Each part through a real layer's weight loader (fused parts as gate/up), then y = x W^T."""
    rows = [p.shape[0] for p in parts]
    if len(parts) == 1:
        layer = ColumnParallelLinear(K, rows[0], quant=quant)
        layer.weight.weight_loader(layer.weight, parts[0])
    else:
        layer = MergedColumnParallelLinear(K, rows, quant=quant)
        for i, p in enumerate(parts):
            layer.weight.weight_loader(layer.weight, p, i)
    layer.finish_loading()
    return layer(x), layer


def assert_matches(y: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
    """Within bf16 accumulation tolerance of x W^T in fp64 (the CPU kernel takes bf16
    activations and scales, accumulates in fp32, rounds its output to bf16)."""
    ref = (x.double() @ w.double().T).float()
    scale = (x.abs().double() @ w.abs().double().T).float()  # the sum of |terms| per output
    assert ((y - ref).abs() <= 1.2e-2 * scale + 1e-6).all(), (y - ref).abs().max()


def write_gguf(tmp_path, kind: str, rng: np.random.Generator):
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        data = gguf.quants.quantize(rng.normal(0, 0.05, (N, K)).astype(np.float32), qtype)
    else:  # random K-quant blocks with sane fp16 super-scales
        data = rng.integers(0, 256, (N, K // block, type_size), dtype=np.uint8)
        d = rng.uniform(1e-4, 2e-3, (N, K // block, 1)).astype(np.float16).view(np.uint8)
        at = 208 if kind == "Q6_K" else 0
        data[..., at : at + 2] = d
        if kind != "Q6_K":
            data[..., 2:4] = (d.view(np.float16) / 2).view(np.uint8)  # dmin
        data = data.reshape(N, -1)
    path = tmp_path / f"{kind}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = gguf.GGUFReader(str(path)).tensors[0]
    return t, torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_load_exactly(tmp_path, kind):
    rng = np.random.default_rng(0)
    t, w = write_gguf(tmp_path, kind, rng)
    qw = _gguf_tensor(t, "model.layers.0.mlp.up_proj.weight")
    assert isinstance(qw, QWeight)
    assert qw.group == (16 if kind == "Q6_K" else 32)
    assert qw.bits() == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    torch.testing.assert_close(qw.dequantize(), w, rtol=2e-7, atol=0)  # Q6_K: one fp32 rounding
    x = torch.randn(3, K)
    y, layer = layer_output([qw], x)
    assert_matches(y, w, x)
    assert (layer.lowbit.kernel is None) == (kind == "Q6_K")  # groups of 16: dequantized


def test_gguf_types_mix_in_one_fused_layer(tmp_path):
    """Q4_K_M's way: gate in Q4_K, up in Q6_K: one layer, the finer group, dequantized on CPU;
    Q4_0 beside Q8_0 keeps a kernel (8 bits)."""
    rng = np.random.default_rng(1)
    (t1, w1), (t2, w2) = write_gguf(tmp_path, "Q4_0", rng), write_gguf(tmp_path, "Q8_0", rng)
    parts = [_gguf_tensor(t, "model.layers.0.mlp.up_proj.weight") for t in (t1, t2)]
    x = torch.randn(2, K)
    y, layer = layer_output(parts, x)
    assert layer.lowbit.kernel is not None
    assert_matches(y, torch.cat([w1, w2]), x)


def known_int4(group: int, seed: int = 0, zmin: int = 0):
    """q [N, K] in 0..15, zero points [N, G] in zmin..15, fp16 scales [N, G]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=gen)
    z = torch.randint(zmin, 16, (N, K // group), generator=gen)
    s = (torch.rand(N, K // group, generator=gen) * 0.01 + 0.001).half()
    w = (q - z.repeat_interleave(group, 1)).float() * s.float().repeat_interleave(group, 1)
    return q, z, s, w


def pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values along `dim` into one int32, the first in the lowest bits."""
    v = values.movedim(dim, -1).long()
    v = v.reshape(*v.shape[:-1], -1, 8) << (4 * torch.arange(8))
    return v.sum(-1).to(torch.int64).to(torch.uint32).view(torch.int32).movedim(-1, dim)


def test_awq_gemm_checkpoint():
    q, z, s, w = known_int4(128)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AWQ's nibble order: nibble i holds column order[i]
    perm = torch.arange(N).view(-1, 8)[:, order].flatten()
    tensors = {
        "m.qweight": pack(q.t()[:, perm], 1),  # [K, N / 8]
        "m.qzeros": pack(z.t()[:, perm], 1),  # [G, N / 8]
        "m.scales": s.t().contiguous(),  # [G, N]
    }
    [(name, qw)] = list(integer_modules(tensors.items()))
    assert name == "m.weight" and qw.group == 128 and qw.perm is None
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=0)
    x = torch.randn(4, K)
    assert_matches(layer_output([qw], x)[0], w, x)


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoint(desc_act):
    group = 64
    q, z, s, w = known_int4(group, seed=1, zmin=1)  # GPTQ stores z - 1 >= 0
    g_idx = torch.arange(K) // group
    if desc_act:  # columns handed to groups in a shuffled order, as act-order leaves them
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(2))]
        w = (q - z[:, g_idx]).float() * s.float()[:, g_idx]
    tensors = {
        "m.g_idx": g_idx.int(),
        "m.qweight": pack(q.t(), 0),  # [K / 8, N]
        "m.qzeros": pack((z - 1).t(), 1),  # [G, N / 8], stored minus one
        "m.scales": s.t().contiguous(),
    }
    [(_, qw)] = list(integer_modules(tensors.items()))
    assert (qw.perm is not None) == desc_act
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=0)
    x = torch.randn(4, K)
    assert_matches(layer_output([qw], x)[0], w, x)


def test_compressed_tensors_pack_quantized():
    group = 128
    q, _, s, _ = known_int4(group, seed=3)
    w = (q - 8).float() * s.float().repeat_interleave(group, 1)  # signed int4 = stored - 8
    tensors = {
        "m.weight_packed": pack(q, 1),  # [N, K / 8]
        "m.weight_scale": s,
        "m.weight_shape": torch.tensor([N, K]),
    }
    [(_, qw)] = list(integer_modules(tensors.items()))
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=0)
    x = torch.randn(1, K)
    assert_matches(layer_output([qw], x)[0], w, x)


@pytest.mark.parametrize("bits", [4, 8])
def test_online_round_to_nearest(bits):
    w = torch.randn(N, K) * 0.05
    qw = quantize_rtn(w, bits, 128)
    step = qw.scales.repeat_interleave(128, 1)
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()  # round to nearest
    x = torch.randn(5, K)
    online = QuantConfig(source="online", weight_type="int", bits=bits)
    y, layer = layer_output([w], x, online)
    assert layer.lowbit.kernel is not None
    assert_matches(y, qw.dequantize(), x)


def test_shard_inside_a_group_is_refused():
    qw = quantize_rtn(torch.randn(N, K), 4, 128)
    with pytest.raises(ValueError, match="cuts a quantization group"):
        qw.narrow((0, N), (64, 256))
