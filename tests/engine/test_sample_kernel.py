"""The fused Gumbel-max sampling kernel against the torch sampler's noise and math.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before
the kernel module is imported).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (optional dependency 'gpu')")

from minisgl.engine.sampler import host_row_key, row_keys, uniform_from_keys  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel():
    from minisgl.engine import sample_kernel

    if DEVICE == "cpu" and "Interpreted" not in type(sample_kernel._gumbel_argmax_kernel).__name__:
        pytest.skip("sample_kernel was imported before TRITON_INTERPRET=1 was set")
    return sample_kernel


def test_host_row_key_matches_the_device_hash():
    seeds = [0, 1, 5, 2**40 + 3, 2**63 - 1, 123456789012345]
    steps = [0, 1, 7, 1000, 3, 2**20]
    got = [host_row_key(s, t) for s, t in zip(seeds, steps)]
    want = row_keys(torch.tensor(seeds), torch.tensor(steps)).tolist()
    assert got == want
    assert all(0 <= k < 2**32 for k in got)


def _gumbel_ref(logits: torch.Tensor, temp: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    u = uniform_from_keys(keys, logits.shape[1])
    scores = logits.float() / temp.clamp(min=1e-5).unsqueeze(1) - torch.log(-torch.log(u))
    return torch.where(temp == 0, logits.float().argmax(dim=1), scores.argmax(dim=1))


@pytest.mark.parametrize(
    "vocab,block,dtype",
    [(1000, 256, torch.float32), (5000, 4096, torch.float32), (300, 128, torch.float32),
     (1000, 256, torch.bfloat16)],  # bf16: the model's logits as the engine hands them over
)  # fmt: skip
def test_kernel_matches_torch_gumbel_max(vocab: int, block: int, dtype: torch.dtype):
    sk = _kernel()
    gen = torch.Generator().manual_seed(vocab)
    batch = 6
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE, dtype)
    temp = torch.tensor([0.6, 1.0, 0.0, 2.0, 0.3, 0.0], device=DEVICE)
    keys = torch.tensor([host_row_key(7 * i + 1, i) for i in range(batch)], device=DEVICE)
    got = sk.gumbel_argmax(logits, temp, keys, block=block)
    assert torch.equal(got.cpu(), _gumbel_ref(logits, temp, keys).cpu())
    greedy = logits.argmax(dim=1)
    assert got[2] == greedy[2] and got[5] == greedy[5]


def test_kernel_samples_the_softmax_distribution():
    sk = _kernel()
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    n = 1500  # rows are programs: the interpreter runs each one in Python
    keys = torch.tensor([host_row_key(i * 7919 + 11, 0) for i in range(n)])
    temp = torch.full((n,), 0.7)
    tokens = sk.gumbel_argmax(
        logits.repeat(n, 1).to(DEVICE), temp.to(DEVICE), keys.to(DEVICE), block=16
    )
    got = torch.bincount(tokens.cpu(), minlength=8).double() / n
    expected = torch.softmax(logits.double() / 0.7, dim=0)
    sigma = torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((got - expected).abs() <= 5 * sigma + 1e-9), (got, expected)


def test_uniforms_stay_strictly_inside_the_unit_interval():
    # The extreme hash values must not round to 0 or 1 in fp32.
    keys = torch.tensor([host_row_key(s, 0) for s in range(64)])
    u = uniform_from_keys(keys, 1 << 16)
    assert float(u.min()) > 0 and float(u.max()) < 1
    top = ((torch.tensor([(1 << 32) - 1]) >> 9).float() + 0.5) * (1.0 / (1 << 23))
    assert float(top) < 1.0


def test_kernel_never_samples_ids_the_stop_mask_removed():
    """min_tokens: the fused path gets logits with -inf at a row's stop ids (a whole block of
    them in row 0) and samples among the rest, as the torch reference does."""
    from minisgl.engine.sampler import StopMask, mask_stop_ids

    sk = _kernel()
    vocab, block, batch = 1000, 256, 4
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE)
    logits[:, 5] = 50.0  # the token every row would pick
    stop_ids = [set(range(256)), {5}, {5}, set()]
    mask = StopMask.build([True, True, False, True], stop_ids, vocab, torch.device(DEVICE))
    assert mask is not None
    masked = mask_stop_ids(logits, mask)
    temp = torch.tensor([1.0, 0.7, 1.0, 0.0], device=DEVICE)
    keys = torch.tensor([host_row_key(11 * i, i) for i in range(batch)], device=DEVICE)
    got = sk.gumbel_argmax(masked, temp, keys, block=block).cpu()
    assert torch.equal(got, _gumbel_ref(masked, temp, keys).cpu())
    assert got[0] >= 256 and got[1] != 5 and got[2] == 5 and got[3] == 5


def test_fused_rejection_matches_the_rejection_rule():
    """The verify step's fused path (log-sum-exp accept test, Gumbel race over the logits with
    the draft removed) takes the same decisions as `rejection_sample` on the full [N, V]
    distribution and uniforms, for the same keys."""
    _kernel()
    from minisgl.engine.speculative import fused_rejection
    from minisgl.spec.verify import rejection_sample

    n, vocab = 48, 500
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=gen) * 2
    temp = 0.4 + torch.rand(n, generator=gen)
    keys = torch.tensor([host_row_key(11 * i + 5, i % 7) for i in range(n)])
    draft = torch.randint(0, vocab, (n,), generator=gen)
    has = torch.rand(n, generator=gen) < 0.75
    # A draft the target is all but sure of, and one it can never sample (masked out).
    draft[0], has[0] = 7, True
    logits[0, 7] = 60.0
    draft[1], has[1] = 9, True
    logits[1, 9] = float("-inf")
    probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
    want = rejection_sample(probs, draft, has, uniform_from_keys(keys, vocab))
    got = fused_rejection(
        logits.to(DEVICE), temp.to(DEVICE), keys.to(DEVICE), draft.to(DEVICE), has.to(DEVICE)
    )
    assert torch.equal(got.accept.cpu(), want.accept)
    # (an accepted draft's choice is never used: row 0's residual underflows to all zeros in
    # the reference's probabilities, not in the fused path's logits)
    taken = ~want.accept
    assert torch.equal(got.choice.cpu()[taken], want.choice[taken])
    assert got.accept[0] and not got.accept[1] and got.choice[1] != 9
    assert 0 < int(want.accept.sum()) < int(has.sum())  # both outcomes occur
