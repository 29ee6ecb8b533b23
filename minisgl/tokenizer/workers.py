"""The tokenizer and detokenizer worker processes (spawned by the server's launcher)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from minisgl.core import InvalidRequestError
from minisgl.message import (
    AbortReq,
    DetokOut,
    EngineInfo,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    SchedulerOut,
    StrOut,
)
from minisgl.message.child import ChildReady, run_child
from minisgl.message.transport import IpcPaths, Receiver, Sender, worker_context
from minisgl.tokenizer.detokenizer import Detokenizer
from minisgl.tokenizer.loading import load_and_save, load_saved
from minisgl.tokenizer.tokenize import RequestTokenizer

logger = logging.getLogger(__name__)


class TokenizerWorker:
    """Requests from the API become tokenized requests for the scheduler; aborts follow them
    down the same pipe, so an abort never overtakes its request."""

    def __init__(
        self, tokenizer: RequestTokenizer, inbox: Receiver, scheduler: Sender, api: Sender
    ) -> None:
        self.tokenizer = tokenizer
        self.inbox = inbox
        self.scheduler = scheduler
        self.api = api

    def handle(self, msg: Any) -> None:
        if isinstance(msg, (AbortReq, FlushCacheReq)):
            self.scheduler.send(msg)
        elif isinstance(msg, GenerateReq):
            self._generate(msg)
        else:
            raise TypeError(f"tokenizer: unexpected message {type(msg).__name__}")

    def _generate(self, req: GenerateReq) -> None:
        try:
            reqs = self.tokenizer.tokenize(req)
        except InvalidRequestError as e:
            field = str(e).split(":", 1)[0]
            self.api.send(RequestError(req.rids, str(e), field, status=400))
            return
        except Exception as e:  # a bug of ours must not take the worker down with it
            logger.exception("tokenizer failed on request %s", req.rids[0])
            self.api.send(RequestError(req.rids, f"tokenizer failed: {e}", None, status=500))
            return
        for r in reqs:
            self.scheduler.send(r)

    def run_forever(self) -> None:
        while True:
            self.handle(self.inbox.recv())


class DetokenizerWorker:
    def __init__(
        self, detokenizer: Detokenizer, inbox: Receiver, scheduler: Sender, api: Sender
    ) -> None:
        self.detokenizer = detokenizer
        self.inbox = inbox
        self.scheduler = scheduler
        self.api = api

    def handle(self, msg: SchedulerOut | FlushCacheOut) -> None:
        if isinstance(msg, FlushCacheOut):  # for the API server, in order with the outputs
            self.api.send(msg)
            return
        outputs: list[StrOut] = []
        for out in msg.outputs:
            text_out, abort = self.detokenizer.process(out)
            if abort:  # stop computing an answer that already ended at a stop string
                self.scheduler.send(AbortReq(out.rid))
            if text_out is not None:
                outputs.append(text_out)
        self.api.send(DetokOut(outputs, msg.stats))

    def run_forever(self) -> None:
        while True:
            self.handle(self.inbox.recv())


def _start_tokenizer(
    model: str | None, tokenizer_dir: Path, ipc: IpcPaths, conn: Connection
) -> Callable[[], None]:
    tokenizer = load_and_save(model, tokenizer_dir)
    conn.send(ChildReady(str(tokenizer_dir)))  # the detokenizer can start loading now
    info = conn.recv()  # the launcher passes on the scheduler's limits
    assert isinstance(info, EngineInfo)
    ctx = worker_context()
    worker = TokenizerWorker(
        RequestTokenizer(tokenizer, info),
        Receiver(ctx, ipc.tokenizer),
        Sender(ctx, ipc.scheduler),
        Sender(ctx, ipc.api),
    )
    conn.send(ChildReady())
    return worker.run_forever


def _start_detokenizer(tokenizer_dir: Path, ipc: IpcPaths, conn: Connection) -> Callable[[], None]:
    ctx = worker_context()
    worker = DetokenizerWorker(
        Detokenizer(load_saved(tokenizer_dir)),
        Receiver(ctx, ipc.detokenizer),
        Sender(ctx, ipc.scheduler),
        Sender(ctx, ipc.api),
    )
    conn.send(ChildReady())
    return worker.run_forever


def tokenizer_main(
    model: str | None,
    tokenizer_dir: Path,
    ipc: IpcPaths,
    conn: Connection,
    parent_pid: int,
    log_level: str,
) -> None:
    run_child(
        "tokenizer",
        conn,
        parent_pid,
        log_level,
        lambda c: _start_tokenizer(model, tokenizer_dir, ipc, c),
    )


def detokenizer_main(
    tokenizer_dir: Path, ipc: IpcPaths, conn: Connection, parent_pid: int, log_level: str
) -> None:
    run_child(
        "detokenizer",
        conn,
        parent_pid,
        log_level,
        lambda c: _start_detokenizer(tokenizer_dir, ipc, c),
    )
