"""Drafters that share the target's tokenizer, and the proposer interface every drafter implements.

A proposer drafts ``gamma`` tokens and returns, for each one, the exact distribution it was drawn from
in target-id space (:class:`Proposal`). Returning the true ``q`` — not an approximation of it — is what
keeps every draft method lossless under :func:`pipeline.engine.verify.verify_speculative`. Each
proposer keeps its own :class:`~pipeline.engine.session.ModelSession` (KV cache), re-synchronised with
the target's context by longest common prefix, so a rejected draft costs only a cache crop; each round
it may also read the target's hidden states (:class:`~pipeline.engine.session.TargetState`). This
module owns the interface plus the two same-tokenizer drafters: the full LM head and the static
shortlist of FR-Spec (Zhao et al. 2025) / VocabTrim (Goel et al. 2025), which evaluates only the
shortlisted rows of the drafter's LM head. Methods are built by name through
:mod:`pipeline.engine.methods`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Generator, Tensor

from pipeline.engine.sampling import SamplingParams, draw, standardise
from pipeline.engine.session import ModelSession, TargetState
from pipeline.engine.static import DecodeOptions, EventClock, session_for
from pipeline.errors import DrafterError


class Proposal(NamedTuple):
    """Drafted tokens and the distributions they were drawn from.

    Attributes:
        tokens: ``gamma' <= gamma`` drafted tokens as target ids; ``-1`` marks a drafted token with no
            target id (its target probability is 0, so it is always rejected). A list when the proposer had to
            read them (string-level methods), else a 1-D int64 tensor on the drafter's device: the loop then
            verifies them without a host read (:mod:`pipeline.engine.rounds`).
        q: ``(gamma', V_target)`` float64, row ``i`` the exact distribution ``tokens[i]`` was drawn from
            in target-id space (sub-stochastic when mass lies outside the target vocabulary); ``None``
            asks the verifier for exact-match verification (SLEM).
    """

    tokens: list[int] | Tensor
    q: Tensor | None

    def token_list(self) -> list[int]:
        """The drafts as host ids (reads a device tensor: for tests and host-side callers, not the decode loop)."""
        return self.tokens.tolist() if isinstance(self.tokens, Tensor) else list(self.tokens)


@runtime_checkable
class Proposer(Protocol):
    """A drafter the decode loop can call once per speculation round.

    Attributes:
        name: Label used in metrics and reports.
        target_layers: Indices into the target's ``output_hidden_states`` (``0`` = embedding output,
            ``-1`` = last layer) whose hidden states the proposer reads from :class:`TargetState`; empty
            (the default of every proposer here) means none are captured, at no extra cost.

    A proposer that runs model sessions of its own may also define ``prepare(options: DecodeOptions)``: the loop
    calls it before each generation so the sessions follow the generation's decode path (static caches, CUDA
    graphs; :mod:`pipeline.engine.static`).
    """

    name: str
    target_layers: tuple[int, ...]

    def reset(self) -> None:
        """Forget all state; the next :meth:`propose` starts a new sequence."""
        ...

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft up to ``gamma`` tokens continuing ``context`` (all target ids so far).

        Args:
            context: Every token of the sequence, prompt included, as target ids.
            gamma: Most tokens to draft.
            params: Sampling parameters (the drafts' law must be what ``q`` reports).
            generator: Random source shared with the verifier.
            state: The target's hidden states at :attr:`target_layers` for every position of
                ``context`` but the newest, and its last distribution (see :class:`TargetState`);
                outside the decode loop, ``TargetState()`` (nothing known).
        """
        ...


def require_context(context: Sequence[int]) -> None:
    """Raise :class:`DrafterError` for an empty context (there is nothing to draft from)."""
    if not context:
        raise DrafterError(
            "cannot draft from an empty context",
            expected="at least one prompt token",
            found="0 tokens",
            fix="pass a non-empty prompt",
        )


