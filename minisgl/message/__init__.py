"""Typed messages between the server's processes (`types`) and their msgpack encoding: each
one is an ext type holding its fields in declaration order, so nested messages and
`SamplingParams` round-trip as themselves."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from minisgl.core import SamplingParams
from minisgl.message.types import (
    AbortReq,
    ChatMessage,
    ChatOptions,
    DetokOut,
    EngineInfo,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    RequestError,
    SchedulerOut,
    SchedulerStats,
    StrOut,
    TokenizedReq,
    TokenLogprob,
    TokenOut,
    ToolCall,
    TopLogprob,
    WorkerDied,
)

# The position in this tuple is the wire code: append new types, never reorder.
_TYPES: tuple[type, ...] = (
    SamplingParams,
    ChatMessage,
    GenerateReq,
    TokenizedReq,
    AbortReq,
    TokenOut,
    SchedulerStats,
    SchedulerOut,
    TopLogprob,
    TokenLogprob,
    StrOut,
    DetokOut,
    RequestError,
    EngineInfo,
    FlushCacheReq,
    FlushCacheOut,
    ToolCall,
    ChatOptions,
    WorkerDied,
)
_CODES = {cls: code for code, cls in enumerate(_TYPES)}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES}


class DecodeError(ValueError):
    """Bytes that are not a message this version knows."""


def _default(obj: Any) -> msgpack.ExtType:
    cls = type(obj)
    code = _CODES.get(cls)
    if code is None:
        raise TypeError(f"cannot encode {cls.__name__}: not a registered message type")
    values = [getattr(obj, name) for name in _FIELDS[cls]]
    return msgpack.ExtType(code, msgpack.packb(values, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if not 0 <= code < len(_TYPES):
        raise DecodeError(f"unknown message code {code}")
    values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    return _TYPES[code](*values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """The message in `data` (any registered type, as encoded)."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
