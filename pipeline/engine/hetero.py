"""Proposers for a drafter whose tokenizer differs from the target's (heterogeneous vocabularies).

Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies" (ICML 2025) give lossless ways to use such a drafter; three are here:
:class:`UnionProposer` (Alg. 1, the union-vocabulary baseline), :class:`SLEMProposer` (Alg. 2,
string-level exact match) and :class:`TLIProposer` (Alg. 4, token-level intersection); string-level
rejection sampling (Alg. 3) needs a byte-level drafter and lives in :mod:`pipeline.engine.slrs`, on the
bridge defined here. Every one keeps the drafter's own token sequence and KV cache (a
:class:`~pipeline.engine.session.ModelSession`): at each round the target context is decoded to text,
re-encoded by the drafter tokenizer, and only the suffix past the longest common prefix with the cached
sequence is run. TLI and Union return ``q`` in target-id space through a
:class:`~pipeline.vocab.maps.VocabMap`; SLEM returns ``q=None`` and is verified by exact match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Generator, Tensor

from pipeline.engine.proposers import Proposal
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import ModelSession, TargetState, common_prefix_length
from pipeline.vocab.maps import VocabMap, as_backend, decode_ids, encode_text

# Why re-tokenising text at every round cannot break losslessness: the verifier's guarantee (Leviathan
# et al. 2023, Thm. 3.5) needs only that each drafted token was drawn from the ``q`` we return (or, for
# SLEM, nothing at all). How the drafter came to its logits is irrelevant, so a decode/re-encode that
# tokenises the context differently from what the drafter drafted, a cache cropped too eagerly, or a
# look-behind that fails to align only lowers acceptance; the emitted tokens keep the target's law.


class _CrossVocabDrafter:
    """What every proposer here shares: the drafter's :class:`ModelSession` and the text bridge to it.

    The session holds the drafter's own token ids (``session.ids``) and their KV cache.

    With ``keep_specials``, a target special token (BOS, chat markers, EOS) whose exact content is also a
    special of the drafter is handed over as that drafter token instead of being dropped: a drafter
    trained under the same chat template then sees the turns it was trained on.
    """

    target_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model: torch.nn.Module,
        drafter_tokenizer: Any,
        target_tokenizer: Any,
        *,
        keep_specials: bool = False,
    ) -> None:
        self.session = ModelSession(model)
        self.drafter_tokenizer = as_backend(drafter_tokenizer)
        self.target_tokenizer = as_backend(target_tokenizer)
        self.keep_specials = keep_specials
        drafter_specials = {
            token.content: token_id
            for token_id, token in self.drafter_tokenizer.get_added_tokens_decoder().items()
            if token.special
        }
        # Target special id -> the drafter's special with the same content, or None (dropped).
        self.special_map: dict[int, int | None] = {
            token_id: drafter_specials.get(token.content)
            for token_id, token in self.target_tokenizer.get_added_tokens_decoder().items()
            if token.special
        }

    def reset(self) -> None:
        """Forget the cached sequence; see :class:`~pipeline.engine.proposers.Proposer`."""
        self.session.reset()

    @property
    def drafter_calls(self) -> int:
        """Drafter forward calls made so far (each one sequential step of drafting latency)."""
        return self.session.forwards

    def drafter_ids(self, target_context: list[int]) -> list[int]:
        """The target context as drafter tokens, via text.

        Without ``keep_specials`` specials are dropped and the drafter tokenizer's own post-processing
        (e.g. its BOS) is applied; with it, each text run between specials is re-encoded on its own and
        shared specials are kept in place (the context's own BOS, if any, is then the drafter's).
        """
        if not self.keep_specials:
            text = decode_ids(self.target_tokenizer, target_context)
            return encode_text(self.drafter_tokenizer, text, add_special_tokens=True)
        ids: list[int] = []
        start = 0
        for index, token in enumerate([*target_context, None]):
            if token is not None and token not in self.special_map:
                continue
            text = decode_ids(self.target_tokenizer, target_context[start:index])
            ids += encode_text(self.drafter_tokenizer, text, add_special_tokens=False) if text else []
            if token is not None and self.special_map[token] is not None:
                ids.append(self.special_map[token])
            start = index + 1
        return ids

    def _start(self, context: list[int], gamma: int) -> tuple[list[int], Tensor] | None:
        """Move the session to ``context`` in drafter ids; those ids and the next-token logits.

        Returns None when there is nothing to draft (``gamma <= 0`` or an empty context).
        """
        ids = self.drafter_ids(context)
        if gamma <= 0 or not ids or not context:
            return None
        return ids, self.session.move_to(ids)[-1]


def _empty(width: int, device: torch.device) -> Proposal:
    return Proposal([], torch.zeros(0, width, dtype=torch.float64, device=device))


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


class _MappedProposer(_CrossVocabDrafter):
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
            return _empty(self.target_vocab_size, self.session.device)
        logits = started[1]
        inter_d, inter_t, d2t = self.pairs(logits.shape[-1])
        if inter_d.numel() == 0:
            # No shared token at this logit width: every draft would be rejected, so draft none.
            return _empty(self.target_vocab_size, self.session.device)
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


def align_draft(target_tokenizer: Any, context: list[int], draft_text: str, lookbehind: int = 8) -> list[int]:
    """Target ids that continue ``context`` with ``draft_text``, re-aligned through a look-behind window.

    ``draft_text`` is encoded together with the text of the last ``lookbehind`` context tokens, since a
    tokenizer is not injective over concatenation (the draft may merge with the context's tail). The
    window starts after its last special token: specials are split out before tokenization, so no text
    before one can merge with the draft. If the encoding keeps the window's tokens, the draft is what
    follows them. If it re-splits the window but still has a token boundary exactly where the window's
    text ends, the draft is what follows that boundary. If a token straddles that point, no
    continuation of *these* context tokens spells the text, and nothing is returned.

    Args:
        target_tokenizer: The target's tokenizer.
        context: Target ids so far.
        draft_text: Text to hand over.
        lookbehind: Context tokens re-encoded with the draft.

    Returns:
        Target ids (possibly empty) whose text follows the window's text.
    """
    return align_drafts(target_tokenizer, context, [draft_text], lookbehind)[0]


def byte_lengths(tokenizer: Any) -> list[int] | None:
    """Bytes each id adds to a decoded text, for a GPT-2 byte-level tokenizer (else None).

    Such a tokenizer decodes by concatenating its tokens' bytes (specials skipped) and reading them as
    UTF-8; specials add 0 bytes, and -1 marks ids whose bytes are not known (non-special added tokens).
    """
    from pipeline.vocab.tokens import Spelling, token_meanings

    backend = as_backend(tokenizer)
    spelling = Spelling.of(backend)
    if not spelling.byte_level or spelling.space_sign or spelling.byte_fallback:
        return None
    added = backend.get_added_tokens_decoder()
    lengths = [-1] * (max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
    for token_id, meaning in token_meanings(backend).items():
        if token_id not in added:
            lengths[token_id] = len(meaning.data)
        elif added[token_id].special:
            lengths[token_id] = 0
    return lengths


def align_drafts(
    target_tokenizer: Any,
    context: list[int],
    draft_texts: list[str],
    lookbehind: int = 8,
    token_bytes: list[int] | None = None,
) -> list[list[int]]:
    """:func:`align_draft` for many drafts after one context, encoded in one batch.

    ``token_bytes`` (:func:`byte_lengths` of the target tokenizer) makes the re-split search cheap: a
    window text without U+FFFD decodes only from exactly its bytes, so only a boundary where the running
    byte count equals its length is decoded, and the search stops past it. The result is the same.
    """
    backend = as_backend(target_tokenizer)
    window = context[-max(1, lookbehind) :]
    specials = {token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special}
    after = max((i + 1 for i, token in enumerate(window) if token in specials), default=0)
    window = window[after:]
    window_text = decode_ids(backend, window)
    known = token_bytes is not None and "\ufffd" not in window_text
    goal = len(window_text.encode("utf-8")) if known else None
    encodings = backend.encode_batch([window_text + text for text in draft_texts], add_special_tokens=False)
    aligned: list[list[int]] = []
    for encoding in encodings:
        encoded = list(encoding.ids)
        agreed = common_prefix_length(encoded, window)
        if agreed == len(window):
            aligned.append(encoded[agreed:])
            continue
        sizes = None
        if goal is not None and token_bytes is not None and encoded and max(encoded) < len(token_bytes):
            sizes = [token_bytes[token] for token in encoded]
            sizes = None if min(sizes) < 0 else sizes
        aligned.append(_after_boundary(backend, encoded, agreed, window_text, goal, sizes))
    return aligned


def _after_boundary(
    backend: Any, encoded: list[int], agreed: int, window_text: str, goal: int | None, sizes: list[int] | None
) -> list[int]:
    """The ids after the first boundary at or past ``agreed`` whose prefix decodes to ``window_text``."""
    total = sum(sizes[:agreed]) if sizes is not None else 0
    for boundary in range(agreed, len(encoded) + 1):
        if sizes is None:
            # Every boundary is tried: a prefix ending inside a multi-byte character decodes to U+FFFD
            # and matches nothing, so there is no early exit.
            if decode_ids(backend, encoded[:boundary]) == window_text:
                return encoded[boundary:]
            continue
        if total > goal:
            return []
        if total == goal and decode_ids(backend, encoded[:boundary]) == window_text:
            return encoded[boundary:]
        if boundary < len(encoded):
            total += sizes[boundary]
    return []


class SLEMProposer(_CrossVocabDrafter):
    """String-level exact match (Alg. 2): draft in the drafter's vocabulary, hand over text.

    The drafter drafts ``gamma`` of its own tokens (argmax when greedy, else sampled from its
    standardised distribution: exact-match verification is lossless either way), stopping before a
    special token, and their text is re-encoded by the target tokenizer through :func:`align_draft`
    (look-behind re-alignment for non-injective tokenizers). At most ``gamma`` target ids are proposed.

    Args:
        drafter: A Hugging Face causal LM using ``drafter_tokenizer``.
        drafter_tokenizer: The drafter's tokenizer.
        target_tokenizer: The target's tokenizer.
        target_lookbehind: Context tokens re-encoded with the draft.
        drafter_lookbehind: Drafter tokens decoded with the draft, so its first token's leading space
            survives decoding (SentencePiece decoders strip a sequence's leading space).
        keep_specials: Hand shared special tokens over to the drafter (see :class:`_CrossVocabDrafter`).
        name: Label used in metrics and reports.
    """

    def __init__(
        self,
        drafter: torch.nn.Module,
        drafter_tokenizer: Any,
        target_tokenizer: Any,
        *,
        target_lookbehind: int = 8,
        drafter_lookbehind: int = 8,
        keep_specials: bool = False,
        name: str = "slem",
    ) -> None:
        super().__init__(drafter, drafter_tokenizer, target_tokenizer, keep_specials=keep_specials)
        self.target_lookbehind = max(1, target_lookbehind)
        self.drafter_lookbehind = max(1, drafter_lookbehind)
        self.name = name
        added = self.drafter_tokenizer.get_added_tokens_decoder()
        self._drafter_specials = {token_id for token_id, token in added.items() if token.special}

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft up to ``gamma`` target tokens by string matching; ``q`` is None (exact-match verify)."""
        started = self._start(context, gamma)
        if started is None:
            return Proposal([], None)
        ids, logits = started
        drafted: list[int] = []
        for step in range(gamma):
            token = int(sample(standardise(logits, params), generator))
            if token in self._drafter_specials:
                # A special (EOS, chat marker) has no text to hand over; the draft ends before it.
                break
            drafted.append(token)
            if step + 1 < gamma:
                logits = self.session.feed([token])[-1]
        draft_text = self._draft_text(ids, drafted)
        if not draft_text:
            return Proposal([], None)
        aligned = align_draft(self.target_tokenizer, context, draft_text, self.target_lookbehind)
        return Proposal(aligned[:gamma], None)

    def _draft_text(self, ids: list[int], drafted: list[int]) -> str:
        """The text the drafted tokens add after ``ids`` ('' if it cannot be isolated)."""
        if not drafted:
            return ""
        tokenizer = self.drafter_tokenizer
        for window in (ids[-self.drafter_lookbehind :], ids):
            before = decode_ids(tokenizer, window)
            after = decode_ids(tokenizer, window + drafted)
            if after.startswith(before):
                # A draft ending inside a multi-byte character decodes to U+FFFD; that byte tail is
                # not text the target could match.
                return after[len(before) :].rstrip("\ufffd")
        return ""
