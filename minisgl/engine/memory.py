"""How many KV pages fit: from free device memory on CUDA, from a fixed budget on the CPU.

On CUDA the pool gets `mem_fraction` of the device's total memory, minus what is already used
(the weights, other processes), minus the peak activations of one eager step, minus what the
decode CUDA graphs will hold (captured after the pool is allocated, so they are estimated here;
the engine logs the measured figure after capture).
"""

from __future__ import annotations

import torch

from minisgl.config import EngineConfig, ModelConfig
from minisgl.kvcache import KVPool


def _elem(cfg: EngineConfig) -> int:
    return torch.empty((), dtype=cfg.torch_dtype).element_size()


def activation_reserve_bytes(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    """Peak activation memory of one step, generously: a prefill of max_prefill_tokens."""
    tokens = cfg.max_prefill_tokens + cfg.max_running_requests
    width = mcfg.hidden_size * 4 + mcfg.intermediate_size * 3 + mcfg.q_size * 3
    # Sampling temporaries: fp32 logits and probabilities, int64 hash words ([B, V] each).
    logits = cfg.max_running_requests * mcfg.vocab_size * 4 * 12
    return tokens * width * _elem(cfg) + logits + (512 << 20)


def graph_reserve_bytes(cfg: EngineConfig, mcfg: ModelConfig, max_context: int) -> int:
    """Memory the decode CUDA graphs keep: the private pool (activations of the largest batch
    size, reused by the smaller ones), block-table gathers, split-K partials, and the graphs'
    own bookkeeping. An over-estimate by design; the engine logs what capture really took."""
    bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
    width = mcfg.hidden_size * 6 + mcfg.intermediate_size * 3 + mcfg.q_size * 4
    activations = bs * width * _elem(cfg)
    pages_per_req = -(-max_context // cfg.page_size)
    tables = bs * pages_per_req * 4 * 2
    partials = 64 * mcfg.num_heads * mcfg.head_dim * 4 * 2 * max(1, bs // 8)
    return 2 * (activations + tables + partials) + (256 << 20)


def piecewise_reserve_bytes(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    """Memory the piecewise graphs keep: the activations of their largest token count (the
    smaller ones reuse them) and the attention output buffer."""
    width = mcfg.hidden_size * 4 + mcfg.intermediate_size * 3 + mcfg.q_size * 4
    return cfg.piecewise_graph_max_tokens * width * _elem(cfg) + (64 << 20)


def plan_num_pages(
    cfg: EngineConfig,
    mcfg: ModelConfig,
    num_kv_heads: int,
    max_context: int,
    graph_reserve: int = 0,
    extra_per_page: int = 0,
) -> int:
    """Pages of the KV pool (`extra_per_page`: bytes another pool of the same pages takes, a
    draft model's)."""
    per_page = extra_per_page + KVPool.bytes_per_page(
        mcfg.num_layers, cfg.page_size, num_kv_heads, mcfg.head_dim, cfg.kv_torch_dtype
    )
    # No point in more pages than every running request at full context could use.
    useful = cfg.max_running_requests * -(-max_context // cfg.page_size)
    device = cfg.torch_device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        reserve = activation_reserve_bytes(cfg, mcfg) + graph_reserve
        budget = int(total * cfg.mem_fraction) - used - reserve
    else:
        budget = int(cfg.cpu_kv_gib * (1 << 30))
    # One page of the pool is the engine's (CUDA-graph padding writes there).
    pages = min(useful, budget // per_page - 1)
    if pages < 1:
        raise ValueError(
            "not enough memory for a single KV page; lower max_prefill_tokens or "
            "max_running_requests, or raise mem_fraction"
        )
    return pages
