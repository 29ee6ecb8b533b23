"""Waiting queue, running set, chunked prefill, KV reservation, retraction."""

from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.scheduler import Scheduler, StepEvent

__all__ = ["KVManager", "Scheduler", "StepEvent"]
