"""EAGLE-3's training objective: the training-time test, and the target features it learns from.

Training-time test (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", arXiv:2503.01840, §3.2 and Fig. 6): the drafter is unrolled for ``K``
steps over the whole sequence at once. Step 0 reads the fused target features; step ``s > 0`` reads the
drafter's own output of step ``s-1`` in place of them (so it learns to draft from its own, imperfect,
features as at inference) while the input tokens move on by one per step. Row ``t`` of step ``s``:

    input token x_{t+1+s}, feature g^{s}_t (g^0_t = fc(f_t), g^{s}_t = drafter output of step s-1),
    RoPE position t+s; predicts x_{t+2+s} against the target's distribution at position t+1+s.

The loss is ``Σ_s decay^s · CE_s`` (decay 0.8 as in the EAGLE-3 and SpecForge code), ``CE_s`` the soft
cross-entropy to the target's next-token distribution restricted to the draft vocabulary (target logits
gathered at the draft ids and softmaxed over them), averaged per example (then over the batch's examples,
so that the harness may split a global batch freely; SpecForge averages over the batch's tokens, which
weights long answers more) over the rows whose predicted token
``x_{t+2+s}`` carries the calibration ``loss_mask`` (assistant tokens) and whose full-vocabulary target
argmax lies in the draft vocabulary (SpecForge's position mask: elsewhere the restricted distribution is
not the target's). Top-1 accuracy counts a row as right when the drafter's argmax is the target's
argmax, over all loss-masked rows (a target argmax outside the draft vocabulary is a miss). The
simulated accepted length ``τ = 1 + Σ_k Π_{i≤k} acc_i`` treats the per-step accuracies as the
chance a greedy chain draft survives that far: the cheap number used to pick checkpoints.

Only one step's logits exist at a time: the target's logits are gathered to the draft vocabulary once,
and each step's ``(B, T, V_draft)`` logits live only inside that step's (checkpointed) loss, rebuilt
in backward, so K steps cost K ``(B, T, H)`` hidden states in the graph, not K sets of logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from pipeline.drafters.eagle3 import Eagle3Drafter, TTTCache, check_aux_layer_ids
from pipeline.errors import DrafterError


@torch.no_grad()
def target_features(target_model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    aux_layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the frozen target once: its low/mid/high features and its logits.

    Args:
        target_model: a ``transformers`` causal LM.
        input_ids: ``(B, T)``; batches are padded on the right.
        attention_mask: ``(B, T)`` or None.
        aux_layer_ids: three indices into ``output_hidden_states`` (``Eagle3Config.aux_layer_ids``).

    Returns:
        ``(hidden_3 (B, T, 3H), logits (B, T, V))``.
    """
    out = target_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                       use_cache=False)
    check_aux_layer_ids(tuple(aux_layer_ids), len(out.hidden_states) - 1)
    hidden = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1)
    return hidden, out.logits


@dataclass(frozen=True)
class TTTResult:
    """One batch of the training-time test. Everything but ``loss`` is detached."""

    loss: torch.Tensor
    """Scalar ``Σ_s decay^s · per_step_loss[s]``, with gradient."""
    per_step_loss: torch.Tensor
    """``(K,)`` soft cross-entropy of each step."""
    per_step_acc: torch.Tensor
    """``(K,)`` top-1 agreement with the target, ``per_step_correct / per_step_tokens``."""
    simulated_tau: torch.Tensor
    """Scalar ``1 + Σ_k Π_{i≤k} per_step_acc[i]``."""
    tokens: int
    """Loss-masked rows at step 0 (the batch's weight when averaging over batches)."""
    per_step_correct: torch.Tensor
    """``(K,)`` rows where the drafter's argmax is the target's (sum these across batches, then divide)."""
    per_step_tokens: torch.Tensor
    """``(K,)`` loss-masked rows of each step."""


def simulated_tau(per_step_acc: torch.Tensor) -> torch.Tensor:
    """Expected accepted length of a greedy chain draft if step ``k`` survives with ``acc_k``."""
    return 1 + torch.cumprod(per_step_acc.double(), dim=0).sum().to(per_step_acc.dtype)


def _shift(x: torch.Tensor, by: int, fill: int | bool = 0) -> torch.Tensor:
    """``x[:, by:]`` padded on the right back to ``x``'s length with ``fill``."""
    pad = torch.full((x.shape[0], by, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, by:], pad], dim=1)


