"""RDK proposers: draft from the drafter's kept-token distribution redistributed onto the whole target vocabulary.

Timor et al., "Out-of-Vocabulary Sampling Boosts Speculative Decoding", Alg. 1: apply TLI to get ``q'`` over
the kept tokens ``I`` (the pruned head's rows, or ``T ∩ D`` for a drafter with another tokenizer), map it to
``p' = R(q')`` over all of ``T`` with a redistribution ``R`` (:mod:`pipeline.rdk.affinity`: the exact
sparse ``Mᵀq'`` of Eq. 2, the Taylor form of Eq. 3 with the calibration prior, or the rank-one prior mix),
then *sample the draft from p'* and hand ``p'`` to the verifier as ``q``. Because each drafted token is
drawn from exactly the row returned, verification (Leviathan et al. 2023, Thm. 3.5) keeps the target's
law, whatever ``R`` is; ``R`` only decides how often drafts are accepted. An out-of-vocabulary draft is
fed back to the drafter like any other token: as itself for a same-tokenizer drafter, as the drafter
encoding of its text for another tokenizer.

Greedy decoding drafts the argmax of ``p'`` and reports a one-hot ``q`` (verification is exact match).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Generator, Tensor

from pipeline.engine.bridge import CrossVocabDrafter, empty_proposal
from pipeline.engine.proposers import (
    HeadStats,
    LinearHead,
    Proposal,
    SessionProposer,
    require_context,
    timed_call,
)
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import ModelSession, TargetState
from pipeline.errors import DrafterError
from pipeline.vocab.maps import VocabMap, decode_ids, encode_text


class Redistribution(Protocol):
    """Maps ``(..., |I|)`` kept-token distributions to ``(..., |T|)`` target distributions."""

    kept: Tensor

    def redistribute(self, q_kept: Tensor) -> Tensor: ...

    def step_bytes(self) -> int:
        """Bytes one row's :meth:`redistribute` reads and writes (what MBSU's cost charges per draft step)."""
        ...

    def to(self, device: torch.device | str) -> Redistribution: ...


def draw_on_device(p: Tensor, params: SamplingParams, generator: Generator) -> tuple[Tensor, Tensor]:
    """One draft token ``(1,)`` from the redistributed row ``p``, left on the device, and the exact law it was drawn
    from.

    Round-off can leave ``-1e-17``-sized entries in a redistributed row; they are zeroed and the row
    renormalised *before* sampling, so the returned law is the sampled one.
    """
    q = p.clamp_min(0.0)
    q = q / q.sum()
    if params.greedy:
        token = q.argmax().reshape(1)
        return token, torch.zeros_like(q).index_fill_(0, token, 1.0)
    return sample(q, generator).reshape(1), q


def draw(p: Tensor, params: SamplingParams, generator: Generator) -> tuple[int, Tensor]:
    """:func:`draw_on_device` with the token read on the host (for drafters that must read it)."""
    token, q = draw_on_device(p, params, generator)
    return int(token[0]), q


def _check_kept(transform: Redistribution, kept: Tensor, what: str) -> None:
    found = transform.kept.cpu()
    if found.numel() != kept.numel() or not torch.equal(found, kept.cpu()):
        raise DrafterError(f"The RDK redistribution was built for another kept-token set than {what}.",
                           expected=f"{kept.numel()} kept ids in the drafter's order",
                           found=f"{found.numel()} ids" + ("" if found.numel() != kept.numel() else " (different)"),
                           fix="Build it from the estimate_rdk artifact for this drafter and pruning level.")


class RedistributedShortlistProposer(SessionProposer):
    """A same-tokenizer drafter pruned to ``I`` (FR-Spec / VocabTrim head rows) whose drafts RDK redistributes.

    Args:
        model: A Hugging Face causal LM sharing the target's tokenizer.
        transform: The redistribution; its ``kept`` are the head rows evaluated (EOS among them).
        target_vocab_size: Width of ``q``; defaults to the drafter's LM-head rows.
        name: Label used in metrics and reports.
    """

    def __init__(self, model: torch.nn.Module, transform: Redistribution, *, target_vocab_size: int | None = None,
                 name: str = "rdk") -> None:
        self._model = model
        self.session = ModelSession(model, body_only=True)
        self.name = name
        self.target_layers: tuple[int, ...] = ()
        rows = model.get_output_embeddings().weight.shape[0]
        self.target_vocab_size = target_vocab_size or rows
        self._feedable = min(rows, model.get_input_embeddings().weight.shape[0])
        self.transform = transform.to(self.session.device)
        self.head = LinearHead(model, self.transform.kept)
        self.head_stats = HeadStats()

    def _law(self, row: Tensor, params: SamplingParams) -> Tensor:
        return self.transform.redistribute(standardise(self.head(row), params))

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: Generator,
                state: TargetState) -> Proposal:
        """Draft up to ``gamma`` tokens from the redistributed pruned head; see ``Proposer``."""
        require_context(context)
        width = self.target_vocab_size
        if gamma <= 0:
            return empty_proposal(width, self.session.device)
        row = self.session.move_to(context, device_ids=state.token_ids)[-1]
        tokens: list[Tensor] = []
        rows: list[Tensor] = []
        for step in range(gamma):
            p = timed_call(self.head_stats, self.session.device, self._law, row, params)
            self.head_stats.add(step, int(self.transform.kept.numel()))
            token, q = draw_on_device(_fit(p, width), params, generator)
            tokens.append(token)
            rows.append(q)
            if step + 1 < gamma:
                # A target id the drafter cannot embed is fed as its last row: the drafts after it are still
                # drawn from the laws reported for them, so verification stays exact (they are rarely accepted).
                row = self.session.feed(token.clamp(max=self._feedable - 1))[-1]
        return Proposal(torch.cat(tokens), torch.stack(rows))


def _fit(p: Tensor, width: int) -> Tensor:
    """``p`` cut or zero-padded to ``width`` (mass beyond the target's ids is dropped before sampling)."""
    if p.shape[-1] == width:
        return p
    if p.shape[-1] > width:
        return p[..., :width]
    return torch.nn.functional.pad(p, (0, width - p.shape[-1]))


class RedistributedTLIProposer(CrossVocabDrafter):
    """A drafter with another tokenizer: TLI onto ``I = T ∩ D`` (Alg. 4 of Timor et al. 2025), then RDK.

    The redistribution must be built for ``I`` in the drafter's order (``vocab_map.intersection_ids_target``
    restricted to the drafter's logit width). A drafted target token outside ``D`` is fed to the drafter as
    the drafter encoding of its text (the draft ends if that is empty).

    Args:
        drafter: A Hugging Face causal LM using ``drafter_tokenizer``.
        drafter_tokenizer: Its tokenizer.
        target_tokenizer: The target's tokenizer.
        vocab_map: ``VocabMap.build(target_tokenizer, drafter_tokenizer)``.
        transform: The redistribution over ``I``.
        target_vocab_size: Width of ``q``; defaults to the target tokenizer's.
        name: Label used in metrics and reports.

    Raises:
        DrafterError: If the vocabularies share no token, or ``transform`` was built for another ``I``.
    """

    def __init__(self, drafter: torch.nn.Module, drafter_tokenizer: Any, target_tokenizer: Any,
                 vocab_map: VocabMap, transform: Redistribution, *, target_vocab_size: int | None = None,
                 name: str = "tli_rdk") -> None:
        from pipeline.engine.hetero import intersection_pairs  # deferred: pulls in torch

        vocab_map.require_nonempty()
        super().__init__(drafter, drafter_tokenizer, target_tokenizer)
        self.name = name
        self.target_vocab_size = target_vocab_size or vocab_map.target_vocab_size
        width = drafter.get_output_embeddings().weight.shape[0]
        inter_d, inter_t, _ = intersection_pairs(vocab_map, width, self.target_vocab_size)
        _check_kept(transform, inter_t, "this drafter's T ∩ D")
        device = self.session.device
        self.inter_d = inter_d.to(device)
        self.transform = transform.to(device)
        self.target_to_drafter = vocab_map.target_to_drafter.tolist()

    def _feed_ids(self, token: int) -> list[int]:
        mapped = self.target_to_drafter[token] if token < len(self.target_to_drafter) else -1
        if mapped >= 0:
            return [mapped]
        return encode_text(self.drafter_tokenizer, decode_ids(self.target_tokenizer, [token]),
                           add_special_tokens=False)

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: Generator,
                state: TargetState) -> Proposal:
        """Draft up to ``gamma`` target tokens; see :class:`~pipeline.engine.proposers.Proposer`."""
        started = self._start(context, gamma)
        if started is None:
            return empty_proposal(self.target_vocab_size, self.session.device)
        logits = started[1]
        tokens: list[int] = []
        rows: list[Tensor] = []
        for step in range(gamma):
            q_kept = standardise(logits.index_select(-1, self.inter_d), params)
            token, q = draw(_fit(self.transform.redistribute(q_kept), self.target_vocab_size), params, generator)
            tokens.append(token)
            rows.append(q)
            feed = self._feed_ids(token)
            if step + 1 == gamma or not feed:
                break
            logits = self.session.feed(feed)[-1]
        return Proposal(tokens, torch.stack(rows))
