"""EAGLE-3 training as a harness task: calibration rows in, the training-time-test loss out.

Its rows come from :class:`pipeline.data.rows.CalibrationRows` (training and held-out turns of a calibration
artifact). :class:`Eagle3Task` is the module
:func:`pipeline.training.harness.fit` trains: it holds the drafter (trained) and the frozen target, which
computes the low/mid/high features and logits **online** inside each training step (EAGLE-3 §3.1), or
reads them from a :class:`FeatureCache` written once before training (the offline mode that costs disk;
:func:`feature_bytes` says how much before anything is written). Its ``evaluate()`` is the checkpoint
choice of the stage: the simulated accepted length (``1 + Σ_k Π_{i≤k} acc_i``, per-step top-1 agreement
with the target over the held-out rows, EAGLE-3 §4's acceptance length under a greedy chain) — the
cheap stand-in for the τ the ``evaluate`` stage then measures in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.data.rows import Row, pad_batch
from pipeline.drafters.eagle3 import Eagle3Drafter
from pipeline.progress import Progress, log
from pipeline.staged import staged_ok, write_staged
from pipeline.training.eagle3_objective import simulated_tau, target_features, ttt_loss
from pipeline.training.ranks import gather
from pipeline.training.task import DrafterTask


def feature_bytes(rows: Sequence[Row], hidden_size: int, dtype: torch.dtype) -> int:
    """Disk a feature cache of ``rows`` takes: per token the three aux layers and the final hidden state."""
    tokens = sum(len(r.input_ids) for r in rows)
    return tokens * 4 * hidden_size * torch.empty((), dtype=dtype).element_size()


class FeatureCache:
    """Target features of every training row, written once (the offline mode), read back per batch.

    Per row, ``<dir>/<index>.safetensors`` holds ``aux`` ``(T, 3H)`` and ``last`` ``(T, H)`` (the final
    normed hidden state; the target's logits are its LM head applied to it, recomputed per batch so the
    ``(T, V)`` logits never touch the disk). Each file is a staged shard (:func:`~pipeline.staged.write_staged`:
    atomic, with its checksum), so a killed run resumes by computing only the rows missing, and a file that does
    not match its checksum (a node crash after the rename, a flipped byte on shared storage) is deleted with a
    line naming it and computed again. The cache is filled once the trainer's ranks exist
    (:meth:`Eagle3Task.before_training`), on the device training runs on: rank ``r`` of ``w`` computes rows
    ``r, r + w, …``, then all ranks wait for each other, so on ``n`` nodes each computes ``1/n`` of the cache
    (the directory is the stage's staging directory, shared by every node).
    """

    def __init__(self, directory: Path, target: nn.Module, aux_layer_ids: Sequence[int], rows: Sequence[Row]) -> None:
        self.base, self.target, self.aux, self.rows = directory, target, tuple(aux_layer_ids), list(rows)

    @property
    def directory(self) -> Path:
        """The rows' files: a folder per dtype the target computes them in (DeepSpeed bf16 casts it, the other
        strategies keep float32), so a run killed before its first checkpoint and rerun under another strategy (a run
        setting) computes its own rather than training on the other's."""
        return self.base / str(next(self.target.parameters()).dtype).removeprefix("torch.")

    def path(self, index: int) -> Path:
        return self.directory / f"{index:09d}.safetensors"

    def missing(self, rows: Sequence[Row]) -> list[Row]:
        return [r for r in rows if not staged_ok(self.path(r.index), lambda message: log("feature cache", message))]

    def fill(self, rank: int = 0, world_size: int = 1, barrier: Callable[[], None] | None = None,
             batch_size: int = 8, label: str = "feature cache") -> dict[str, Any]:
        """Compute this rank's missing rows (a staged file that fails its checksum is missing), wait for the other
        ranks (``barrier``), then any row still missing (none unless a file was removed meanwhile). Returns this
        rank's ``computed`` rows and ``seconds``."""
        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        share = self.missing(self.rows[rank::world_size])
        progress = Progress(label, len(share), "row") if rank == 0 else None  # one rank speaks for all
        computed = self._compute(share, batch_size, progress)
        if progress is not None:
            progress.close()
        if barrier is not None and world_size > 1:
            barrier()
        # the other ranks' shares were checked by them before they computed (a production cache is terabytes:
        # hashing every file twice a fill is what a resume would wait for); here only what is still missing
        computed += self._compute([r for r in self.rows if not self.path(r.index).is_file()], batch_size, None)
        return {"computed": computed, "seconds": round(time.perf_counter() - started, 2)}

    @torch.no_grad()
    def _compute(self, rows: Sequence[Row], batch_size: int, progress: Progress | None) -> int:
        from safetensors.torch import save_file

        device = next(self.target.parameters()).device
        for start in range(0, len(rows), batch_size):
            todo = rows[start : start + batch_size]
            batch = {k: v.to(device) for k, v in pad_batch(todo).items()}
            out = self.target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              output_hidden_states=True, use_cache=False, logits_to_keep=1)
            aux = torch.cat([out.hidden_states[i] for i in self.aux], dim=-1)
            for i, row in enumerate(todo):
                n = len(row.input_ids)
                tensors = {"aux": aux[i, :n].cpu().contiguous(), "last": out.hidden_states[-1][i, :n].cpu().contiguous()}
                write_staged(self.path(row.index), lambda tmp, tensors=tensors: save_file(tensors, str(tmp)))
            if progress is not None:
                progress.update(len(todo))
        return len(rows)

    def load(self, index: torch.Tensor, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``(aux (B, T, 3H), last (B, T, H))`` for the rows ``index``."""
        from safetensors.torch import load_file

        parts = [load_file(str(self.path(int(i)))) for i in index]
        aux = torch.zeros(len(parts), length, parts[0]["aux"].shape[-1], dtype=parts[0]["aux"].dtype)
        last = torch.zeros(len(parts), length, parts[0]["last"].shape[-1], dtype=parts[0]["last"].dtype)
        for i, part in enumerate(parts):
            n = part["aux"].shape[0]
            aux[i, :n], last[i, :n] = part["aux"], part["last"]
        return aux.to(device), last.to(device)


class Eagle3Task(DrafterTask):
    """The harness module: a trainable EAGLE-3 drafter on a frozen target.

    Args:
        drafter: the drafter (its ``d2t``/``t2d`` set from the ``count`` artifact).
        target: the frozen target (a submodule, so it moves with the task; it stays in eval mode).
        heldout: rows scored by :meth:`evaluate`.
        ttt_steps: unrolled steps ``K`` of the training-time test.
        decay: weight ``decay^s`` of step ``s``.
        pad_id: token id used to pad batches (masked out everywhere).
        eval_batch_size: rows per forward in :meth:`evaluate`.
        cache: a :class:`FeatureCache` (offline mode: filled by :meth:`before_training`) or None (online: the
            target runs every step).
    """

    def __init__(self, drafter: Eagle3Drafter, target: nn.Module, heldout: Sequence[Row], *, ttt_steps: int,
                 decay: float, pad_id: int = 0, eval_batch_size: int = 8, cache: FeatureCache | None = None) -> None:
        super().__init__(drafter, target, heldout, pad_id=pad_id, eval_batch_size=eval_batch_size)
        self.ttt_steps, self.decay, self.cache = ttt_steps, decay, cache
        self.aux_layer_ids = drafter.config.aux_layer_ids
        self.cache_record: dict[str, Any] | None = None

    def before_training(self, rank: int, world_size: int, barrier: Callable[[], None]) -> None:
        """Fill the feature cache (offline mode), each rank its share, on the device the trainer put the target
        on; ``cache_record``: the cache's rows, the rows each rank computed (none on a resume that finds them
        all), the slowest rank's seconds and rank 0's device."""
        if self.cache is None:
            return
        mine = self.cache.fill(rank, world_size, barrier)
        everyone = gather(world_size, mine)
        self.cache_record = {"rows": len(self.cache.rows), "computed": [r["computed"] for r in everyone],
                             "seconds": max(r["seconds"] for r in everyone),
                             "device": str(next(self.target.parameters()).device)}

    def _features(self, batch: dict[str, torch.Tensor], cached: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not cached:
            return target_features(self.target, batch["input_ids"], batch["attention_mask"], self.aux_layer_ids)
        device = batch["input_ids"].device
        aux, last = self.cache.load(batch["index"], batch["input_ids"].shape[1], device)
        with torch.no_grad():
            logits = self.target.get_output_embeddings()(last.to(self.target.dtype))
        return aux, logits

    def _ttt(self, batch: dict[str, torch.Tensor], cached: bool) -> Any:
        """The training-time test of ``batch``; ``cached``: features from the cache (training rows only)."""
        hidden, logits = self._features(batch, cached)
        hidden = hidden.to(next(self.drafter.parameters()).dtype)
        return ttt_loss(self.drafter, batch["input_ids"], batch["loss_mask"], hidden, logits,
                        steps=self.ttt_steps, decay=self.decay)

    def training_step(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        result = self._ttt(batch, cached=self.cache is not None)
        metrics = {f"count.correct_{s}": result.per_step_correct[s] for s in range(self.ttt_steps)}
        metrics.update({f"count.tokens_{s}": result.per_step_tokens[s] for s in range(self.ttt_steps)})
        return result.loss, metrics

    def step_figures(self, counts: dict[str, float]) -> dict[str, float]:
        """A step's per-step agreement and simulated τ over all its micro-batches' rows (the harness sums the
        counts over micro-batches and ranks)."""
        acc = torch.tensor([counts[f"correct_{s}"] / max(1.0, counts[f"tokens_{s}"]) for s in range(self.ttt_steps)],
                           dtype=torch.float64)
        return {**{f"acc_{s}": float(a) for s, a in enumerate(acc)}, "train_simulated_tau": float(simulated_tau(acc))}

    forward = training_step

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Per-step top-1 agreement with the target over the held-out rows and the simulated τ."""
        device = next(self.drafter.parameters()).device
        correct = torch.zeros(self.ttt_steps, dtype=torch.float64)
        tokens = torch.zeros(self.ttt_steps, dtype=torch.float64)
        loss = 0.0
        for start in range(0, len(self.heldout_rows), self.eval_batch_size):
            rows = self.heldout_rows[start : start + self.eval_batch_size]
            batch = {k: v.to(device) for k, v in pad_batch(rows, self.pad_id).items()}
            result = self._ttt(batch, cached=False)  # held-out rows are never in the feature cache
            correct += result.per_step_correct.double().cpu()
            tokens += result.per_step_tokens.double().cpu()
            loss += float(result.loss) * len(rows)
        acc = correct / tokens.clamp(min=1)
        out = {f"acc_{s}": float(a) for s, a in enumerate(acc)}
        out["simulated_tau"] = float(simulated_tau(acc))
        out["loss"] = loss / max(1, len(self.heldout_rows))
        out["tokens"] = float(tokens[0])
        return out
