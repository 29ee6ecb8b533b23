"""On-device sampling: greedy, temperature, top-k, top-p, min-p, penalties, seeded noise.

Randomness comes from a counter-based hash of (request seed, output position, token id), so a
seeded request draws the same numbers alone or in any batch, and nothing syncs with the host.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) picks token i with
probability p_i.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from minisgl.core import SeqInfo
from minisgl.engine.step import TokenMask, to_device

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # MurmurHash3's finaliser on int64 tensors holding 32-bit values; products wrap mod 2^64,
    # and the mask keeps the low 32 bits, which is all the mix needs.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _fmix32_host(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=4096)
def _host_seed_key(seed: int) -> int:
    # A request keeps its seed for life: mix it once, not once per sampled token.
    return _fmix32_host((seed & _M32) ^ _fmix32_host(((seed >> 32) & _M32) + 0x9E3779B9))


def host_row_key(seed: int, step: int) -> int:
    """The per-row key of `hashed_uniform`, computed on the host (the same bits as the device
    code, which works on int64 that never overflow before masking)."""
    return _fmix32_host(_host_seed_key(seed) ^ ((step * 0x27D4EB2F) & _M32))


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] seeds, [B] steps -> [B] int64 keys in [0, 2^32)."""
    key = _fmix32((seeds & _M32) ^ _fmix32(((seeds >> 32) & _M32) + 0x9E3779B9))
    return _fmix32(key ^ ((steps * 0x27D4EB2F) & _M32))


def uniform_from_keys(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] keys -> [B, vocab] uniforms in (0, 1)."""
    idx = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = _fmix32((keys.unsqueeze(1) + idx.unsqueeze(0) * 0x165667B1) & _M32)  # [B, V]
    # 23 bits, so that the largest value stays below 1.0 in fp32 (24 bits would round the top
    # one up to 1.0, and -log(1) = 0 would make that token win the race whatever its weight).
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def uniform_at(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[B] keys, [B] token ids -> [B] the uniforms `uniform_from_keys(keys, V)[b, ids[b]]`,
    without the [B, V] tensor."""
    h = _fmix32((keys + ids.long() * 0x165667B1) & _M32)
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds, [B] steps -> [B, vocab] uniforms in (0, 1), a pure function of its inputs."""
    return uniform_from_keys(row_keys(seeds, steps), vocab)


@dataclass
class SamplingInputs:
    """Per-row sampling parameters on the device; host flags pick the work to skip."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, vocab size = off
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, index (0-based) of the token being sampled in the output
    all_greedy: bool
    needs_sort: bool  # some row uses top-k or top-p
    needs_min_p: bool
    top_logprobs: int  # largest top_logprobs asked for; 0 = none
    want_logprobs: bool
    penalties: PenaltyInputs | None = None
    keys: torch.Tensor | None = None  # [B] int64 `row_keys(seeds, steps)`, mixed on the host
    token_mask: TokenMask | None = None  # grammars: tokens the constrained rows may sample
    logit_bias: LogitBias | None = None  # OpenAI's logit_bias of the rows that have one
    stop_mask: StopMask | None = None  # stop ids rows may not sample yet (min_tokens)

    @staticmethod
    def build(
        seqs: list[SeqInfo], out_index: list[int], vocab: int, device: torch.device
    ) -> SamplingInputs:
        """`out_index[i]`: which output token (0-based) row `i` samples."""
        ps = [s.params for s in seqs]
        greedy = [p.greedy for p in ps]
        temps = [0.0 if g else p.temperature for p, g in zip(ps, greedy)]
        seeds = [s.seed for s in seqs]
        steps = out_index
        # Only the Gumbel kernel reads keys, and only for rows with a temperature.
        keys = [0 if g else host_row_key(s, t) for g, s, t in zip(greedy, seeds, steps)]
        n = len(seqs)
        # Two host-to-device copies per step: one of floats, one of integers.
        floats = to_device(
            temps + [p.top_p for p in ps] + [p.min_p for p in ps], torch.float32, device
        )
        top_k = [vocab if p.top_k < 1 else p.top_k for p in ps]
        # Keys (and temperatures) first: the Gumbel kernel reads them, and Triton compiles a
        # variant per pointer alignment (an offset of 8 * 3n bytes is aligned for even n only).
        ints = to_device(keys + top_k + seeds + steps, torch.int64, device)
        return SamplingInputs(
            temperature=floats[:n],
            top_k=ints[n : 2 * n],
            top_p=floats[n : 2 * n],
            min_p=floats[2 * n :],
            seeds=ints[2 * n : 3 * n],
            steps=ints[3 * n :],
            all_greedy=all(greedy),
            needs_sort=any(not g and (p.top_k > 1 or p.top_p < 1.0) for p, g in zip(ps, greedy)),
            needs_min_p=any(not g and p.min_p > 0 for p, g in zip(ps, greedy)),
            top_logprobs=max(p.top_logprobs for p in ps),
            want_logprobs=any(p.logprobs for p in ps),
            keys=ints[:n],
        )


