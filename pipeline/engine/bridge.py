"""The bridge every proposer with a foreign drafter stands on (heterogeneous vocabularies).

:class:`CrossVocabDrafter` keeps the drafter's own token sequence and KV cache (a
:class:`~pipeline.engine.session.ModelSession`): at each round the target context is decoded to text,
re-encoded by the drafter tokenizer, and only the suffix past the longest common prefix with the cached
sequence is run. TLI and Union (:mod:`pipeline.engine.hetero`), SLEM (:mod:`pipeline.engine.slem`), SLRS
(:mod:`pipeline.engine.slrs`) and the redistributed TLI drafts (:mod:`pipeline.engine.rdk`) all build on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipeline.engine.proposers import Proposal
from pipeline.engine.session import ModelSession
from pipeline.vocab.maps import as_backend, decode_ids, encode_text

# Why re-tokenising text at every round cannot break losslessness: the verifier's guarantee (Leviathan
# et al. 2023, Thm. 3.5) needs only that each drafted token was drawn from the ``q`` we return (or, for
# SLEM, nothing at all). How the drafter came to its logits is irrelevant, so a decode/re-encode that
# tokenises the context differently from what the drafter drafted, a cache cropped too eagerly, or a
# look-behind that fails to align only lowers acceptance; the emitted tokens keep the target's law.


class CrossVocabDrafter:
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


def empty_proposal(width: int, device: torch.device) -> Proposal:
    return Proposal([], torch.zeros(0, width, dtype=torch.float64, device=device))
