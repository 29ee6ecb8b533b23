"""The loops of the tokenizer and detokenizer worker processes (started by `minisgl.runtime`)."""

from __future__ import annotations

import logging
from typing import Any

from minisgl.core import InvalidRequestError
from minisgl.message import (
    AbortReq,
    DetokOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    SchedulerOut,
    StrOut,
)
from minisgl.message.transport import Receiver, Sender
from minisgl.tokenizer.detokenizer import Detokenizer
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
