"""The tokenizer worker between real sockets: long prompts tokenize in threads without holding
up short ones, an abort never lets its request reach the scheduler after it, and a request's
grammar is checked before it is sent on: a bad one is answered with a 400 that never reaches
the scheduler, a slow check holds up no other request."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from minisgl.constrain import GrammarCompiler
from minisgl.core import SamplingParams
from minisgl.message import (
    AbortReq,
    EngineInfo,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    TokenizedReq,
)
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
    api: Receiver
    gated: GatedTokenizer
    grammar_gate: threading.Event  # every grammar check waits for it


@pytest.fixture
def pipes(tmp_path: Path, tokenizer: Any) -> Iterator[Pipes]:
    ipc = IpcPaths.in_dir(tmp_path)
    ctx = zmq.Context()
    gated = GatedTokenizer(tokenizer)
    grammar_gate = threading.Event()

    class GatedCompiler(GrammarCompiler):
        def check(self, constraint: Any) -> str:
            assert grammar_gate.wait(60), "the test never opened the grammar gate"
            return super().check(constraint)

    worker = TokenizerWorker(
        RequestTokenizer(gated, INFO),
        Receiver(ctx, ipc.tokenizer),
        Sender(ctx, ipc.scheduler),
        Sender(ctx, ipc.api),
        grammars=GatedCompiler(lambda: tokenizer, INFO.vocab_size),
    )
    scheduler = Receiver(ctx, ipc.scheduler)
    api = Receiver(ctx, ipc.api)
    to_worker = Sender(ctx, ipc.tokenizer)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            worker.step()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield Pipes(to_worker, scheduler, api, gated, grammar_gate)
    finally:
        gated.gate.set()
        grammar_gate.set()
        stop.set()
        to_worker.send(FlushCacheReq(0))  # wakes the loop so that it sees `stop`
        thread.join(10)
        ctx.destroy(linger=0)


def req(rids: list[str], text: str, field: str | None = None, **grammar: str) -> GenerateReq:
    params = SamplingParams(**grammar)
    return GenerateReq(rids, [0] * len(rids), params, 4, text=text, grammar_field=field)


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


def test_a_slow_grammar_check_holds_up_no_other_request(pipes: Pipes) -> None:
    pipes.to_worker.send(req(["date"], "Hi", regex=r"\d{4}-\d{2}-\d{2}"))
    pipes.to_worker.send(req(["plain"], "Hi"))
    assert pipes.scheduler.recv().rid == "plain"  # while the grammar is still checked
    pipes.grammar_gate.set()
    constrained = pipes.scheduler.recv()
    assert constrained.rid == "date" and constrained.params.regex == r"\d{4}-\d{2}-\d{2}"


def test_a_bad_grammar_is_a_400_that_never_reaches_the_scheduler(pipes: Pipes) -> None:
    pipes.grammar_gate.set()
    pipes.to_worker.send(req(["r0", "r1"], "Hi", regex="([a-z"))
    schema = '{"type": "object", "properties": {"a": {"not": {"type": "string"}}}}'
    pipes.to_worker.send(req(["s"], "Hi", "response_format.json_schema.schema", json_schema=schema))
    pipes.to_worker.send(req(["ok"], "Hi", regex="[a-z]+"))
    errors = {e.rids[0]: e for e in (pipes.api.recv(), pipes.api.recv())}
    bad_regex, bad_schema = errors["r0"], errors["s"]
    assert isinstance(bad_regex, RequestError) and bad_regex.rids == ["r0", "r1"]
    assert bad_regex.status == 400 and bad_regex.param == "regex"
    assert bad_regex.message.startswith("regex: ") and "Unclosed" in bad_regex.message
    assert bad_schema.status == 400 and bad_schema.param == "response_format.json_schema.schema"
    assert bad_schema.message == (
        "response_format.json_schema.schema: at /properties/a: `not` is not enforced; remove it"
    )
    assert pipes.scheduler.recv().rid == "ok"  # the only one the scheduler ever sees
    pipes.to_worker.send(FlushCacheReq(3))
    assert pipes.scheduler.recv() == FlushCacheReq(3)
