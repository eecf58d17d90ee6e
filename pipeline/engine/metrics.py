"""Speculative-decoding metrics, aggregated over many prompts by summing counts (never averaging ratios).

Symbols follow the papers: ``alpha`` acceptance rate, ``tau`` mean accepted length, ``gamma`` drafts per
round, ``c`` the drafter/target cost ratio.

``tau`` is what the papers call the mean accepted length or block efficiency: tokens emitted per
drafting-verification round (Leviathan et al. 2023, Eq. 1: tokens per run of Alg. 1; VocabTrim §4,
"tokens generated per block"; DynaSpec §6, "tokens committed per draft-verification cycle"), i.e. the
accepted drafts plus the one token the target itself emits, so ``tau >= 1`` and autoregressive decoding,
one round of one token per target forward, has ``tau = 1`` exactly. It is counted as kept tokens over
rounds (:func:`verify_rounds`), not over target forwards: a proposer that reads target hidden states
has the prompt prefilled in a forward of its own, which emits nothing and is prompt processing that
autoregressive decoding does inside its first forward; it stays in ``target_forwards`` (the true forward
count, which times ``target_ms_per_forward``) and out of ``tau``. A last round cut short by EOS or by
``max_new_tokens`` counts as one round with the tokens actually kept, so the numerator is exactly the
tokens returned (each round keeps at least its first token, hence still ``tau >= 1``). A token the target's
prefill emitted before the first round (``DecodeOptions.first_token == "prefill"``, the order of vLLM, SGLang and
EAGLE's reference code) belongs to no round and is left out of the numerator, as those engines leave it out.

Two analytic models turn them into speedups, both per round and so consistent with this ``tau``:

* Leviathan et al. 2023, Eq. 1 and Thm. 3.8: expected tokens per round ``(1 - alpha^(gamma+1)) /
  (1 - alpha)`` (the expected ``tau``) and expected walltime improvement ``(1 - alpha^(gamma+1)) /
  ((1 - alpha)(gamma c + 1))``, which assume each draft is accepted independently with probability
  ``alpha`` — so they are fed the per-verified-draft estimate ``sum(position accepts) / sum(position
  attempts)``.
* Memory-bound speed-up, MBSU (Zhong & Bharadwaj 2024, "S3D", arXiv:2405.20314; VocabTrim §4):
  ``tau / (1 + gamma c)`` with ``c`` the drafter/target parameter ratio — a round reads the target's
  weights once and the drafter's ``gamma`` times and emits ``tau`` tokens, so this is the speedup if every
  forward costs time proportional to the weights it reads, i.e. batch-1 decoding on a GPU.

How sure a τ is: τ is a ratio of sums over prompts (kept tokens over rounds), so its standard error comes
from each prompt's residual ``kept_i − τ · rounds_i`` (the delta method for a ratio estimator, Cochran 1977,
§6.3): ``sqrt(Σ residual_i² / (n (n − 1))) / mean(rounds)``. Two methods decoded on the same prompts are compared
by the per-prompt difference of their residuals (each over its own mean rounds), which cancels what the prompts
share: :func:`paired_tau_difference`. Greedy decoding is deterministic, so this is the error from which prompts
were drawn, not from the drafter's training draw (retrain with another seed to see that one).

Everything returned is a plain dataclass of floats/ints/lists (``None`` where undefined) and serialises
to JSON via :meth:`SpeculationMetrics.to_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeline.engine.loop import GenerationResult


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """Leviathan et al. Eq. 1: expected tokens per round (the expected ``tau``) with i.i.d. acceptance ``alpha``."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Leviathan et al. Thm. 3.8: ``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))``.

    At ``alpha = 1`` the limit ``(gamma + 1) / (gamma c + 1)`` is returned.
    """
    return expected_tokens_per_round(alpha, gamma) / (gamma * cost_ratio + 1.0)


def memory_bound_speedup(tau: float, gamma: int, param_ratio: float) -> float:
    """MBSU = ``tau / (1 + gamma c)`` with ``c`` = drafter parameters / target parameters."""
    return tau / (1.0 + gamma * param_ratio)


def verify_rounds(result: GenerationResult) -> int:
    """Drafting-verification rounds of one generation: one per speculative round (``gamma >= 1``), and one
    per token for autoregressive decoding (``gamma = 0``: each target forward emits exactly one token)."""
    return len(result.accepted_per_round) if result.gamma > 0 else len(result.tokens)


def kept_tokens(result: GenerationResult) -> int:
    """τ's numerator for one generation: tokens its rounds kept (a token the prefill emitted is in no round)."""
    return len(result.tokens) - result.prefill_tokens


