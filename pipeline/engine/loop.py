"""The decode loops: plain autoregressive decoding and draft-then-verify speculative decoding.

Both loops run the target through a session (:class:`~pipeline.engine.session.ModelSession`, a growing KV cache;
or on the static paths :class:`~pipeline.engine.static.StaticSession`, a preallocated one with fixed-shape
forwards and optionally CUDA graphs — :class:`~pipeline.engine.static.DecodeOptions`), run batch size 1, stop at
EOS or after ``max_new_tokens``, and record what the metrics need (:class:`GenerationResult`). Each speculative
round (:func:`~pipeline.engine.rounds.speculative_round`) hands the proposer the target's state (hidden states at
the layers it declared, for every accepted position, the last distribution and the sequence's ids on the device:
:class:`~pipeline.engine.session.TargetState`), asks it for ``gamma'`` drafts, scores all of them plus the bonus
position in *one* target forward, verifies (:mod:`pipeline.engine.verify`) and rolls the target's cache and
captured hidden states back to the accepted prefix; drafts that stay on the device cost one host read per round.
With greedy parameters the speculative loop emits exactly the autoregressive loop's tokens; with sampling it emits
them with exactly the same law.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from pipeline.engine.proposers import Proposer
from pipeline.engine.rounds import Round, RoundChecks, RoundClocks, speculative_round
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.static import DecodeOptions, EventClock, decode_capacity, session_for
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
        prefill_tokens: New tokens the target's prefill emitted before the first drafting round: 1 with
            ``DecodeOptions.first_token == "prefill"`` (and a token to generate), else 0. They are in ``tokens`` and
            in no round, so τ leaves them out.
        drafted_per_round: Drafts the proposer returned in each round.
        accepted_per_round: Drafts accepted in each round.
        position_attempts: ``[i]`` = rounds in which draft position ``i`` was verified.
        position_accepts: ``[i]`` = rounds in which draft position ``i`` was accepted.
        drafter_seconds: Time spent in the proposer.
        target_seconds: Time spent in target forwards (prefill included) and verifying their rows.
        prefill_seconds: Of that, the prompt's prefill forward (0 for a one-token prompt, which has none).
        wall_seconds: End-to-end time of the call.
        ttft_seconds: Time from the call to the first new token.
        stop_reason: ``"eos"`` or ``"length"``.
    """

    tokens: list[int]
    prompt_length: int
    method: str
    gamma: int = 0
    target_forwards: int = 0
    prefill_tokens: int = 0
    drafted_per_round: list[int] = field(default_factory=list)
    accepted_per_round: list[int] = field(default_factory=list)
    position_attempts: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
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


def _sized(options: DecodeOptions | None, prompt: int, new_tokens: int, gamma: int) -> DecodeOptions:
    """``options`` (default: eager) with the capacity this generation's sessions need."""
    options = options or DecodeOptions()
    return replace(options, capacity=max(options.capacity, decode_capacity(prompt, new_tokens, gamma)))


def _context_ids(prompt: list[int], options: DecodeOptions, device: torch.device) -> Tensor:
    """The sequence's ids on the device, a buffer of the generation's capacity (the prompt copied once): rounds,
    proposers and the verify forward read ids from it instead of copying them from the host each round."""
    ids = torch.zeros(options.capacity, dtype=torch.long, device=device)
    ids[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    return ids


def _extend(context_ids: Tensor, length: int, step: Round) -> None:
    """Append a round's emitted tokens to the device ids (from the device after a device round)."""
    emitted = step.emitted_device
    if emitted is None:
        emitted = torch.tensor(step.emitted, dtype=torch.long)
    context_ids[length : length + emitted.shape[0]] = emitted


def _prepare(proposer: Proposer, options: DecodeOptions) -> None:
    """Let a proposer that runs sessions of its own set them up for ``options`` (see :class:`Proposer`)."""
    prepare = getattr(proposer, "prepare", None)
    if prepare is not None:
        prepare(options)


def generate_autoregressive(
    target: torch.nn.Module,
    input_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    generator: torch.Generator,
    eos_token_id: int | Sequence[int] | None = None,
    options: DecodeOptions | None = None,
) -> GenerationResult:
    """Decode one token per target forward: the baseline speculative decoding must reproduce.

    Args:
        target: A Hugging Face causal LM (eval mode is the caller's business).
        input_ids: Prompt token ids.
        max_new_tokens: Upper bound on new tokens.
        params: Sampling parameters.
        generator: Random source (unused when greedy).
        eos_token_id: Token id(s) that end the sequence.
        options: The decode path (:mod:`pipeline.engine.static`); default eager. On the static paths the prompt
            but its last token is prefilled first, so every later forward is one token (one CUDA graph).

    Returns:
        The :class:`GenerationResult`.
    """
    _check_request(input_ids, max_new_tokens)
    start = time.perf_counter()
    eos = _eos_set(eos_token_id)
    options = _sized(options, len(input_ids), max_new_tokens, 0)
    model = session_for(target, options)
    clock, prefill = EventClock(model.device), EventClock(model.device)
    checks = RoundChecks()
    forwards = model.forwards
    sequence = list(input_ids)
    if options.static and len(sequence) > 1:
        prefill.start()
        model.feed(sequence[:-1])
        prefill.stop()
    result = GenerationResult(tokens=[], prompt_length=len(input_ids), method="autoregressive")
    last: Tensor | None = None  # the newest token on the device, fed from there
    stopped = False
    while len(result.tokens) < max_new_tokens and not stopped:
        clock.start()
        pending = sequence[len(model.ids) :]
        probs = standardise(checks.target(model.feed(last if last is not None and len(pending) == 1 else pending)),
                            params)
        last = probs[0].argmax().reshape(1) if params.greedy else sample(probs[0], generator).reshape(1)
        token = int(last[0])  # the one device → host read of a step
        clock.stop()
        if not result.tokens:
            result.ttft_seconds = time.perf_counter() - start
        result.tokens.append(token)
        sequence.append(token)
        stopped = token in eos
    checks.raise_if_any()
    result.stop_reason = "eos" if stopped else "length"
    result.target_forwards, result.prefill_seconds = model.forwards - forwards, prefill.seconds()
    result.target_seconds = clock.seconds() + result.prefill_seconds
    result.wall_seconds = time.perf_counter() - start
    return result


def generate_speculative(
    target: torch.nn.Module,
    proposer: Proposer,
    input_ids: list[int],
    max_new_tokens: int,
    gamma: int,
    params: SamplingParams,
    generator: torch.Generator,
    eos_token_id: int | Sequence[int] | None = None,
    options: DecodeOptions | None = None,
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
        options: The decode path (:mod:`pipeline.engine.static`); default eager. On the static paths the prompt
            but its last token is always prefilled, so every round's verify forward is ``γ' + 1`` tokens. With
            ``first_token="prefill"`` the target emits the first new token before any drafting (a round without
            drafts, timed as prefill: one forward over the prompt, or over its last token where the rest was
            prefilled), so the first round drafts after the target's own token, as vLLM, SGLang and EAGLE's
            reference code do.

    Returns:
        The :class:`GenerationResult`. Phases are timed without synchronising (CUDA events); a round whose
        drafts stay on the device reads the host once (:mod:`pipeline.engine.rounds`).

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
    options = _sized(options, len(input_ids), max_new_tokens, gamma)
    model = session_for(target, options, layers=layers)
    forwards = model.forwards
    _prepare(proposer, options)
    proposer.reset()
    clocks, prefill = RoundClocks.on(model.device), EventClock(model.device)
    vocab = _vocab_size(target)
    checks = RoundChecks(vocab=vocab)
    sequence = list(input_ids)
    context_ids = _context_ids(sequence, options, model.device)
    if len(sequence) > 1:
        # Prefill all prompt tokens but the newest, so the first round's state covers the prompt. On every path: a
        # first round that ran the prompt itself counted the prompt's forward as a round's verify time (per-round
        # figures held a prefill that autoregressive decoding's per-token time leaves out).
        prefill.start()
        model.feed(sequence[:-1], device_ids=context_ids[: len(sequence) - 1])
        prefill.stop()
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
    stopped = False
    if options.first_token == "prefill" and max_new_tokens > 0:
        # The target's own first token, before any drafting: the same round code with no drafts, timed as prefill.
        step = speculative_round(model, proposer, sequence, 0, params, generator, None, vocab,
                                 clocks=RoundClocks(clocks.draft, prefill), checks=checks, context_ids=context_ids)
        last_p = step.p_next
        _extend(context_ids, len(sequence), step)
        sequence.extend(step.emitted)
        new.extend(step.emitted)
        result.ttft_seconds = time.perf_counter() - start
        result.prefill_tokens = len(step.emitted)
        new, stopped = _finish(new, eos, max_new_tokens)
    while len(new) < max_new_tokens and not stopped:
        # Drafts beyond the length budget would be thrown away, so do not pay for them.
        round_gamma = min(gamma, max_new_tokens - len(new) - 1)
        step = speculative_round(model, proposer, sequence, round_gamma, params, generator, last_p, vocab,
                                 clocks=clocks, checks=checks, context_ids=context_ids)
        last_p = step.p_next
        _extend(context_ids, len(sequence), step)
        if not new:
            result.ttft_seconds = time.perf_counter() - start
        sequence.extend(step.emitted)
        before = len(new)
        new.extend(step.emitted)
        new, stopped = _finish(new, eos, max_new_tokens)
        # An accepted EOS ends the generation: drafts after it were verified but are not part of the answer, and
        # no position after it was tried. Counting them made α, per-position acceptance and the predicted speedup
        # disagree with τ, which counts kept tokens.
        ended_in_drafts = stopped and len(new) - before <= step.accepted
        accepted = len(new) - before if ended_in_drafts else step.accepted
        result.drafted_per_round.append(accepted if ended_in_drafts else step.drafted)
        result.accepted_per_round.append(accepted)
        for i in range(accepted if ended_in_drafts else min(accepted + 1, step.verified)):
            result.position_attempts[i] += 1
            result.position_accepts[i] += int(i < accepted)
    checks.raise_if_any()
    result.tokens = new
    result.stop_reason = "eos" if stopped else "length"
    result.target_forwards = model.forwards - forwards
    result.prefill_seconds = prefill.seconds()
    result.drafter_seconds = clocks.draft.seconds()
    result.target_seconds = clocks.verify.seconds() + result.prefill_seconds
    result.wall_seconds = time.perf_counter() - start
    return result


def first_rounds(
    target: torch.nn.Module,
    proposer: Proposer,
    context: list[int],
    gamma: int,
    params: SamplingParams,
    generator: torch.Generator,
    draws: int,
    on_draw: Callable[[Round], None] | None = None,
    options: DecodeOptions | None = None,
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
    options = _sized(options, len(context), 1, gamma)
    model = session_for(target, options, layers=tuple(proposer.target_layers))
    _prepare(proposer, options)
    proposer.reset()
    context_ids = _context_ids(context, options, model.device)
    if len(context) > 1:
        model.feed(context[:-1], device_ids=context_ids[: len(context) - 1])
    base, vocab = len(model.ids), _vocab_size(target)
    rounds = []
    for _ in range(draws):
        step = speculative_round(model, proposer, context, gamma, params, generator, None, vocab,
                                 context_ids=context_ids)
        model.crop(base)
        rounds.append(step)
        if on_draw is not None:
            on_draw(step)
    return rounds


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)
