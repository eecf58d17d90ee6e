"""One draft-then-verify round: the proposer drafts, the target scores every draft in one forward, the verifier
accepts a prefix, and the target's session rolls back to it.

A proposal whose drafts are host ids (the string-level and cross-tokenizer methods, which must read their text)
is verified as it always was (:func:`_host_round`). A proposal whose drafts stay on the device — every method that
drafts in the target's vocabulary (full head, shortlists, routed heads, RDK, EAGLE-3, DFlash) — is verified
without the host reading anything until the round is decided (:func:`_device_round`): the drafts are fed to the
target straight from the device (a draft with no target id, ``-1``, is fed as id 0: it is rejected with
certainty, so nothing after it is ever kept), verification runs on the device, and **one** device → host transfer
per round carries the accepted count, the number of drafts verified and the emitted tokens. The checks that would
need a host read (an id outside the target vocabulary, a drafted token with ``q = 0``) are folded into a device
flag the loop reads once, after the generation (:class:`RoundChecks`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from pipeline.engine.proposers import Proposal, Proposer
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import SessionBase, TargetState
from pipeline.engine.static import EventClock
from pipeline.engine.verify import (
    bad_draft_law,
    non_finite_target,
    target_logits_flag,
    verify_exact,
    verify_speculative,
    zero_or_non_finite_q,
)
from pipeline.errors import DrafterError


@dataclass
class Round:
    """One draft-then-verify round.

    Attributes:
        drafted: Drafts the proposer returned.
        verified: Draft positions the target scored (drafts up to and including the first without a target id).
        accepted: Leading drafts accepted.
        emitted: The accepted drafts and the token the target emitted after them.
        p_next: The target's standardised distribution the last emitted token was drawn from (``(V,)``).
        drafter_seconds: Time spent in the proposer (0 where a :class:`RoundClocks` keeps it instead).
        emitted_device: ``emitted`` on the target's device, followed by scratch (``(drafted + 1,)``), after a device
            round; None after a host round.
    """

    drafted: int
    verified: int
    accepted: int
    emitted: list[int]
    p_next: Tensor
    drafter_seconds: float
    emitted_device: Tensor | None = None


@dataclass
class RoundClocks:
    """The phases of a generation's rounds, timed without synchronising (:class:`~pipeline.engine.static.EventClock`):
    ``draft`` (the proposer), ``verify`` (the target's forward and the verification)."""

    draft: EventClock
    verify: EventClock

    @classmethod
    def on(cls, device: torch.device) -> RoundClocks:
        return cls(EventClock(device), EventClock(device))


@dataclass
class RoundChecks:
    """What device rounds could not check without a host read, folded into one flag read after the generation."""

    bad_ids: Tensor | None = None
    zero_q: Tensor | None = None
    bad_target: Tensor | None = None
    vocab: int = 0

    def add(self, name: str, flag: Tensor) -> None:
        current = getattr(self, name)
        setattr(self, name, flag if current is None else current | flag)

    def target(self, logits: Tensor) -> Tensor:
        """Note whether the target's ``logits`` are finite (a device flag); returns them."""
        self.add("bad_target", target_logits_flag(logits))
        return logits

    def raise_if_any(self) -> None:
        """Raise :class:`DrafterError` if any round saw target logits that are not finite, an id outside the
        vocabulary, or a draft law that is zero at a draft or not finite (the one host read of these checks)."""
        if self.bad_target is not None and bool(self.bad_target):
            raise non_finite_target()
        if self.bad_ids is not None and bool(self.bad_ids):
            raise _outside_vocabulary(self.vocab, "an id out of range")
        if self.zero_q is not None and bool(self.zero_q):
            raise zero_or_non_finite_q()


def _outside_vocabulary(vocab: int, found: str) -> DrafterError:
    return DrafterError("the drafter proposed ids outside the target vocabulary",
                        expected=f"ids in [0, {vocab}) or -1 (no target id)", found=found,
                        fix="map drafter ids to target ids (pipeline.vocab.maps) or pass target_vocab_size to the "
                            "proposer")


def _check_proposal(proposal: Proposal, gamma: int, vocab: int) -> tuple[list[int], Tensor | None]:
    tokens = [int(t) for t in proposal.tokens[:gamma]]
    bad = [t for t in tokens if t < -1 or t >= vocab]
    if bad:
        raise _outside_vocabulary(vocab, f"{bad[:5]}")
    return tokens, _check_q(proposal.q, len(tokens), vocab)


def _check_q(q: Tensor | None, drafted: int, vocab: int) -> Tensor | None:
    """``q`` cut to the drafts and padded to the target's width (shapes only: no host read)."""
    if q is None:
        return None
    if not drafted and q.dim() != 2 and q.numel() == 0:
        # Nothing drafted: the round samples from p alone, whatever the shape of the empty q.
        q = q.reshape(0, vocab)
    if q.dim() != 2 or q.shape[0] < drafted:
        raise DrafterError(
            "the draft distributions do not match the drafts",
            expected=f"q of shape (gamma', V) with a row for each of the {drafted} drafts",
            found=f"q of shape {tuple(q.shape)}",
            fix="return one row of q per drafted token (an empty (0, V) tensor when drafting nothing)",
        )
    q = q[:drafted].to(torch.float64)
    if q.shape[-1] < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))  # ids the drafter lacks get q = 0
    elif q.shape[-1] > vocab:
        raise DrafterError(
            "the draft distribution is wider than the target vocabulary",
            expected=f"q with at most {vocab} columns (target ids)",
            found=f"{q.shape[-1]} columns",
            fix="construct the proposer with target_vocab_size set to the target's",
        )
    return q