def _residuals(kept: Sequence[int], rounds: Sequence[int]) -> tuple[float, float, list[float]] | None:
    """(τ, mean rounds, per-prompt residual kept_i − τ · rounds_i), or None without two prompts that ran a round."""
    if len(kept) != len(rounds):
        raise ValueError(f"{len(kept)} kept-token counts for {len(rounds)} round counts: one of each per prompt")
    if len(kept) < 2 or sum(rounds) <= 0:
        return None
    tau = sum(kept) / sum(rounds)
    return tau, sum(rounds) / len(rounds), [y - tau * x for y, x in zip(kept, rounds, strict=True)]


def tau_standard_error(kept: Sequence[int], rounds: Sequence[int]) -> float | None:
    """Standard error of τ = Σ kept / Σ rounds over prompts (one entry each); None for fewer than two prompts."""
    fit = _residuals(kept, rounds)
    if fit is None:
        return None
    _, mean_rounds, residuals = fit
    n = len(residuals)
    return math.sqrt(sum(r * r for r in residuals) / (n * (n - 1))) / mean_rounds


def paired_tau_difference(kept_a: Sequence[int], rounds_a: Sequence[int], kept_b: Sequence[int],
                          rounds_b: Sequence[int]) -> tuple[float, float] | None:
    """τ_a − τ_b for two methods decoded on the same prompts (entry i of each is prompt i), and its standard
    error from the per-prompt differences of the linearised τs; None for fewer than two prompts."""
    if len(kept_a) != len(kept_b):
        raise ValueError(f"{len(kept_a)} prompts against {len(kept_b)}: a paired difference needs the same prompts")
    fit_a, fit_b = _residuals(kept_a, rounds_a), _residuals(kept_b, rounds_b)
    if fit_a is None or fit_b is None:
        return None
    (tau_a, mean_a, res_a), (tau_b, mean_b, res_b) = fit_a, fit_b
    d = [ra / mean_a - rb / mean_b for ra, rb in zip(res_a, res_b, strict=True)]
    n = len(d)
    mean_d = sum(d) / n  # 0 up to rounding: each residual sums to 0
    return tau_a - tau_b, math.sqrt(sum((x - mean_d) ** 2 for x in d) / (n * (n - 1)))


def parameter_ratio(drafter: torch.nn.Module, target: torch.nn.Module) -> float:
    """``c`` for MBSU: drafter parameter count over target parameter count (tied weights counted once)."""

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return count(drafter) / count(target)


@dataclass
class SpeculationMetrics:
    """Aggregate metrics of one method over a set of prompts (see the module docstring for symbols)."""

    method: str
    gamma: int
    prompts: int
    new_tokens: int
    target_forwards: int
    """Target forward passes, a proposer's prompt prefill included (times ``target_ms_per_forward``)."""
    rounds: int
    """Drafting-verification rounds (:func:`verify_rounds`): tau's denominator."""
    drafted: int
    accepted: int
    acceptance_rate: float | None
    """accepted drafts / drafted tokens (alpha as vLLM and most papers report it)."""
    verified_acceptance_rate: float | None
    """accepted drafts / drafts actually verified (Leviathan's i.i.d. alpha estimate)."""
    mean_accepted_length: float | None
    """tau: tokens kept per drafting-verification round (accepted drafts + the target's own token); >= 1."""
    tau_standard_error: float | None
    """Standard error of tau over the prompts (:func:`tau_standard_error`); None for one prompt."""
    kept_per_prompt: list[int]
    """Tau's numerator per prompt, in the order given (:func:`kept_tokens`)."""
    rounds_per_prompt: list[int]
    """Tau's denominator per prompt (:func:`verify_rounds`)."""
    per_position_acceptance: list[float | None]
    drafter_ms_per_round: float | None
    drafter_ms_per_draft: float | None
    target_ms_per_forward: float | None
    tokens_per_second: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    speedup_vs_autoregressive: float | None
    param_ratio: float | None
    mbsu: float | None
    leviathan_expected_speedup: float | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return asdict(self)


