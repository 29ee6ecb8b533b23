"""How the server's worker processes start (spawned by `minisgl.runtime.launch`, through
`run_child`): each loads what it serves, tells the launcher it is ready over its pipe, and
returns its loop.

The loops themselves are their packages': `SchedulerProcess` (scheduler), `TokenizerWorker` and
`DetokenizerWorker` (tokenizer).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

from minisgl.config import ChatConfig, EngineConfig
from minisgl.engine.startup import summarize
from minisgl.message import EngineInfo
from minisgl.message.transport import ApiSenders, IpcPaths, Receiver, Sender, worker_context
from minisgl.runtime.child import ChildReady
from minisgl.runtime.ranks import start_scheduler
from minisgl.scheduler.process import SchedulerProcess
from minisgl.tokenizer.parsers import detect_tool_call_parser
from minisgl.tokenizer.tokenize import RequestTokenizer, load_and_save, load_saved, max_token_chars
from minisgl.tokenizer.workers import Detokenizer, DetokenizerWorker, TokenizerWorker
from minisgl.weights import resolve_source

logger = logging.getLogger(__name__)


# ---- scheduler ---------------------------------------------------------------------------------


def start_scheduler_process(
    config: EngineConfig, ipc: IpcPaths, conn: Connection
) -> Callable[[], None]:
    """At tp > 1 this process is rank 0: it starts ranks 1..N-1, which stop when it exits."""
    started = time.perf_counter()
    scheduler, tp = start_scheduler(config)
    if tp is not None:
        tp.watch(_exit_on_rank_failure)
    ctx = worker_context()
    proc = SchedulerProcess(scheduler, Receiver(ctx, ipc.scheduler), Sender(ctx, ipc.detokenizer))
    name = resolve_source(config.model).name
    info = EngineInfo(
        model_name=name,
        max_context=scheduler.max_context,
        num_pages=scheduler.num_pages,
        page_size=scheduler.page_size,
        vocab_size=scheduler.engine.model_config.vocab_size,
    )
    conn.send(ChildReady(info))
    logger.info("%s", summarize(scheduler.engine, name, started).text())
    return proc.run_forever


def _exit_on_rank_failure(reason: str) -> None:
    # The engine cannot go on without a rank; the launcher sees this process exit.
    logger.critical("%s", reason)
    os._exit(1)


# ---- tokenizer and detokenizer -----------------------------------------------------------------


def start_tokenizer(
    model: str | None, tokenizer_dir: Path, ipc: IpcPaths, chat: ChatConfig, conn: Connection
) -> Callable[[], None]:
    tokenizer = load_and_save(model, tokenizer_dir, chat.template)
    conn.send(ChildReady(str(tokenizer_dir)))  # the detokenizer can start loading now
    info = conn.recv()  # the launcher passes on the scheduler's limits
    assert isinstance(info, EngineInfo)
    ctx = worker_context()
    worker = TokenizerWorker(
        RequestTokenizer(tokenizer, info),
        Receiver(ctx, ipc.tokenizer),
        Sender(ctx, ipc.scheduler),
        ApiSenders(ctx, ipc),  # type: ignore[arg-type]  # `send` alike
    )
    # The API server refuses prompts longer than the context by their characters, before they
    # are sent to be tokenized.
    parser = chat.tool_call_parser or detect_tool_call_parser(tokenizer.chat_template)
    info = replace(info, max_token_chars=max_token_chars(tokenizer), tool_call_parser=parser)
    conn.send(ChildReady(info))
    return worker.run_forever


def start_detokenizer(tokenizer_dir: Path, ipc: IpcPaths, conn: Connection) -> Callable[[], None]:
    ctx = worker_context()
    worker = DetokenizerWorker(
        Detokenizer(load_saved(tokenizer_dir)),
        Receiver(ctx, ipc.detokenizer),
        Sender(ctx, ipc.scheduler),
        ApiSenders(ctx, ipc),  # type: ignore[arg-type]  # `send` alike
    )
    conn.send(ChildReady())
    return worker.run_forever
