"""minisgl: a compact, high-performance LLM inference and serving engine."""

from typing import TYPE_CHECKING

from minisgl.core import SamplingParams

if TYPE_CHECKING:
    from minisgl.llm import LLM

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # `LLM` pulls in torch and the engine; import it only when asked for.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
