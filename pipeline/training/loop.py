"""The LightningModule :func:`pipeline.training.harness.fit` runs: it wraps the caller's module and owns
the step-derived data loader, the optimizer and schedule, restoring them on resume, the per-step
metrics (progress on rank zero: :class:`~pipeline.progress.Progress`, and MLflow) and the checkpoint every
``checkpoint_every`` steps.

Randomness: before each micro-batch the global torch seed is set from (seed, step, global micro-batch
index), so dropout does not depend on how many steps ran in this process; that, the step-derived data
order and the restored optimizer make a resumed CPU run bit-identical to an uninterrupted one. What a module
draws per example (DFlash's anchors) must not depend on the micro-batch layout either, which is a run setting:
a module with a ``step_seed`` attribute gets one per optimizer step, the same on every rank and micro-batch, to
seed each example's draws with its own index.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, default_collate

from pipeline.errors import DrafterError, redact
from pipeline.progress import Progress, heartbeat, silent
from pipeline.runlog import flatten
from pipeline.tracking import seed_local_store
from pipeline.training import checkpoints as ckpt
from pipeline.training.plan import RunPlan, all_finite, trainable_parameters
from pipeline.training.strategy import build_optimizer, build_scheduler, lr_factor, position_scheduler

COUNT = "count."
"""A ``training_step`` metric named ``count.<name>`` is a count: summed over a step's micro-batches and ranks and
handed to the module's ``step_figures(counts) -> dict`` (``counts`` keyed by ``<name>``), which makes the step's
figures from them. Every other metric is the mean of its micro-batch values."""


def split_output(output: Any) -> tuple[Any, dict[str, Any]]:
    """``training_step``'s result as (loss, metrics): a loss, ``(loss, metrics)`` or ``{"loss": ..., **metrics}``."""
    if isinstance(output, dict):
        metrics = dict(output)
        return metrics.pop("loss"), metrics
    if isinstance(output, (tuple, list)):
        return output[0], dict(output[1]) if len(output) > 1 else {}
    return output, {}