def summarize(
    results: Sequence[GenerationResult],
    baseline: Sequence[GenerationResult] | None = None,
    param_ratio: float | None = None,
) -> SpeculationMetrics:
    """Aggregate per-prompt results into one :class:`SpeculationMetrics`.

    Args:
        results: One :class:`GenerationResult` per prompt, all from the same method.
        baseline: Autoregressive results on the same prompts, for ``speedup_vs_autoregressive``.
        param_ratio: Drafter/target parameter ratio ``c`` (see :func:`parameter_ratio`), for MBSU and
            Leviathan's expected speedup.

    Returns:
        The aggregate metrics; fields that need missing inputs are ``None``.
    """
    gamma = max((r.gamma for r in results), default=0)
    new_tokens = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    kept_per_prompt = [kept_tokens(r) for r in results]
    rounds_per_prompt = [verify_rounds(r) for r in results]
    rounds = sum(rounds_per_prompt)
    drafting_rounds = sum(sum(1 for d in r.drafted_per_round if d > 0) for r in results)
    drafted = sum(sum(r.drafted_per_round) for r in results)
    accepted = sum(sum(r.accepted_per_round) for r in results)
    width = max((len(r.position_attempts) for r in results), default=0)
    attempts = [
        sum(r.position_attempts[i] for r in results if i < len(r.position_attempts)) for i in range(width)
    ]
    accepts = [
        sum(r.position_accepts[i] for r in results if i < len(r.position_accepts)) for i in range(width)
    ]
    drafter_seconds = sum(r.drafter_seconds for r in results)
    target_seconds = sum(r.target_seconds for r in results)
    wall = sum(r.wall_seconds for r in results)
    after_first = sum(r.wall_seconds - r.ttft_seconds for r in results if r.tokens)
    later_tokens = sum(len(r.tokens) - 1 for r in results if r.tokens)

    tau = _ratio(sum(kept_per_prompt), rounds)
    verified_alpha = _ratio(sum(accepts), sum(attempts))
    tokens_per_second = _ratio(new_tokens, wall)
    speedup = None
    if baseline:
        baseline_rate = _ratio(sum(len(r.tokens) for r in baseline), sum(r.wall_seconds for r in baseline))
        if tokens_per_second is not None and baseline_rate:
            speedup = tokens_per_second / baseline_rate
    mbsu = expected = None
    if param_ratio is not None and tau is not None:
        mbsu = memory_bound_speedup(tau, gamma, param_ratio)
        if verified_alpha is not None:
            expected = expected_speedup(verified_alpha, gamma, param_ratio)
    milli = 1000.0
    return SpeculationMetrics(
        method=results[0].method if results else "",
        gamma=gamma,
        prompts=len(results),
        new_tokens=new_tokens,
        target_forwards=forwards,
        rounds=rounds,
        drafted=drafted,
        accepted=accepted,
        acceptance_rate=_ratio(accepted, drafted),
        verified_acceptance_rate=verified_alpha,
        mean_accepted_length=tau,
        tau_standard_error=tau_standard_error(kept_per_prompt, rounds_per_prompt),
        kept_per_prompt=kept_per_prompt,
        rounds_per_prompt=rounds_per_prompt,
        per_position_acceptance=[_ratio(a, n) for a, n in zip(accepts, attempts, strict=True)],
        drafter_ms_per_round=_scaled(_ratio(drafter_seconds, drafting_rounds), milli),
        drafter_ms_per_draft=_scaled(_ratio(drafter_seconds, drafted), milli),
        target_ms_per_forward=_scaled(_ratio(target_seconds, forwards), milli),
        tokens_per_second=tokens_per_second,
        ttft_ms=_scaled(
            _ratio(sum(r.ttft_seconds for r in results if r.tokens), sum(1 for r in results if r.tokens)),
            milli,
        ),
        tpot_ms=_scaled(_ratio(after_first, later_tokens), milli),
        speedup_vs_autoregressive=speedup,
        param_ratio=param_ratio,
        mbsu=mbsu,
        leviathan_expected_speedup=expected,
    )


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor
