"""Typed messages between the server's processes and their msgpack encoding."""

from minisgl.message.codec import DecodeError, decode, encode
from minisgl.message.types import (
    AbortReq,
    ChatMessage,
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
    TopLogprob,
)

__all__ = [
    "AbortReq",
    "ChatMessage",
    "DecodeError",
    "DetokOut",
    "EngineInfo",
    "FlushCacheOut",
    "FlushCacheReq",
    "GenerateReq",
    "RequestError",
    "SchedulerOut",
    "SchedulerStats",
    "StrOut",
    "TokenLogprob",
    "TokenOut",
    "TokenizedReq",
    "TopLogprob",
    "decode",
    "encode",
]
