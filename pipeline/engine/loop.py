"""The decode loops: plain autoregressive decoding and draft-then-verify speculative decoding.

Both loops run the target through a :class:`~pipeline.engine.session.ModelSession` (KV cache), run
batch size 1, stop at EOS or after ``max_new_tokens``, and record what the metrics need
(:class:`GenerationResult`). A speculative round hands the proposer the target's state (hidden states
at the layers it declared, for every accepted position, and the last distribution:
:class:`~pipeline.engine.session.TargetState`), asks it for ``gamma'`` drafts, scores all of them plus
the bonus position in *one* target forward, verifies (:mod:`pipeline.engine.verify`) and crops the
target cache and captured hidden states back to the accepted prefix. With greedy parameters the
speculative loop emits exactly the autoregressive loop's tokens; with sampling it emits them with
exactly the same law.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from pipeline.engine.proposers import Proposal, Proposer
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import ModelSession, TargetState
from pipeline.engine.verify import verify_exact, verify_speculative
from pipeline.errors import DrafterError


@dataclass
class GenerationResult:
    """What one generation produced and what it cost.

    Attributes:
        tokens: The new tokens (prompt excluded), EOS included when it ended the sequence.
        prompt_length: Number of prompt tokens.
        method: ``"autoregressive"`` or the proposer's name.
        gamma: Draft length asked for per round (0 for autoregressive decoding).
        target_forwards: Target forward passes (prefill included).
        drafted_per_round: Drafts the proposer returned in each round.
        accepted_per_round: Drafts accepted in each round.
        position_attempts: ``[i]`` = rounds in which draft position ``i`` was verified.
        position_accepts: ``[i]`` = rounds in which draft position ``i`` was accepted.
        drafter_seconds: Time spent in the proposer.
        target_seconds: Time spent in target forwards (and standardising their logits).
        wall_seconds: End-to-end time of the call.
        ttft_seconds: Time from the call to the first new token.
        stop_reason: ``"eos"`` or ``"length"``.
    """

    tokens: list[int]
    prompt_length: int
    method: str
    gamma: int = 0
    target_forwards: int = 0
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    wall_seconds: float = 0.0
    ttft_seconds: float = 0.0
    stop_reason: str = "length"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view."""
        return asdict(self)


def _eos_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def _check_request(input_ids: list[int], max_new_tokens: int) -> None:
    if not input_ids:
        raise DrafterError(
            "cannot generate from an empty prompt",
            expected="at least one prompt token",
            found="0 tokens",
            fix="tokenise a non-empty prompt (a BOS token suffices)",
        )
    if max_new_tokens < 0:
        raise DrafterError(
            "max_new_tokens must be non-negative",
            expected="max_new_tokens >= 0",
            found=f"max_new_tokens={max_new_tokens}",
            fix="pass a non-negative length",
        )


