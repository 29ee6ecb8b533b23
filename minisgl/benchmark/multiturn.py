"""W10: multi-turn conversations with the KV host tier on against off, in one run.

N conversations run concurrently, each a closed loop of turns: a turn sends the whole history
(a system prompt of its own, then every user message and answer so far) plus a new user
message, and the next turn starts when its answer ends. The device pool is sized so that the
conversations' distinct tokens are about 3x what it holds: without a lower tier, a returning
turn finds its history evicted and computes it again.

python -m minisgl.benchmark.multiturn                       # CPU: SmolLM2, small conversations
python -m minisgl.benchmark.multiturn --gpu       # GPU: Llama-3-8B shape, dummy weights

Rows: off (radix cache alone), host (--kv-host-gib holding the whole working set), and disk (a
host tier of a third of it over a disk tier that takes the rest). Reported: throughput, TTFT
p50 of returning turns, bytes loaded, and the load bandwidth against a pinned host-to-device
copy of the same machine.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl import LLM
from minisgl.benchmark import common
from minisgl.benchmark.common import Row
from minisgl.core import Req, SamplingParams

GIB = 1 << 30


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    system: int  # tokens of each conversation's own system prompt
    user: int  # tokens of each user message
    answer: int  # tokens of each answer (ignore_eos)
    vocab: int = 10000

    @property
    def distinct_tokens(self) -> int:
        return self.conversations * (self.system + self.turns * (self.user + self.answer))


CPU = Workload(conversations=8, turns=3, system=96, user=32, answer=16)
GPU = Workload(conversations=64, turns=4, system=2048, user=256, answer=64)


@dataclass
class _Conv:
    history: list[int]
    turn: int = 0
    sent: float = 0.0
    req: Req | None = None


def drive(llm: LLM, w: Workload, seed: int = 0) -> dict[str, Any]:
    """Run every conversation's turns through the scheduler; per-turn TTFTs and totals."""
    rng = random.Random(seed)
    sched = llm.scheduler
    params = SamplingParams(max_tokens=w.answer, temperature=0, ignore_eos=True)
    convs = [
        _Conv([rng.randrange(w.vocab) for _ in range(w.system)]) for _ in range(w.conversations)
    ]
    ttft: dict[int, list[float]] = {}
    outputs = 0

    def send(c: _Conv, i: int) -> None:
        c.history += [rng.randrange(w.vocab) for _ in range(w.user)]
        c.req = Req(f"c{i}t{c.turn}", list(c.history), params, seed=0)
        c.sent = time.perf_counter()
        sched.add_request(c.req)

    start = time.perf_counter()
    for i, c in enumerate(convs):
        send(c, i)
    by_req = {id(c.req): (i, c) for i, c in enumerate(convs)}
    while sched.has_work:
        for ev in sched.step():
            i, c = by_req[id(ev.req)]
            if ev.new_tokens and len(ev.req.output_ids) == len(ev.new_tokens):
                ttft.setdefault(c.turn, []).append(time.perf_counter() - c.sent)
            if not ev.finished:
                continue
            outputs += len(ev.req.output_ids)
            c.history += ev.req.output_ids
            c.turn += 1
            del by_req[id(ev.req)]
            if c.turn < w.turns:
                send(c, i)
                by_req[id(c.req)] = (i, c)
    seconds = time.perf_counter() - start
    returning = [t for turn, ts in ttft.items() if turn > 0 for t in ts]
    return {
        "seconds": seconds,
        "output_tok_s": outputs / seconds,
        "turns_s": w.conversations * w.turns / seconds,
        "ttft_first_p50_ms": 1e3 * statistics.median(ttft[0]),
        "ttft_returning_p50_ms": 1e3 * statistics.median(returning),
        "computed_prompt_tokens": sched.stats["computed_prompt_tokens"],
    }


def pinned_h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of one large copy from pinned host memory to the device (the CPU: a memcpy),
    the best of five."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        common.synchronize(device)

    common.synchronize(device)
    return nbytes / common.best_time(copy, 5)[1]


