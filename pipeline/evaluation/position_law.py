"""Every emitted position's law: whether sampled speculative decoding emits, at each position, a sample of the target's
distribution given everything before it.

The first-token check (:meth:`~pipeline.evaluation.evaluator.Evaluator.sampling_check`) bins many draws of one
position against its known p. A later position has another p for every history, so its tokens cannot be binned.
Instead each emitted token ``x`` at a position whose target law is ``p`` (recomputed by one target forward over the
whole generation, standardised as the decode was) becomes a randomised probability integral transform

    u = F(x) + U · p(x),   F(x) = the mass of the tokens ordered before x,   U ~ U(0, 1) from a seeded generator,

with the order fixed before ``x`` is drawn. Whatever ``p`` is, ``u`` is uniform on (0, 1) given the past, so a
lossless decode's ``u`` are independent uniforms, whatever the drafter, the history or the round structure. Three
orders point at three ways a fault moves a law:

- **target order** (``p`` descending, ties by id): too much or too little mass on the target's likely tokens (a
  residual or bonus taken from another position's row, a temperature applied twice) moves the mean of ``u``;
- **draft order** (``q(x) / p(x)`` descending, where the round drafted at that position; ``q`` is the row the method
  reported for the draft): drafts kept too often or too rarely (a residual that ignores ``q``, an accept test against
  another ``q``) pull ``u`` toward 0 or toward 1;
- **id order** (token id ascending, the order the engine's inverse-CDF sampler walks): mass moved between tokens that
  sit together in both orders above but apart in id (a residual drawn by inverse CDF with a uniform it already used,
  the acceptance test's, which leans the corrections to high ids) moves the mean of ``u``.

A fault that keeps the mean of ``u`` in every order, and the target-order ``u``'s distribution, is not seen: a law
too hot on some histories and too cold on others at one offset, for example.

The statistics: the mean of the target-order ``u`` for each offset in the round (0 = the round's first token; offsets
with fewer than :data:`MIN_GROUP` positions merged with their neighbours), the mean of every draft-order ``u``, the
mean of every id-order ``u`` (each a z-score: ``(mean - 1/2) · sqrt(12 n)``, exact uniforms, so the normal
approximation holds at small n), and a Kolmogorov-Smirnov test of all target-order ``u``. Each is tested at
``alpha / m`` (m statistics): the check fails a lossless decode with probability at most ``alpha``. An emitted token
outside the target's support (probability 0 before any top-k or top-p truncation) fails it outright. One inside the
support but outside the recomputed nucleus is counted and takes ``u = 1``
(last in target order): the decode's own forwards and the check's one forward over the whole generation round apart
(far apart in bf16), so a token on the nucleus's edge may fall either side, while a decode that ignored the nucleus
emits such tokens often and moves the statistics.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from inspect import signature
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipeline.engine.loop import GenerationResult, generate_speculative
from pipeline.engine.proposers import Proposal, Proposer, TargetState
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.static import DecodeOptions

MIN_GROUP = 10
"""Fewest positions an offset group's statistic is computed over (sparse offsets are merged with their neighbours,
:func:`_grouped`). The mean of ten uniforms has lighter tails than the normal (|z| beyond 4: probability 1.1e-5,
Irwin-Hall, against the normal's 6.3e-5), so the normal bound stays conservative; the floor keeps offsets that a few
rounds reached from each taking a share of alpha."""


class DraftLog:
    """A proposer that drafts with ``inner`` and keeps each round's reported ``q`` rows of the current generation (on
    the host, float32), keyed by the round's context length. It reads each round's ``q`` from the device: for the check,
    not for timed decodes."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.name = inner.name
        self.target_layers = inner.target_layers
        self.rows: dict[int, Tensor] = {}

    def prepare(self, options: DecodeOptions) -> None:
        prepare = getattr(self.inner, "prepare", None)
        if prepare is not None:
            prepare(options)

    def reset(self) -> None:
        self.rows = {}
        self.inner.reset()

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: torch.Generator,
                state: TargetState) -> Proposal:
        proposal = self.inner.propose(context, gamma, params, generator, state)
        tokens = proposal.tokens
        drafted = min(tokens.numel() if isinstance(tokens, Tensor) else len(tokens), gamma)
        if proposal.q is not None and drafted:
            self.rows[len(context)] = proposal.q.reshape(-1, proposal.q.shape[-1])[:drafted].detach().to(
                "cpu", torch.float32)
        return proposal