def _finish(new: list[int], eos: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut ``new`` after its first EOS and at ``max_new_tokens``; report whether EOS ended it."""
    for i, token in enumerate(new[:max_new_tokens]):
        if token in eos:
            return new[: i + 1], True
    return new[:max_new_tokens], False


def generate_autoregressive(
    target: torch.nn.Module,
    input_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    eos_token_id: int | Sequence[int] | None = None,
) -> GenerationResult:
    """Decode one token per target forward: the baseline speculative decoding must reproduce.

    Args:
        target: A Hugging Face causal LM (eval mode is the caller's business).
        input_ids: Prompt token ids.
        max_new_tokens: Upper bound on new tokens.
        params: Sampling parameters.
        generator: Random source (unused when greedy).
        eos_token_id: Token id(s) that end the sequence.

    Returns:
        The :class:`GenerationResult`.
    """
    _check_request(input_ids, max_new_tokens)
    start = time.perf_counter()
    eos = _eos_set(eos_token_id)
    model = ModelSession(target)
    sequence = list(input_ids)
    result = GenerationResult(tokens=[], prompt_length=len(input_ids), method="autoregressive")
    stopped = False
    while len(result.tokens) < max_new_tokens and not stopped:
        with model.timed():
            probs = standardise(model.feed(sequence[len(model.ids) :]), params)
        token = int(probs[0].argmax()) if params.greedy else int(sample(probs[0], generator))
        if not result.tokens:
            result.ttft_seconds = time.perf_counter() - start
        result.tokens.append(token)
        sequence.append(token)
        stopped = token in eos
    result.stop_reason = "eos" if stopped else "length"
    result.target_forwards, result.target_seconds = model.forwards, model.seconds
    result.wall_seconds = time.perf_counter() - start
    return result


def _check_proposal(proposal: Proposal, gamma: int, vocab: int) -> tuple[list[int], Tensor | None]:
    tokens = [int(t) for t in proposal.tokens[:gamma]]
    bad = [t for t in tokens if t < -1 or t >= vocab]
    if bad:
        raise DrafterError(
            "the drafter proposed ids outside the target vocabulary",
            expected=f"ids in [0, {vocab}) or -1 (no target id)",
            found=f"{bad[:5]}",
            fix="map drafter ids to target ids (pipeline.vocab.maps) or pass "
            "target_vocab_size to the proposer",
        )
    q = proposal.q
    if q is None:
        return tokens, None
    if not tokens and q.dim() != 2 and q.numel() == 0:
        # Nothing drafted: the round samples from p alone, whatever the shape of the empty q.
        q = q.reshape(0, vocab)
    if q.dim() != 2 or q.shape[0] < len(tokens):
        raise DrafterError(
            "the draft distributions do not match the drafts",
            expected=f"q of shape (gamma', V) with a row for each of the {len(tokens)} drafts",
            found=f"q of shape {tuple(q.shape)}",
            fix="return one row of q per drafted token (an empty (0, V) tensor when drafting nothing)",
        )
    q = q[: len(tokens)].to(torch.float64)
    if q.shape[-1] < vocab:
        q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))  # ids the drafter lacks get q = 0
    elif q.shape[-1] > vocab:
        raise DrafterError(
            "the draft distribution is wider than the target vocabulary",
            expected=f"q with at most {vocab} columns (target ids)",
            found=f"{q.shape[-1]} columns",
            fix="construct the proposer with target_vocab_size set to the target's",
        )
    return tokens, q


def generate_speculative(
    target: torch.nn.Module,
    proposer: Proposer,
    input_ids: list[int],
    max_new_tokens: int,
    gamma: int,
    params: SamplingParams,
    generator: torch.Generator,
    eos_token_id: int | Sequence[int] | None = None,
) -> GenerationResult:
    """Draft-then-verify decoding with one target forward per round.

    Args:
        target: A Hugging Face causal LM.
        proposer: The drafter; see :class:`pipeline.engine.proposers.Proposer`. When it declares
            ``target_layers``, the prompt but its last token is prefilled in a forward of its own
            (counted in ``target_forwards``) so its first round already sees the prompt's states.
        input_ids: Prompt token ids.
        max_new_tokens: Upper bound on new tokens.
        gamma: Drafts per round (capped so no round drafts past ``max_new_tokens``).
        params: Sampling parameters, applied alike to target and drafter.
        generator: Random source shared by drafter and verifier.
        eos_token_id: Token id(s) that end the sequence.

    Returns:
        The :class:`GenerationResult`.

    Raises:
        DrafterError: If ``gamma < 1``, the proposer asks for hidden states at layers the target
            lacks, or returns ids or distributions that do not fit the target's vocabulary.
    """
    if gamma < 1:
        raise DrafterError(
            "speculative decoding needs at least one draft per round",
            expected="gamma >= 1",
            found=f"gamma={gamma}",
            fix="set gamma to a positive draft length (4 or 5 is typical), or use autoregressive decoding",
        )
    _check_request(input_ids, max_new_tokens)
    start = time.perf_counter()
    eos = _eos_set(eos_token_id)
    layers = tuple(proposer.target_layers)
    model = ModelSession(target, layers=layers)
    proposer.reset()
    sequence = list(input_ids)
    if layers and len(sequence) > 1:
        # Prefill all prompt tokens but the newest, so the first round's state covers the prompt.
        with model.timed():
            model.feed(sequence[:-1])
    last_p: Tensor | None = None
    new: list[int] = []
    result = GenerationResult(
        tokens=[],
        prompt_length=len(input_ids),
        method=proposer.name,
        gamma=gamma,
        position_attempts=[0] * gamma,
        position_accepts=[0] * gamma,
    )
    vocab = _vocab_size(target)
    stopped = False
    while len(new) < max_new_tokens and not stopped:
        # Drafts beyond the length budget would be thrown away, so do not pay for them.
        round_gamma = min(gamma, max_new_tokens - len(new) - 1)
        step = speculative_round(model, proposer, sequence, round_gamma, params, generator, last_p, vocab)
        result.drafter_seconds += step.drafter_seconds
        last_p = step.p_next
        sequence.extend(step.emitted)
        new.extend(step.emitted)
        if not result.drafted_per_round:
            result.ttft_seconds = time.perf_counter() - start
        result.drafted_per_round.append(step.drafted)
        result.accepted_per_round.append(step.accepted)
        for i in range(min(step.accepted + 1, step.verified)):
            result.position_attempts[i] += 1
            result.position_accepts[i] += int(i < step.accepted)
        new, stopped = _finish(new, eos, max_new_tokens)
    result.tokens = new
    result.stop_reason = "eos" if stopped else "length"
    result.target_forwards, result.target_seconds = model.forwards, model.seconds
    result.wall_seconds = time.perf_counter() - start
    return result


@dataclass
class Round:
    """One draft-then-verify round.

    Attributes:
        drafted: Drafts the proposer returned.
        verified: Draft positions the target scored (drafts up to and including the first without a target id).
        accepted: Leading drafts accepted.
        emitted: The accepted drafts and the token the target emitted after them.
        p_next: The target's standardised distribution the last emitted token was drawn from (``(V,)``).
        drafter_seconds: Time spent in the proposer.
    """

    drafted: int
    verified: int
    accepted: int
    emitted: list[int]
    p_next: Tensor
    drafter_seconds: float


def speculative_round(model: ModelSession, proposer: Proposer, sequence: list[int], gamma: int,
                      params: SamplingParams, generator: torch.Generator, last_p: Tensor | None, vocab: int) -> Round:
    """Draft ``gamma`` tokens after ``sequence``, score them in one target forward, verify, and crop the target
    session back to the accepted prefix (``sequence`` itself is not changed).

    ``model`` holds every position of ``sequence`` but the newest (the invariant both decode loops keep).
    """
    tokens: list[int] = []
    q: Tensor | None = None
    drafter_seconds = 0.0
    if gamma > 0:
        drafter_start = time.perf_counter()
        state = TargetState(model.layers, model.hidden(), last_p, len(model.ids))
        proposal = proposer.propose(list(sequence), gamma, params, generator, state)
        model.sync()
        drafter_seconds = time.perf_counter() - drafter_start
        tokens, q = _check_proposal(proposal, gamma, vocab)
    # A draft with no target id cannot be fed to the target and is always rejected, so stop
    # feeding there; its own p-row (from the token before it) is still scored.
    drafted = len(tokens)
    fed = tokens.index(-1) if -1 in tokens else len(tokens)
    tokens = tokens[: fed + 1]
    # The session holds every position but the newest token's; feed it and the drafts.
    with model.timed():
        p = standardise(model.feed(sequence[len(model.ids) :] + tokens[:fed], fed + 1), params)
    if len(tokens) > fed:
        # Placeholder bonus row: never read, because the -1 draft is rejected with certainty.
        p = torch.cat([p, p[-1:]], dim=0)
    if q is None or params.greedy:
        # Greedy p is one-hot, where speculative sampling reduces to argmax exact match anyway.
        n_accepted, next_token = verify_exact(p, tokens, generator, params)
    else:
        n_accepted, next_token = verify_speculative(p, q[: len(tokens)], tokens, generator)
    model.crop(len(sequence) + n_accepted)  # cache and captured hidden states alike
    return Round(drafted, len(tokens), n_accepted, tokens[:n_accepted] + [next_token], p[n_accepted],
                 drafter_seconds)


def first_rounds(
    target: torch.nn.Module,
    proposer: Proposer,
    context: list[int],
    gamma: int,
    params: SamplingParams,
    generator: torch.Generator,
    draws: int,
    on_draw: Callable[[Round], None] | None = None,
) -> list[Round]:
    """``draws`` independent first rounds of speculative decoding after ``context``, for one prefill.

    Each round is the one :func:`generate_speculative` runs first (same :func:`speculative_round`, the proposer
    drafting from the same state); after it the target's session is cropped back to the context and the proposer
    re-syncs to the context on its next call, as it does after any rejection. So the first emitted tokens are
    ``draws`` independent samples of the first token's law, and the losslessness check that tests that law pays
    one prefill instead of one per draw. The context but its newest token is prefilled for every proposer (the
    loop does so only for proposers that read target states); caching changes no distribution.

    Raises:
        DrafterError: As :func:`generate_speculative`.
    """
    if gamma < 1:
        raise DrafterError("a first round needs at least one draft", expected="gamma >= 1", found=f"gamma={gamma}")
    _check_request(context, 1)
    model = ModelSession(target, layers=tuple(proposer.target_layers))
    proposer.reset()
    if len(context) > 1:
        with model.timed():
            model.feed(context[:-1])
    base, vocab = len(model.ids), _vocab_size(target)
    rounds = []
    for _ in range(draws):
        step = speculative_round(model, proposer, context, gamma, params, generator, None, vocab)
        model.crop(base)
        rounds.append(step)
        if on_draw is not None:
            on_draw(step)
    return rounds


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
