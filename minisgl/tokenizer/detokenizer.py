"""The detokenizer's bookkeeping: scheduler token outputs in, text outputs for the API out."""

from __future__ import annotations

from typing import Any

from minisgl.message import StrOut, TokenLogprob, TokenOut, TopLogprob
from minisgl.tokenizer.output import OutputDelta, OutputOptions, RequestOutput


class Detokenizer:
    """Keeps one `RequestOutput` (the output pipeline) per live request id.

    `process` returns the text output for the API (None when there is nothing to tell) and
    whether the scheduler must be told to abort the request (a stop string matched).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestOutput] = {}
        self._token_text: dict[int, str] = {}

    def process(self, out: TokenOut) -> tuple[StrOut | None, bool]:
        state = self.states.get(out.rid)
        if state is None:
            state = self.states[out.rid] = RequestOutput(self.tokenizer, _options(out))
        if out.finished:  # the scheduler's last word on it (the pipeline may have ended sooner)
            del self.states[out.rid]
        delta = state.add(
            out.new_ids,
            out.finished,
            out.finish_reason,
            out.logprobs,
            out.top_ids,
            out.top_logprobs,
        )
        if delta is None:  # the answer already ended at its stop string
            return None, False
        return self._str_out(out, delta), delta.abort

    def _str_out(self, out: TokenOut, delta: OutputDelta) -> StrOut:
        return StrOut(
            rid=out.rid,
            text=delta.text,
            new_ids=delta.token_ids,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=delta.completion_tokens,
            logprobs=self._logprobs(delta),
            error=out.error,
            matched_stop=delta.matched_stop,
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _logprobs(self, delta: OutputDelta) -> list[TokenLogprob]:
        if not delta.logprobs:
            return []
        ids = delta.token_ids
        tops = delta.top_ids or [[] for _ in ids]
        top_lps = delta.top_logprobs or [[] for _ in ids]
        return [
            TokenLogprob(
                self.token_text(tid),
                tid,
                lp,
                [TopLogprob(self.token_text(t), v) for t, v in zip(tids, lps, strict=True)],
            )
            for tid, lp, tids, lps in zip(ids, delta.logprobs, tops, top_lps, strict=True)
        ]


def _options(out: TokenOut) -> OutputOptions:
    return OutputOptions(
        tuple(out.stop), out.skip_special_tokens, out.min_tokens, out.include_stop_str_in_output
    )
