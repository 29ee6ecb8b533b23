"""Grammar-constrained decoding: compile (llguidance, cached, off the serving loop), per-request
matchers, and the token bitmask each constrained row of a step samples under."""

from minisgl.constrain.base import GrammarError
from minisgl.constrain.grammar import CompileStats, GrammarCompiler
from minisgl.constrain.matcher import MaskFiller, RequestGrammar, bitmask_width

__all__ = [
    "CompileStats",
    "GrammarCompiler",
    "GrammarError",
    "MaskFiller",
    "RequestGrammar",
    "bitmask_width",
]
