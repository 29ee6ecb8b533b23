"""How many KV pages fit: from free device memory on CUDA, from a fixed budget on the CPU."""

from __future__ import annotations

import torch

from minisgl.config import EngineConfig, ModelConfig
from minisgl.kvcache import KVPool


def activation_reserve_bytes(cfg: EngineConfig, mcfg: ModelConfig) -> int:
    """Peak activation memory of one step, generously: a prefill of max_prefill_tokens."""
    elem = torch.empty((), dtype=cfg.torch_dtype).element_size()
    tokens = cfg.max_prefill_tokens + cfg.max_running_requests
    width = mcfg.hidden_size * 4 + mcfg.intermediate_size * 3 + mcfg.q_size * 3
    logits = cfg.max_running_requests * mcfg.vocab_size * 4 * 6  # fp32 sampling temporaries
    return tokens * width * elem + logits + (512 << 20)


def plan_num_pages(
    cfg: EngineConfig, mcfg: ModelConfig, num_kv_heads: int, max_context: int
) -> int:
    per_page = KVPool.bytes_per_page(
        mcfg.num_layers, cfg.page_size, num_kv_heads, mcfg.head_dim, cfg.torch_dtype
    )
    # No point in more pages than every running request at full context could use.
    useful = cfg.max_running_requests * -(-max_context // cfg.page_size)
    device = cfg.torch_device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cfg.mem_fraction) - used - activation_reserve_bytes(cfg, mcfg)
    else:
        budget = int(cfg.cpu_kv_gib * (1 << 30))
    pages = min(useful, budget // per_page)
    if pages < 1:
        raise ValueError(
            "not enough memory for a single KV page; lower max_prefill_tokens or "
            "max_running_requests, or raise mem_fraction"
        )
    return pages
