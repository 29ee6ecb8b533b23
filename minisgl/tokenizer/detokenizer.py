"""The detokenizer's bookkeeping: scheduler token outputs in, text outputs for the API out."""

from __future__ import annotations

from typing import Any

from minisgl.core import FinishReason
from minisgl.message import StrOut, TokenLogprob, TokenOut, TopLogprob
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, StopMatcher


class _RequestText:
    def __init__(self, tokenizer: Any, first: TokenOut) -> None:
        self.decoder = IncrementalDetokenizer(tokenizer, first.skip_special_tokens)
        self.stops = StopMatcher(first.stop)
        self.completion_tokens = 0
        # A stop string matched; the scheduler's own final output is still to come.
        self.stopped = False


class Detokenizer:
    """Keeps one `_RequestText` per live request id.

    `process` returns the text output for the API (None when there is nothing to tell) and
    whether the scheduler must be told to abort the request (a stop string matched).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestText] = {}
        self._token_text: dict[int, str] = {}

    def process(self, out: TokenOut) -> tuple[StrOut | None, bool]:
        state = self.states.get(out.rid)
        if state is None:
            state = self.states[out.rid] = _RequestText(self.tokenizer, out)
        if out.finished:
            del self.states[out.rid]
        if state.stopped:  # the answer already ended at its stop string
            return None, False
        text_ids = out.new_ids
        if out.finish_reason == FinishReason.STOP.value and text_ids:
            # The scheduler stops on an EOS or stop token; its text is not part of the answer.
            text_ids = text_ids[:-1]
        text = state.decoder.add(text_ids)
        if out.finished:
            text += state.decoder.flush()
        text, matched = state.stops.feed(text)
        if out.finished and not matched:
            text += state.stops.flush()
        state.completion_tokens += len(out.new_ids)
        reason = out.finish_reason
        if matched:
            state.stopped = True
            reason = FinishReason.STOP.value
        abort = matched and not out.finished
        return self._str_out(out, text, matched or out.finished, reason, state), abort

    def _str_out(
        self, out: TokenOut, text: str, finished: bool, reason: str | None, state: _RequestText
    ) -> StrOut:
        return StrOut(
            rid=out.rid,
            text=text,
            new_ids=out.new_ids,
            finished=finished,
            finish_reason=reason if finished else None,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=state.completion_tokens,
            logprobs=self._logprobs(out),
            error=out.error,
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, out: TokenOut) -> list[TokenLogprob]:
        if not out.logprobs:
            return []
        tops = out.top_ids or [[] for _ in out.new_ids]
        top_lps = out.top_logprobs or [[] for _ in out.new_ids]
        return [
            TokenLogprob(
                self.token_text(tid),
                tid,
                lp,
                [TopLogprob(self.token_text(t), v) for t, v in zip(ids, lps, strict=True)],
            )
            for tid, lp, ids, lps in zip(out.new_ids, out.logprobs, tops, top_lps, strict=True)
        ]
