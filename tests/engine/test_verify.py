"""Lossless means lossless: statistical tests of verification for every kind of draft distribution.

Each test runs the real, batched ``verify_speculative`` / ``verify_exact`` on N = 200,000 independent
draft blocks drawn from fixed random target rows ``p_0..p_gamma`` and draft rows ``q_0..q_{gamma-1}``
(rows independent of the prefix, a special case of the sequential setting). Lossless verification then
implies, and the tests assert, each count within 6 binomial standard deviations of its expectation
(precisely: the Bernstein bound ``6 + 6 sqrt(1 + n p (1 - p))`` of ``conftest.assert_counts_match``,
false-alarm probability about 3e-8 per count, valid for small expected counts too):

* the token emitted at block position j, among blocks that reach j, has law ``p_j``;
* a token with ``p_j = 0`` is never emitted at position j (exactly zero count);
* the number of accepted drafts has law ``[1 - a_0, a_0 (1 - a_1), ..., a_0 ... a_{gamma-1}]`` with
  ``a_i = sum_x min(p_i(x), q_i(x))`` for speculative sampling and ``a_i = sum_x p_i(x) q_i(x)`` for
  exact-match verification.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.verify import verify_exact, verify_speculative
from pipeline.errors import DrafterError
from tests.engine.conftest import assert_counts_match

N = 200_000
GAMMA = 3
VOCAB = 12


def _dirichlet(
    shape: tuple[int, ...], generator: torch.Generator, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """Random distributions over the last axis, with optional forced zeros (``zero`` mask)."""
    weights = -torch.log(torch.rand(shape, generator=generator, dtype=torch.float64))
    if zero is not None:
        weights = weights.masked_fill(zero, 0.0)
    return weights / weights.sum(-1, keepdim=True)


def _draw_drafts(q: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Sample ``(N, gamma)`` drafts from (possibly sub-stochastic) rows; missing mass drafts ``-1``."""
    missing = (1.0 - q.sum(-1, keepdim=True)).clamp(min=0.0)
    augmented = torch.cat([q, missing], dim=-1).expand(N, -1, -1)
    drafts = sample(augmented, generator)
    return torch.where(drafts == q.shape[-1], -1, drafts)


def _check_law(
    p: torch.Tensor,
    n_accepted: torch.Tensor,
    next_token: torch.Tensor,
    drafts: torch.Tensor,
    accept_probs: torch.Tensor,
) -> None:
    """Shared assertions: accepted-count law and per-position emitted-token law."""
    survive = torch.cumprod(torch.cat([torch.ones(1, dtype=torch.float64), accept_probs]), 0)
    count_law = survive.clone()
    count_law[:-1] = survive[:-1] * (1 - accept_probs)
    assert_counts_match(
        torch.bincount(n_accepted, minlength=GAMMA + 1).double(), count_law, N, "accepted count"
    )
    for j in range(GAMMA + 1):
        reached = n_accepted >= j
        emitted = torch.where(
            n_accepted[reached] == j,
            next_token[reached],
            drafts[reached][:, j] if j < GAMMA else next_token[reached],
        )
        # bincount raises on -1, so an emitted untranslatable draft would fail here too.
        counts = torch.bincount(emitted, minlength=VOCAB).double()
        assert_counts_match(counts, p[j], int(reached.sum()), f"token law at position {j}")


def _run_speculative(p: torch.Tensor, q: torch.Tensor, seed: int) -> torch.Tensor:
    """Verify N blocks drafted from ``q`` against ``p`` and check the law; the drafts verified."""
    generator = torch.Generator().manual_seed(seed)
    drafts = _draw_drafts(q, generator)
    n_accepted, next_token = verify_speculative(p.expand(N, -1, -1), q.expand(N, -1, -1), drafts, generator)
    accept_probs = torch.minimum(p[:GAMMA], q).sum(-1)
    _check_law(p, n_accepted, next_token, drafts, accept_probs)
    return drafts


def test_full_draft_distribution() -> None:
    """Dense random p and q (full LM head). N = 200k blocks, gamma = 3, V = 12, 6σ (Bernstein) bounds."""
    g = torch.Generator().manual_seed(1)
    _run_speculative(_dirichlet((GAMMA + 1, VOCAB), g), _dirichlet((GAMMA, VOCAB), g), seed=11)


def test_shortlist_draft_with_zero_target_tokens() -> None:
    """q zero outside a 5-token shortlist; p zero on 3 tokens (top-k style), two of them shortlisted, so
    drafts with p(x) = 0 occur and must always be rejected. N = 200k, 6σ (Bernstein) bounds, zero counts exact."""
    g = torch.Generator().manual_seed(2)
    off_shortlist = torch.ones(VOCAB, dtype=torch.bool)
    off_shortlist[[0, 3, 4, 7, 9]] = False
    p_zero = torch.zeros(VOCAB, dtype=torch.bool)
    p_zero[[3, 9, 11]] = True
    p = _dirichlet((GAMMA + 1, VOCAB), g, zero=p_zero.expand(GAMMA + 1, -1))
    q = _dirichlet((GAMMA, VOCAB), g, zero=off_shortlist.expand(GAMMA, -1))
    _run_speculative(p, q, seed=12)


