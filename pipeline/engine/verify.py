"""Lossless verification of drafted tokens against the target distribution.

Two verifiers, both batched over a leading dimension so the statistical tests exercise the very code the
decode loop runs:

* :func:`verify_speculative` — speculative sampling (Leviathan et al. 2023, Alg. 1 / Thm. 3.5; Chen et
  al. 2023, Alg. 2): accept draft ``x_i ~ q_i`` with probability ``min(1, p_i(x)/q_i(x))``, on the first
  rejection emit a sample of ``norm(max(0, p_i - q_i))``, and after ``gamma'`` acceptances emit a bonus
  token from ``p_{gamma'}``. The emitted token then has law ``p_i`` exactly, for any ``q`` (including
  sub-stochastic rows whose missing mass belongs to drafts with no target id, encoded as ``-1``).
* :func:`verify_exact` — for proposers that cannot state ``q`` (SLEM): the target samples its own token
  at each position and a draft is accepted iff it is equal. With greedy decoding both verifiers reduce
  to "accept while the draft equals the target's argmax".

All arithmetic is float64 (see :mod:`pipeline.engine.sampling`).
"""

from __future__ import annotations

from typing import overload

import torch
from torch import Tensor

from pipeline.engine.sampling import SamplingParams, sample
from pipeline.errors import DrafterError


def bad_draft_law(q: Tensor, q_x: Tensor, valid: Tensor) -> Tensor:
    """Whether draft laws ``q`` are no laws, as a device flag (no host read): zero or NaN at a token drafted from
    them (``valid``: drafts with a target id; ``q_x`` their q), or a row holding NaN or infinity anywhere (the
    residual ``p − q`` would be NaN). ``q(x) <= 0`` alone let a NaN through."""
    return (~(q_x > 0) & valid).any() | ~torch.isfinite(q.sum(dim=-1)).all()


def zero_or_non_finite_q() -> DrafterError:
    return DrafterError("a proposal gave zero or non-finite draft probability to a token it drafted",
                        expected="q = the distribution each draft was sampled from: finite, positive at each draft",
                        found="q(x) = 0, or a q row holding NaN or infinity (a drafter forward that overflowed)",
                        fix="return the exact law the drafts were drawn from (Proposal.q); where the drafter's logits "
                            "overflowed, run it in float32 or bfloat16 rather than float16")


def non_finite_target() -> DrafterError:
    return DrafterError("the target's logits are not finite (NaN or infinity), so it has no distribution to decode",
                        expected="finite logits from every target forward",
                        found="a logit row whose largest entry is NaN or infinite (every generated token after it "
                              "would be meaningless)",
                        fix="load the target in float32 or bfloat16 where it ran in float16 (target.dtype), and check "
                            "its weights for NaN")


def target_logits_flag(logits: Tensor) -> Tensor:
    """Whether any row of the target's ``logits`` is not finite, as a device flag: its largest entry is NaN or
    infinite (``-inf`` alone marks ids that cannot be drawn, but not a whole row)."""
    return ~torch.isfinite(logits.amax(dim=-1)).all()


def _as_batch(p: Tensor, tokens: list[int] | Tensor) -> tuple[Tensor, Tensor, bool]:
    """Return ``p`` as ``(B, gamma'+1, V)``, tokens as ``(B, gamma')`` and whether a batch was given."""
    batched = p.dim() == 3
    tokens = torch.as_tensor(tokens, dtype=torch.long, device=p.device)
    if not batched:
        p, tokens = p.unsqueeze(0), tokens.reshape(1, -1)
    if p.shape[1] != tokens.shape[1] + 1:
        raise ValueError(f"p needs gamma'+1 = {tokens.shape[1] + 1} rows per sequence, got {p.shape[1]}")
    return p.to(torch.float64), tokens, batched


def _leading_accepts(accept: Tensor) -> Tensor:
    """Number of leading ``True`` entries per row of a ``(B, gamma')`` mask."""
    return torch.cumprod(accept.to(torch.long), dim=-1).sum(dim=-1)


