"""Token-level proposers for a drafter whose tokenizer differs from the target's (heterogeneous vocabularies).

Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies" (ICML 2025) give lossless ways to use such a drafter. Here are the two that
map token distributions: :class:`UnionProposer` (Alg. 1, the union-vocabulary baseline) and
:class:`TLIProposer` (Alg. 4, token-level intersection). Both return ``q`` in target-id space through a
:class:`~pipeline.vocab.maps.VocabMap`. String-level exact match (Alg. 2) is in :mod:`pipeline.engine.slem`,
string-level rejection sampling (Alg. 3, byte-level drafter) in :mod:`pipeline.engine.slrs`; all of them
stand on the text bridge of :mod:`pipeline.engine.bridge`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Generator, Tensor

from pipeline.engine.bridge import CrossVocabDrafter, empty_proposal
from pipeline.engine.proposers import Proposal
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState
from pipeline.vocab.maps import VocabMap


def intersection_pairs(
    vocab_map: VocabMap, drafter_width: int, target_width: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The T∩D pairs usable with these logit widths, and ``d2t`` padded to the drafter's width.

    LM heads are often padded past their tokenizer, so ids beyond either tokenizer have no partner.

    Args:
        vocab_map: The token map.
        drafter_width: Width of the drafter's logits.
        target_width: Width of ``q`` (the target's logits).

    Returns:
        ``(inter_d, inter_t, d2t)``: matched drafter ids (ascending), their target ids, and a
        ``(drafter_width,)`` map with -1 for drafter ids without a usable target id.
    """
    d2t = torch.full((drafter_width,), -1, dtype=torch.long)
    n = min(drafter_width, vocab_map.drafter_vocab_size)
    d2t[:n] = vocab_map.drafter_to_target[:n]
    d2t[d2t >= target_width] = -1
    inter_d = torch.nonzero(d2t >= 0).flatten()
    return inter_d, d2t[inter_d], d2t