@functools.lru_cache(maxsize=16)
def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each value of a mask byte, what its 8 tokens add to their logits (0 where
    the token's bit is set, -inf where it is clear)."""
    allowed = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(allowed == 1, 0.0, float("-inf")).to(dtype=dtype, device=device)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """Set the disallowed tokens of the constrained rows of logits [B, V] to -inf, in place
    (rows without a constraint are untouched; no host sync); returns `logits`. `mask.bits`
    is on the logits' device."""
    if not mask.rows:
        return logits
    vocab = min(logits.shape[1], mask.bits.shape[1] * 32)
    every = len(mask.rows) == logits.shape[0] == mask.bits.shape[0]
    rows = None if every else to_device(mask.rows, torch.int64, logits.device)
    bits = mask.bits if rows is None else mask.bits.index_select(0, rows)
    # Bit j of int32 word w is bit j % 8 of byte 4w + j // 8 (little-endian): one lookup per
    # byte gives its 8 tokens' biases, and one add applies them (no data-dependent branch: a
    # masked fill on the CPU is several times slower on a mask's irregular bits).
    table = _byte_bias(logits.dtype, logits.device)
    bias = torch.nn.functional.embedding(bits.view(torch.uint8).int(), table)
    bias = bias.view(bits.shape[0], -1)[:, :vocab]
    if rows is None:
        logits[:, :vocab] += bias
    else:
        logits[:, :vocab].index_add_(0, rows, bias)
    return logits


@dataclass
class StopMask:
    """(row, token id) pairs whose logits are -inf this step: the stop ids of rows that have
    fewer outputs than their `min_tokens` (vLLM's semantics: a request's stop tokens cannot
    be sampled until it has `min_tokens` outputs)."""

    rows: torch.Tensor  # [K] int64
    ids: torch.Tensor  # [K] int64

    @staticmethod
    def build(
        pending: Sequence[bool],
        stop_ids: Sequence[Collection[int]],
        vocab: int,
        device: torch.device,
    ) -> StopMask | None:
        """Per row: whether min_tokens is still pending, and its stop ids (EOS unless
        ignore_eos, plus stop_token_ids). None when no row masks anything. Ids outside the
        vocabulary are never sampled anyway (and would index out of bounds)."""
        pairs = [
            (row, t)
            for row, (p, ids) in enumerate(zip(pending, stop_ids, strict=True))
            if p
            for t in ids
            if t < vocab
        ]
        if not pairs:
            return None
        flat = to_device([r for r, _ in pairs] + [t for _, t in pairs], torch.int64, device)
        return StopMask(flat[: len(pairs)], flat[len(pairs) :])


def mask_stop_ids(logits: torch.Tensor, mask: StopMask) -> torch.Tensor:
    """logits [B, V] -> a copy with the masked (row, id) pairs at -inf (no host sync)."""
    inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put((mask.rows, mask.ids), inf)


@dataclass
class LogitBias:
    """(row, token id, bias) triples added to the logits this step: each row's `logit_bias`."""

    rows: torch.Tensor  # [K] int64
    ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] fp32

    @staticmethod
    def build(
        biases: Sequence[Sequence[tuple[int, float]]], vocab: int, device: torch.device
    ) -> LogitBias | None:
        """Per row its (id, bias) pairs; None when no row has any. Ids outside the vocabulary
        (refused at the API) are dropped rather than indexed out of bounds."""
        triples = [(row, t, b) for row, pairs in enumerate(biases) for t, b in pairs if t < vocab]
        if not triples:
            return None
        k = len(triples)
        ints = to_device(
            [r for r, _, _ in triples] + [t for _, t, _ in triples], torch.int64, device
        )
        values = to_device([b for _, _, b in triples], torch.float32, device)
        return LogitBias(ints[:k], ints[k:], values)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """logits [B, V] -> an fp32 copy with each triple's bias added (rows without one keep their
    values; no host sync)."""
    return logits.float().index_put((bias.rows, bias.ids), bias.values, accumulate=True)


