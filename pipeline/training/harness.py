"""The training harness: one Lightning loop that trains any module which computes its own loss.

:func:`fit` trains ``module`` (an ``nn.Module`` whose ``training_step(batch)`` returns a loss, or
``(loss, metrics)``; the loss must be the mean over the micro-batch's examples of a per-example loss, so
that a step's gradient is the mean over its global batch however it is split into ranks and
micro-batches) on a map-style dataset with AdamW and a warmup + cosine/constant schedule, on the
strategy :mod:`pipeline.training.strategy` picks (DeepSpeed ZeRO on GPUs, DDP or one process on CPU).
Every parameter with ``requires_grad`` is trained and saved; the module may also define
``collate(examples) -> batch`` (default: torch's ``default_collate``) and ``count_tokens(batch) -> int``
(for tokens/s), ``step_figures(counts) -> dict`` (a step's figures from the metrics it names ``count.*``,
summed over the step's micro-batches and ranks: :data:`pipeline.training.loop.COUNT`), and ``evaluate() -> dict`` with a ``selection_metric`` name (higher is better): with
``eval_every`` set, the weights that score best are the ones :func:`fit` leaves in the module (checkpoint
choice by the metric that matters, not by the loss). Checkpoints land every ``checkpoint_every`` steps under the caller's staging directory
and a rerun resumes from the newest (see :mod:`pipeline.training.checkpoints`); on CPU the resumed run
ends with bit-identical weights. Per-step metrics go to MLflow when a tracking URI is given, and
:func:`save_final` writes the trained weights as safetensors. The Lightning module lives in
:mod:`pipeline.training.loop`.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.checksums import temp_sibling
from pipeline.config.schema import identity as config_identity
from pipeline.config.training import TrainConfig
from pipeline.errors import DrafterError
from pipeline.training import checkpoints as ckpt
from pipeline.training.plan import RunPlan, all_finite, trainable_parameters
from pipeline.training.ranks import collectives, participants, took_part
from pipeline.training.strategy import (
    ddp_strategy,
    deepspeed_config,
    device_count,
    planned_world_size,
    resolve_strategy,
    trainer_arguments,
)


def slurm_plugins() -> list:
    """Lightning plugins for a run under Slurm: its environment *without* Lightning's auto-requeue.

    Our stages resume a requeued job from their own shards and checkpoints. Lightning's handlers would write
    (and later load) a pickled checkpoint on SIGUSR1 and swallow the SIGTERM of ``scontrol requeue`` /
    preemption ("Bypassing SIGTERM"), so a requeued step would keep running until Slurm's SIGKILL.
    """
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def quiet_lightning() -> None:
    """Keep Lightning's start-up chatter (accelerator lines, tips) and one deprecation notice from its own
    internals out of the stage logs; its warnings and errors still show.

    Outside a Slurm job its hint that ``srun`` is installed but not used is dropped too: on a login node or any
    machine with Slurm's client tools it fired at every trainer of a local run, where nothing is wrong (``drafter
    submit`` is how a run goes to the cluster). Inside a job (``SLURM_JOB_ID`` set) it stays: there a multi-rank
    stage started without ``srun`` would wait for ranks that never start."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    if "SLURM_JOB_ID" not in os.environ:
        warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")


def shard_trainer(stage: str, accelerator: str, devices: int | str, num_nodes: int,
                  collective_timeout: int = 1800):  # noqa: ANN201
    """The Lightning trainer of a sharded predict stage (generate, estimate_rdk): one shard per predict step,
    each written atomically by the step, ranks splitting the pending shards. With more than one rank its
    collectives give up after ``collective_timeout`` seconds (:func:`~pipeline.training.strategy.ddp_strategy`).

    Lightning's predict loop only *notes* a SIGTERM (preemption, ``scancel``, ``scontrol requeue``) and would
    keep producing shards until Slurm's SIGKILL, so a requeued job could race its own dying predecessor to the
    publish. The trainer stops before the next shard instead, with an error that says the rerun resumes.
    """
    import lightning as L

    class StopOnSigterm(L.Callback):
        def on_predict_batch_start(self, trainer, *_) -> None:  # noqa: ANN001
            if trainer.received_sigterm:
                raise DrafterError(f"Stage {stage} received SIGTERM (preemption, scancel or scontrol requeue) "
                                   "and stopped after its finished shards.",
                                   fix="Rerun the same command (a requeued Slurm job does): the finished shards "
                                       "are kept and only the rest run.")

    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    quiet_lightning()
    several = num_nodes > 1 or device_count(accelerator, devices) > 1
    return L.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, logger=False,
                     strategy=ddp_strategy(collective_timeout) if several else "auto",
                     plugins=slurm_plugins(), callbacks=[StopOnSigterm()], enable_checkpointing=False,
                     use_distributed_sampler=False, enable_model_summary=False, enable_progress_bar=False)