class HeadStats:
    """What a proposer's LM head did: mean shortlist size per draft position and head seconds per step.

    ``sizes[t]`` / ``counts[t]`` is the mean number of logits computed at draft position ``t`` (a size may be a
    device tensor: it is read when the stats are); ``clock`` times the head alone (shortlist selection, gather and
    matmul; CUDA events, so timing adds no synchronisation), ``router_seconds`` the DynaSpec router. The evaluate
    stage resets it before a decode and reads it after.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sizes: list[Any] = []
        self.counts: list[int] = []
        self.clock: EventClock | None = None
        self.router_seconds = 0.0
        self.steps = 0

    def timer(self, device: torch.device) -> EventClock:
        """The head's clock on ``device`` (kept until :meth:`reset`)."""
        if self.clock is None:
            self.clock = EventClock(device)
        return self.clock

    def add(self, position: int, size: int | Tensor) -> None:
        while len(self.sizes) <= position:
            self.sizes.append(0.0)
            self.counts.append(0)
        self.sizes[position] = self.sizes[position] + size
        self.counts[position] += 1
        self.steps += 1

    @property
    def seconds(self) -> float:
        return self.clock.seconds() if self.clock is not None else 0.0

    def per_position(self) -> list[float]:
        return [float(s) / c for s, c in zip(self.sizes, self.counts) if c]

    def mean_size(self) -> float | None:
        return sum(float(s) for s in self.sizes) / self.steps if self.steps else None

    def ms_per_step(self) -> float | None:
        return 1e3 * self.seconds / self.steps if self.steps else None


