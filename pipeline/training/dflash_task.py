"""DFlash training as a harness task: anchored blocks of calibration rows, a position-decayed loss.

Each training row (the target's own answer, from ``generate``) is read once by the frozen target, **online**:
its tapped layers become the context features of every position, its logits the teacher. Then ``A`` anchor
positions ``a`` are drawn among those whose next token is an assistant token (each row's draw is seeded by the
harness's seed of the optimizer step and the row's own index, :func:`row_generators`: a resumed run draws the same
anchors, and neither the micro-batch size nor the device count changes them). Each
anchor opens a block ``[x_a, MASK × (B − 1)]`` at positions ``a .. a + B − 1`` that sees the context features of
positions ``< a`` (exactly what the proposer's block sees after ``x_a`` was verified) and, bidirectionally, its
own rows; all of a row's blocks run side by side in one forward with that attention mask (SpecForge trains the
same way: many anchors per sequence, one forward). With ``train_dflash.next_round_anchors`` a forward without
gradient first scores the drawn blocks, and the block each one's next greedy round would open (:func:`next_round_blocks`)
joins them: inference rounds start right after a miss, where a first row agrees least.

Loss: block row ``k`` (``1 ≤ k < B``) predicts position ``a + k``. Its cross-entropy (``train_dflash.loss``: ``ce``,
SpecForge's, to the row's own token there, which the target wrote; or ``kl``, the soft cross-entropy to the target's
distribution there, the gradient of ``speculators``' KL) is weighted by ``exp(−(k − 1)/γ)``
(``train_dflash.loss_decay``; SpecForge γ = 7 at B = 16, ``speculators`` γ = 4 at B = 8), only where position
``a + k`` is an assistant token of the row. Weighted mean per example, then the mean over
examples (the harness's contract: a global batch may be split over ranks and micro-batches freely). A drafter with
its own draft-vocabulary head learns a row only where the token it is taught (``ce``: the row's; ``kl``: the
target's argmax) is in that vocabulary, against the teacher restricted to it (as EAGLE-3 does); its agreement
counts every learnable row, so a token outside the vocabulary is a miss.

Checkpoint choice (``evaluate()``): on held-out rows with a fixed anchor draw, the **simulated τ** of a block =
1 + the number of leading rows whose argmax is the target's argmax (the target conditioned on the row's own
tokens), averaged over anchors — a greedy round's accepted length if the target had written the row greedily.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.config.dflash import DFLASH_LOSSES
from pipeline.data.rows import Row, pad_batch
from pipeline.drafters.dflash import DFlashDrafter
from pipeline.training.checkpoints import derive_seed
from pipeline.training.task import DrafterTask


@torch.no_grad()
def tapped_features(target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    hidden_state_indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's tapped layers ``(B, T, n·H)`` (``output_hidden_states[i]`` for each index) and logits."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i] for i in hidden_state_indices], dim=-1), out.logits


@dataclass(frozen=True)
class Blocks:
    """A batch's anchored blocks, ``N`` per row (padded with invalid ones).

    Attributes:
        anchors: ``(B, N)`` anchor positions (0 where invalid).
        valid: ``(B, N)`` whether the anchor exists.
        targets: ``(B, N, K)`` with ``K = B_size − 1``: whether block row ``k + 1`` has an assistant token to learn.
    """

    anchors: torch.Tensor
    valid: torch.Tensor
    targets: torch.Tensor


def draw_blocks(loss_mask: torch.Tensor, lengths: torch.Tensor, block_size: int, per_row: int,
                generator: torch.Generator | Sequence[torch.Generator] | None = None) -> Blocks:
    """Up to ``per_row`` anchors per row, without replacement, among positions ``a ≥ 1`` with ``loss_mask[a+1]``.

    ``a ≥ 1`` because a block at ``a`` sees the features of positions ``< a`` (the proposer drafts nothing
    without one). ``generator``: one for the whole batch, or one per row (:func:`row_generators`: a row's anchors
    then do not depend on the batch it came in).
    """
    batch = loss_mask.shape[0]
    anchors = torch.zeros(batch, per_row, dtype=torch.long)
    valid = torch.zeros(batch, per_row, dtype=torch.bool)
    mask = loss_mask.cpu().bool()
    for b in range(batch):
        n = int(lengths[b])
        candidates = torch.nonzero(mask[b, 2:n]).flatten() + 1  # a with loss_mask[a + 1], 1 <= a <= n - 2
        if candidates.numel() == 0:
            continue
        drawn_by = generator if generator is None or isinstance(generator, torch.Generator) else generator[b]
        order = torch.randperm(candidates.numel(), generator=drawn_by)[:per_row]
        chosen = candidates[order].sort().values
        anchors[b, : chosen.numel()] = chosen
        valid[b, : chosen.numel()] = True
    device = loss_mask.device
    return blocks_at(anchors.to(device), valid.to(device), loss_mask, lengths, block_size)


def row_generators(seed: int, index: torch.Tensor) -> list[torch.Generator]:
    """One generator per row, seeded by ``seed`` and the row's index in its dataset: the row's draws are the same
    whichever micro-batch, rank or position in a batch it lands in (micro-batch size and device count are run
    settings: they must not change what is learnt)."""
    return [torch.Generator().manual_seed(derive_seed(seed, "row", int(i))) for i in index.tolist()]


def blocks_at(anchors: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
              block_size: int) -> Blocks:
    """The blocks at ``anchors`` ``(B, N)`` (where ``valid``): each row learnable where it lies inside the row and its
    position is an assistant token."""
    batch, length = loss_mask.shape
    rows = anchors.unsqueeze(-1) + torch.arange(1, block_size, device=anchors.device)  # (B, N, K) predicted positions
    inside = rows < lengths.to(anchors.device).view(batch, 1, 1)
    learn = loss_mask.bool().gather(1, rows.clamp(max=length - 1).view(batch, -1)).view_as(rows)
    return Blocks(anchors, valid, learn & inside & valid.unsqueeze(-1))


def next_round_blocks(blocks: Blocks, runs: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor,
                      block_size: int) -> Blocks:
    """Where the next greedy round starts after each valid block: its ``runs`` leading rows were accepted, the
    target's token at the first miss was emitted, and that token opens the next block, at ``a + runs + 1``. Valid
    where that anchor is ``≤ length − 2`` and its next token is an assistant token (as :func:`draw_blocks` asks)."""
    length = loss_mask.shape[1]
    anchors = blocks.anchors + runs + 1
    valid = blocks.valid & (anchors <= lengths.to(anchors.device).view(-1, 1) - 2)
    valid &= loss_mask.bool().gather(1, (anchors + 1).clamp(max=length - 1))
    return blocks_at(torch.where(valid, anchors, torch.zeros_like(anchors)), valid, loss_mask, lengths, block_size)


def join_blocks(first: Blocks, second: Blocks) -> Blocks:
    """Both sets of blocks side by side, ``(B, N₁ + N₂)``."""
    return Blocks(*(torch.cat([a, b], dim=1) for a, b in ((first.anchors, second.anchors),
                                                           (first.valid, second.valid),
                                                           (first.targets, second.targets))))


def block_attention(anchors: torch.Tensor, valid: torch.Tensor, context_length: int, block_size: int) -> torch.Tensor:
    """``(B, 1, N·B_size, T + N·B_size)`` boolean: a block row sees context keys ``< a`` and its own block's rows."""
    batch, count = anchors.shape
    query_block = torch.arange(count, device=anchors.device).repeat_interleave(block_size)  # (N·Bs,)
    context = torch.arange(context_length, device=anchors.device).view(1, 1, -1) < anchors[:, query_block].unsqueeze(-1)
    context = context & valid[:, query_block].unsqueeze(-1)
    own = (query_block.view(-1, 1) == query_block.view(1, -1)).expand(batch, -1, -1)
    return torch.cat([context, own], dim=-1).unsqueeze(1)


@dataclass(frozen=True)
class BlockResult:
    """One batch of blocks. Everything but ``loss`` is detached."""

    loss: torch.Tensor
    """Scalar weighted soft cross-entropy (mean of per-example weighted means), with gradient."""
    per_position_correct: torch.Tensor
    """``(K,)`` learned rows where the drafter's argmax is the target's."""
    per_position_tokens: torch.Tensor
    """``(K,)`` learned rows."""
    accepted: torch.Tensor
    """Sum over valid blocks of the leading run of agreeing rows (stops at the first miss or unlearnable row)."""
    blocks: int
    """Valid blocks."""
    runs: torch.Tensor
    """``(B, N)`` each block's leading run of agreeing rows (0 for an invalid block)."""


def _head_loss(drafter: DFlashDrafter, hidden: torch.Tensor, target_p: torch.Tensor | None, labels: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example weighted sums ``(B,)`` of the rows' cross-entropies (soft to ``target_p``, or to ``labels`` when
    it is None), and the drafter's argmax."""
    logits = drafter.logits(hidden).float()
    log_q = torch.log_softmax(logits, dim=-1)
    if target_p is None:
        cross_entropy = -log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    else:
        cross_entropy = -(target_p * log_q).sum(-1)
    return (cross_entropy * weight).flatten(1).sum(-1), logits.argmax(-1)