def predict_shards(trainer: Any, module: Any, stage: str, collective_timeout: int) -> list[dict]:
    """Run ``module``'s predict pass on ``trainer`` (each rank its shards), wait for every rank's shards (a
    barrier) and return the ranks that took part (:func:`~pipeline.training.ranks.participants`). A peer lost
    on the way is our error (:func:`~pipeline.training.ranks.collectives`)."""
    with collectives(stage, trainer, collective_timeout, f"{stage}.collective_timeout"):
        trainer.predict(module, return_predictions=False)
        trainer.strategy.barrier()
        return participants(trainer)


@dataclass
class TrainResult:
    """What one :func:`fit` call did, on this rank."""

    steps: int
    """Optimizer steps of the whole run (the last checkpoint's step)."""
    start_step: int
    """Step this call resumed from (0: trained from scratch; == steps: the run was already finished)."""
    strategy: str
    world_size: int
    global_rank: int
    deepspeed_config: dict | None
    """The DeepSpeed config used (strategy deepspeed), for the artifact's provenance."""
    metrics: dict[str, float]
    """The last step's metrics (averaged over ranks)."""
    mlflow_run_id: str | None
    seconds: float
    """Seconds trained, over every process of the run (a kill and a resume included; a finished run's rerun
    reports the run's own)."""
    best: dict | None = None
    """With ``eval_every``: the best evaluation (``step``, ``score``, ``metric``, all ``metrics``, weights'
    ``sha256``); the module then holds those weights. None without evaluation (the last weights)."""
    batch_layout: dict[str, int] = field(default_factory=dict)
    """This call's ``micro_batch_size`` and ``accumulation`` per rank (run settings: they change how a step is
    computed, not what)."""
    ranks: list[dict] = field(default_factory=list)
    """The ranks that trained in this call (:func:`~pipeline.training.ranks.participants`: rank, node rank, local
    rank, host); this rank alone when the run was already finished and nothing trained."""

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def record(self) -> dict[str, Any]:
        """What every trainer's ``training.json`` says of the run: steps, resume point, strategy and DeepSpeed
        config, the kept evaluation, the last step's metrics, the MLflow run, and the nodes and ranks that took
        part; each stage adds its own rows and inputs."""
        return {"steps": self.steps, "resumed_from": self.start_step, "strategy": self.strategy,
                "world_size": self.world_size, "deepspeed_config": self.deepspeed_config, "best": self.best or {},
                "batch_layout": self.batch_layout, "last_step_metrics": self.metrics, "mlflow_run_id": self.mlflow_run_id,
                **took_part(self.ranks)}

    def stage_metrics(self, rows: Any) -> dict[str, Any]:
        """What a trainer stage publishes: steps, the rows (a :class:`~pipeline.data.rows.CalibrationRows`) and
        time, the last step's metrics (``final.*``) and the kept evaluation's (``best.*``, ``best_step``)."""
        metrics: dict[str, Any] = {"train_steps": self.steps, "train_rows": len(rows.train),
                                   "train_tokens": rows.train_tokens, "heldout_rows": len(rows.heldout),
                                   "train_seconds": round(self.seconds, 2), "world_size": self.world_size}
        metrics.update({f"final.{k}": round(v, 6) for k, v in self.metrics.items() if not k.startswith("eval.")})
        if self.best:
            metrics["best_step"] = self.best["step"]
            metrics.update({f"best.{k}": round(v, 6) for k, v in self.best["metrics"].items()})
        return metrics

    def describe(self) -> str:
        """One log line: steps, ranks, strategy, the kept checkpoint's score."""
        best = self.best or {}
        return (f"trained {self.steps} steps on {self.world_size} rank(s) ({self.strategy}); best "
                f"{best.get('metric', 'score').replace('_', ' ')} {best.get('score', float('nan')):.3f} at step "
                f"{best.get('step')}")


