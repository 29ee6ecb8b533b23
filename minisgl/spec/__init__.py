"""Speculative decoding: proposers behind one interface (`base.Proposer`), the acceptance rule
(`verify`) and when to speculate (`policy`)."""

from minisgl.spec.base import DraftRow, Proposer
from minisgl.spec.device_draft import DeviceDraftProposer
from minisgl.spec.ngram import NgramIndex, NgramProposer
from minisgl.spec.policy import SpecPolicy, SpecStats

__all__ = [
    "DraftRow",
    "DeviceDraftProposer",
    "NgramProposer",
    "Proposer",
    "SpecPolicy",
    "SpecStats",
    "NgramIndex",
]
