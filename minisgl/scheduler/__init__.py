"""Waiting queue (in the schedule policy's order), running set, chunked prefill within a token
and a latency budget (the step-time model), KV reservation, retraction; with tensor
parallelism, rank 0's requests and step times replayed on every rank (`sync`)."""

from minisgl.scheduler.kv_manager import KVManager
from minisgl.scheduler.scheduler import Scheduler, StepEvent
from minisgl.scheduler.sync import EngineStopped, RequestSync

__all__ = ["EngineStopped", "KVManager", "RequestSync", "Scheduler", "StepEvent"]
