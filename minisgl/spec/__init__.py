"""Speculative decoding: proposers behind one interface (`base.Proposer`), the acceptance rule
(`verify`), when to speculate (`policy`) and the scheduler's draft planner (`planner`)."""

from minisgl.spec.base import DraftRow, Proposer
from minisgl.spec.device_draft import DeviceDraftProposer
from minisgl.spec.ngram import NgramIndex, NgramProposer
from minisgl.spec.planner import DraftPlanner
from minisgl.spec.policy import SpecPolicy, SpecStats

__all__ = [
    "DraftRow",
    "DeviceDraftProposer",
    "DraftPlanner",
    "NgramProposer",
    "Proposer",
    "SpecPolicy",
    "SpecStats",
    "NgramIndex",
]
