"""What every drafter's harness module shares: a trainable drafter on a frozen target, fed padded calibration rows and
scored on held-out ones by simulated τ (each task defines ``training_step`` and ``evaluate``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from pipeline.data.rows import Row, pad_batch


class DrafterTask(nn.Module):
    """The harness module's common part.

    Args:
        drafter: the module that trains.
        target: the frozen target (a submodule, so it moves with the task; it stays in eval mode).
        heldout: rows scored by the task's ``evaluate``.
        pad_id: token id used to pad batches (masked out everywhere).
        eval_batch_size: rows per forward in ``evaluate``.
    """

    selection_metric = "simulated_tau"

    def __init__(self, drafter: nn.Module, target: nn.Module, heldout: Sequence[Row], *, pad_id: int,
                 eval_batch_size: int) -> None:
        super().__init__()
        self.drafter, self.target = drafter, target.eval().requires_grad_(False)
        self.heldout_rows, self.pad_id, self.eval_batch_size = list(heldout), pad_id, eval_batch_size

    def train(self, mode: bool = True) -> DrafterTask:
        super().train(mode)
        self.target.eval()  # frozen: never dropout, whatever Lightning toggles
        return self

    def collate(self, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
        return pad_batch(rows, self.pad_id)

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum())