@dataclass
class PenaltyInputs:
    """Tokens seen so far per row (padded with -1) and the penalty strengths."""

    prompt_tokens: torch.Tensor  # [B, Lp] int64, -1 padded
    output_tokens: torch.Tensor  # [B, Lo] int64, -1 padded
    presence: torch.Tensor  # [B] fp32
    frequency: torch.Tensor  # [B] fp32
    repetition: torch.Tensor  # [B] fp32


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab + 1, device=tokens.device)
    idx = torch.where(tokens < 0, vocab, tokens)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, pen: PenaltyInputs) -> torch.Tensor:
    """OpenAI presence/frequency penalties on output tokens; HF-style repetition penalty on all."""
    vocab = logits.shape[1]
    out_counts = _counts(pen.output_tokens, vocab)
    seen = (out_counts + _counts(pen.prompt_tokens, vocab)) > 0
    rep = pen.repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - pen.frequency.unsqueeze(1) * out_counts
    return logits - pen.presence.unsqueeze(1) * (out_counts > 0).float()


def penalty_inputs(
    seqs: list[SeqInfo], num_out: list[int], req_slots: torch.Tensor, token_table: torch.Tensor
) -> PenaltyInputs:
    """Prompt and the `num_out` earlier output tokens of each row, read from its request slot
    (`req_slots` [S]) of the token table on the device: with overlap scheduling the host does
    not know the previous step's token yet."""
    dev = token_table.device
    prompt_lens = [s.prompt_len for s in seqs]
    plen = to_device(prompt_lens, torch.int64, dev)

    def gather(start: torch.Tensor, lens: list[int]) -> torch.Tensor:
        width = max(1, max(lens))
        cols = start.unsqueeze(1) + torch.arange(width, device=dev)  # [S, W]
        n = to_device(lens, torch.int64, dev).unsqueeze(1)
        valid = cols < start.unsqueeze(1) + n
        cols = cols.clamp(max=token_table.shape[1] - 1)
        ids = token_table[req_slots.unsqueeze(1), cols].long()
        return torch.where(valid, ids, -1)

    def f(vals: list[float]) -> torch.Tensor:
        return to_device(vals, torch.float32, dev)

    return PenaltyInputs(
        prompt_tokens=gather(torch.zeros_like(plen), prompt_lens),
        output_tokens=gather(plen, num_out),
        presence=f([s.params.presence_penalty for s in seqs]),
        frequency=f([s.params.frequency_penalty for s in seqs]),
        repetition=f([s.params.repetition_penalty for s in seqs]),
    )


def sampling_inputs(
    seqs: list[SeqInfo],
    out_index: list[int],
    req_slots: torch.Tensor,
    token_table: torch.Tensor,
    vocab: int,
    mask: Callable[[], TokenMask] | None,
) -> SamplingInputs:
    """Everything a step's sampling reads, one row per sampled position: row `i` of request
    `seqs[i]` (request slot `req_slots[i]`) samples output number `out_index[i]`, so penalties
    and min_tokens see the outputs before it (in a verify step: the drafts before it too).
    `mask` (constrained rows) is called last: once the step's model work is launched."""
    dev = token_table.device
    sin = SamplingInputs.build(seqs, out_index, vocab, dev)
    if any(s.params.has_penalties for s in seqs):
        sin.penalties = penalty_inputs(seqs, out_index, req_slots, token_table)
    if any(s.params.min_tokens for s in seqs):
        pending = [n < s.params.min_tokens for s, n in zip(seqs, out_index)]
        sin.stop_mask = StopMask.build(pending, [s.stop_ids for s in seqs], vocab, dev)
    if any(s.params.logit_bias for s in seqs):
        sin.logit_bias = LogitBias.build([s.params.logit_bias for s in seqs], vocab, dev)
    if mask is not None:
        m = mask()
        assert m.bits.shape[0] == len(seqs)  # a mask row per sampled position
        sin.token_mask = m.to(dev)
    return sin


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32, log-softmax of the raw logits at the token
    top_ids: torch.Tensor | None  # [B, K] int64
    top_logprobs: torch.Tensor | None  # [B, K] fp32


