"""Waiting queue, running set, chunked prefill, KV reservation, retraction; with tensor
parallelism, rank 0's requests replayed on every rank (`sync`)."""

from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.scheduler import Scheduler, StepEvent
from minisgl.scheduler.sync import EngineStopped, RequestSync

__all__ = ["EngineStopped", "KVManager", "RequestSync", "Scheduler", "StepEvent"]