class LinearHead:
    """A drafter's LM head as a callable on hidden states, over all rows or a given subset of them.

    Mirrors what some families do to logits in ``forward()`` (``logit_scale``, ``final_logit_softcapping``)
    so q matches the drafter's own head; :meth:`rows` gives the ``(k, d)`` weight of a shortlist once.
    """

    def __init__(self, model: torch.nn.Module, rows: Tensor | None = None) -> None:
        head = model.get_output_embeddings()
        with torch.no_grad():
            weight = head.weight if rows is None else head.weight[rows]
            self.weight = weight.detach() if rows is None else weight.detach().clone()
            bias = getattr(head, "bias", None)
            self.bias = None if bias is None else (bias.detach() if rows is None else bias[rows].detach().clone())
        config = getattr(model, "config", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.logit_scale = getattr(config, "logit_scale", None)

    def finish(self, logits: Tensor) -> Tensor:
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def __call__(self, hidden: Tensor, index: Tensor | None = None) -> Tensor:
        """Logits of every row, or of the rows ``index`` only (a gathered ``(k, d)`` matmul)."""
        if index is None:
            return self.finish(torch.nn.functional.linear(hidden, self.weight, self.bias))
        weight = self.weight.index_select(0, index)
        bias = None if self.bias is None else self.bias.index_select(0, index)
        return self.finish(torch.nn.functional.linear(hidden, weight, bias))


def timed_call(stats: HeadStats, device: torch.device, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its time added to ``stats``' clock (no synchronisation: CUDA events on a GPU)."""
    clock = stats.timer(device)
    clock.start()
    out = fn(*args)
    clock.stop()
    return out


def _draft(
    session: Any,
    context: list[int],
    gamma: int,
    params: SamplingParams,
    generator: torch.Generator,
    logits_of: Callable[[Tensor], Tensor],
    token_ids: Tensor | None,
    stats: HeadStats | None = None,
    device_ids: Tensor | None = None,
) -> tuple[Tensor, list[Tensor]]:
    """Sample ``gamma`` tokens autoregressively from ``session``; the token ids ``(gamma,)`` and their distributions.

    Nothing is read on the host: each draft is fed back to the drafter from the device (its session lists it as
    ``-1``, so the next round's common prefix stops there and re-feeds the drafts that were accepted, in the same
    forward as the target's own token). ``logits_of`` turns the session's output row into logits; ``token_ids``
    maps an index of the distribution to the token id (None: the index is the id); ``stats`` (optional) records
    the head's time and width per draft position; ``device_ids`` holds ``context`` on the device
    (:attr:`TargetState.token_ids`).
    """
    require_context(context)
    row = session.move_to(context, device_ids=device_ids)[-1]
    tokens: list[Tensor] = []
    dists: list[Tensor] = []
    for step in range(gamma):
        if stats is None:
            logits = logits_of(row)
        else:
            logits = timed_call(stats, session.device, logits_of, row)
            stats.add(step, int(logits.shape[-1]))
        probs = standardise(logits, params)
        index = draw(probs, params, generator).reshape(1)
        token = index if token_ids is None else token_ids.index_select(0, index)
        tokens.append(token)
        dists.append(probs)
        if step + 1 < gamma:
            row = session.feed(token)[-1]
    empty = torch.zeros(0, dtype=torch.long, device=session.device)
    return (torch.cat(tokens) if tokens else empty), dists


class SessionProposer:
    """A proposer drafting with a Hugging Face model of its own, kept in a session that follows the decode path."""

    session: Any
    _model: torch.nn.Module

    def prepare(self, options: DecodeOptions) -> None:
        """Run the drafter's body in the session the generation's decode path asks for (static, CUDA graphs)."""
        self.session = session_for(self._model, options, body_only=True)

    def reset(self) -> None:
        """Forget the cached sequence; see :class:`Proposer`."""
        self.session.reset()


class FullHeadProposer(SessionProposer):
    """A same-tokenizer drafter sampling from its full LM head.

    Args:
        model: Any Hugging Face causal LM sharing the target's tokenizer.
        target_vocab_size: The target's logit width when it differs from the drafter's (padded
            embeddings); drafted ids at or beyond it become ``-1`` and ``q`` is padded or cut to it.
        name: Label used in metrics and reports.
    """

    def __init__(
        self, model: torch.nn.Module, *, target_vocab_size: int | None = None, name: str = "full_head"
    ) -> None:
        # The body runs in the session and the head here, so the head's own time can be measured.
        self._model = model
        self.session = ModelSession(model, body_only=True)
        self.name = name
        self.target_layers: tuple[int, ...] = ()
        self.target_vocab_size = target_vocab_size
        self.head = LinearHead(model)
        self._head_rows = self.head.weight.shape[0]
        self.head_stats = HeadStats()

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft ``gamma`` tokens from the full head; see :class:`Proposer`."""
        tokens, dists = _draft(self.session, context, gamma, params, generator, self.head, None, self.head_stats,
                               state.token_ids)
        width = self.target_vocab_size
        if not dists:
            return Proposal(tokens, torch.zeros(0, width or self._head_rows, dtype=torch.float64,
                                                device=self.session.device))
        q = torch.stack(dists)
        if width is not None and width != q.shape[-1]:
            if width > q.shape[-1]:
                q = torch.nn.functional.pad(q, (0, width - q.shape[-1]))
            else:
                # Mass on ids the target does not have stays out of q (sub-stochastic rows).
                q = q[:, :width]
            tokens = torch.where(tokens < width, tokens, -1)
        return Proposal(tokens, q)


class ShortlistProposer(SessionProposer):
    """A same-tokenizer drafter whose LM head is cut to a static shortlist (FR-Spec / VocabTrim).

    The drafter body runs as usual; the head is a genuinely smaller ``(k, d)`` matmul against the
    shortlisted rows, sliced once here. Tokens are sampled in shortlist space and mapped back, and ``q``
    is that distribution scattered into target-id space (zero off the shortlist).

    Args:
        model: Any Hugging Face causal LM sharing the target's tokenizer.
        shortlist: 1-D tensor of unique target ids to keep, e.g. the most frequent tokens.
        target_vocab_size: Width of ``q``; defaults to the drafter's LM-head rows.
        name: Label used in metrics and reports.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        shortlist: Tensor,
        *,
        target_vocab_size: int | None = None,
        name: str = "shortlist",
    ) -> None:
        self._model = model
        self.session = ModelSession(model, body_only=True)
        self.name = name
        self.target_layers: tuple[int, ...] = ()
        head = model.get_output_embeddings()
        vocab = head.weight.shape[0]
        self.target_vocab_size = target_vocab_size or vocab
        shortlist = torch.as_tensor(shortlist).to(torch.long).flatten().cpu()
        if shortlist.numel() == 0:
            raise DrafterError(
                "the draft shortlist is empty",
                expected="at least one token id",
                found="0 ids",
                fix="rebuild the shortlist with a positive size",
            )
        bad = shortlist[(shortlist < 0) | (shortlist >= min(vocab, self.target_vocab_size))]
        if bad.numel():
            raise DrafterError(
                "the draft shortlist holds ids outside the vocabulary",
                expected=f"ids in [0, {min(vocab, self.target_vocab_size)})",
                found=f"{bad.numel()} out-of-range ids, e.g. {bad[:5].tolist()}",
                fix="rebuild the shortlist from counts made with this target's tokenizer",
            )
        if torch.unique(shortlist).numel() != shortlist.numel():
            raise DrafterError(
                "the draft shortlist repeats token ids",
                expected="unique ids",
                found=f"{shortlist.numel() - torch.unique(shortlist).numel()} duplicates",
                fix="deduplicate the shortlist (e.g. torch.unique) before loading it",
            )
        self.shortlist = shortlist.to(self.session.device)
        self.head = LinearHead(model, self.shortlist)  # the (k, d) rows, sliced once
        self.head_stats = HeadStats()

    @staticmethod
    def check(shortlist: Tensor, tokenizer: Any, prompts: Sequence[Sequence[int]] = (),
              stop: Sequence[int] = ()) -> None:
        """Refuse a shortlist that cannot end a sequence or covers none of a prompt's tokens.

        Args:
            shortlist: The shortlist ids.
            tokenizer: The target's Hugging Face tokenizer (for ``eos_token_id``).
            prompts: Tokenised prompts; a prompt none of whose tokens is shortlisted suggests the
                shortlist was built for another tokenizer or domain.
            stop: Every other id the decodes stop at (the generation config's end-of-turn ids,
                :func:`pipeline.vocab.tokens.stop_ids`): a drafter that can never propose the end of a turn loses
                every round that would end one.

        Raises:
            DrafterError: If EOS or a stop id is excluded or some prompt shares no token with the shortlist.
        """
        ids = set(torch.as_tensor(shortlist).flatten().tolist())
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = sorted({*([] if eos is None else ([eos] if isinstance(eos, int) else list(eos))), *stop})
        missing = [e for e in eos_ids if e not in ids]
        if missing:
            raise DrafterError(
                "the draft shortlist excludes an end-of-sequence or end-of-turn token",
                expected=f"EOS and end-of-turn id(s) {eos_ids} in the shortlist",
                found=f"missing {missing}",
                fix="add them to the shortlist (count stage: count.always_include_special=true keeps every id a "
                    "turn ends at)",
            )
        for index, prompt in enumerate(prompts):
            if prompt and not any(t in ids for t in prompt):
                raise DrafterError(
                    "the draft shortlist shares no token with a prompt",
                    expected="a shortlist built with this target's tokenizer and a matching domain",
                    found=f"prompt #{index} ({len(prompt)} tokens) has no shortlisted token",
                    fix="rebuild the shortlist from calibration data tokenised by this target",
                )

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft ``gamma`` tokens from the shortlisted head; see :class:`Proposer`."""
        tokens, dists = _draft(self.session, context, gamma, params, generator, self.head, self.shortlist,
                               self.head_stats, state.token_ids)
        q = torch.zeros(len(dists), self.target_vocab_size, dtype=torch.float64, device=self.session.device)
        if dists:
            q[:, self.shortlist] = torch.stack(dists)
        return Proposal(tokens, q)