class HarnessModule(L.LightningModule):
    """Trains ``inner`` (a module with ``training_step(batch)``) on ``dataset`` as ``plan`` says: the step-derived
    loader, the optimizer and schedule (restored on resume), per-step metrics, evaluation and checkpoints.

    Args:
        inner: The module to train (its parameters with ``requires_grad`` are trained and saved).
        dataset: A map-style dataset of examples.
        plan: The run: config, staging directory, strategy, batch layout, steps, resume state, tracking.
    """

    def __init__(self, inner: Any, dataset: Any, plan: RunPlan) -> None:
        super().__init__()
        self.inner = inner
        self.dataset, self.plan = dataset, plan
        self.last_metrics: dict[str, float] = {}
        self.mlflow_run_id: str | None = plan.resume[1].get("mlflow_run_id") if plan.resume else None
        self._sums: dict[str, Any] = defaultdict(float)
        self._tokens = 0
        self._clock = 0.0
        self._client: Any = None
        self._progress: Progress | None = None
        self.best: dict | None = plan.resume[1].get("best") if plan.resume else None
        self._checkpointed_best = self.best  # the best the last checkpoint names: its file stays until the next one

    def train_dataloader(self) -> DataLoader:
        sampler = ckpt.StepBatchSampler(
            len(self.dataset), micro_batch_size=self.plan.micro_batch_size, accumulation=self.plan.accumulation,
            world_size=self.trainer.world_size, rank=self.global_rank, seed=self.plan.cfg.seed,
            start_step=self.plan.start_step, total_steps=self.plan.total_steps)
        collate = getattr(self.inner, "collate", None) or default_collate
        return DataLoader(self.dataset, batch_sampler=sampler, collate_fn=collate, num_workers=self.plan.cfg.num_workers)

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(list(trainable_parameters(self.inner).values()), self.plan.cfg,
                                    deepspeed=self.plan.strategy == "deepspeed")
        scheduler = build_scheduler(optimizer, self.plan.cfg, self.plan.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        # The ranks and the device exist only now: the module's own preparation (a feature cache) runs here.
        prepare = getattr(self.inner, "before_training", None)
        if prepare is not None:
            prepare(self.global_rank, self.trainer.world_size, self.trainer.strategy.barrier)
        # Optimizers exist only now (DeepSpeed builds its ZeRO wrapper in strategy setup).
        if self.plan.resume is None:
            return
        path, state = self.plan.resume
        optimizer = self.trainer.strategy.optimizers[0]
        ckpt.restore_optimizer(optimizer, ckpt.load_optimizer_state(path, state, self.global_rank),
                               self.trainer.world_size)
        position_scheduler(self.trainer.lr_scheduler_configs[0].scheduler, self.plan.start_step)

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero and self.plan.tracking_uri:
            self._start_mlflow()
        if self.trainer.is_global_zero:
            self._progress = Progress(self.plan.label, self.plan.total_steps - self.plan.start_step, "step",
                                      bar=None if self.plan.cfg.progress_bar else False)
        self._clock = time.perf_counter()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        step, micro = self.plan.start_step + batch_idx // self.plan.accumulation, batch_idx % self.plan.accumulation
        global_micro = micro * self.trainer.world_size + self.global_rank
        torch.manual_seed(ckpt.derive_seed(self.plan.cfg.seed, "micro", step, global_micro))
        if hasattr(self.inner, "step_seed"):  # draws keyed by it and an example's own index ignore the batch layout
            self.inner.step_seed = ckpt.derive_seed(self.plan.cfg.seed, "step", step)
        loss, metrics = split_output(self.inner.training_step(batch))
        self._sums["loss"] += loss.detach().float()
        for key, value in metrics.items():
            self._sums[key] += value.detach().double() if torch.is_tensor(value) else float(value)
        if hasattr(self.inner, "count_tokens"):
            self._tokens += int(self.inner.count_tokens(batch))
        self.log("loss", loss.detach(), prog_bar=True, logger=False)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % self.plan.accumulation:
            return
        step = self.plan.start_step + (batch_idx + 1) // self.plan.accumulation
        self.last_metrics = self._step_metrics(step)
        if self._progress is not None:
            self._progress.update(1, loss=self.last_metrics["loss"])
        if self.trainer.is_global_zero and self._client is not None and (
                step % self.plan.cfg.log_every == 0 or step == self.plan.total_steps):
            self._log_mlflow(step, self.last_metrics)
        if self.plan.cfg.eval_every and (step % self.plan.cfg.eval_every == 0 or step == self.plan.total_steps):
            self._evaluate(step)
        if step % self.plan.cfg.checkpoint_every == 0 or step == self.plan.total_steps:
            ckpt.save_checkpoint(
                self.plan.staging, step, rank=self.global_rank, world_size=self.trainer.world_size,
                weights=trainable_parameters(self.inner), optimizer=self.trainer.strategy.optimizers[0],
                state={**self.plan.expected, "mlflow_run_id": self.mlflow_run_id, "metrics": self.last_metrics,
                       "best": self.best, "train_seconds": round(self.plan.seconds_so_far(), 3)},
                barrier=self.trainer.strategy.barrier, keep=self.plan.cfg.keep_checkpoints)
            self._checkpointed_best = self.best
            if self.trainer.is_global_zero and self.best is not None:
                ckpt.prune_best(self.plan.staging, {self.best["step"]})

    def _evaluate(self, step: int) -> None:
        """Score the weights of ``step`` with the module's ``evaluate()``; keep them if they are the best.

        Every rank evaluates the same rows (the weights are replicated under DDP and ZeRO-1/2), so
        every rank reaches the same verdict without a collective; rank zero writes the weights.
        """
        was_training = self.inner.training
        self.inner.eval()
        # the held-out evaluation can run a minute or more between two steps' progress lines: a line every 30 s
        with torch.no_grad(), heartbeat(f"{self.plan.run_name}: held-out evaluation at step {step}",
                                        None if self.trainer.is_global_zero else silent):
            scores = {k: float(v) for k, v in self.inner.evaluate().items()}
        self.inner.train(was_training)
        metric = getattr(self.inner, "selection_metric", None)
        if metric not in scores:
            raise DrafterError("The module's evaluate() does not return its selection metric.",
                               expected=f"a key {metric!r} (the module's selection_metric)",
                               found=f"keys {sorted(scores)}")
        self.last_metrics.update({f"eval.{k}": v for k, v in scores.items()})
        if self._progress is not None:
            self._progress.note(**{f"held-out {metric}": scores[metric]})
        weights = trainable_parameters(self.inner)
        # Weights that diverged never win, whatever their selection metric reads (NaN logits still give a top-1).
        diverged = not all(math.isfinite(v) for v in scores.values()) or not all_finite(weights.values())
        if diverged and self._progress is not None:
            self._progress.note(**{f"held-out {metric}": "diverged (not finite), not kept"})
        if not diverged and (self.best is None or scores[metric] > self.best["score"]):
            record = {"step": step, "score": scores[metric], "metric": metric, "metrics": scores}
            if self.trainer.is_global_zero:
                record.update(ckpt.save_best(self.plan.staging, step, weights))
                # Keep the best the last checkpoint points at until the next checkpoint lands (a run killed before
                # then resumes from that checkpoint and reads that file).
                kept = self._checkpointed_best
                ckpt.prune_best(self.plan.staging, {step} | ({kept["step"]} if kept else set()))
            self.best = record
        if self.trainer.is_global_zero and self._client is not None:
            self._log_mlflow(step, {f"eval.{k}": v for k, v in scores.items()})

    def on_train_end(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._client is not None:
            with self._mlflow_call("close the MLflow run"):
                self._client.set_terminated(self.mlflow_run_id, "FINISHED")

    def _step_metrics(self, step: int) -> dict[str, float]:
        """This step's metrics averaged over micro-batches and ranks (one all-reduce)."""
        keys = sorted(self._sums)
        values = torch.stack([torch.as_tensor(self._sums[k], dtype=torch.float64, device=self.device)
                              for k in keys] + [torch.tensor(float(self._tokens), dtype=torch.float64,
                                                             device=self.device)])
        world = self.trainer.world_size
        values = self.trainer.strategy.reduce(values, reduce_op="sum")  # over ranks; then per micro-batch below
        now = time.perf_counter()
        seconds, self._clock = max(now - self._clock, 1e-9), now
        summed = dict(zip(keys, values[:-1].tolist(), strict=True))
        out = {k: v / (self.plan.accumulation * world) for k, v in summed.items() if not k.startswith(COUNT)}
        counts = {k.removeprefix(COUNT): v for k, v in summed.items() if k.startswith(COUNT)}
        if counts:  # pooled over the step's micro-batches and ranks: a ratio of sums, not a mean of ratios
            figures = getattr(self.inner, "step_figures", None)
            out.update(figures(counts) if figures is not None else counts)
        out["lr"] = self.plan.cfg.lr * lr_factor(step - 1, total_steps=self.plan.total_steps, warmup_steps=self.plan.cfg.warmup_steps,
                                       schedule=self.plan.cfg.schedule, min_lr_ratio=self.plan.cfg.min_lr_ratio)
        out["examples_per_s"] = self.plan.cfg.global_batch_size / seconds
        if hasattr(self.inner, "count_tokens"):
            out["tokens_per_s"] = float(values[-1]) / seconds
        self._sums.clear()
        self._tokens = 0
        return out

    @contextmanager
    def _mlflow_call(self, what: str) -> Iterator[None]:
        """MLflow's errors as a :class:`DrafterError` (scrubbed: MLflow's messages quote the store's URL, credentials
        and all), with the original suppressed: a traceback would print it."""
        try:
            yield
        except Exception as err:  # noqa: BLE001 - MLflow raises many types for one cause
            message = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        else:
            return
        raise DrafterError(f"Cannot {what} at {redact(str(self.plan.tracking_uri))}: {message}",
                           fix="Check the tracking URI/server; checkpoints are kept, rerun to resume.") from None

    def _start_mlflow(self) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        with self._mlflow_call("open an MLflow run"):
            seed_local_store(self.plan.tracking_uri)
            client = MlflowClient(self.plan.tracking_uri)
            if self.mlflow_run_id is None:
                exp = client.get_experiment_by_name(self.plan.experiment)
                exp_id = exp.experiment_id if exp else client.create_experiment(self.plan.experiment)
                run = client.create_run(exp_id, run_name=self.plan.run_name,
                                        tags={"drafter.training": self.plan.staging.name,
                                              "drafter.strategy": self.plan.strategy})
                self.mlflow_run_id = run.info.run_id
                params = [Param(k, v) for k, v in flatten(self.plan.expected["identity"]).items()]
                for i in range(0, len(params), 100):
                    client.log_batch(self.mlflow_run_id, params=params[i : i + 100])
            else:
                client.update_run(self.mlflow_run_id, status="RUNNING")
        self._client = client

    def _log_mlflow(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        with self._mlflow_call(f"log step {step}'s metrics"):
            self._client.log_batch(self.mlflow_run_id,
                                   metrics=[Metric(k, v, stamp, step) for k, v in metrics.items()])

