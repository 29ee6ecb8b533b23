from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from minisgl.core.constraint import CONSTRAINT_KINDS, Constraint
from minisgl.core.errors import InvalidRequestError, check_fields, checked


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` and `top_p == 1` and `min_p == 0` disable those
    filters. `seed` makes a sampled request reproducible whatever else shares its batch.
    `min_tokens`: until a request has this many output tokens, its stop tokens (EOS unless
    `ignore_eos`, and `stop_token_ids`) cannot be sampled and its stop strings do not count.
    `include_stop_str_in_output` keeps the stop string (or stop token's text) that ended the
    answer in its text. The output semantics are written down in `minisgl.tokenizer.output`.
    `logit_bias`: (token id, bias) pairs added to the raw logits before the other filters
    (OpenAI's field; a mapping or pairs are accepted, kept sorted by id).
    `priority` (lower is more urgent, as in vLLM; any integer) orders requests under the
    scheduler's `priority` policy (`minisgl.scheduler.policy`); other policies take only 0.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = checked(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = checked(0.0, ge=0, le=1)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = checked(0.0, ge=-2, le=2)
    frequency_penalty: float = checked(0.0, ge=-2, le=2)
    repetition_penalty: float = checked(1.0, gt=0, le=10)
    logprobs: bool = False
    top_logprobs: int = checked(0, ge=0, le=20)
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = field(default=())
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # At most one grammar the output must follow (`minisgl.constrain`): a JSON schema (as JSON
    # text), a regular expression, an EBNF grammar, or forced tool calls (`Constraint`).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    tool_calls: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    priority: int = 0
    # The grammar applies only once this token has been sampled (a reasoning model's end of
    # thinking, `</think>`): the thinking before it is free text.
    grammar_after_token: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers, keep tuples inside (hashable, immutable).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{field_name}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        check_fields(self, InvalidRequestError)
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"{self.min_tokens} is more than max_tokens ({self.max_tokens}); lower it or "
                "raise max_tokens",
            )
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad(
                "priority", f"must be an integer (lower is more urgent), got {self.priority!r}"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "token ids must be >= 0")
        self._check_logit_bias()
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise bad(given[1], f"only one constraint per request, got {' and '.join(given)}")
        _ = self.constraint  # checks its shape

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        ids = [t for t, _ in self.logit_bias]
        for t, bias in self.logit_bias:
            if t < 0:
                raise InvalidRequestError(f"logit_bias: token id {t} must be >= 0")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError(
                    f"logit_bias: the bias of token {t} must be in [-100, 100], got {bias!r}"
                )
        if len(set(ids)) != len(ids):
            raise InvalidRequestError("logit_bias: a token id is given twice")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidRequestError if a token id of `stop_token_ids`, `grammar_after_token` or
        `logit_bias` is not in the vocabulary."""
        after = () if self.grammar_after_token is None else (self.grammar_after_token,)
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("grammar_after_token", after),
            ("logit_bias", [t for t, _ in self.logit_bias]),
        ):
            for t in ids:
                if t >= vocab_size:
                    raise InvalidRequestError(
                        f"{name}: token id {t} is not in the vocabulary [0, {vocab_size})"
                    )

    @property
    def constraint(self) -> Constraint | None:
        """The grammar the output must follow, if any."""
        for kind in CONSTRAINT_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return Constraint(kind, text)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


MAX_LOGIT_BIAS = 1024  # tokens per request: the pairs are sent to the device every step


def _bias_pairs(bias: Mapping[Any, float] | Iterable[Any]) -> tuple[tuple[int, float], ...]:
    """A mapping or (id, bias) pairs as pairs sorted by id (ids may be strings, as JSON keys
    are)."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    pairs = []
    for item in items:
        try:
            t, b = item
            if isinstance(t, bool) or not isinstance(t, (int, str)):
                raise TypeError
            pairs.append((int(t), float(b)))
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"logit_bias: {item!r}: keys must be token ids, values numbers"
            ) from None
    return tuple(sorted(pairs))
