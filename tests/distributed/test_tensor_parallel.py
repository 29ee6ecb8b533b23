"""Tensor parallelism on the CPU (gloo): tp=2 and tp=4 give tp=1's log-probs and greedy tokens,
on tiny models whose KV heads are fewer than the ranks and whose vocab does not divide by them;
also over two "nodes", with dummy weights, and when a rank dies."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import random_prompts, randomize, tiny_hf_config

from minisgl import LLM, SamplingParams
from minisgl.config import EngineConfig
from minisgl.core import Req
from minisgl.distributed import RankFailedError

VOCAB = 385  # divides by neither 2 nor 4: the last vocab shard is padded
ATOL = 1e-5  # fp32: tp changes only the order of the sums
# A small pool: every rank allocates one, and the CPU's default is 2 GiB.
OPTS: dict[str, Any] = {"num_pages": 2048, "max_running_requests": 16}
GREEDY = SamplingParams(
    temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=20
)


def save_model(arch: str, path: Path) -> Path:
    """A tiny random HF model: 4 query heads, 2 KV heads (replicated at tp=4)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, vocab=VOCAB))
    randomize(model, seed=1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {a: save_model(a, tmp_path_factory.mktemp(a)) for a in ("llama3", "qwen3")}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(4, VOCAB, seed=5, lo=3, hi=30)


def generate(model: Path | str, prompts: list[list[int]], **options: Any) -> list[dict[str, Any]]:
    with LLM(str(model), **OPTS, **options) as llm:
        return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(models: dict[str, Path], prompts: list[list[int]]) -> dict[str, list[dict]]:
    """tp=1 outputs per architecture."""
    return {arch: generate(path, prompts) for arch, path in models.items()}


def assert_same_outputs(ref: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    """Identical greedy tokens; every step's top-20 log-probs within ATOL of the reference."""
    for r, o in zip(ref, out):
        assert o["token_ids"] == r["token_ids"]
        assert max(abs(a - b) for a, b in zip(r["logprobs"], o["logprobs"])) <= ATOL
        for top_r, top_o in zip(r["top_logprobs"], o["top_logprobs"]):
            # Compare by token id: two nearly equal log-probs may swap places.
            ref_lp, out_lp = dict(top_r), dict(top_o)
            shared = ref_lp.keys() & out_lp.keys()
            assert len(shared) >= 19
            assert max(abs(ref_lp[t] - out_lp[t]) for t in shared) <= ATOL


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_tp_matches_tp1(
    arch: str,
    tp: int,
    models: dict[str, Path],
    prompts: list[list[int]],
    reference: dict[str, list[dict]],
) -> None:
    assert_same_outputs(reference[arch], generate(models[arch], prompts, tp_size=tp))
    assert rank_processes() == []  # closing the LLM stopped its ranks


def test_dummy_weights_same_at_tp2(models: dict[str, Path], prompts: list[list[int]]) -> None:
    ref = generate(models["llama3"], prompts, load_format="dummy", seed=3)
    assert_same_outputs(
        ref, generate(models["llama3"], prompts, load_format="dummy", seed=3, tp_size=2)
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_nodes(
    models: dict[str, Path], prompts: list[list[int]], reference: dict[str, list[dict]]
) -> None:
    """Rank 0 here (node 0); node 1 is a separate launcher holding rank 1, met over TCP."""
    addr = f"127.0.0.1:{_free_port()}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "minisgl.runtime.ranks", "--dist-init-addr", addr]
        + ["--node-rank", "1", "--nnodes", "2"]
    )
    try:
        out = generate(models["llama3"], prompts, tp_size=2, nnodes=2, dist_init_addr=addr)
        assert node1.wait(timeout=30) == 0  # closing rank 0 stops the other node
    finally:
        node1.kill()
    assert_same_outputs(reference["llama3"], out)


# The llama3 model's KV per token and rank at tp=2, by hand: K and V, 2 layers, 1 of the 2 KV
# heads, head_dim 64 / 4 = 16, fp32.
KV_BYTES_PER_PAGE = 2 * 2 * 1 * 16 * 4  # page_size 1 (the CPU's default)


def kv_gib(pages: int) -> float:
    """A CPU KV budget that holds `pages` pages besides the engine's own padding page."""
    return (pages + 1) * KV_BYTES_PER_PAGE / (1 << 30)


@pytest.mark.slow
@pytest.mark.parametrize(("rank0_pages", "rank1_pages"), [(3000, 120), (120, 3000)])
def test_ranks_agree_on_the_smallest_pool(
    models: dict[str, Path],
    rank0_pages: int,
    rank1_pages: int,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Node 1 gives its rank a different KV budget than node 0 gives rank 0 (`--cpu-kv-gib`):
    both ranks build the smaller pool before allocating, and a workload that queues and retracts
    in it gives tp=1's greedy tokens without a hang."""
    small = min(rank0_pages, rank1_pages)
    prompts = random_prompts(8, VOCAB, seed=9, lo=15, hi=25)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(models["llama3"]), max_running_requests=16, num_pages=small) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.stats["retractions"] > 0  # the small pool is under pressure

    addr = f"127.0.0.1:{_free_port()}"
    log = tmp_path / "node1.log"
    with open(log, "wb") as out:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "minisgl.runtime.ranks", "--dist-init-addr", addr]
            + ["--node-rank", "1", "--nnodes", "2", "--cpu-kv-gib", str(kv_gib(rank1_pages))],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        opts = {"max_running_requests": 16, "cpu_kv_gib": kv_gib(rank0_pages)}
        with caplog.at_level("INFO", logger="minisgl.engine.engine"):
            llm = LLM(str(models["llama3"]), tp_size=2, nnodes=2, dist_init_addr=addr, **opts)
        with llm:
            assert llm.engine.config.num_pages == small
            assert llm.scheduler.num_pages == small
            out = llm.generate(prompts, params, use_tqdm=False)
        assert node1.wait(timeout=30) == 0
    finally:
        node1.kill()
    assert [o["token_ids"] for o in out] == [r["token_ids"] for r in ref]
    said = {
        "rank 0": caplog.text,
        "rank 1": "\n".join(line for line in log.read_text().splitlines() if " tp1 " in line),
    }
    for rank, own in (("rank 0", rank0_pages), ("rank 1", rank1_pages)):
        pool = re.findall(r"KV pool: (\d+) pages of 1 tokens \(the ranks' minimum; "
                          r"this rank's budget holds (\d+)\)", said[rank])  # fmt: skip
        assert pool == [(str(small), str(own))], said[rank][-2000:]


def test_dead_rank_raises(models: dict[str, Path], prompts: list[list[int]]) -> None:
    with LLM(str(models["llama3"]), tp_size=2, **OPTS) as llm:
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        worker = llm._tp.procs[1]  # type: ignore[union-attr]
        assert rank_processes() == [worker.pid]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 .*exit code -9"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 5
        with pytest.raises(RankFailedError):  # and it stays broken, without hanging
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert rank_processes() == []


def drive(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """More requests than the pool holds (retractions), one aborted mid-way and two added
    late: rank 0's adds and aborts must reach every rank at the same step."""
    sched = llm.scheduler
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [Req(f"r{i}", p, params, seed=i) for i, p in enumerate(prompts)]
    for r in reqs[:4]:
        sched.add_request(r)
    steps = 0
    while sched.has_work:
        sched.step()
        steps += 1
        if steps == 3:
            sched.abort("r1")
        if steps == 5:
            for r in reqs[4:]:
                sched.add_request(r)
    return [r.output_ids for r in reqs], sched.stats["retractions"]


def test_aborts_and_retractions_stay_in_step(models: dict[str, Path]) -> None:
    prompts = random_prompts(6, VOCAB, seed=9, lo=15, hi=25)
    opts = {**OPTS, "num_pages": 96}
    with LLM(str(models["llama3"]), **opts) as llm:
        ref, retractions = drive(llm, prompts)
    assert retractions > 0 and len(ref[1]) < 24
    with LLM(str(models["llama3"]), tp_size=2, **opts) as llm:
        assert drive(llm, prompts) == (ref, retractions)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tp_size": 4, "nnodes": 3}, "nnodes: 3 nodes cannot hold tp_size 4"),
        ({"tp_size": 2, "nnodes": 2}, "dist_init_addr: several nodes need"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2}, "node_rank: must be in"),
        ({"tp_size": 2, "dist_init_addr": "localhost"}, "expected host:port"),
    ],
)
def test_bad_distributed_options(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_rank0_must_run_on_node0(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="node_rank: rank 0 runs on node 0"):
        LLM(str(models["llama3"]), tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")


def rank_processes() -> list[int]:
    """Live tensor-parallel ranks started by this process."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # not a process, or it just went
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"--rank" in cmdline:
            pids.append(int(entry.name))
    return pids


def test_heads_that_do_not_divide(models: dict[str, Path]) -> None:
    """Every rank refuses the model; rank 0 says why and leaves no process behind."""
    with pytest.raises(ValueError, match="4 attention heads do not divide by tp size 3"):
        LLM(str(models["llama3"]), tp_size=3, **OPTS)
    assert rank_processes() == []


def test_priorities_and_the_latency_target_stay_in_step(models: dict[str, Path]) -> None:
    # Every rank plans by rank 0's step-time model and arrival times: the budget and the
    # queue's order are the same everywhere, or the ranks' batches would differ.
    prompts = random_prompts(6, VOCAB, seed=10, lo=15, hi=40)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, priority=i % 3)
        for i in range(len(prompts))
    ]
    opts = {**OPTS, "num_pages": 96, "schedule_policy": "priority", "itl_target_ms": "auto"}
    with LLM(str(models["llama3"]), **opts) as llm:
        ref = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(str(models["llama3"]), tp_size=2, **opts) as llm:
        out = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.scheduler.step_model.ready
    assert out == ref and all(len(t) == 12 for t in out)


@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_speculation_at_tp2_gives_the_tp1_answers(
    algo: str, models: dict[str, Path], prompts: list[list[int]]
) -> None:
    """Every rank proposes the same drafts (the n-gram proposer reads the same host tokens, the
    layer-skip draft runs the same sharded layers) and accepts the same tokens."""
    looping = [p * 3 for p in prompts]  # the prompts repeat themselves: n-gram matches
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=True)
    with LLM(str(models["qwen3"]), **OPTS) as llm:
        ref = llm.generate(looping, params, use_tqdm=False)
    options = dict(tp_size=2, speculative_algorithm=algo, speculative_draft_layers=1)
    options["speculative_ngram_min_n"] = 2  # the random model's outputs repeat pairs soonest
    with LLM(str(models["qwen3"]), **OPTS, **options) as llm:
        out = llm.generate(looping, params, use_tqdm=False)
        assert llm.scheduler.spec is not None
        stats = llm.scheduler.spec.stats
    for r, o in zip(ref, out, strict=True):
        assert o["token_ids"] == r["token_ids"]
        assert max(abs(a - b) for a, b in zip(r["logprobs"], o["logprobs"])) <= ATOL
    assert stats.verify_rows > 0 and (algo == "draft" or stats.accepted > 0), stats