def block_loss(drafter: DFlashDrafter, input_ids: torch.Tensor, target_hidden: torch.Tensor,
               target_logits: torch.Tensor, blocks: Blocks, decay: float, loss: str = "ce") -> BlockResult:
    """The decayed block loss of one batch (see the module docstring); ``loss`` one of ``DFLASH_LOSSES``."""
    if loss not in DFLASH_LOSSES:
        raise ValueError(f"loss must be one of {DFLASH_LOSSES}, not {loss!r}")
    batch, length = input_ids.shape
    size = drafter.config.block_size
    count = blocks.anchors.shape[1]
    device = input_ids.device
    first = input_ids.gather(1, blocks.anchors)  # (B, N)
    block_ids = drafter.block_ids(first.flatten()).view(batch, count * size)
    block_positions = (blocks.anchors.unsqueeze(-1) + torch.arange(size, device=device)).view(batch, count * size)
    context_positions = torch.arange(length, device=device).expand(batch, length)
    mask = block_attention(blocks.anchors, blocks.valid, length, size)
    hidden = drafter(block_ids, target_hidden, block_positions, context_positions, mask=mask)
    hidden = hidden.view(batch, count, size, -1)[:, :, 1:]  # rows 1..B-1 draft

    with torch.no_grad():
        # Row k of the block at a predicts position a + k: the target's distribution there is its logits at a + k - 1.
        source = (blocks.anchors.unsqueeze(-1) + torch.arange(size - 1, device=device)).clamp(max=length - 1)
        teacher = target_logits.gather(1, source.view(batch, -1, 1).expand(-1, -1, target_logits.shape[-1]))
        teacher = teacher.float().view(batch, count, size - 1, -1)
        target_top = teacher.argmax(-1)
        position_weight = torch.exp(-torch.arange(size - 1, device=device, dtype=torch.float32) / decay)
        weight = blocks.targets.float() * position_weight
        labels = input_ids.gather(1, (source + 1).clamp(max=length - 1).view(batch, -1)).view(batch, count, size - 1)
        vocab = drafter.draft_to_target  # None: the head's rows are the target's ids
        if vocab is not None:
            weight = weight * drafter.t2d[labels if loss == "ce" else target_top]
            labels = (drafter.t2d.long().cumsum(0) - 1)[labels].clamp(min=0)  # draft ids (masked out where absent)
            teacher = teacher.index_select(-1, vocab)
        soft = torch.softmax(teacher, dim=-1) if loss == "kl" else None  # ce needs only the row's own token

    sums, draft_top = checkpoint(_head_loss, drafter, hidden, soft, labels, weight, use_reentrant=False)
    loss = (sums / weight.flatten(1).sum(-1).clamp(min=1e-9)).mean()
    with torch.no_grad():
        if vocab is not None:
            draft_top = vocab[draft_top]
        right = (draft_top == target_top) & blocks.targets
        run = torch.cumprod(right.long(), dim=-1).sum(-1)  # leading agreeing, learnable rows
    return BlockResult(loss=loss, per_position_correct=right.sum((0, 1)), per_position_tokens=blocks.targets.sum((0, 1)),
                       accepted=run[blocks.valid].sum(), blocks=int(blocks.valid.sum()),
                       runs=run * blocks.valid)


