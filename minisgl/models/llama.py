"""One decoder for the Llama family: Llama 2/3 (+llama3 RoPE), Mistral, Qwen2 (qkv bias),
Qwen3 (q/k RMSNorm), SmolLM2 (tied embeddings). Pure math: inputs come in as arguments."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from minisgl.config import ModelConfig, QuantConfig
from minisgl.layers import (
    ForwardContext,
    MergedColumnParallelLinear,
    PagedAttention,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
    silu_and_mul,
)
from minisgl.layers.fused import fused_kernels
from minisgl.layers.linear import OneRowGemv, one_row_gemv
from minisgl.layers.moe import SparseMoeBlock


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, cfg.quant
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, quant=cfg.quant
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(layer, self.num_heads, self.num_kv_heads, cfg.head_dim)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if ctx.pieces is not None:  # a piecewise CUDA graph: attention runs between pieces
            return self.o_proj(ctx.pieces.split(qkv, self.attend))
        return self.o_proj(self.attend(qkv, positions, ctx))

    def attend(
        self, qkv: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """[T, q + k + v] projections -> [T, Hq * D] attention output (before o_proj)."""
        t = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_proj.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # Qwen3's per-head q/k RMSNorm goes with the rotation (one fused kernel on CUDA), and
        # so does the KV store where the backend allows it (k comes back None then).
        store = ctx.backend.kv_store(self.attn.layer, ctx.meta)
        q, k_rot = self.rotary.rotate_and_store(
            positions, q, k, v, store, self.q_norm, self.k_norm, ctx.rope
        )
        return self.attn(q, k_rot, None if k_rot is None else v, ctx)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], quant=quant
        )
        self.down_proj = RowParallelLinear(intermediate, hidden, quant=quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    batch_invariant = False  # `minisgl.layers.linear.set_batch_invariant`: no one-row kernels

    def __init__(self, cfg: ModelConfig, attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.quant, self.skinny_max_rows = cfg.quant, cfg.skinny_max_rows

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output, residual): the layer's result is their sum (no residual: the output)."""
        gemv = None if self.batch_invariant else one_row_gemv(x, self.quant, self.skinny_max_rows)
        # (A mixture of experts' fused path takes one token; a piecewise graph's attention
        # runs between its pieces.)
        few = x.shape[0] == 1 or isinstance(self.mlp, LlamaMLP)
        if gemv is not None and few and ctx.pieces is None:
            return self.forward_one_row(gemv, x, residual, positions, ctx)
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def forward_one_row(
        self,
        gemv: OneRowGemv,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token (a batch-1 decode step) on CUDA: each projection is one GEMV kernel that
        takes the norm before it and the residual add or SiLU after it, so a dense layer is six
        kernels (qkv, RoPE + KV store, attention, o_proj, gate/up, down) and a mixture of
        experts seven (its router, gate/up and down: `SparseMoeBlock.forward_one_row`). Returns
        the layer's output with the residual already added (and no residual). A dense layer
        takes a few rows (a speculative verify step) the same way, with the skinny GEMM for
        `gemv` (`one_row_gemv`)."""
        if residual is not None:
            x = x + residual
        attn, ln1, ln2 = self.self_attn, self.input_layernorm, self.post_attention_layernorm
        qkv = attn.qkv_proj.one_row(gemv, x, norm_weight=ln1.weight, eps=ln1.eps)
        a = attn.attend(qkv, positions, ctx)
        x = attn.o_proj.one_row(gemv, a, residual=x)
        mlp = self.mlp
        if isinstance(mlp, SparseMoeBlock):
            return mlp.forward_one_row(x, ln2), None
        assert isinstance(mlp, LlamaMLP)
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        # SiLU-and-multiply in the down GEMV's prologue: the Llama-3-8B layer on the H200 took
        # 112.1 us against 114.4 with it in a gate/up epilogue (`minisgl.benchmark.tune gemv`).
        h = gate_up.one_row(gemv, x, norm_weight=ln2.weight, eps=ln2.eps)
        return down.one_row(gemv, h, residual=x, act=True), None


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, LlamaAttention(cfg, i, rotary), self._mlp(cfg, i))
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def _mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.quant)

    def attention_context(
        self, ctx: ForwardContext, positions: torch.Tensor, like: torch.Tensor
    ) -> ForwardContext:
        """`ctx` with the RoPE rows of `positions` where the torch rotation needs them (the
        fused rotation kernel, used for tensors like `like`, reads the table itself)."""
        if fused_kernels(like) is None:
            return replace(ctx, rope=self.rotary.lookup(positions))
        return ctx

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """`num_layers`: run only the first layers, then the final norm (a layer-skip draft:
        the model's own early exit)."""
        h = self.embed_tokens(input_ids)  # [T, hidden]
        ctx = self.attention_context(ctx, positions, h)
        residual: torch.Tensor | None = None
        for layer in self.layers[:num_layers]:
            h, residual = layer(h, residual, positions, ctx)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint names that land in a fused parameter: name -> (fused name, shard id).
    stacked_params: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    model_class: type[LlamaModel] = LlamaModel

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tie_to=tied, skinny_max_rows=cfg.skinny_max_rows
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (after the first
        `num_layers` layers only, when given)."""
        return self.model(input_ids, positions, ctx, num_layers)

    def attention_context(
        self, ctx: ForwardContext, positions: torch.Tensor, like: torch.Tensor
    ) -> ForwardContext:
        return self.model.attention_context(ctx, positions, like)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in the model dtype (the sampler upcasts where it needs to:
        the fused sampling kernel reads them as they are)."""
        return self.lm_head(hidden)  # type: ignore[no-any-return]

    def checkpoint_name(self, name: str) -> tuple[str, str | int | tuple[int, int] | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard id); None to skip it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if self.config.tie_word_embeddings and name.startswith("lm_head."):
            return None
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.stacked_params:
                fused, shard = self.stacked_params[part]
                return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each checkpoint tensor into its parameter; returns the parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            target = self.checkpoint_name(ckpt_name)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
            param = params[name]
            loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(name)
        return loaded
