"""Every `MINISGL_*` environment switch, in one typed and documented registry.

A switch is read when its user asks (`Switch.get`), not when this module is imported, so a
test or a benchmark that sets one before it starts an engine is heard. A value that is not of
the switch's type raises an error naming the switch. The README's table of switches is this
registry's `markdown()` (`python -m minisgl.config` prints it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_FLAGS = {"1": True, "true": True, "yes": True, "on": True}
_FLAGS |= {"0": False, "false": False, "no": False, "off": False, "": False}


def _flag(raw: str) -> bool:
    value = _FLAGS.get(raw.strip().lower())
    if value is None:
        raise ValueError("expected 1 or 0 (or true / false, yes / no, on / off)")
    return value


def _count(raw: str) -> int:
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError("expected a whole number >= 1")
    return int(raw)


# type -> (how a value is read, what the README calls it)
_KINDS: dict[type, tuple[Callable[[str], object], str]] = {
    bool: (_flag, "1 / 0"),
    int: (_count, "integer >= 1"),
    str: (str, "text"),
}


@dataclass(frozen=True)
class Switch(Generic[T]):
    """One environment variable: its name, the type of its value, its default (while unset)
    and what it does."""

    name: str
    type: type[T]
    default: T
    doc: str

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value in `environ` (default: the process's environment) now; ValueError naming
        the switch when its text is not a value of its type."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None:
            return self.default
        try:
            return _KINDS[self.type][0](raw)  # type: ignore[return-value]
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e} ({self.doc})") from None


# fmt: off
DEBUG_KV = Switch("MINISGL_DEBUG_KV", bool, False, "KV debug mode: freed pages hold NaN; freeing a page that a step in flight uses fails an assertion (the tests turn it on)")
DISABLE_OVERLAP = Switch("MINISGL_DISABLE_OVERLAP", bool, False, "overlap scheduling off (CUDA)")
DISABLE_CUDA_GRAPH = Switch("MINISGL_DISABLE_CUDA_GRAPH", bool, False, "decode and prefill CUDA graphs off")
DISABLE_FUSED = Switch("MINISGL_DISABLE_FUSED", bool, False, "the fused Triton norm / RoPE / SiLU kernels off (the torch code runs)")
DISABLE_PDL = Switch("MINISGL_DISABLE_PDL", bool, False, "programmatic dependent launch of the Triton kernels off (Hopper and newer)")
DISABLE_ONE_ROW_GEMV = Switch("MINISGL_DISABLE_ONE_ROW_GEMV", bool, False, "batch-1 steps skip the fused one-row GEMVs (cuBLAS instead)")
DISABLE_CUSTOM_ALLREDUCE = Switch("MINISGL_DISABLE_CUSTOM_ALLREDUCE", bool, False, "tensor-parallel all-reduces through NCCL only (no symmetric-memory one-shot kernel)")
MOE_W8A8 = Switch("MINISGL_MOE_W8A8", bool, True, "FP8 experts run the W8A8 kernels (0: weight-only GEMMs with 16-bit activations)")
MOE_W8A8_BLOCK_M = Switch("MINISGL_MOE_W8A8_BLOCK_M", int, 16, "the W8A8 expert kernels' least BLOCK_M")
API_KEY: Switch[str | None] = Switch("MINISGL_API_KEY", str, None, "the server's API key when neither --api-key nor --api-key-file is given (unset: none)")
# fmt: on
SWITCHES: tuple[Switch, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Switch)
)  # in order


def check_all() -> None:
    """Read every switch: a bad value stops the start-up, not the first step that asks."""
    for switch in SWITCHES:
        switch.get()


def markdown() -> str:
    """The registry as a Markdown table (the README's)."""
    rows = ["| switch | value | default | what it does |", "|---|---|---|---|"]
    for s in SWITCHES:
        default = "unset" if s.default is None else str(int(s.default))
        rows.append(f"| `{s.name}` | {_KINDS[s.type][1]} | {default} | {s.doc} |")
    return "\n".join(rows) + "\n"