def fit(module: Any, dataset: Any, cfg: TrainConfig, staging: str | Path, *, tracking_uri: str | None = None,
        experiment: str = "drafter-pipeline", run_name: str | None = None,
        identity: dict | None = None, label: str = "training") -> TrainResult:
    """Train ``module`` on ``dataset`` (resuming from ``staging`` when it holds a checkpoint).

    Args:
        module: an ``nn.Module`` with ``training_step(batch)`` (see the module docstring).
        dataset: a map-style dataset (``len`` and integer indexing) of examples.
        cfg: the training config.
        staging: scratch directory for checkpoints (the stage's ``<workdir>/staging/<artifact id>/``);
            never published.
        tracking_uri: MLflow store for per-step metrics; None logs nothing.
        experiment: MLflow experiment of the training run.
        run_name: MLflow run name (default: the staging directory's name).
        identity: what else defines this run (module config, input artifact ids); hashed with ``cfg``
            into every checkpoint so one from another run is refused.
        label: what progress lines call the run (the stage's name).

    Returns:
        A :class:`TrainResult`. Under DDP/DeepSpeed every rank returns; only rank 0 should publish.
    """
    import lightning as L

    from pipeline.training.loop import HarnessModule  # deferred: pulls in lightning

    started = time.perf_counter()
    staging = Path(staging)
    staging.mkdir(parents=True, exist_ok=True)
    strategy = resolve_strategy(cfg)
    world = planned_world_size(cfg, strategy)
    num_examples = len(dataset)
    micro, accumulation = cfg.batch_layout(world)
    sampler = ckpt.StepBatchSampler(num_examples, micro_batch_size=micro,
                                    accumulation=accumulation, world_size=world, rank=0,
                                    seed=cfg.seed, start_step=0, total_steps=0)
    total = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch
    hashed = {"train": config_identity(cfg), "extra": identity or {}, "num_examples": num_examples}
    expected = {"config_hash": ckpt.config_hash(hashed), "identity": hashed, "world_size": world,
                "strategy": strategy,
                "trainable": {k: list(p.shape) for k, p in trainable_parameters(module).items()}}
    if not expected["trainable"]:
        raise DrafterError("The module to train has no parameter with requires_grad=True.",
                           fix="Unfreeze the parameters to train before calling fit().")

    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")  # frozen parts stay in eval
    quiet_lightning()
    plugins = slurm_plugins()
    trainer = L.Trainer(max_steps=max(total, 1), plugins=plugins, accumulate_grad_batches=accumulation, logger=False,
                        enable_checkpointing=False, use_distributed_sampler=False, enable_model_summary=False,
                        enable_progress_bar=False, num_sanity_val_steps=0,
                        default_root_dir=str(staging), **trainer_arguments(cfg, strategy, world))
    if trainer.world_size != world:
        raise DrafterError("Lightning started a different number of processes than the config asks for.",
                           expected=f"{world} ranks", found=f"{trainer.world_size} ranks",
                           fix="Set train.devices and train.num_nodes to what the job really has.")
    if trainer.global_rank == 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        ckpt.remove_temp(staging)
    found = ckpt.checkpoints(staging)
    resume = (found[-1], ckpt.read_checkpoint(found[-1], expected)) if found else None
    start = resume[1]["step"] if resume else 0
    if resume:
        _load_trainable(module, ckpt.load_weights(resume[0]))
    ds_config = deepspeed_config(cfg, world) if strategy == "deepspeed" else None
    if resume and trainer.global_rank == 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        best = resume[1].get("best")
        ckpt.prune_best(staging, {best["step"]} if best else set())  # later ones are evaluated again
    layout = {"micro_batch_size": micro, "accumulation": accumulation}
    plan = RunPlan(cfg=cfg, staging=staging, strategy=strategy, world_size=world, micro_batch_size=micro,
                   accumulation=accumulation, total_steps=total,
                   start_step=start, expected=expected, resume=resume, tracking_uri=tracking_uri,
                   experiment=experiment, run_name=run_name or staging.name, label=label,
                   seconds_before=float(resume[1].get("train_seconds", 0.0)) if resume else 0.0, started=started)
    if start >= total:
        state = resume[1] if resume else {}
        as_trained(module, cfg, strategy)
        return TrainResult(steps=total, start_step=start, strategy=strategy, world_size=world, batch_layout=layout,
                           global_rank=trainer.global_rank, deepspeed_config=ds_config,
                           metrics=state.get("metrics", {}), mlflow_run_id=state.get("mlflow_run_id"),
                           seconds=plan.seconds_before, best=_take_best(module, staging, state),
                           ranks=participants(trainer))
    # The Trainer exists before the checkpoint is read (its rank decides who cleans up), so the steps left
    # are set here; Lightning's own step counter starts at 0, ours at `start`.
    trainer.fit_loop.epoch_loop.max_steps = total - start
    lightning_module = HarnessModule(module, dataset, plan)
    with collectives(label, trainer, cfg.collective_timeout, f"{label}.train.collective_timeout"):
        trainer.fit(lightning_module)
        ranks = participants(trainer)  # the process group outlives fit (Lightning does not destroy it)
    final = ckpt.read_checkpoint(ckpt.checkpoints(staging)[-1], expected)  # every rank: written before a barrier
    return TrainResult(steps=total, start_step=start, strategy=strategy, world_size=world, batch_layout=layout,
                       global_rank=trainer.global_rank, deepspeed_config=ds_config,
                       metrics=lightning_module.last_metrics, mlflow_run_id=lightning_module.mlflow_run_id,
                       seconds=plan.seconds_so_far(), best=_take_best(module, staging, final), ranks=ranks)