def run(name: str, w: Workload, args: Any, **options: Any) -> Row:
    llm = common.make_llm(args, **options)
    row = {"tier": name, **drive(llm, w)}
    stats = llm.scheduler.tier_stats()
    if stats:
        assert llm.engine.tier is not None
        stats = {**stats, **vars(llm.engine.tier.collect(block=True))}
        row |= {"loaded_gb": stats["loaded_bytes"] / 1e9, "saved_gb": stats["saved_bytes"] / 1e9,
                "disk_read_gb": stats["fetched_bytes"] / 1e9,
                "load_gb_s": stats["loaded_bytes"] / max(stats["load_copy_s"], 1e-9) / 1e9,
                **{k: stats[k] for k in ("wait_s", "host_hit_pages", "disk_hit_pages")}}  # fmt: skip
    del llm
    common.release_memory()
    return row


def main(argv: Sequence[str] | None = None) -> None:
    p = common.engine_parser(__doc__)
    p.add_argument("--gpu", action="store_true", help="the GPU variant (Llama-3-8B shape)")
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--turns", type=int, default=None)
    p.add_argument("--pool-share", type=float, default=1 / 3, help="device pool / distinct tokens")
    p.add_argument("--no-disk", action="store_true", help="skip the disk row")
    args = p.parse_args(argv)
    w = GPU if args.gpu else CPU
    w = dataclasses.replace(w, conversations=args.conversations or w.conversations,
                            turns=args.turns or w.turns)  # fmt: skip
    if args.gpu and args.model is None:  # the shape directory has no weights
        args.model, args.load_format = str(Path(__file__).parent / "models" / "llama-3-8b"), "dummy"
    # The pool holds `pool_share` of the distinct tokens (plus one answer's room per turn).
    probe = common.make_llm(args, num_pages=64, skip_warmup=True, cuda_graph_max_bs=0)
    ps, page_bytes, device = (
        probe.engine.page_size,
        probe.engine.pool.page_bytes,
        probe.engine.device,
    )
    del probe
    common.release_memory()
    pages = int(w.distinct_tokens * args.pool_share) // ps + 1
    working_gib = (w.distinct_tokens // ps + w.conversations) * page_bytes / GIB
    variants: list[tuple[str, Row]] = [
        ("off", {}),
        ("host", {"kv_host_gib": 1.25 * working_gib}),
    ]
    disk_dir = tempfile.TemporaryDirectory(prefix="minisgl-kv-")
    if not args.no_disk:  # a host tier of a third of the working set over a disk tier
        variants.append(("disk", {"kv_host_gib": working_gib / 3, "kv_disk_dir": disk_dir.name,
                                  "kv_disk_gib": 1.25 * working_gib}))  # fmt: skip
    rows = [run(name, w, args, num_pages=pages, page_size=ps, **extra) for name, extra in variants]
    disk_dir.cleanup()
    h2d = pinned_h2d_bandwidth(device)
    for r in rows:
        r["speedup"] = r["turns_s"] / rows[0]["turns_s"]
        r["ttft_ratio"] = r["ttft_returning_p50_ms"] / rows[0]["ttft_returning_p50_ms"]
        if "load_gb_s" in r:
            r["load_of_pinned"] = r["load_gb_s"] * 1e9 / h2d
    title = (
        f"W10 multi-turn: {w.conversations} conversations x {w.turns} turns (system {w.system}, "
        f"user {w.user}, answer {w.answer}); {w.distinct_tokens} distinct tokens, device pool "
        f"{pages * ps} tokens; pinned H2D {h2d / 1e9:.1f} GB/s"
    )
    cols = ["tier", "seconds", "turns_s", "output_tok_s", "speedup", "ttft_first_p50_ms",
            "ttft_returning_p50_ms", "ttft_ratio", "computed_prompt_tokens", "loaded_gb",
            "disk_read_gb", "load_gb_s", "load_of_pinned", "wait_s"]  # fmt: skip
    common.print_table(title, rows, cols)
    common.emit_json({"workload": "W10", **common.device_info(device), "pool_tokens": pages * ps,
               "distinct_tokens": w.distinct_tokens, "pinned_h2d_gb_s": h2d / 1e9, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
