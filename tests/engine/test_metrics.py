"""Metrics on hand-built generation results whose every aggregate is computed by hand in the comments."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline.engine.loop import GenerationResult
from pipeline.engine.metrics import (
    expected_speedup,
    expected_tokens_per_round,
    memory_bound_speedup,
    paired_tau_difference,
    summarize,
    tau_standard_error,
)


def _speculative_results() -> list[GenerationResult]:
    # Prompt A, gamma 3: rounds accept 2, 0, 3 of 3 drafts -> 3 + 1 + 4 = 8 tokens in 3 forwards.
    # Position attempts: round 1 verifies 0,1,2; round 2 only 0; round 3 all -> [3, 2, 2]; accepts [2, 2, 1].
    a = GenerationResult(
        tokens=list(range(8)), prompt_length=5, method="shortlist", gamma=3, target_forwards=3,
        drafted_per_round=[3, 3, 3], accepted_per_round=[2, 0, 3],
        position_attempts=[3, 2, 2], position_accepts=[2, 2, 1],
        drafter_seconds=0.03, target_seconds=0.06, wall_seconds=0.10, ttft_seconds=0.04,
    )  # fmt: skip
    # Prompt B, gamma 3: round 1 accepts 1 of 3, round 2 (capped at 1 draft) accepts it -> 2 + 2 = 4 tokens.
    b = GenerationResult(
        tokens=list(range(4)), prompt_length=7, method="shortlist", gamma=3, target_forwards=2,
        drafted_per_round=[3, 1], accepted_per_round=[1, 1],
        position_attempts=[2, 1, 0], position_accepts=[2, 0, 0],
        drafter_seconds=0.01, target_seconds=0.04, wall_seconds=0.05, ttft_seconds=0.02,
    )  # fmt: skip
    return [a, b]


def _autoregressive_results() -> list[GenerationResult]:
    return [
        GenerationResult(tokens=list(range(8)), prompt_length=5, method="autoregressive", target_forwards=8,
                         wall_seconds=0.2, ttft_seconds=0.03, target_seconds=0.19),
        GenerationResult(tokens=list(range(4)), prompt_length=7, method="autoregressive", target_forwards=4,
                         wall_seconds=0.1, ttft_seconds=0.03, target_seconds=0.09),
    ]  # fmt: skip


def test_summary_sums_counts_across_prompts() -> None:
    m = summarize(_speculative_results(), baseline=_autoregressive_results(), param_ratio=0.1)
    assert (m.new_tokens, m.target_forwards, m.rounds, m.drafted, m.accepted) == (12, 5, 5, 13, 7)
    assert m.acceptance_rate == pytest.approx(7 / 13)  # not the mean of 5/9 and 2/4
    assert m.verified_acceptance_rate == pytest.approx(7 / 10)
    assert m.mean_accepted_length == pytest.approx(12 / 5)
    assert m.per_position_acceptance == pytest.approx([4 / 5, 2 / 3, 1 / 2])
    assert m.drafter_ms_per_round == pytest.approx(40 / 5)
    assert m.drafter_ms_per_draft == pytest.approx(40 / 13)
    assert m.target_ms_per_forward == pytest.approx(100 / 5)
    assert m.tokens_per_second == pytest.approx(12 / 0.15)
    assert m.ttft_ms == pytest.approx(30.0)
    assert m.tpot_ms == pytest.approx(1000 * (0.06 + 0.03) / (7 + 3))
    assert m.speedup_vs_autoregressive == pytest.approx((12 / 0.15) / (12 / 0.3))
    assert m.mbsu == pytest.approx(2.4 / (1 + 3 * 0.1))
    assert m.leviathan_expected_speedup == pytest.approx((1 - 0.7**4) / (0.3 * 1.3))
    json.dumps(m.to_dict())


def test_autoregressive_summary_has_no_acceptance() -> None:
    m = summarize(_autoregressive_results())
    assert m.acceptance_rate is None and m.verified_acceptance_rate is None
    assert m.mean_accepted_length == 1.0
    assert m.per_position_acceptance == [] and m.mbsu is None and m.speedup_vs_autoregressive is None
    assert m.drafter_ms_per_round is None
    json.dumps(m.to_dict())


def test_leviathan_formulas() -> None:
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_speedup(1.0, 4, 0.05) == pytest.approx(5 / 1.2)
    # The alpha -> 1 limit is continuous with the closed form.
    assert expected_speedup(1 - 1e-9, 4, 0.05) == pytest.approx(5 / 1.2, rel=1e-6)
    assert expected_speedup(0.8, 3, 0.0) == pytest.approx((1 - 0.8**4) / 0.2)
    assert memory_bound_speedup(3.0, 4, 0.05) == pytest.approx(2.5)
    assert math.isclose(memory_bound_speedup(1.0, 0, 0.3), 1.0)


def test_tau_counts_rounds_not_the_prefill_forward() -> None:
    # A proposer that reads target hidden states (eagle3) has the prompt prefilled in a forward of its own,
    # which emits nothing: 4 rounds accepting 0, 1, 0, 2 drafts emit 1 + 2 + 1 + 3 = 7 tokens in 5 forwards.
    # Per forward that is 7 / 5 = 1.4, and a run that accepts nothing reads 4 / 5 = 0.8 < 1; per round
    # (the papers' tau) 7 / 4 and exactly 1.
    eagle = GenerationResult(
        tokens=list(range(7)), prompt_length=9, method="eagle3", gamma=3, target_forwards=5,
        drafted_per_round=[3, 3, 3, 3], accepted_per_round=[0, 1, 0, 2],
        position_attempts=[4, 2, 1], position_accepts=[2, 1, 0],
    )  # fmt: skip
    m = summarize([eagle], param_ratio=0.1)
    assert (m.target_forwards, m.rounds) == (5, 4)
    assert m.mean_accepted_length == pytest.approx(7 / 4)
    assert m.mbsu == pytest.approx((7 / 4) / (1 + 3 * 0.1))
    rejected = GenerationResult(
        tokens=list(range(4)), prompt_length=9, method="eagle3", gamma=3, target_forwards=5,
        drafted_per_round=[3, 3, 3, 3], accepted_per_round=[0, 0, 0, 0],
        position_attempts=[4, 0, 0], position_accepts=[0, 0, 0],
    )  # fmt: skip
    assert summarize([rejected]).mean_accepted_length == 1.0


def test_a_last_round_cut_by_eos_counts_its_kept_tokens() -> None:
    # Round 1 accepts 1 of 3 (2 tokens); round 2 accepts all 3 drafts but the first is EOS, so of its 4
    # emitted tokens only that one is kept: 3 tokens over 2 rounds, not (2 + 4) / 2.
    eos_cut = GenerationResult(
        tokens=[5, 6, 1], prompt_length=4, method="full", gamma=3, target_forwards=2,
        drafted_per_round=[3, 3], accepted_per_round=[1, 3],
        position_attempts=[2, 2, 1], position_accepts=[2, 1, 1], stop_reason="eos",
    )  # fmt: skip
    m = summarize([eos_cut])
    assert m.rounds == 2 and m.new_tokens == 3
    assert m.mean_accepted_length == pytest.approx(3 / 2)


def test_autoregressive_rounds_are_its_tokens() -> None:
    m = summarize(_autoregressive_results())
    assert m.rounds == m.target_forwards == m.new_tokens == 12
    assert m.mean_accepted_length == 1.0


def test_tau_standard_error_by_hand() -> None:
    # tau = 60 / 12 = 5; residuals kept - 5 rounds: 0, -5, 5; sqrt(50 / (3 * 2)) over mean rounds 4
    assert tau_standard_error([10, 20, 30], [2, 5, 5]) == pytest.approx(math.sqrt(50 / 6) / 4)
    # _speculative_results: kept 8 and 4 in 3 and 2 rounds; tau 2.4; residuals 0.8, -0.8; sqrt(1.28 / 2) / 2.5
    assert summarize(_speculative_results()).tau_standard_error == pytest.approx(0.8 / 2.5)
    assert summarize(_autoregressive_results()).tau_standard_error == 0.0  # one token a round: no spread
    assert summarize(_speculative_results()[:1]).tau_standard_error is None  # one prompt: no spread to see
    with pytest.raises(ValueError, match="3 kept-token counts for 2 round counts"):
        tau_standard_error([1, 2, 3], [1, 2])


def test_paired_tau_difference_by_hand() -> None:
    # a as above (tau 5, residuals 0, -5, 5 over mean rounds 4); b: 52 / 13 = 4 with residuals 0, 0, 0, so the
    # pair's per-prompt differences are a's alone: 0, -1.25, 1.25 -> sqrt(3.125 / 6)
    difference, error = paired_tau_difference([10, 20, 30], [2, 5, 5], [8, 20, 24], [2, 5, 6])
    assert difference == pytest.approx(1.0) and error == pytest.approx(math.sqrt(3.125 / 6))
    assert paired_tau_difference([10, 20, 30], [2, 5, 5], [10, 20, 30], [2, 5, 5]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="3 prompts against 2: a paired difference needs the same prompts"):
        paired_tau_difference([10, 20, 30], [2, 5, 5], [10, 20], [2, 5])


def _evaluations(rng: np.random.Generator, alpha: np.ndarray, rounds: np.ndarray, gamma: int = 7) -> np.ndarray:
    """Kept tokens per prompt of ``len(alpha)`` prompts, each ``rounds[i]`` rounds of ``gamma`` drafts accepted
    one after the other with probability ``alpha[i]`` (a round keeps its accepted drafts plus one)."""
    draws = rng.random((alpha.size, int(rounds.max()), gamma)) < alpha[:, None, None]
    accepted = np.cumprod(draws, axis=2).sum(axis=2)  # the leading run of accepted drafts
    live = np.arange(int(rounds.max()))[None, :] < rounds[:, None]
    return ((accepted + 1) * live).sum(axis=1)


def test_the_standard_errors_are_the_spread_over_prompt_draws() -> None:
    """2,000 evaluations of 64 prompts each, every prompt with its own acceptance rate (Beta(8, 1.5)) and
    length (4-16 rounds) drawn anew; a second method decodes the same prompts at each one's rate minus 0.03.
    The standard deviation of tau-hat over the evaluations must match the mean reported standard error within 10 %
    (its sampling error at 2,000 draws is about 1.6 %), for one method and for the paired difference; the pairing
    must cut the error an unpaired difference would report by at least a third (seed 0: to 0.46 of it)."""
    rng = np.random.default_rng(0)
    taus, errors, differences, paired_errors, unpaired = [], [], [], [], []
    for _ in range(2000):
        alpha = rng.beta(8.0, 1.5, size=64)
        rounds = rng.integers(4, 17, size=64)
        kept_a = _evaluations(rng, alpha, rounds)
        kept_b = _evaluations(rng, np.clip(alpha - 0.03, 0.0, 1.0), rounds)
        taus.append(kept_a.sum() / rounds.sum())
        errors.append(tau_standard_error(kept_a.tolist(), rounds.tolist()))
        difference, error = paired_tau_difference(kept_a.tolist(), rounds.tolist(), kept_b.tolist(), rounds.tolist())
        differences.append(difference)
        paired_errors.append(error)
        unpaired.append(math.hypot(errors[-1], tau_standard_error(kept_b.tolist(), rounds.tolist())))
    assert np.std(taus, ddof=1) == pytest.approx(np.mean(errors), rel=0.10)
    assert np.std(differences, ddof=1) == pytest.approx(np.mean(paired_errors), rel=0.10)
    assert np.mean(paired_errors) < 2 / 3 * np.mean(unpaired)
