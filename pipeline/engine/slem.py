"""String-level exact match (Timor et al. 2025, Alg. 2): a foreign drafter drafts in its own vocabulary and hands
text over; the target's tokenizer re-encodes it (:func:`align_draft`, with look-behind re-alignment for
tokenizers that are not injective over concatenation) and verification is exact match, so :class:`SLEMProposer`
returns ``q=None``. :func:`align_drafts` and :func:`byte_lengths` are shared with SLRS (:mod:`pipeline.engine.slrs`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Generator

from pipeline.engine.bridge import CrossVocabDrafter
from pipeline.engine.proposers import Proposal
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState, common_prefix_length
from pipeline.vocab.maps import as_backend, decode_ids
from pipeline.vocab.tokens import Spelling, token_meanings


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
    # Without offsets (all the alignment reads is ids): the same ids at two thirds of the time on the kit's target, the
    # lookups being most of SLRS's host time. tokenizers < 0.20 has only encode_batch.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    encodings = encode([window_text + text for text in draft_texts], add_special_tokens=False)
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


class SLEMProposer(CrossVocabDrafter):
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
        keep_specials: Hand shared special tokens over to the drafter (see :class:`CrossVocabDrafter`).
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