def adjust_logits(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """logits [B, V] -> the logits sampling draws from: grammar masks, logit bias, penalties
    and min_tokens' stop masks applied (in place on `logits` only where the raw ones are not
    wanted afterwards: log-probs are of the raw distribution)."""
    if inp.token_mask is not None:
        keep_raw = inp.want_logprobs or bool(inp.top_logprobs)
        logits = apply_token_mask(logits.clone() if keep_raw else logits, inp.token_mask)
    if inp.logit_bias is not None:
        logits = apply_logit_bias(logits, inp.logit_bias)
    if inp.penalties is not None:
        logits = apply_penalties(logits.float(), inp.penalties)
    if inp.stop_mask is not None:
        logits = mask_stop_ids(logits, inp.stop_mask)
    return logits


def sampling_probs(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """Adjusted logits [B, V] -> the fp32 distribution [B, V] a row with a temperature samples
    from: temperature, then top-k / top-p, then min-p (not renormalised after the cuts: the
    exponential race only needs ratios)."""
    temp = inp.temperature.clamp(min=1e-5).unsqueeze(1)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    if inp.needs_sort:
        probs = _top_k_top_p(probs, inp.top_k, inp.top_p)
    if inp.needs_min_p:
        cut = inp.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < cut, 0.0)
    return probs


def sample(logits: torch.Tensor, inp: SamplingInputs) -> SampleOutput:
    """logits [B, V] (fp32, or the model's 16-bit dtype: upcast here where the math needs it;
    argmax and the fused kernel take them as they are, the upcast being exact) -> next tokens,
    and log-probs when asked for."""
    return with_logprobs(logits, draw(adjust_logits(logits, inp), inp), inp)


def draw(logits: torch.Tensor, inp: SamplingInputs) -> torch.Tensor:
    """Adjusted logits [B, V] -> each row's token [B] int64: the argmax at temperature 0, else
    the exponential race over the row's (seed, output index) uniforms."""
    if inp.all_greedy:
        return logits.argmax(dim=-1)
    if use_fused(logits, inp):
        from minisgl.engine.sample_kernel import gumbel_argmax

        assert inp.keys is not None
        return gumbel_argmax(logits, inp.temperature, inp.keys)
    greedy_tokens = logits.argmax(dim=-1)
    probs = sampling_probs(logits, inp)
    noise = -torch.log(hashed_uniform(inp.seeds, inp.steps, probs.shape[1]))
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(inp.temperature == 0, greedy_tokens, sampled)


def with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, inp: SamplingInputs) -> SampleOutput:
    """The sampled `tokens` [B] with the log-probs (of the raw logits [B, V]) asked for."""
    if not (inp.want_logprobs or inp.top_logprobs):
        return SampleOutput(tokens, None, None, None)
    logp = torch.log_softmax(raw.float(), dim=-1)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_ids = top_lp = None
    if inp.top_logprobs:
        top_lp, top_ids = logp.topk(inp.top_logprobs, dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_lp)


def use_fused(logits: torch.Tensor, inp: SamplingInputs) -> bool:
    """Plain temperature sampling on CUDA runs as one Triton pass (`sample_kernel`)."""
    return logits.is_cuda and inp.keys is not None and not (inp.needs_sort or inp.needs_min_p)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
    # Keep a token if it is among the top k and the mass before it is below top_p.
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (rank < top_k.unsqueeze(1)) & (mass_before < top_p.unsqueeze(1))
    keep[:, 0] = True
    return torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