def round_offsets(result: GenerationResult) -> list[int]:
    """For each new token of ``result``, its place in the round that emitted it (0 = the round's first token; a token
    the target's prefill emitted, and each token of autoregressive decoding, is a round of its own)."""
    if result.gamma == 0:
        return [0] * len(result.tokens)
    offsets = [0] * result.prefill_tokens
    for accepted in result.accepted_per_round:
        offsets.extend(range(accepted + 1))
    return offsets[: len(result.tokens)]


@dataclass
class Decode:
    """One sampled generation for the check: its prompt, its result, and the ``q`` rows its rounds reported."""

    prompt: list[int]
    result: GenerationResult
    q_rows: dict[int, Tensor] = field(default_factory=dict)


def _transform(p: Tensor, key: Tensor, token: int, uniform: float) -> float:
    """``u`` of ``token`` under ``p`` with the tokens ordered by ``key`` descending, ties by id ascending."""
    ids = torch.arange(p.shape[0])
    before = (key > key[token]) | ((key == key[token]) & (ids < token))
    return float(p[before].sum()) + uniform * float(p[token])


def _z(u: Sequence[float]) -> float:
    return (float(np.mean(u)) - 0.5) * float(np.sqrt(12 * len(u)))


@dataclass
class PositionLaw:
    """The check's statistics over a set of decodes (see the module docstring)."""

    positions: int
    impossible: int
    """Emitted tokens outside the target's support."""
    outside_nucleus: int
    """Emitted tokens inside the support but outside the recomputed top-k / top-p set."""
    groups: list[tuple[str, int, float]]
    """``(offsets, positions, z)`` of the target-order ``u`` per offset group."""
    draft_positions: int
    draft_z: float | None
    ks_pvalue: float
    id_z: float | None = None
    """z of the id-order ``u`` over every position (None: no position)."""
    drafted: int = 0
    """Drafts the decodes' rounds proposed, each verified (a check over none tests no draft)."""

    def statistics(self) -> int:
        return len(self.groups) + (self.draft_z is not None) + (self.id_z is not None) + 1

    def critical_z(self, alpha: float) -> float:
        from scipy.stats import norm  # deferred: pulls in scipy

        return float(norm.isf(alpha / (2 * self.statistics())))

    def failures(self, alpha: float) -> list[str]:
        """What the decodes got wrong at family-wise level ``alpha`` (empty: consistent with the target's law)."""
        bound, share = self.critical_z(alpha), alpha / self.statistics()
        found = [f"{self.impossible} emitted tokens outside the target's support"] if self.impossible else []
        found += [f"target-order z {z:+.2f} at offsets {label} ({n} positions)" for label, n, z in self.groups
                  if abs(z) > bound]
        if self.draft_z is not None and abs(self.draft_z) > bound:
            found.append(f"draft-order z {self.draft_z:+.2f} ({self.draft_positions} drafted positions)")
        if self.id_z is not None and abs(self.id_z) > bound:
            found.append(f"id-order z {self.id_z:+.2f} ({self.positions} positions)")
        if self.ks_pvalue < share:
            found.append(f"Kolmogorov-Smirnov p={self.ks_pvalue:.3g}")
        return found

    def detail(self, alpha: float) -> str:
        groups = ", ".join(f"{label}: {z:+.2f} (n={n})" for label, n, z in self.groups)
        draft = ("no drafted position reported a q" if self.draft_z is None
                 else f"draft-order z {self.draft_z:+.2f} (n={self.draft_positions})")
        ids = "no position" if self.id_z is None else f"id-order z {self.id_z:+.2f}"
        return (f"{self.positions} positions; target-order z by offset in the round {groups}; {draft}; {ids}; KS p="
                f"{self.ks_pvalue:.3g}; each |z| must stay within {self.critical_z(alpha):.2f} (family-wise alpha "
                f"{alpha:g} over {self.statistics()} statistics); tokens emitted outside the target's support: "
                f"{self.impossible}, outside the recomputed nucleus: {self.outside_nucleus}")