class DFlashTask(DrafterTask):
    """The harness module: a trainable DFlash drafter on a frozen target.

    Args:
        drafter: the drafter.
        target: the frozen target (a submodule, so it moves with the task; it stays in eval mode).
        heldout: rows scored by :meth:`evaluate`.
        anchors_per_row: blocks per row.
        decay: γ of the position weight ``exp(−(k − 1)/γ)``.
        loss: one of ``DFLASH_LOSSES`` (``train_dflash.loss``).
        next_round_anchors: in training, also the block where the next greedy round would start after each drawn
            one (:func:`next_round_blocks`, found by a forward without gradient): the positions rounds start from at
            inference, right after a miss (``train_dflash.next_round_anchors``).
        pad_id: token id used to pad batches.
        eval_batch_size: rows per forward in :meth:`evaluate`.
    """

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, heldout: Sequence[Row], *, anchors_per_row: int,
                 decay: float, loss: str = "ce", next_round_anchors: bool = False, pad_id: int = 0,
                 eval_batch_size: int = 8) -> None:
        super().__init__(drafter, target, heldout, pad_id=pad_id, eval_batch_size=eval_batch_size)
        self.anchors_per_row, self.decay, self.loss = anchors_per_row, decay, loss
        self.next_round_anchors = next_round_anchors
        self.step_seed = 0  # the harness sets it before each optimizer step's micro-batches

    def _blocks(self, batch: dict[str, torch.Tensor], generator: Sequence[torch.Generator],
                next_round: bool = False) -> BlockResult:
        hidden, logits = tapped_features(self.target, batch["input_ids"], batch["attention_mask"],
                                         self.drafter.config.hidden_state_indices)
        lengths, size = batch["attention_mask"].sum(-1), self.drafter.config.block_size
        blocks = draw_blocks(batch["loss_mask"], lengths, size, self.anchors_per_row, generator)
        hidden = hidden.to(self.drafter.fc.weight.dtype)
        if next_round:
            with torch.no_grad():
                probe = block_loss(self.drafter, batch["input_ids"], hidden, logits, blocks, self.decay, self.loss)
            blocks = join_blocks(blocks, next_round_blocks(blocks, probe.runs, batch["loss_mask"], lengths, size))
        return block_loss(self.drafter, batch["input_ids"], hidden, logits, blocks, self.decay, self.loss)

    def training_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        # each row's anchors from the harness's seed of this optimizer step and the row's own index
        result = self._blocks(batch, row_generators(self.step_seed, batch["index"]), self.next_round_anchors)
        width = result.per_position_correct.numel()
        metrics = {f"count.correct_{k + 1}": result.per_position_correct[k] for k in range(width)}
        metrics.update({f"count.tokens_{k + 1}": result.per_position_tokens[k] for k in range(width)})
        metrics.update({"count.accepted": result.accepted, "count.blocks": result.blocks})
        return result.loss, metrics

    def step_figures(self, counts: dict[str, float]) -> dict[str, float]:
        """A step's per-position agreement and simulated τ over all its micro-batches' blocks (the harness sums the
        counts over micro-batches and ranks)."""
        width = self.drafter.config.block_size - 1
        out = {f"acc_{k}": counts[f"correct_{k}"] / max(1.0, counts[f"tokens_{k}"]) for k in range(1, width + 1)}
        out["train_simulated_tau"] = 1 + counts["accepted"] / max(1.0, counts["blocks"])
        return out

    forward = training_step

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out simulated τ (the selection metric), per-position agreement and loss, on fixed anchors."""
        device = next(self.drafter.parameters()).device
        size = self.drafter.config.block_size
        correct = torch.zeros(size - 1, dtype=torch.float64)
        tokens = torch.zeros(size - 1, dtype=torch.float64)
        accepted, blocks, loss = 0.0, 0, 0.0
        for start in range(0, len(self.heldout_rows), self.eval_batch_size):
            rows = self.heldout_rows[start : start + self.eval_batch_size]
            batch = {k: v.to(device) for k, v in pad_batch(rows, self.pad_id).items()}
            result = self._blocks(batch, row_generators(0, batch["index"]))  # the same blocks at every evaluation
            correct += result.per_position_correct.double().cpu()
            tokens += result.per_position_tokens.double().cpu()
            accepted += float(result.accepted)
            blocks += result.blocks
            loss += float(result.loss) * len(rows)
        acc = correct / tokens.clamp(min=1)
        out = {f"acc_{k + 1}": float(a) for k, a in enumerate(acc)}
        out["simulated_tau"] = 1 + accepted / max(1, blocks)
        out["loss"] = loss / max(1, len(self.heldout_rows))
        out["blocks"] = float(blocks)
        return out
