"""Calibration rows for the trainers: a calibration artifact's turns, split into training and held-out rows, and
padded batches of them.

:class:`CalibrationRows` turns a calibration artifact (the target's own answers, from ``generate``) into
training and held-out rows: ``input_ids`` cut to ``max_length`` and the assistant ``loss_mask``; a
chat's rows go to the held-out side when the hash of its ``group`` (the chat a record is one part of; the row's
``prompt_id`` in shards without that column) falls under ``eval_fraction`` (stable whatever the shard layout).
The EAGLE-3 head, the DynaSpec router and RDK's estimation all read them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.data.calibration import read_shard, shard_files
from pipeline.errors import DrafterError


@dataclass(frozen=True)
class Row:
    """One calibration turn: token ids as the target read them and the assistant loss mask."""

    index: int
    input_ids: list[int]
    loss_mask: list[int]
    group: str = ""
    """The chat the row comes from (its split group); empty where the row is a chat of its own."""


def heldout(group: str, fraction: float) -> bool:
    """Whether chat ``group`` is held out (a hash threshold: stable across shards and runs)."""
    digest = hashlib.sha256(f"eagle3-eval:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class CalibrationRows:
    """Training and held-out rows of a calibration artifact's ``data/`` shards.

    Args:
        directory: the calibration artifact's ``data`` directory (Arrow shards).
        max_length: tokens kept per row (the start: prompt, then the answer's first tokens).
        eval_fraction: share of conversations held out for the simulated-τ evaluation.
        eval_max_rows: most held-out rows kept (the evaluation's cost).
        min_length: shortest row kept (the unrolled test needs ``ttt_steps + 2`` tokens).
        what: what is trained, for error messages.
        fraction_key: the config key that sets ``eval_fraction``, which an error tells to raise or lower.
    """

    def __init__(self, directory: Path, *, max_length: int, eval_fraction: float, eval_max_rows: int,
                 min_length: int, what: str, fraction_key: str) -> None:
        files = shard_files(directory)
        if not files:
            raise DrafterError(f"The calibration set at {directory} holds no shards.",
                               fix="Rerun `drafter generate` for this config.")
        self.train: list[Row] = []
        self.heldout: list[Row] = []
        self.dropped = {"no_assistant_tokens": 0, "too_short": 0}
        for path in files:
            table = read_shard(path)
            if "loss_mask" not in table.column_names:
                raise DrafterError(
                    f"The calibration shard {path.name} has no loss_mask column.",
                    expected="columns input_ids and loss_mask (1 on the assistant's tokens)",
                    found=f"columns {table.column_names}",
                    fix="Build the calibration set with `drafter generate` (it writes the loss mask).")
            grouped = ["group"] if "group" in table.column_names else []
            for row in table.select(["input_ids", "loss_mask", "prompt_id", *grouped]).to_pylist():
                ids, mask = row["input_ids"][:max_length], row["loss_mask"][:max_length]
                if not any(mask[2:]):
                    self.dropped["no_assistant_tokens"] += 1
                    continue
                if len(ids) < min_length:
                    self.dropped["too_short"] += 1
                    continue
                group = row.get("group") or row["prompt_id"]
                side = self.heldout if heldout(group, eval_fraction) else self.train
                side.append(Row(len(self.train) + len(self.heldout), ids, mask, group))
        self.heldout = self.heldout[:eval_max_rows]
        if not self.train:
            raise DrafterError(
                f"The calibration set at {directory} leaves no rows to train {what} on.",
                expected="at least one row with assistant (loss-masked) tokens outside the held-out share",
                found=f"{len(self.heldout)} held-out rows; dropped {self.dropped}",
                fix=f"Generate more calibration data (generate.limit), or lower {fraction_key}.")
        if not self.heldout:
            raise DrafterError(
                f"No held-out calibration rows to choose the checkpoint of {what} on.",
                expected=f"some of the {len(self.train)} rows' conversations under eval_fraction",
                found="none", fix=f"Raise {fraction_key} or generate more calibration data (generate.limit).")

    @property
    def train_tokens(self) -> int:
        return sum(len(r.input_ids) for r in self.train)

    def describe(self) -> str:
        """One log line: rows and tokens kept, held-out rows, rows dropped."""
        return (f"{len(self.train)} training rows ({self.train_tokens} tokens), {len(self.heldout)} held-out rows; "
                f"dropped {self.dropped}")

    def record(self) -> dict[str, Any]:
        """The ``rows`` entry of a trainer's ``training.json``."""
        return {"train": len(self.train), "heldout": len(self.heldout), "dropped": self.dropped,
                "train_tokens": self.train_tokens}


def chat_numbers(rows: Sequence[Row]) -> list[int]:
    """The chat each row comes from, numbered as chats first appear (a row without a group is a chat of its own)."""
    number: dict[str, int] = {}
    return [number.setdefault(r.group or f"row {r.index}", len(number)) for r in rows]


def split_by_chat(rows: Sequence[Row]) -> tuple[list[Row], list[Row]]:
    """Held-out rows in two halves by chat: the even-numbered chats' rows (to choose on: a checkpoint, a τ) and the
    odd-numbered chats' (to report the choice's figures on), so no figure is scored on what it was chosen on."""
    odd = [n % 2 == 1 for n in chat_numbers(rows)]
    return [r for r, o in zip(rows, odd) if not o], [r for r, o in zip(rows, odd) if o]


def pad_batch(rows: Sequence[Row], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``loss_mask`` (0 on padding) and row ``index``."""
    length = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), length, dtype=torch.long)
    loss = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        ids[i, :n] = torch.tensor(row.input_ids)
        attention[i, :n] = 1
        loss[i, :n] = torch.tensor(row.loss_mask)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss,
            "index": torch.tensor([r.index for r in rows])}