@overload
def verify_speculative(
    p: Tensor, q: Tensor, tokens: list[int], generator: torch.Generator, *, strict: bool = True
) -> tuple[int, int]: ...
@overload
def verify_speculative(
    p: Tensor, q: Tensor, tokens: Tensor, generator: torch.Generator, *, strict: bool = True
) -> tuple[Tensor, Tensor]: ...
def verify_speculative(
    p: Tensor, q: Tensor, tokens: list[int] | Tensor, generator: torch.Generator, *, strict: bool = True
) -> tuple[int, int] | tuple[Tensor, Tensor]:
    """Speculative-sampling verification of one (or a batch of) draft blocks.

    Args:
        p: Target distributions, ``(gamma'+1, V)`` or batched ``(B, gamma'+1, V)``; row ``i`` is the
            target's standardised distribution after the context plus the first ``i`` drafts.
        q: Draft distributions, ``(gamma', V)`` or ``(B, gamma', V)``, row ``i`` the exact distribution
            draft ``i`` was drawn from (may be sub-stochastic); ``gamma' = 0`` (no drafts) is allowed.
        tokens: The drafts as target ids, ``-1`` for a draft with no target id; a list, or a
            ``(B, gamma')`` tensor for a batch.
        generator: Random source for the accept tests and the residual/bonus sample.
        strict: Check that ``q`` gives every drafted token a positive probability (a host read); the device
            round folds that check into a flag it reads once per generation instead (``strict=False``).

    Returns:
        ``(n_accepted, next_token)``: how many leading drafts are accepted and the token emitted after
        them (residual sample on rejection, bonus sample on full acceptance). Python ints when ``p``
        is 2-D (one block), ``(B,)`` int64 tensors when it is 3-D (a batch).

    Raises:
        ValueError: If the shapes of ``p``, ``q`` and ``tokens`` disagree, or ``q`` gives zero
            probability to a token it drafted.
    """
    p, tokens, batched = _as_batch(p, tokens)
    q = q.to(device=p.device, dtype=torch.float64)
    if not batched:
        q = q.unsqueeze(0)
    batch, gamma = tokens.shape
    if q.shape[-2] != gamma:
        raise ValueError(f"q needs gamma' = {gamma} rows per sequence, got {q.shape[-2]}")
    if q.shape[-1] != p.shape[-1]:
        raise ValueError(f"q needs {p.shape[-1]} columns (p's width), got {q.shape[-1]}")
    valid = tokens >= 0
    safe = tokens.clamp(min=0).unsqueeze(-1)
    p_x = p[:, :gamma].gather(-1, safe).squeeze(-1)
    q_x = q.gather(-1, safe).squeeze(-1)
    if strict:
        if not bool(torch.isfinite(p.sum(dim=-1)).all()):
            raise non_finite_target()
        if bool(bad_draft_law(q, q_x, valid)):
            raise zero_or_non_finite_q()
    uniform = torch.rand(
        (batch, gamma), generator=generator, dtype=torch.float64, device=generator.device
    ).to(p.device)
    # u < p/q written as u*q < p: no division, and p(x) = 0 rejects with certainty.
    accept = (uniform * q_x < p_x) & valid
    n_accepted = _leading_accepts(accept)

    rows = torch.arange(batch, device=p.device)
    p_next = p[rows, n_accepted]
    # A zero q-row after the last draft turns the residual into p_{gamma'}: one formula for both cases,
    # and for gamma' = 0 (nothing drafted) the emitted token is a plain sample of p_0.
    q_padded = torch.cat([q, q.new_zeros(batch, 1, q.shape[-1])], dim=1)
    residual = (p_next - q_padded[rows, n_accepted]).clamp_(min=0.0)
    # An all-zero residual needs p_i <= q_i everywhere, i.e. p_i = q_i for normalised rows; then every
    # draft with q_i(x) > 0 has p_i(x)/q_i(x) = 1 and is accepted, so rejecting at i has probability 0.
    # Falling back to p_i keeps that measure-zero case (or its float64 round-off twin) NaN-free.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    next_token = sample(residual, generator)
    if batched:
        return n_accepted, next_token
    return int(n_accepted[0]), int(next_token[0])


@overload
def verify_exact(
    p: Tensor, tokens: list[int], generator: torch.Generator, params: SamplingParams
) -> tuple[int, int]: ...
@overload
def verify_exact(
    p: Tensor, tokens: Tensor, generator: torch.Generator, params: SamplingParams
) -> tuple[Tensor, Tensor]: ...
def verify_exact(
    p: Tensor, tokens: list[int] | Tensor, generator: torch.Generator, params: SamplingParams
) -> tuple[int, int] | tuple[Tensor, Tensor]:
    """Exact-match verification for drafts whose distribution is unknown (``Proposal.q is None``).

    The target draws ``y_i ~ p_i`` at every position (the argmax when greedy); drafts are accepted
    while ``y_i == x_i`` and the first mismatching ``y_i`` (or ``y_{gamma'}`` after a full match) is
    emitted. Every emitted token is a genuine sample of the target given the emitted prefix, so the
    output law is the target's whatever the drafter did.

    Args:
        p: Standardised target distributions, ``(gamma'+1, V)`` or ``(B, gamma'+1, V)``.
        tokens: Drafted target ids (``-1`` never matches); list or ``(B, gamma')`` tensor.
        generator: Random source for the target's samples (unused when greedy).
        params: Sampling parameters; only ``params.greedy`` is read, as ``p`` is already standardised.

    Returns:
        ``(n_accepted, next_token)`` as in :func:`verify_speculative`.
    """
    p, tokens, batched = _as_batch(p, tokens)
    gamma = tokens.shape[1]
    target_tokens = p.argmax(dim=-1) if params.greedy else sample(p, generator)
    n_accepted = _leading_accepts(target_tokens[:, :gamma] == tokens)
    next_token = target_tokens.gather(-1, n_accepted.unsqueeze(-1)).squeeze(-1)
    if batched:
        return n_accepted, next_token
    return int(n_accepted[0]), int(next_token[0])