def speculative_round(model: SessionBase, proposer: Proposer, sequence: list[int], gamma: int, params: SamplingParams,
                      generator: torch.Generator, last_p: Tensor | None, vocab: int, *,
                      clocks: RoundClocks | None = None, checks: RoundChecks | None = None,
                      context_ids: Tensor | None = None) -> Round:
    """Draft ``gamma`` tokens after ``sequence``, score them in one target forward, verify, and roll the target
    session back to the accepted prefix (``sequence`` itself is not changed).

    ``model`` (a :class:`~pipeline.engine.session.ModelSession` or
    :class:`~pipeline.engine.static.StaticSession`) holds every position of ``sequence`` but the newest (the
    invariant both decode loops keep); ``context_ids``, when given, holds ``sequence`` on the device (proposers and
    the verify forward read the ids from there, nothing is copied from the host). Without ``clocks`` the proposer's time is measured synchronised into
    :attr:`Round.drafter_seconds`; without ``checks`` a device round's deferred checks are read at its end.
    """
    own_checks = checks is None
    checks = checks if checks is not None else RoundChecks(vocab=vocab)
    drafted: Proposal | None = None
    drafter_seconds = 0.0
    if gamma > 0:
        state = TargetState(model.layers, model.hidden(), last_p, len(model.ids), context_ids)
        if clocks is not None:
            clocks.draft.start()
            drafted = proposer.propose(list(sequence), gamma, params, generator, state)
            clocks.draft.stop()
        else:  # synchronised wall time, charged to this round
            start = time.perf_counter()
            drafted = proposer.propose(list(sequence), gamma, params, generator, state)
            model.sync()
            drafter_seconds = time.perf_counter() - start
    if drafted is None:  # a round with no room for drafts (the last one): the target's own token, from the device
        drafted = Proposal(torch.zeros(0, dtype=torch.long, device=model.device), None)
    if isinstance(drafted.tokens, Tensor):
        step = _device_round(model, drafted, sequence, gamma, params, generator, vocab, clocks, checks, context_ids)
        if own_checks:
            checks.raise_if_any()
    else:
        tokens, q = _check_proposal(drafted, gamma, vocab)
        step = _host_round(model, tokens, q, sequence, params, generator, clocks, checks)
        if own_checks:
            checks.raise_if_any()
    step.drafter_seconds = drafter_seconds
    return step


