"""Distilling a drafter that has a different tokenizer from the target: aligned soft targets.

A drafter with another vocabulary cannot be fit to the target's logits token by token, but the two
tokenizations of one text share many *boundaries*: wherever a target token and a drafter token start at
the same character, both models predict "the text that starts here". At those positions the target's
next-token distribution, restricted to the tokens both vocabularies spell identically (the intersection
``I``, matched by byte meaning in :mod:`pipeline.vocab.tokens`) and renormalised, is a soft target for
the drafter. That is the distribution TLI (Timor et al. 2025, "Lossless speculative decoding for
heterogeneous vocabularies") verifies against, so fitting it raises acceptance directly. This module
owns the aligned rows, and the soft-target loss and agreement figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.tiny.train import StepLoss, batches
from pipeline.vocab.tokens import representatives


def shared_tokens(tok_target: Any, tok_drafter: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens both vocabularies spell identically: ``(target_ids, drafter_ids)``, by target id.

    Text tokens only (specials are control symbols, never distilled on); where several drafter tokens
    mean the same bytes, the one the tokenizer emits (a learnt 'A', not the byte fallback '<0x41>').
    """
    drafter_ids = representatives(tok_drafter)
    pairs = sorted(
        (target_id, drafter_ids[meaning])
        for meaning, target_id in representatives(tok_target).items()
        if meaning.kind == "text" and meaning in drafter_ids
    )
    return torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])


@dataclass
class AlignedRows:
    """Rows of the same text under both tokenizers, and where their predictions line up.

    ``target_pos[r, j]`` is the target position predicting the same text as drafter position ``j``
    of row ``r`` (both next tokens start at the same character), or -1.
    """

    target: torch.Tensor
    drafter: torch.Tensor
    target_pos: torch.Tensor


def aligned_rows(tok_target: Any, tok_drafter: Any, texts: list[str], context: int) -> AlignedRows:
    """Cut the concatenated ``texts`` into chunks that fill ``context`` tokens under both tokenizers."""
    stream = "\n\n".join(texts)
    chunk = context * 4  # ~2.7 characters per token on this text: every chunk overfills both rows
    chunks = [stream[i : i + chunk] for i in range(0, len(stream) - chunk + 1, chunk)]
    enc_t = tok_target(chunks, add_special_tokens=False, return_offsets_mapping=True)
    enc_d = tok_drafter(chunks, add_special_tokens=False, return_offsets_mapping=True)
    rows_t, rows_d, positions = [], [], []
    for ids_t, off_t, ids_d, off_d in zip(
        enc_t["input_ids"], enc_t["offset_mapping"], enc_d["input_ids"], enc_d["offset_mapping"], strict=True
    ):
        if len(ids_t) < context or len(ids_d) < context:
            continue
        start_to_t: dict[int, int] = {}
        for i in range(1, context):
            start_to_t.setdefault(off_t[i][0], i)
        pos = [-1] * context
        seen: set[int] = set()
        for j in range(1, context):
            start = off_d[j][0]
            if start in start_to_t and start not in seen:  # only the first byte token of a character
                pos[j - 1] = start_to_t[start] - 1
            seen.add(start)
        rows_t.append(ids_t[:context])
        rows_d.append(ids_d[:context])
        positions.append(pos)
    return AlignedRows(torch.tensor(rows_t), torch.tensor(rows_d), torch.tensor(positions))


def soft_targets(
    target_logits: torch.Tensor, target_pos: torch.Tensor, shared_target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probabilities on the shared tokens, renormalised, at each drafter position.

    Returns:
        ``(log_p, mask)``: ``[batch, context, |I|]`` and the boolean mask of aligned positions.
    """
    mask = target_pos >= 0
    index = target_pos.clamp(min=0)[..., None].expand(-1, -1, target_logits.shape[-1])
    at_drafter = target_logits.gather(1, index)[..., shared_target]
    return F.log_softmax(at_drafter.float(), dim=-1), mask


def aligned_loss(
    drafter_logits: torch.Tensor, log_p: torch.Tensor, mask: torch.Tensor, shared_drafter: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy of the drafter's full distribution against the soft targets, at aligned positions.

    Using the drafter's full softmax (not renormalised onto ``I``) also moves its mass onto shared
    tokens, which is what TLI proposes from.
    """
    log_q = F.log_softmax(drafter_logits.float(), dim=-1)[..., shared_drafter]
    per_position = -(log_p.exp() * log_q).sum(-1)
    return per_position[mask].mean()


@torch.no_grad()
def aligned_agreement(
    target: Any,
    drafter: Any,
    rows: AlignedRows,
    shared: tuple[torch.Tensor, torch.Tensor],
    batch_size: int = 16,
) -> dict:
    """Agreement on the shared vocabulary at aligned positions, both sides renormalised onto ``I``.

    Returns:
        ``top1_agreement`` (argmax equal), ``expected_acceptance`` (mean ``sum_I min(p_I, q_I)``, the
        TLI acceptance rate of one draft token) and ``positions`` counted.
    """
    agree, overlap, count = 0.0, 0.0, 0
    for start in range(0, rows.target.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        log_p, mask = soft_targets(target(input_ids=rows.target[sl]).logits, rows.target_pos[sl], shared[0])
        log_q = F.log_softmax(drafter(input_ids=rows.drafter[sl]).logits[..., shared[1]].float(), dim=-1)
        p, q = log_p[mask].exp(), log_q[mask].exp()
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        overlap += torch.minimum(p, q).sum().item()
        count += int(mask.sum())
    return {
        "top1_agreement": round(agree / count, 4),
        "expected_acceptance": round(overlap / count, 4),
        "positions": count,
    }


def aligned_distill_loss(
    rows: AlignedRows,
    chat_rows: torch.Tensor,
    teacher: Any,
    shared: tuple[torch.Tensor, torch.Tensor],
    batch_size: int,
    seed: int,
) -> StepLoss:
    """Half of each batch: aligned text with soft targets; half: chats (template, turn ends) with CE.

    The loss is next-token cross-entropy on every row plus the aligned soft-target cross-entropy.
    """
    half = batch_size // 2
    aligned = batches(torch.arange(rows.drafter.shape[0]), half, seed)
    chats = batches(chat_rows, batch_size - half, seed + 1)

    def step(model: Any) -> torch.Tensor:
        idx = next(aligned)
        with torch.no_grad():
            log_p, mask = soft_targets(
                teacher(input_ids=rows.target[idx]).logits.float(), rows.target_pos[idx], shared[0]
            )
        batch = torch.cat([rows.drafter[idx], next(chats)])
        logits = model(input_ids=batch).logits.float()
        hard = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
        return hard + aligned_loss(logits[:half], log_p, mask, shared[1])

    return step