def _head_loss(drafter: Eagle3Drafter, hidden: torch.Tensor, target_p: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example weighted sums ``(B,)`` of one step's soft cross-entropies, and the drafter's argmax."""
    logits = drafter.logits(hidden).float()
    cross_entropy = -(target_p * torch.log_softmax(logits, dim=-1)).sum(-1)
    return (cross_entropy * weight).sum(-1), logits.argmax(-1)


def ttt_loss(drafter: Eagle3Drafter, input_ids: torch.Tensor, loss_mask: torch.Tensor,
             target_hidden: torch.Tensor, target_logits: torch.Tensor, steps: int = 7, decay: float = 0.8,
             position_ids: torch.Tensor | None = None) -> TTTResult:
    """The unrolled training-time-test loss of one batch (see the module docstring for the alignment).

    Args:
        drafter: the EAGLE-3 drafter (its ``d2t``/``t2d`` define the draft vocabulary).
        input_ids: ``(B, T)`` token ids as the target read them, padded on the right.
        loss_mask: ``(B, T)`` 1 on tokens to learn (assistant tokens), 0 elsewhere and on padding.
        target_hidden: ``(B, T, 3H)`` from :func:`target_features` (or already fused, ``(B, T, H)``).
        target_logits: ``(B, T, V)`` the target's logits at the same positions.
        steps: unrolled steps ``K``.
        decay: weight ``decay^s`` of step ``s``.
        position_ids: ``(B, T)`` RoPE positions of step 0 (default ``arange(T)``); step ``s`` adds ``s``.

    Returns:
        The loss and its per-step metrics.
    """
    batch, length = input_ids.shape
    if steps < 1 or length < steps + 2:
        raise DrafterError("The training-time test cannot unroll this many steps over these sequences.",
                           expected=f"1 <= steps <= T - 2 (T = {length} tokens per row)", found=f"steps={steps}",
                           fix="Lower ttt steps or use longer sequences.")
    if target_logits.shape[:2] != (batch, length) or loss_mask.shape != (batch, length):
        raise DrafterError("ttt_loss inputs disagree on batch and sequence length.",
                           expected=f"input_ids, loss_mask and target_logits all ({batch}, {length}, ...)",
                           found=f"loss_mask {tuple(loss_mask.shape)}, target_logits {tuple(target_logits.shape)}")
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)

    with torch.no_grad():
        # Target side, once for all steps: (B, T, V_draft) probabilities and which rows can be learned.
        in_draft_vocab = drafter.t2d[target_logits.argmax(-1)]
        target_p = torch.softmax(target_logits.index_select(-1, drafter.draft_to_target).float(), dim=-1)
        target_top = target_p.argmax(-1)
        mask = loss_mask.bool()

    hidden, cache = target_hidden, TTTCache()
    losses, correct, counted = [], [], []
    for s in range(steps):
        hidden = drafter.step(_shift(input_ids, 1 + s), hidden, position_ids + s, cache)
        rows = length - 1 - s  # rows whose target position t+1+s exists
        with torch.no_grad():
            predicted = _shift(mask, 2 + s, False)[:, :rows]  # x_{t+2+s} is a token to learn
            learnable = predicted & in_draft_vocab[:, 1 + s:]
            weight = learnable.float()
        # Checkpointed: this step's (B, rows, V_draft) logits are freed here and rebuilt in backward, so
        # the steps' logits never coexist, not even in the autograd graph.
        sums, draft_top = checkpoint(_head_loss, drafter, hidden[:, :rows], target_p[:, 1 + s:], weight,
                                     use_reentrant=False)
        # Per example, then over examples: a batch's loss is a mean of per-example terms, so splitting a
        # global batch over ranks and micro-batches does not change the step (the harness's contract).
        losses.append((sums / weight.sum(-1).clamp(min=1)).mean())
        correct.append(((draft_top == target_top[:, 1 + s:]) & learnable).sum())
        counted.append(predicted.sum())

    per_step_loss = torch.stack(losses)
    weights = decay ** torch.arange(steps, device=per_step_loss.device, dtype=per_step_loss.dtype)
    per_step_correct, per_step_tokens = torch.stack(correct), torch.stack(counted)
    per_step_acc = per_step_correct.float() / per_step_tokens.clamp(min=1).float()
    return TTTResult(
        loss=(weights * per_step_loss).sum(),
        per_step_loss=per_step_loss.detach(),
        per_step_acc=per_step_acc,
        simulated_tau=simulated_tau(per_step_acc),
        tokens=int(per_step_tokens[0]),
        per_step_correct=per_step_correct,
        per_step_tokens=per_step_tokens,
    )