def as_trained(module: Any, cfg: TrainConfig, strategy: str) -> Any:
    """``module`` in the dtype training leaves it in: DeepSpeed with ``bf16`` casts the whole module to bfloat16 (its
    engine keeps the float32 master weights in the optimizer), so an uninterrupted run publishes bfloat16 weights and
    a stage's figures after training (the router's curves) come from a bfloat16 module. A finished run's rerun (the
    job killed after its last checkpoint) builds no engine: it casts here, so it publishes the same weights and
    figures under the same id. Other strategies keep float32 parameters."""
    import torch

    return module.to(torch.bfloat16) if strategy == "deepspeed" and cfg.bf16 else module


def _take_best(module: Any, staging: Path, state: dict) -> dict | None:
    """Load the best evaluated weights the final checkpoint names into ``module``; their record, or None."""
    best = state.get("best")
    if best:
        _load_trainable(module, ckpt.load_best(staging, best))
    bad = [name for name, p in trainable_parameters(module).items() if not all_finite([p])]
    if bad:  # no evaluation kept finite weights (or none ran): never publish a diverged run
        raise DrafterError(
            "Training diverged: the weights it would publish are not finite.",
            expected="finite weights from the best held-out evaluation or, without one, the last step",
            found=f"NaN or infinite values in {len(bad)} tensor(s), e.g. {bad[0]}; "
                  + (f"kept evaluation: step {best['step']}" if best else "no finite held-out evaluation was kept"),
            fix="Lower train.lr (or raise train.warmup_steps) and rerun: a new config is a new run, started afresh.")
    return best


def _load_trainable(module: Any, weights: dict[str, Any]) -> None:
    import torch

    params = trainable_parameters(module)
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)


def save_final(module: Any, out_dir: str | Path, name: str = "model.safetensors") -> Path:
    """Write the trainable parameters of ``module`` (names as in the module) to ``out_dir/name``, atomically.

    Only parameters with ``requires_grad`` are written: frozen ones (e.g. a target's embeddings) and
    buffers belong to whoever built the module.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: p.detach().cpu().clone().contiguous() for k, p in trainable_parameters(module).items()}
    tmp = temp_sibling(out / name)
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / name)
    return out / name