def test_target_mass_outside_drafter_vocabulary() -> None:
    """Half the vocabulary is unknown to the drafter (q = 0) and carries most of p's mass, so rejections
    dominate and the residual must supply those tokens. N = 200k, 6σ (Bernstein) bounds."""
    g = torch.Generator().manual_seed(3)
    unknown = torch.arange(VOCAB) >= VOCAB // 2
    p = _dirichlet((GAMMA + 1, VOCAB), g)
    p = torch.where(unknown, 4 * p, p)
    p = p / p.sum(-1, keepdim=True)
    q = _dirichlet((GAMMA, VOCAB), g, zero=unknown.expand(GAMMA, -1))
    _run_speculative(p, q, seed=13)


def test_substochastic_draft_with_untranslatable_tokens() -> None:
    """Union-style q: 30 % of the drafter's mass is on tokens with no target id (drafted as -1, always
    rejected), so q rows sum to 0.7. N = 200k, 6σ (Bernstein) bounds."""
    g = torch.Generator().manual_seed(4)
    p = _dirichlet((GAMMA + 1, VOCAB), g)
    q = 0.7 * _dirichlet((GAMMA, VOCAB), g)
    drafts = _run_speculative(p, q, seed=14)
    assert 0.25 < float((drafts == -1).double().mean()) < 0.35  # the -1 path really ran


def test_exact_match_verification() -> None:
    """q = None (SLEM): the target samples y_i ~ p_i and accepts while y_i equals the draft; drafts come
    from an unrelated q with some -1 drafts. Count law uses a_i = sum p_i q_i. N = 200k, 6σ (Bernstein) bounds."""
    g = torch.Generator().manual_seed(5)
    p = _dirichlet((GAMMA + 1, VOCAB), g, zero=(torch.arange(VOCAB) == 2).expand(GAMMA + 1, -1))
    q = 0.9 * _dirichlet((GAMMA, VOCAB), g)
    generator = torch.Generator().manual_seed(15)
    drafts = _draw_drafts(q, generator)
    n_accepted, next_token = verify_exact(
        p.expand(N, -1, -1), drafts, generator, SamplingParams(temperature=1.0)
    )
    _check_law(p, n_accepted, next_token, drafts, (p[:GAMMA] * q).sum(-1))


def test_identical_p_and_q_accepts_everything_without_nan() -> None:
    """p = q: every draft is accepted (the zero-residual fallback is never needed, and never NaNs)."""
    g = torch.Generator().manual_seed(6)
    p = _dirichlet((GAMMA + 1, VOCAB), g)
    drafts = _draw_drafts(p[:GAMMA], g)[:1000]
    n, token = verify_speculative(p.expand(1000, -1, -1), p[:GAMMA].expand(1000, -1, -1), drafts, g)
    assert bool((n == GAMMA).all())
    assert bool(((token >= 0) & (token < VOCAB)).all())


def test_greedy_is_argmax_exact_match() -> None:
    """One-hot p and q: accept exactly the leading drafts equal to the target argmax, then emit the argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 2.0], [0.0, 0.0, 5.0], [1.0, 0.0, 0.0]])
    greedy = SamplingParams()
    p = standardise(logits, greedy)
    assert p.argmax(-1).tolist() == [1, 0, 2, 0]  # the tie in row 1 goes to the lowest id
    for drafts, expected in [
        ([1, 0, 2], (3, 0)),
        ([1, 2, 2], (1, 0)),
        ([0, 0, 2], (0, 1)),
        ([1, 0, -1], (2, 2)),
    ]:
        q = torch.nn.functional.one_hot(torch.tensor(drafts).clamp(min=0), 3).double()
        g = torch.Generator().manual_seed(0)
        assert verify_speculative(p, q, drafts, g) == expected
        assert verify_exact(p, drafts, g, greedy) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_standardise_in_the_logits_dtype_is_the_float64_argmax(dtype: torch.dtype) -> None:
    """Greedy standardising takes the argmax before widening to float64: on rows with ties (exact in every dtype
    here), -inf entries and values that round together in the narrow dtype, the one-hot equals the one the float64
    logits give, and it is float64."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 50, generator=g).to(dtype)
    logits[:16, 7] = logits[:16, 3] = logits[:16].max() + 1  # ties: the lower id wins
    logits[16:32, :10] = float("-inf")
    logits[32:48] = (logits[32:48] * 1e-3 + 100).to(dtype)  # narrow values that collide after rounding
    hot = standardise(logits, SamplingParams())
    wide = logits.to(torch.float64)
    expected = torch.zeros_like(wide).scatter_(-1, wide.argmax(-1, keepdim=True), 1.0)
    assert hot.dtype == torch.float64 and torch.equal(hot, expected)
    assert hot[:16].argmax(-1).eq(3).all()


