"""What a user can get wrong: `InvalidRequestError`, and the rules a dataclass field's value must
follow (`checked`, `check_fields`: the configs' and the sampling parameters')."""

from __future__ import annotations

import dataclasses
from typing import Any

BOUNDS = ("ge", "gt", "le")


class InvalidRequestError(ValueError):
    """A request a user sent cannot be served as asked; the message says which field and why."""


def checked(default: Any, **rules: Any) -> Any:
    """A dataclass field with `check_fields`' rules (`choices`, bounds `ge`, `gt`, `le`)."""
    return dataclasses.field(default=default, metadata=rules)


def check_fields(config: Any, error: type[Exception] = ValueError) -> None:
    """`error` naming the field whose value breaks its rules: not among its `choices`, or
    out of its bounds (None passes where it is the default)."""
    for f in dataclasses.fields(config):
        rules, value = f.metadata, getattr(config, f.name)
        if value is None and f.default is None:
            continue
        choices = rules.get("choices")
        if choices is not None and value not in choices:
            raise error(f"{f.name}: {value!r} is not one of {', '.join(choices)}")
        ge, gt, le = (rules.get(b) for b in BOUNDS)
        low = ge is None or value >= ge
        if not (low and (gt is None or value > gt) and (le is None or value <= le)):
            raise error(f"{f.name}: must be {_bounds_text(ge, gt, le)}, got {value!r}")


def _bounds_text(ge: Any, gt: Any, le: Any) -> str:
    if le is None:
        return f">= {ge}" if ge is not None else f"> {gt}"
    return f"in [{ge}, {le}]" if ge is not None else f"in ({gt}, {le}]"
