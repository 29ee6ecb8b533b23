"""The engine's side of speculative decoding: device drafts (a layer-skip draft of the
target's own first layers, or a separate draft model: `draft_model.py`) and the verify step,
which scores every draft of every row of a plan in one forward (the decode CUDA graph with a row
per token where it can, else the extend attention path) and samples all positions at once."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from minisgl.core import Batch, SeqInfo
from minisgl.engine.cuda_graph import CudaGraphRunner, GraphHost, eager_forward
from minisgl.engine.draft_model import DraftModel
from minisgl.engine.sampler import (
    SamplingInputs,
    adjust_logits,
    draw,
    hashed_uniform,
    sampling_inputs,
    sampling_probs,
    uniform_at,
    use_fused,
    with_logprobs,
)
from minisgl.engine.step import ForwardOutput, TokenMask, batch_inputs, step_inputs, to_device
from minisgl.spec import DeviceDraftProposer, DraftRow
from minisgl.spec.verify import Verdict, accepted_tokens, greedy_verify, rejection_sample


class SpecEngine(GraphHost, Protocol):
    """What speculative decoding uses of the engine (`minisgl.engine.Engine`), beyond what
    its graphs read."""

    num_pages: int
    graphs: CudaGraphRunner | None
    draft_model: DraftModel | None
    drafter: DeviceDraftProposer | None


def draft_layers(engine: SpecEngine) -> int:
    """The layer-skip draft's depth: the configured one, or a quarter of the layers."""
    n = engine.model_config.num_layers
    want = engine.config.speculative_draft_layers or max(1, n // 4)
    return min(want, n)


def make_device_proposer(engine: SpecEngine) -> DeviceDraftProposer | None:
    """The engine's device proposer for `speculative_algorithm` "draft" (the layer-skip draft,
    or the separate draft model); None otherwise (host proposers run in the scheduler)."""
    if engine.config.speculative_algorithm != "draft":
        return None
    graphs = engine.graphs
    bs = engine.config.speculative_max_batch
    if graphs is not None:
        bs = min(bs, graphs.max_bs)
    draft = engine.draft_model
    if draft is not None:
        capture = graphs is None or graphs.captured
        draft.attach_pool(engine.num_pages, bs if graphs is not None else None, capture)

        def model_step(slots: list[int], positions: list[int]) -> torch.Tensor:
            return draft_step(engine, draft, slots, positions, None, draft.graphs)

        def prepare(rows: Sequence[DraftRow]) -> None:
            draft.catch_up([r.slot for r in rows], [r.seq_len for r in rows])

        return DeviceDraftProposer(model_step, prepare)
    layers = draft_layers(engine)
    skip_graphs = None
    if graphs is not None:  # the draft's steps as CUDA graphs too, in the same pool
        skip_graphs = CudaGraphRunner(
            engine, graphs.captured, bs, num_layers=layers, pool=graphs.pool
        )

    def step(slots: list[int], positions: list[int]) -> torch.Tensor:
        return draft_step(engine, engine, slots, positions, layers, skip_graphs)

    return DeviceDraftProposer(step)


@torch.inference_mode()
def draft_step(
    engine: SpecEngine,
    host: GraphHost,
    slots: list[int],
    positions: list[int],
    layers: int | None,
    graphs: CudaGraphRunner | None = None,
) -> torch.Tensor:
    """One token per row through `host`'s model (the target's first `layers` layers, or a
    draft model whole), its final norm and LM head: the token at `positions[i]` of row
    `slots[i]` goes in (its K/V written to the host's pool, where the verify step overwrites
    the target's), the greedy draft comes out and is written to the token table after it.
    Returns the drafts, [B] int64 on the device."""
    if graphs is not None and len(slots) <= graphs.max_bs:
        rows = graphs.run_rows(slots, positions, [p + 1 for p in positions])
        hidden, req_slots, next_pos = rows.hidden, rows.req_slots, rows.seq_lens
    else:
        step = step_inputs(slots, positions, [1] * len(slots), engine.device)
        hidden = eager_forward(host, step, num_layers=layers)  # [B, hidden]
        req_slots, next_pos = step.token_slots, step.positions + 1
    tokens = host.model.compute_logits(hidden).argmax(dim=-1)  # type: ignore[operator]
    engine.table.token_table[req_slots, next_pos] = tokens.int()
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


def propose_on_device(engine: SpecEngine, proposer: DeviceDraftProposer, batch: Batch) -> None:
    """Launch the drafts of the plan's verify rows into the token table (the verify step reads
    them there: no wait for the device in between)."""
    rows = [
        DraftRow((), (), seq.slot, d, p + 1)
        for seq, p, d in zip(batch.seqs, batch.prefix_lens, batch.draft_lens)
        if d
    ]
    proposer.draft(rows)


@torch.inference_mode()
def verify_step(
    engine: SpecEngine, batch: Batch, mask: Callable[[], TokenMask] | None
) -> ForwardOutput:
    """Run a plan with verify rows (table writes already applied); waits for its tokens."""
    if engine.drafter is not None:
        propose_on_device(engine, engine.drafter, batch)
    hidden = _verify_forward(engine, batch)  # [T, hidden]
    sc = _scored(batch)
    dev, n = engine.device, len(sc.rows)
    host = sc.rows + [s.slot for s in sc.seqs] + sc.positions + [int(h) for h in sc.has_draft]
    idx, slots, pos, has_int = to_device(host, torch.int64, dev).split(n)  # one copy
    has = has_int.bool()
    scored = hidden[idx]  # [N, hidden]
    logits = engine.model.compute_logits(scored)  # type: ignore[operator]  # [N, V]
    # Each scored position samples its own output number: penalties see the drafts before it.
    vocab, table = engine.model_config.vocab_size, engine.table.token_table
    sin = sampling_inputs(sc.seqs, sc.out_index, slots, table, vocab, mask)
    adjusted = adjust_logits(logits, sin)
    width = engine.table.token_table.shape[1]
    draft = engine.table.token_table[slots, (pos + 1).clamp(max=width - 1)].long()  # [N]
    if engine.config.deterministic:
        # Each position draws its token as plain decoding would (the same per-position
        # stream) and a draft stands while it equals the draw: exact for point-mass drafts,
        # and the very tokens of decoding without drafts.
        choice = draw(adjusted, sin)
        verdict = Verdict(has & (choice == draft), choice)
    else:
        verdict = _verdict(adjusted, sin, draft, has)
    out = _outputs(engine, sc, logits, sin, draft, verdict.accept, verdict.choice)
    if engine.draft_model is not None and batch.draft_lens:
        assert out.counts is not None
        for row, count in zip(sc.sample_rows, out.counts):
            slot, last = batch.seqs[row].slot, batch.prefix_lens[row]
            engine.draft_model.verified(slot, last, batch.draft_lens[row], count - 1)
    return out


def _verdict(
    adjusted: torch.Tensor, sin: SamplingInputs, draft: torch.Tensor, has: torch.Tensor
) -> Verdict:
    """Greedy rows accept the argmax; the others take the rejection rule."""
    verdict = greedy_verify(adjusted, draft, has)
    if sin.all_greedy:
        return verdict
    if use_fused(adjusted, sin):
        assert sin.keys is not None
        drawn = fused_rejection(adjusted, sin.temperature, sin.keys, draft, has)
    else:
        probs = sampling_probs(adjusted, sin)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        u = hashed_uniform(sin.seeds, sin.steps, probs.shape[1])
        drawn = rejection_sample(probs, draft, has, u)
    greedy = sin.temperature == 0
    return Verdict(
        torch.where(greedy, verdict.accept, drawn.accept),
        torch.where(greedy, verdict.choice, drawn.choice),
    )


def fused_rejection(
    logits: torch.Tensor,  # [N, V] the adjusted logits (model dtype or fp32)
    temperature: torch.Tensor,  # [N] fp32
    keys: torch.Tensor,  # [N] int64, the sampler's row keys
    draft: torch.Tensor,  # [N] int64
    has_draft: torch.Tensor,  # [N] bool
) -> Verdict:
    """`rejection_sample` for rows of plain temperature sampling (no top-k, top-p or min-p)
    without its [N, V] distribution and uniforms (about 60 small kernels on the H200): the
    draft d is accepted when u[d] < p[d], p[d] from one log-sum-exp; the residual's race is
    the fused Gumbel-max kernel over the logits with d removed, since argmax p / -log u =
    argmax logits / T - log(-log u) over the same uniforms."""
    from minisgl.engine.sample_kernel import gumbel_argmax

    d = draft.clamp(min=0, max=logits.shape[1] - 1).unsqueeze(1)  # [N, 1]
    scaled = logits.float() / temperature.clamp(min=1e-5).unsqueeze(1)
    p_d = torch.exp(scaled.gather(1, d).squeeze(1) - torch.logsumexp(scaled, dim=-1))
    accept = has_draft & (uniform_at(keys, d.squeeze(1)) < p_d)
    removed = torch.where(has_draft.unsqueeze(1), float("-inf"), logits.gather(1, d))
    residual = logits.clone().scatter_(1, d, removed)
    return Verdict(accept, gumbel_argmax(residual, temperature, keys))


def _verify_forward(engine: SpecEngine, batch: Batch) -> torch.Tensor:
    """Final hidden states of every token of a verify plan [T, hidden]. A plan of decode and
    verify rows only replays the decode CUDA graph of T rows: token j of a row is a decode row
    of its own at position prefix + j that attends up to itself (causal within the drafts, the
    same request-table row for all), so one graph serves every mix of draft lengths. A plan
    with prefill chunks (or too many tokens) runs eagerly through the extend path."""
    graphs = engine.graphs
    drafts = batch.draft_lens or [0] * batch.size
    decode_like = all(e == d + 1 for e, d in zip(batch.extend_lens, drafts))
    if graphs is None or not decode_like or not 0 < batch.num_tokens <= graphs.max_bs:
        return eager_forward(engine, batch_inputs(batch, engine.device))
    slots: list[int] = []
    positions: list[int] = []
    for slot, p, e in zip(batch.slots, batch.prefix_lens, batch.extend_lens):
        slots += [slot] * e
        positions += range(p, p + e)
    return graphs.run_rows(slots, positions, [p + 1 for p in positions]).hidden


def _spans(sc: _Scored) -> list[tuple[int, int]]:
    ends = sc.start[1:] + [len(sc.rows)]
    return list(zip(sc.start, ends))


def _outputs(
    engine: SpecEngine,
    sc: _Scored,
    logits: torch.Tensor,
    sin: SamplingInputs,
    draft: torch.Tensor,
    accept: torch.Tensor,
    choice: torch.Tensor,
) -> ForwardOutput:
    """Accepted tokens per row (the step's one host sync), written to the token table, with
    log-probs when asked for."""
    verdicts = torch.stack([accept.long(), choice, draft]).tolist()  # [3, N]
    emitted: list[int] = []  # scored positions whose token is kept
    tokens: list[int] = []
    counts: list[int] = []
    last_slots: list[int] = []
    last_pos: list[int] = []
    for a, b in _spans(sc):
        row = accepted_tokens(verdicts[2][a : b - 1], verdicts[0][a:b], verdicts[1][a:b])
        emitted.extend(range(a, a + len(row)))
        tokens.extend(row)
        counts.append(len(row))
        # Each row's last token is the input of its next step (accepted drafts are in place).
        last = a + len(row) - 1
        last_slots.append(sc.seqs[last].slot)
        last_pos.append(sc.positions[last] + 1)
    t, b = len(tokens), len(counts)
    ends = [c - 1 for c in itertools.accumulate(counts)]
    host = tokens + emitted + last_slots + last_pos + [tokens[e] for e in ends]
    tok, kept, slots, pos, last_tok = to_device(host, torch.int64, engine.device).split(
        [t, t, b, b, b]
    )
    engine.table.token_table[slots, pos] = last_tok.int()
    lp = ti = tl = None
    if sin.want_logprobs or sin.top_logprobs:
        out = with_logprobs(logits[kept], tok, sin)
        lp = None if out.logprobs is None else out.logprobs.cpu()
        ti = None if out.top_ids is None else out.top_ids.cpu()
        tl = None if out.top_logprobs is None else out.top_logprobs.cpu()
    host_tokens = torch.tensor(tokens, dtype=torch.int64)
    return ForwardOutput(sc.sample_rows, tok, host_tokens, lp, ti, tl, None, True, counts)
