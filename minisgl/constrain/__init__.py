"""Grammar-constrained decoding: compile (xgrammar, cached, off the serving loop), per-request
matchers, and the token bitmask each constrained row of a step samples under."""

from minisgl.constrain.grammar import CompileStats, GrammarCompiler, GrammarError
from minisgl.constrain.matcher import RequestGrammar, bitmask_width, fill_bitmask

__all__ = [
    "CompileStats",
    "GrammarCompiler",
    "GrammarError",
    "RequestGrammar",
    "bitmask_width",
    "fill_bitmask",
]
