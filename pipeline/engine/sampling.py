"""Sampling parameters and the standardised distribution both target and drafter sample from.

Speculative sampling is lossless only if the target distribution ``p`` and the draft distribution ``q``
are *both* the distributions the tokens are actually drawn from after temperature, top-k and top-p
(Leviathan et al. 2023, §2.2: "we can apply standard sampling methods … to p and q"). This module owns
that one transform (:func:`standardise`) and the one sampler (:func:`sample`), so every part of the engine
draws tokens the same way. Everything is float64: the verification ratios ``p/q`` and the residual
``max(0, p - q)`` are differences of small numbers where float32 rounding would bias the output law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.errors import DrafterError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn from next-token logits.

    Attributes:
        temperature: Softmax temperature; ``0`` means greedy (argmax, ties to the lowest id).
        top_k: Keep only the ``top_k`` most likely tokens; ``0`` turns the filter off.
        top_p: Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (nucleus);
            ``1.0`` turns the filter off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise DrafterError(
                "sampling temperature must be finite and non-negative",
                expected="a finite temperature >= 0 (0 = greedy)",
                found=f"temperature={self.temperature}",
                fix="set temperature to 0 for greedy decoding or a positive value for sampling",
            )
        if self.top_k < 0:
            raise DrafterError(
                "top_k must be non-negative",
                expected="top_k >= 0 (0 = off)",
                found=f"top_k={self.top_k}",
                fix="use 0 to disable top-k filtering",
            )
        if not 0.0 < self.top_p <= 1.0:
            raise DrafterError(
                "top_p must lie in (0, 1]",
                expected="0 < top_p <= 1 (1 = off)",
                found=f"top_p={self.top_p}",
                fix="use 1.0 to disable nucleus filtering",
            )

    @property
    def greedy(self) -> bool:
        """Whether decoding is deterministic argmax."""
        return self.temperature == 0.0


def standardise(logits: Tensor, params: SamplingParams) -> Tensor:
    """Turn logits into the distribution tokens are drawn from.

    Applies temperature, then top-k, then top-p (the order Hugging Face ``generate`` uses). Greedy
    decoding gives a one-hot distribution at the argmax, ties broken towards the lowest id, so the
    verification code treats greedy and sampled decoding alike.

    Args:
        logits: ``(..., V)`` logits; ``-inf`` marks tokens that cannot be drawn.
        params: The sampling parameters.

    Returns:
        ``(..., V)`` float64 probabilities summing to 1 along the last dimension.
    """
    if params.greedy:
        # torch.argmax returns the first maximal index, i.e. ties go to the lowest id. Taken in the logits' own dtype:
        # widening to float64 is exact and keeps their order and ties, so the argmax is the same without copying
        # every row to float64 (a block drafter's (B - 1) x V rows; at V = 128k, 1 MiB a row).
        index = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float64, device=logits.device).scatter_(-1, index, 1.0)
    logits = logits.to(torch.float64)
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # A token survives if the tokens ranked above it have not yet reached top_p; the top token
        # always survives because the mass before it is 0.
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator) -> Tensor:
    """Draw one token per row by inverse-CDF sampling.

    Rows need not be normalised (a sub-stochastic row is sampled in proportion to its entries), and a
    zero entry can never be drawn. One uniform is consumed per row from ``generator``, so runs with the
    same seed are reproducible across CPU and GPU tensors. A row that is no law (NaN, nothing positive) still
    gives an id in ``[0, V)``, so the forward it is fed to stays valid; the loops refuse the generation that drew
    it (:class:`~pipeline.engine.rounds.RoundChecks`).

    Args:
        probs: ``(..., V)`` non-negative weights with a positive sum in every row.
        generator: The random source; it may live on a different device from ``probs``.

    Returns:
        ``(...)`` int64 token ids.
    """
    probs = probs.to(torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[..., -1:]
    uniform = torch.rand(
        probs.shape[:-1] + (1,), generator=generator, dtype=torch.float64, device=generator.device
    ).to(probs.device)
    index = torch.searchsorted(cdf, uniform * total, right=True)
    # Rounding can put uniform*total on the very top of the CDF; fall back to the last drawable token
    # rather than an out-of-range or zero-probability one.
    vocab = probs.shape[-1]
    positions = torch.arange(vocab, device=probs.device)
    last_positive = torch.where(probs > 0, positions, -1).amax(dim=-1, keepdim=True)
    index = torch.minimum(index, last_positive).clamp_(min=0)
    return index.squeeze(-1)


def draw(probs: Tensor, params: SamplingParams, generator: torch.Generator) -> Tensor:
    """One token per row of standardised ``probs``: the argmax when greedy (each row is one-hot there, so this is
    the token :func:`sample` would return, without its cumulative sums and without consuming ``generator``), else
    :func:`sample`."""
    return probs.argmax(dim=-1) if params.greedy else sample(probs, generator)
