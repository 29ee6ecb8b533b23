"""The tokenizer worker between real sockets: long prompts tokenize in threads without holding
up short ones, and an abort never lets its request reach the scheduler after it."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from minisgl.core import SamplingParams
from minisgl.message import AbortReq, EngineInfo, FlushCacheReq, GenerateReq, TokenizedReq
from minisgl.message.transport import IpcPaths, Receiver, Sender
from minisgl.tokenizer.tokenize import RequestTokenizer
from minisgl.tokenizer.workers import INLINE_CHARS, TokenizerWorker

INFO = EngineInfo("m", max_context=8192, num_pages=100_000, page_size=1, vocab_size=49152)
LONG = "hello world " * (INLINE_CHARS // 6)  # past INLINE_CHARS: tokenized in a thread


class GatedTokenizer:
    """The real tokenizer, except that long texts wait for the test to open the gate (so the
    test decides when a long tokenization ends)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.gate = threading.Event()
        self.long_started = threading.Event()

    def __call__(self, text: str, **kw: Any) -> Any:
        if len(text) > INLINE_CHARS:
            self.long_started.set()
            assert self.gate.wait(60), "the test never opened the gate"
        return self.tokenizer(text, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


@dataclass
class Pipes:
    to_worker: Sender
    scheduler: Receiver
    gated: GatedTokenizer


@pytest.fixture
def pipes(tmp_path: Path, tokenizer: Any) -> Iterator[Pipes]:
    ipc = IpcPaths.in_dir(tmp_path)
    ctx = zmq.Context()
    gated = GatedTokenizer(tokenizer)
    worker = TokenizerWorker(
        RequestTokenizer(gated, INFO),
        Receiver(ctx, ipc.tokenizer),
        Sender(ctx, ipc.scheduler),
        Sender(ctx, ipc.api),
    )
    scheduler = Receiver(ctx, ipc.scheduler)
    to_worker = Sender(ctx, ipc.tokenizer)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            worker.step()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield Pipes(to_worker, scheduler, gated)
    finally:
        gated.gate.set()
        stop.set()
        to_worker.send(FlushCacheReq(0))  # wakes the loop so that it sees `stop`
        thread.join(10)
        ctx.destroy(linger=0)


def req(rids: list[str], text: str) -> GenerateReq:
    return GenerateReq(rids, [0] * len(rids), SamplingParams(), 4, text=text)


def test_a_short_prompt_overtakes_a_long_one(pipes: Pipes, tokenizer: Any) -> None:
    pipes.to_worker.send(req(["long"], LONG))
    assert pipes.gated.long_started.wait(30)
    pipes.to_worker.send(req(["short"], "Hi"))
    first = pipes.scheduler.recv()  # while the long prompt still tokenizes
    assert isinstance(first, TokenizedReq) and first.rid == "short"
    assert first.input_ids == tokenizer("Hi")["input_ids"]
    pipes.gated.gate.set()
    second = pipes.scheduler.recv()
    assert second.rid == "long" and second.input_ids == tokenizer(LONG)["input_ids"]


def test_an_abort_never_lets_its_choice_reach_the_scheduler(pipes: Pipes) -> None:
    pipes.to_worker.send(req(["a0", "a1"], LONG))
    assert pipes.gated.long_started.wait(30)
    pipes.to_worker.send(AbortReq("a0"))  # its request is still tokenizing
    pipes.to_worker.send(req(["s"], "Hi"))
    pipes.to_worker.send(AbortReq("s"))  # its request went on: the abort follows it
    assert pipes.scheduler.recv().rid == "s"
    assert pipes.scheduler.recv() == AbortReq("s")
    pipes.gated.gate.set()
    assert pipes.scheduler.recv().rid == "a1"  # a0 was dropped, with no abort to follow
    pipes.to_worker.send(FlushCacheReq(7))
    assert pipes.scheduler.recv() == FlushCacheReq(7)  # nothing else came before it
