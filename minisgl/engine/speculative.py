"""The engine's side of speculative decoding: device drafts (a layer-skip draft of the
target's own first layers) and the verify step, which scores every draft of every row of a
plan in one forward through the extend attention path and samples all positions at once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from minisgl.core import Batch, SeqInfo
from minisgl.engine.sampler import (
    LogitBias,
    SamplingInputs,
    StopMask,
    adjust_logits,
    hashed_uniform,
    sampling_probs,
    to_device,
    with_logprobs,
)
from minisgl.engine.step import ForwardOutput, StepRows, TokenMask
from minisgl.spec import DraftRow, LayerSkipProposer, Proposer
from minisgl.spec.verify import Verdict, accepted_tokens, greedy_verify, rejection_sample

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


def draft_layers(engine: Engine) -> int:
    """The layer-skip draft's depth: the configured one, or a quarter of the layers."""
    n = engine.model_config.num_layers
    want = engine.config.speculative_draft_layers or max(1, n // 4)
    return min(want, n)


def make_device_proposer(engine: Engine) -> Proposer | None:
    """The engine's device proposer for `speculative_algorithm` "draft"; None otherwise (host
    proposers run in the scheduler)."""
    if engine.config.speculative_algorithm != "draft":
        return None
    layers = draft_layers(engine)

    def step(slots: list[int], positions: list[int]) -> torch.Tensor:
        return draft_step(engine, slots, positions, layers)

    return LayerSkipProposer(step)


@torch.inference_mode()
def draft_step(engine: Engine, slots: list[int], positions: list[int], layers: int) -> torch.Tensor:
    """One token per row through the first `layers` layers, the final norm and the LM head:
    the token at `positions[i]` of row `slots[i]` goes in (its K/V of those layers written to
    the pool, where the verify step overwrites it), the greedy draft comes out and is written
    to the token table after it. Returns the drafts, [B] int64 on the device."""
    step = engine.step_inputs(slots, positions, [1] * len(slots))
    hidden = engine.eager_forward(step, num_layers=layers)  # [B, hidden]
    tokens = engine.model.compute_logits(hidden).argmax(dim=-1)  # type: ignore[operator]
    engine.table.token_table[step.token_slots, step.positions + 1] = tokens.int()
    return tokens


class _Scored(NamedTuple):
    """The positions a verify step samples at: per sampling row, its last `d + 1` tokens."""

    rows: list[int]  # step row of each scored position (into the step's hidden states)
    seqs: list[SeqInfo]
    out_index: list[int]  # the output number each position samples
    positions: list[int]  # the position of the token each one scores after
    has_draft: list[bool]
    start: list[int]  # first scored position of each sampling row
    sample_rows: list[int]


def _scored(batch: Batch) -> _Scored:
    cu = [0, *itertools.accumulate(batch.extend_lens)]
    sc = _Scored([], [], [], [], [], [], [])
    drafts = batch.draft_lens or [0] * batch.size
    for i, (seq, d) in enumerate(zip(batch.seqs, drafts)):
        if not batch.sample[i]:
            continue
        sc.sample_rows.append(i)
        sc.start.append(len(sc.rows))
        last_pos = batch.seq_lens[i] - 1
        for j in range(d + 1):
            sc.rows.append(cu[i + 1] - 1 - d + j)
            sc.seqs.append(seq)
            sc.out_index.append(batch.out_index[i] + j)
            sc.positions.append(last_pos - d + j)
            sc.has_draft.append(j < d)
    return sc


def propose_on_device(engine: Engine, proposer: Proposer, batch: Batch) -> None:
    """Fill the drafts of the plan's verify rows into the token table."""
    rows = [
        DraftRow((), seq.slot, d, p + 1)
        for seq, p, d in zip(batch.seqs, batch.prefix_lens, batch.draft_lens)
        if d
    ]
    drafts = proposer.propose(rows)
    assert all(len(t) == r.k for t, r in zip(drafts, rows)), "a device proposer fills each row"


@torch.inference_mode()
def verify_step(
    engine: Engine, batch: Batch, mask: Callable[[], TokenMask] | None
) -> ForwardOutput:
    """Run a plan with verify rows (table writes already applied); waits for its tokens."""
    if engine.drafter is not None:
        propose_on_device(engine, engine.drafter, batch)
    hidden = engine.eager_forward(engine._step_inputs(batch))  # [T, hidden]
    sc = _scored(batch)
    dev = engine.device
    idx = to_device(sc.rows, torch.int64, dev)
    slots = to_device([s.slot for s in sc.seqs], torch.int64, dev)
    pos = to_device(sc.positions, torch.int64, dev)
    scored = hidden[idx]  # [N, hidden]
    logits = engine.model.compute_logits(scored)  # type: ignore[operator]  # [N, V]
    sin = _sampling_inputs(engine, sc, StepRows(scored, slots, pos + 1), mask)
    adjusted = adjust_logits(logits, sin)
    width = engine.table.token_table.shape[1]
    draft = engine.table.token_table[slots, (pos + 1).clamp(max=width - 1)].long()  # [N]
    has = to_device([int(h) for h in sc.has_draft], torch.int64, dev).bool()
    verdict = greedy_verify(adjusted, draft, has)
    if not sin.all_greedy:
        probs = sampling_probs(adjusted, sin)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        u = hashed_uniform(sin.seeds, sin.steps, probs.shape[1])
        drawn = rejection_sample(probs, draft, has, u)
        greedy = sin.temperature == 0
        verdict = Verdict(
            torch.where(greedy, verdict.accept, drawn.accept),
            torch.where(greedy, verdict.choice, drawn.choice),
        )
    return _outputs(engine, sc, logits, sin, draft, verdict.accept, verdict.choice)


def _sampling_inputs(
    engine: Engine, sc: _Scored, rows: StepRows, mask: Callable[[], TokenMask] | None
) -> SamplingInputs:
    """The plain sampler's inputs, one row per scored position (its own output number, so
    penalties see the drafts before it and min_tokens counts them)."""
    dev, vocab = engine.device, engine.model_config.vocab_size
    sin = SamplingInputs.build(sc.seqs, sc.out_index, vocab, dev)
    if any(s.params.has_penalties for s in sc.seqs):
        sin.penalties = engine._penalties(sc.seqs, sc.out_index, rows)
    if any(s.params.min_tokens for s in sc.seqs):
        pending = [n < s.params.min_tokens for s, n in zip(sc.seqs, sc.out_index)]
        stops = [s.stop_ids for s in sc.seqs]
        sin.stop_mask = StopMask.build(pending, stops, vocab, dev)
    if any(s.params.logit_bias for s in sc.seqs):
        sin.logit_bias = LogitBias.build([s.params.logit_bias for s in sc.seqs], vocab, dev)
    if mask is not None:
        m = mask()  # rows of the sampling rows; a constrained row never verifies drafts
        owner = [r for r, (a, b) in enumerate(_spans(sc)) for _ in range(b - a)]
        bits = m.bits[to_device(owner, torch.int64, m.bits.device)]
        sin.token_mask = TokenMask(bits.to(dev, non_blocking=True), [sc.start[r] for r in m.rows])
    return sin


def _spans(sc: _Scored) -> list[tuple[int, int]]:
    ends = sc.start[1:] + [len(sc.rows)]
    return list(zip(sc.start, ends))


def _outputs(
    engine: Engine,
    sc: _Scored,
    logits: torch.Tensor,
    sin: SamplingInputs,
    draft: torch.Tensor,
    accept: torch.Tensor,
    choice: torch.Tensor,
) -> ForwardOutput:
    """Accepted tokens per row (a host sync), written to the token table, with log-probs."""
    acc, cho, dr = accept.tolist(), choice.tolist(), draft.tolist()
    emitted: list[int] = []  # scored positions whose token is kept
    tokens: list[int] = []
    counts: list[int] = []
    for a, b in _spans(sc):
        row = accepted_tokens(dr[a : b - 1], acc[a:b], cho[a:b])
        emitted.extend(range(a, a + len(row)))
        tokens.extend(row)
        counts.append(len(row))
    dev = engine.device
    tok = to_device(tokens, torch.int64, dev)  # [sum(counts)]
    # Each row's last token is the input of its next step (accepted drafts are in place).
    last = [a + c - 1 for (a, _), c in zip(_spans(sc), counts)]
    slots = to_device([sc.seqs[i].slot for i in last], torch.int64, dev)
    pos = to_device([sc.positions[i] + 1 for i in last], torch.int64, dev)
    ends = to_device([c - 1 for c in itertools.accumulate(counts)], torch.int64, dev)
    engine.table.token_table[slots, pos] = tok[ends].int()
    out = with_logprobs(logits[to_device(emitted, torch.int64, dev)], tok, sin)
    host = tok.cpu()
    lp = None if out.logprobs is None else out.logprobs.cpu()
    ti = None if out.top_ids is None else out.top_ids.cpu()
    tl = None if out.top_logprobs is None else out.top_logprobs.cpu()
    return ForwardOutput(sc.sample_rows, tok, host, lp, ti, tl, None, True, counts)