def test_unbatched_call_matches_batch_of_one() -> None:
    """The list/2-D form is the batched code with B = 1: same generator state, same answer."""
    g = torch.Generator().manual_seed(7)
    p, q = _dirichlet((GAMMA + 1, VOCAB), g), _dirichlet((GAMMA, VOCAB), g)
    for seed in range(50):
        drafts = sample(q, torch.Generator().manual_seed(seed)).tolist()
        single = verify_speculative(p, q, drafts, torch.Generator().manual_seed(seed))
        n, t = verify_speculative(
            p[None], q[None], torch.tensor([drafts]), torch.Generator().manual_seed(seed)
        )
        assert single == (int(n), int(t))


def test_a_round_with_no_draft_samples_from_p() -> None:
    """gamma' = 0 (a proposer with nothing to draft, e.g. EAGLE-3 after a one-token prompt): nothing is
    accepted and the token comes from p_0, exactly as a plain sample would draw it."""
    p = _dirichlet((1, VOCAB), torch.Generator().manual_seed(9))
    q = torch.zeros(0, VOCAB, dtype=torch.float64)
    for seed in range(20):
        expected = int(sample(p[0], torch.Generator().manual_seed(seed)))
        assert verify_speculative(p, q, [], torch.Generator().manual_seed(seed)) == (0, expected)


def test_zero_draft_probability_for_own_token_is_refused() -> None:
    p = _dirichlet((2, VOCAB), torch.Generator().manual_seed(8))
    q = torch.zeros(1, VOCAB, dtype=torch.float64)
    q[0, 1] = 1.0
    with pytest.raises(DrafterError, match="zero or non-finite draft probability"):
        verify_speculative(p, q, [0], torch.Generator())


@pytest.mark.parametrize("temperature", [math.inf, math.nan, -1.0])
def test_a_temperature_that_is_not_finite_and_non_negative_is_refused(temperature: float) -> None:
    with pytest.raises(DrafterError, match="finite and non-negative"):
        SamplingParams(temperature=temperature)


def test_standardise_filters() -> None:
    """Temperature, top-k and top-p give the distributions their definitions say."""
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    probs = standardise(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64))
    assert probs.dtype == torch.float64
    top2 = standardise(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([5 / 7, 2 / 7, 0, 0, 0], dtype=torch.float64))
    # Nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is needed; the fourth is not.
    nucleus = standardise(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(nucleus, torch.tensor([0.5, 0.2, 0.15, 0, 0], dtype=torch.float64) / 0.85)
    hot = standardise(logits, SamplingParams(temperature=2.0))
    expected = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64).sqrt()
    torch.testing.assert_close(hot, expected / expected.sum())
    masked = standardise(torch.tensor([0.0, float("-inf"), 0.0]), SamplingParams(temperature=1.0))
    assert masked.tolist() == [0.5, 0.0, 0.5]


def test_sample_never_draws_zero_weight_and_follows_weights() -> None:
    """Inverse-CDF sampler on a sub-stochastic row with zeros: N = 200k draws, 6σ (Bernstein) bounds."""
    weights = torch.tensor([0.0, 0.3, 0.0, 0.1, 0.2, 0.0], dtype=torch.float64)
    draws = sample(weights.expand(N, -1), torch.Generator().manual_seed(9))
    assert_counts_match(torch.bincount(draws, minlength=6).double(), weights / weights.sum(), N, "sampler")


def test_zero_drafts_emit_a_sample_of_p() -> None:
    """gamma' = 0 (a proposer that drafted nothing): nothing is accepted and the one emitted token is a
    sample of p_0, batched and unbatched. N = 200k blocks, 6σ (Bernstein) bounds, zero counts exact."""
    g = torch.Generator().manual_seed(10)
    p = _dirichlet((1, VOCAB), g, zero=(torch.arange(VOCAB) % 4 == 1).expand(1, -1))
    empty_q = torch.zeros(0, VOCAB, dtype=torch.float64)
    n_accepted, next_token = verify_speculative(
        p.expand(N, -1, -1), empty_q.expand(N, -1, -1), torch.zeros(N, 0, dtype=torch.long), g
    )
    assert bool((n_accepted == 0).all())
    assert_counts_match(torch.bincount(next_token, minlength=VOCAB).double(), p[0], N, "zero-draft token")
    n, token = verify_speculative(p, empty_q, [], torch.Generator().manual_seed(0))
    assert n == 0 and 0 <= token < VOCAB and float(p[0, token]) > 0


def test_q_of_another_width_than_p_is_refused() -> None:
    p = _dirichlet((2, VOCAB), torch.Generator().manual_seed(8))
    for q in (torch.full((1, VOCAB - 1), 1 / (VOCAB - 1)), torch.zeros(0, VOCAB + 1)):
        tokens = [0] if q.shape[0] else []
        with pytest.raises(ValueError, match=f"q needs {VOCAB} columns"):
            verify_speculative(p[: len(tokens) + 1], q.double(), tokens, torch.Generator())