def tli_draft_distribution(
    drafter_logits: Tensor, inter_d: Tensor, inter_t: Tensor, target_width: int, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """TLI's draft law: the drafter's logits restricted to T∩D, then standardised there.

    Args:
        drafter_logits: ``(..., V_drafter)`` logits.
        inter_d: Matched drafter ids (from :func:`intersection_pairs`).
        inter_t: Their target ids.
        target_width: Width of ``q``.
        params: Sampling parameters (temperature/top-k/top-p act inside the intersection).

    Returns:
        ``(probs, q)``: ``(..., |T∩D|)`` the law drafts are drawn from (index ``j`` is drafter id
        ``inter_d[j]``), and the same law in target-id space, ``(..., target_width)``, 0 off T∩D.
    """
    probs = standardise(drafter_logits.index_select(-1, inter_d), params)
    q = probs.new_zeros(probs.shape[:-1] + (target_width,))
    return probs, q.index_copy_(-1, inter_t, probs)


def union_draft_distribution(
    drafter_logits: Tensor, inter_d: Tensor, inter_t: Tensor, target_width: int, params: SamplingParams
) -> tuple[Tensor, Tensor]:
    """The union baseline's draft law: the drafter's full standardised distribution over D.

    Args are as for :func:`tli_draft_distribution`, but ``params`` act over the whole drafter vocabulary.

    Returns:
        ``(probs, q)``: ``(..., V_drafter)`` the law drafts are drawn from, and its restriction to
        T∩D in target-id space, ``(..., target_width)`` (sub-stochastic: mass on D∖T is dropped because
        ``p = 0`` there, so neither the accept test nor the residual ``max(0, p - q)`` ever reads it).
    """
    probs = standardise(drafter_logits, params)
    q = probs.new_zeros(probs.shape[:-1] + (target_width,))
    return probs, q.index_copy_(-1, inter_t, probs.index_select(-1, inter_d))


class _MappedProposer(CrossVocabDrafter):
    """TLI and Union: the (drafter id, target id) pairs of T∩D, and the draft loop both run.

    A subclass names its one-step law (``law``: :func:`tli_draft_distribution` or
    :func:`union_draft_distribution`) and whether that law is indexed by position in T∩D rather than
    by drafter id; the loop stops after a draft with no target id.

    Args:
        drafter: A Hugging Face causal LM using ``drafter_tokenizer``.
        drafter_tokenizer: The drafter's tokenizer (``tokenizers.Tokenizer`` or HF fast tokenizer).
        target_tokenizer: The target's tokenizer.
        vocab_map: ``VocabMap.build(target_tokenizer, drafter_tokenizer)``.
        target_vocab_size: Width of ``q`` (the target's logit width); defaults to the target tokenizer's.
        name: Label used in metrics and reports; defaults to the method's name.
    """

    law: Callable[..., tuple[Tensor, Tensor]]
    indexed_by_intersection: bool
    method: str

    def __init__(
        self,
        drafter: torch.nn.Module,
        drafter_tokenizer: Any,
        target_tokenizer: Any,
        vocab_map: VocabMap,
        *,
        target_vocab_size: int | None = None,
        name: str | None = None,
    ) -> None:
        if self.indexed_by_intersection:
            vocab_map.require_nonempty()  # a law on T∩D needs T∩D
        super().__init__(drafter, drafter_tokenizer, target_tokenizer)
        self.name = name or self.method
        self.vocab_map = vocab_map
        self.target_vocab_size = target_vocab_size or vocab_map.target_vocab_size
        self._pairs: dict[int, tuple[Tensor, Tensor, Tensor]] = {}

    def pairs(self, drafter_width: int) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`intersection_pairs` for this logit width, on the drafter's device (cached)."""
        if drafter_width not in self._pairs:
            pairs = intersection_pairs(self.vocab_map, drafter_width, self.target_vocab_size)
            self._pairs[drafter_width] = tuple(t.to(self.session.device) for t in pairs)
        return self._pairs[drafter_width]

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft up to ``gamma`` tokens; see :class:`~pipeline.engine.proposers.Proposer`."""
        started = self._start(context, gamma)
        if started is None:
            return empty_proposal(self.target_vocab_size, self.session.device)
        logits = started[1]
        inter_d, inter_t, d2t = self.pairs(logits.shape[-1])
        if inter_d.numel() == 0:
            # No shared token at this logit width: every draft would be rejected, so draft none.
            return empty_proposal(self.target_vocab_size, self.session.device)
        tokens: list[int] = []
        rows: list[Tensor] = []
        for step in range(gamma):
            probs, q = self.law(logits, inter_d, inter_t, self.target_vocab_size, params)
            index = int(sample(probs, generator))
            drafted = int(inter_d[index]) if self.indexed_by_intersection else index
            tokens.append(int(d2t[drafted]))  # -1 for a drafter token outside T
            rows.append(q)
            if tokens[-1] < 0 or step + 1 == gamma:
                break
            logits = self.session.feed([drafted])[-1]
        return Proposal(tokens, torch.stack(rows))


class TLIProposer(_MappedProposer):
    """Token-level intersection (Alg. 4): the drafter's distribution renormalised onto T∩D.

    Temperature, top-k and top-p are applied to the drafter's logits restricted to the intersection,
    so ``q`` (zero outside T∩D) is exactly what each draft was drawn from; each drafted token is fed back
    to the drafter as its own drafter id. Args as :class:`_MappedProposer`.

    Raises:
        DrafterError: If the vocabularies share no token (at construction).
    """

    law = staticmethod(tli_draft_distribution)
    indexed_by_intersection = True
    method = "tli"


class UnionProposer(_MappedProposer):
    """Union-vocabulary speculative sampling (Alg. 1), the baseline TLI improves on.

    The drafter samples from its full standardised distribution over D. A token in T∩D becomes its
    target id; one outside T becomes ``-1`` and ends the draft, since the target gives it probability 0
    and rejects it with certainty. ``q`` is the drafter's mass on T∩D in target space: the mass on D∖T
    is left out because, with ``p = 0`` there, the union rule's residual ``max(0, p - q)`` never uses it.
    Args as :class:`_MappedProposer` (an empty intersection is allowed: nothing is then drafted, since
    every draft would be rejected).
    """

    law = staticmethod(union_draft_distribution)
    indexed_by_intersection = False
    method = "union"