def _host_round(model: SessionBase, tokens: list[int], q: Tensor | None, sequence: list[int], params: SamplingParams,
                generator: torch.Generator, clocks: RoundClocks | None, checks: RoundChecks) -> Round:
    """Verify host-side drafts: fed up to the first one without a target id, verified, cropped."""
    # A draft with no target id cannot be fed to the target and is always rejected, so stop
    # feeding there; its own p-row (from the token before it) is still scored.
    drafted = len(tokens)
    fed = tokens.index(-1) if -1 in tokens else len(tokens)
    tokens = tokens[: fed + 1]
    if clocks is not None:
        clocks.verify.start()
    with _timed(model, clocks):
        # The session holds every position but the newest token's; feed it and the drafts.
        p = standardise(checks.target(model.feed(sequence[len(model.ids) :] + tokens[:fed], fed + 1)), params)
    if len(tokens) > fed:
        # Placeholder bonus row: never read, because the -1 draft is rejected with certainty.
        p = torch.cat([p, p[-1:]], dim=0)
    if q is None or params.greedy:
        # Greedy p is one-hot, where speculative sampling reduces to argmax exact match anyway.
        n_accepted, next_token = verify_exact(p, tokens, generator, params)
    else:
        n_accepted, next_token = verify_speculative(p, q[: len(tokens)], tokens, generator)
    model.crop(len(sequence) + n_accepted)  # cache and captured hidden states alike
    if clocks is not None:
        clocks.verify.stop()
    return Round(drafted, len(tokens), n_accepted, tokens[:n_accepted] + [next_token], p[n_accepted], 0.0)


def _device_round(model: SessionBase, proposal: Proposal, sequence: list[int], gamma: int, params: SamplingParams,
                  generator: torch.Generator, vocab: int, clocks: RoundClocks | None, checks: RoundChecks,
                  context_ids: Tensor | None) -> Round:
    """Verify drafts that are on the device, with one device → host transfer (see the module docstring)."""
    device = model.device
    tokens = proposal.tokens.reshape(-1)[:gamma].to(device=device, dtype=torch.long)
    drafted = tokens.shape[0]
    q = _check_q(proposal.q, drafted, vocab)
    checks.add("bad_ids", ((tokens < -1) | (tokens >= vocab)).any())
    if clocks is not None:
        clocks.verify.start()
    if context_ids is not None:
        head = context_ids[len(model.ids) : len(sequence)]
    else:
        head = torch.tensor(sequence[len(model.ids) :], dtype=torch.long, device=device)
    with _timed(model, clocks):
        logits = checks.target(model.feed(torch.cat([head, tokens.clamp(min=0)]), drafted + 1))
    valid = tokens >= 0
    if params.greedy:
        # p is one-hot at each row's argmax (ties to the lowest id, as standardise): exact match against it, without
        # building the (γ' + 1) × V rows; only the row the emitted token came from is built, for the next state
        choice = logits.argmax(dim=-1)
        n_accepted = torch.cumprod((choice[:drafted] == tokens).long(), dim=0).sum().reshape(1)
        next_token = choice.index_select(0, n_accepted)
        p_next = torch.zeros(logits.shape[-1], dtype=torch.float64, device=device).index_fill_(0, next_token, 1.0)
    else:
        p = standardise(logits, params)
        if q is not None:
            q_x = q.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            checks.add("zero_q", bad_draft_law(q, q_x, valid))
            n_accepted, next_token = verify_speculative(p.unsqueeze(0), q.unsqueeze(0), tokens.unsqueeze(0),
                                                        generator, strict=False)
        else:
            n_accepted, next_token = verify_exact(p.unsqueeze(0), tokens.unsqueeze(0), generator, params)
        p_next = p.index_select(0, n_accepted)[0]
    # Drafts verified: up to and including the first without a target id (it is rejected with certainty).
    positions = torch.arange(drafted + 1, device=device)
    first_missing = torch.where(torch.cat([~valid, valid.new_ones(1)]), positions, drafted + 1).min()
    verified = torch.clamp(first_missing + 1, max=drafted)
    emitted = torch.where(positions == n_accepted, next_token, torch.cat([tokens, tokens.new_zeros(1)]))
    packet = torch.cat([n_accepted, verified.reshape(1), emitted]).tolist()  # the round's one device → host read
    accepted, verified_count = int(packet[0]), int(packet[1])
    kept = [int(t) for t in packet[2 : 2 + accepted + 1]]
    model.commit(list(sequence) + kept[:accepted])  # cache and captured hidden states roll back together
    if clocks is not None:
        clocks.verify.stop()
    return Round(drafted, verified_count, accepted, kept, p_next, 0.0, emitted)


def _timed(model: SessionBase, clocks: RoundClocks | None) -> object:
    """The session's synchronised timer where no clocks keep the time, else nothing (the clocks need no sync)."""
    return model.timed() if clocks is None else nullcontext()
