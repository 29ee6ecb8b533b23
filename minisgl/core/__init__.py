"""Requests, batches and sampling parameters: the vocabulary every other package shares."""

from minisgl.core.batch import Batch, BatchKind, PageCopy, SeqInfo, TableWrite
from minisgl.core.constraint import JSON_OBJECT, Constraint
from minisgl.core.errors import InvalidRequestError
from minisgl.core.limits import resolve_max_tokens
from minisgl.core.req import FinishReason, Req, ReqStatus, pages_for, plan_step
from minisgl.core.sampling import SamplingParams

__all__ = [
    "JSON_OBJECT",
    "Constraint",
    "Batch",
    "BatchKind",
    "FinishReason",
    "InvalidRequestError",
    "PageCopy",
    "Req",
    "ReqStatus",
    "SamplingParams",
    "SeqInfo",
    "TableWrite",
    "pages_for",
    "plan_step",
    "resolve_max_tokens",
]