def _grouped(by_offset: dict[int, list[float]]) -> list[tuple[str, list[float]]]:
    """Offsets in order, merged with the offsets after them until a group holds MIN_GROUP positions; a sparse last
    group joins the one before it."""
    groups: list[tuple[int, int, list[float]]] = []
    for offset in sorted(by_offset):
        if groups and len(groups[-1][2]) < MIN_GROUP:
            first, _, values = groups.pop()
            groups.append((first, offset, values + by_offset[offset]))
        else:
            groups.append((offset, offset, list(by_offset[offset])))
    if len(groups) > 1 and len(groups[-1][2]) < MIN_GROUP:
        first, last, values = groups.pop()
        groups[-1] = (groups[-1][0], last, groups[-1][2] + values)
    return [(f"{a}" if a == b else f"{a}-{b}", values) for a, b, values in groups]


@torch.no_grad()
def position_law(target: torch.nn.Module, decodes: Iterable[Decode], params: SamplingParams,
                 seed: int = 0) -> PositionLaw:
    """The statistics of ``decodes`` against ``target``'s law under ``params`` (see the module docstring). ``decodes``
    is read once, each as it comes: from :func:`sampled_decodes`, a generation's ``q`` rows (γ rows of the target's
    vocabulary a round) are dropped once it is scored."""
    from scipy.stats import kstest  # deferred: pulls in scipy

    rng = np.random.default_rng(seed)
    device = next(target.parameters()).device
    by_offset: dict[int, list[float]] = {}
    draft_u: list[float] = []
    id_u: list[float] = []
    impossible = outside_nucleus = drafted = 0
    untruncated = replace(params, top_k=0, top_p=1.0)
    keeps = "logits_to_keep" in signature(target.forward).parameters
    for decode in decodes:
        tokens, start = decode.result.tokens, len(decode.prompt)
        drafted += sum(decode.result.drafted_per_round)
        if not tokens:
            continue
        ids = torch.tensor([decode.prompt + tokens[:-1]], device=device)
        keep = {"logits_to_keep": len(tokens)} if keeps else {}
        logits = target(ids, **keep).logits[0, -len(tokens) :].double()  # the rows that drew the new tokens
        rows = standardise(logits, params).to("cpu", torch.float64)
        round_start = start
        for i, (p, token, offset) in enumerate(zip(rows, tokens, round_offsets(decode.result), strict=True)):
            round_start = start + i if offset == 0 else round_start
            if p[token] <= 0:
                inside = bool(standardise(logits[i], untruncated)[token] > 0)
                outside_nucleus, impossible = outside_nucleus + inside, impossible + (not inside)
            by_offset.setdefault(offset, []).append(_transform(p, p, token, rng.random()))
            id_u.append(float(p[:token].sum()) + rng.random() * float(p[token]))
            q = decode.q_rows.get(round_start)
            if q is not None and offset < q.shape[0]:
                row = torch.nn.functional.pad(q[offset].double(), (0, p.shape[0] - q.shape[1]))  # ids it lacks: 0
                ratio = row / p.clamp(min=torch.finfo(torch.float64).tiny)
                draft_u.append(_transform(p, ratio, token, rng.random()))
    every = [u for values in by_offset.values() for u in values]
    return PositionLaw(
        positions=len(every), impossible=impossible, outside_nucleus=outside_nucleus,
        groups=[(label, len(values), _z(values)) for label, values in _grouped(by_offset)],
        draft_positions=len(draft_u), draft_z=_z(draft_u) if draft_u else None,
        ks_pvalue=float(kstest(every, "uniform").pvalue) if every else 1.0, drafted=drafted,
        id_z=_z(id_u) if id_u else None)


def sampled_decodes(target: torch.nn.Module, proposer: Proposer, prompts: Sequence[list[int]], new_tokens: int,
                    gamma: int, params: SamplingParams, generator: torch.Generator,
                    eos_token_id: int | Sequence[int] | None = None, options: DecodeOptions | None = None,
                    on_decode: Any = None) -> Iterator[Decode]:
    """One sampled speculative generation per prompt, each with the ``q`` rows its rounds reported, decoded as the
    caller asks for it."""
    log = DraftLog(proposer)
    for prompt in prompts:
        result = generate_speculative(target, log, prompt, new_tokens, gamma, params, generator, eos_token_id,
                                      options)
        if on_decode is not None:
            on_decode(result)
        yield Decode(list(prompt), result, log.rows)
