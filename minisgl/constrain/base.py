"""What a grammar backend provides (llguidance serves; xgrammar is kept for comparison).

A backend turns a `Constraint` into grammar text it can check without a vocabulary (`source`,
cheap: the tokenizer worker's check), compiles that text against one vocabulary (`compile`,
milliseconds: the scheduler's pool), and makes a matcher per request from the compiled grammar
(`matcher`, microseconds). Its matchers' masks allow `end_token` exactly where the grammar may
end; `RequestGrammar` turns that into each request's own stop tokens. `fill` and `accept` work
on a whole step's rows in one call each on the backend's `pool`, off the GIL where it can.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from minisgl.core import Constraint, InvalidRequestError

# Whitespace the JSON grammars allow between tokens: enough for pretty-printed nesting, not
# so much that a model can idle in blanks until max_tokens.
JSON_MAX_WHITESPACE = 8


class GrammarError(InvalidRequestError):
    """A schema, regex or grammar that cannot be compiled or enforced; the message is
    "{kind}: {reason}"."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason


class Matcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar refuses it (the matcher is then spent)."""

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens."""

    def accepting(self) -> bool:
        """The output so far is complete (the grammar may end here)."""

    def stopped(self) -> bool:
        """Nothing but the end may follow."""


class Backend(ABC):
    """A grammar engine for one vocabulary of `vocab_size` tokens (rows of a mask are
    `ceil(vocab_size / 32)` int32 words)."""

    name: str
    end_token: int  # the token a mask allows where the grammar may end

    @abstractmethod
    def source(self, constraint: Constraint) -> str:
        """The grammar text of `constraint`, checked as far as can be done without the
        vocabulary (GrammarError)."""

    @abstractmethod
    def compile(self, source: str, kind: str) -> Any:
        """`source` compiled for the vocabulary (GrammarError, with `kind`)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the grammar."""

    @abstractmethod
    def pool(self, threads: int) -> Any:
        """Threads for `fill` and `accept` (the backend's own)."""

    @abstractmethod
    def fill(self, pool: Any, bits: torch.Tensor, rows: Sequence[tuple[Matcher, int]]) -> None:
        """Write each matcher's allowed next tokens into its row of `bits` [R, W] (a contiguous
        host tensor); other rows are not touched."""

    @abstractmethod
    def accept(self, pool: Any, pairs: Sequence[tuple[Matcher, int]]) -> list[bool]:
        """Advance each matcher by its token, as `Matcher.accept`."""
