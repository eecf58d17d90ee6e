"""The training harness: one Lightning loop that trains any module which computes its own loss.

:func:`fit` trains ``module`` (an ``nn.Module`` whose ``training_step(batch)`` returns a loss, or
``(loss, metrics)``; the loss must be the mean over the micro-batch's examples of a per-example loss, so
that a step's gradient is the mean over its global batch however it is split into ranks and
micro-batches) on a map-style dataset with AdamW and a warmup + cosine/constant schedule, on the
strategy :mod:`pipeline.training.strategy` picks (DeepSpeed ZeRO on GPUs, DDP or one process on CPU).
Every parameter with ``requires_grad`` is trained and saved; the module may also define
``collate(examples) -> batch`` (default: torch's ``default_collate``) and ``count_tokens(batch) -> int``
(for tokens/s), and ``evaluate() -> dict`` with a ``selection_metric`` name (higher is better): with
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

from pipeline.config.schema import check_value, run_setting
from pipeline.config.schema import identity as config_identity
from pipeline.errors import DrafterError
from pipeline.training import checkpoints as ckpt
from pipeline.training.strategy import (
    deepspeed_config,
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
    internals out of the stage logs; its warnings and errors still show."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def shard_trainer(stage: str, accelerator: str, devices: int | str, num_nodes: int):  # noqa: ANN201
    """The Lightning trainer of a sharded predict stage (generate, estimate_rdk): one shard per predict step,
    each written atomically by the step, ranks splitting the pending shards.

    Lightning's predict loop only *notes* a SIGTERM (preemption, ``scancel``, ``scontrol requeue``) and would
    keep producing shards until Slurm's SIGKILL, so a requeued job could race its own dying predecessor to the
    publish. The trainer stops before the next shard instead, with an error that says the rerun resumes.
    """
    import lightning as L

    from pipeline.errors import DrafterError

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
    return L.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, logger=False,
                     plugins=slurm_plugins(), callbacks=[StopOnSigterm()], enable_checkpointing=False,
                     use_distributed_sampler=False, enable_model_summary=False, enable_progress_bar=False)

def _check(ok: bool, key: str, expected: str, found: object) -> None:
    check_value(ok, f"train.{key}", expected, found)


@dataclass
class TrainConfig:
    seed: int = 0
    """Seeds the data order (one permutation per epoch) and each micro-batch's randomness (dropout). The
    module's initial weights are the caller's."""
    max_steps: int | None = None
    """Optimizer steps to train; null: ``epochs`` passes over the training set."""
    epochs: int = 1
    """Passes over the training set when ``max_steps`` is null (each drops its last partial global batch)."""
    global_batch_size: int = 8
    """Examples per optimizer step, over all ranks and micro-batches. Fixed by the config, so devices and
    micro-batching only change how a step is computed, not what it computes (see :meth:`batch_layout`)."""
    micro_batch_size: int = run_setting(8)
    """Most examples per rank per forward/backward pass (memory, not math): each rank runs
    ``global_batch_size / ranks`` examples a step in micro-batches of this size (or fewer, see
    :meth:`batch_layout`), accumulating gradients. A run setting: the module's loss is a mean over its
    examples, so the step's gradient is the global batch's mean whatever the split."""
    lr: float = 5e-5
    """Peak learning rate of AdamW."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay, applied to every trainable parameter."""
    gradient_clipping: float = 0.5
    """Clip the global L2 norm of the gradient to this before each step; 0 turns clipping off."""
    schedule: str = "cosine"
    """``cosine``: after warmup, decay to ``min_lr_ratio x lr`` at the last step; ``constant``: stay at lr."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr/warmup_steps to lr."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine schedule, as a fraction of ``lr``."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (strategy deepspeed): 2 shards optimizer states and gradients, 1 only optimizer
    states. Stage 3 is not offered: it shards the weights the harness saves."""
    offload_optimizer: bool = False
    """DeepSpeed: keep optimizer states in CPU memory (DeepSpeed's CPU Adam, the same AdamW update)."""
    bf16: bool = True
    """DeepSpeed: bf16 weights and activations with fp32 master weights. CPU and DDP runs train in fp32 unless
    ``cpu_bf16``."""
    cpu_bf16: bool = False
    """On the CPU (single process or DDP): run forward passes under bfloat16 autocast (Lightning ``bf16-mixed``;
    weights, gradients and optimizer state stay float32). About 1.5x faster on a CPU with native bfloat16 dot
    products (AVX512-BF16, AMX); off by default because float32 keeps CPU runs exact across batch layouts."""
    strategy: str = run_setting("auto")
    """``auto`` (deepspeed with CUDA, else ddp when devices x nodes > 1, else single), ``deepspeed``,
    ``ddp`` or ``single``."""
    accelerator: str = run_setting("auto")
    """Lightning accelerator: auto, cpu or gpu."""
    devices: int | str = run_setting("auto")
    """Processes per node: auto (every GPU, or 1 on CPU), a count, or a list like "0,1"."""
    num_nodes: int = run_setting(1)
    """Nodes in the job (Slurm: $SLURM_JOB_NUM_NODES)."""
    checkpoint_every: int = run_setting(500)
    """Write a resumable checkpoint every this many optimizer steps (and after the last one)."""
    keep_checkpoints: int = run_setting(1)
    """Completed checkpoints kept in the staging directory (older ones are deleted once a newer lands)."""
    log_every: int = run_setting(1)
    """Send metrics to MLflow every this many steps."""
    num_workers: int = run_setting(0)
    """DataLoader worker processes per rank (the order does not depend on it)."""
    progress_bar: bool = run_setting(True)
    """Draw a progress bar when stderr is a terminal (steps, rate, ETA, loss, held-out score); false, or output to
    a file: a plain line every 30 s."""
    eval_every: int | None = None
    """Call the module's ``evaluate()`` every this many steps (and after the last) and keep the weights that
    score best on its ``selection_metric`` (higher wins); null: no evaluation, the last weights are final.
    Part of the result (which weights win), so not a run setting."""

    def __post_init__(self) -> None:
        _check(self.max_steps is None or self.max_steps > 0, "max_steps", "a positive integer or null",
               self.max_steps)
        for key in ("epochs", "global_batch_size", "micro_batch_size", "checkpoint_every", "keep_checkpoints",
                    "log_every", "num_nodes"):
            _check(getattr(self, key) >= 1, key, "an integer >= 1", getattr(self, key))
        _check(self.lr > 0, "lr", "a positive number", self.lr)
        _check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", "two numbers in [0, 1)",
               self.betas)
        _check(self.eps > 0 and self.weight_decay >= 0, "eps/weight_decay", "eps > 0 and weight_decay >= 0",
               (self.eps, self.weight_decay))
        _check(self.gradient_clipping >= 0, "gradient_clipping", "a number >= 0 (0: off)", self.gradient_clipping)
        _check(self.schedule in ("cosine", "constant"), "schedule", "cosine or constant", self.schedule)
        _check(self.warmup_steps >= 0, "warmup_steps", "an integer >= 0", self.warmup_steps)
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        _check(self.zero_stage in (1, 2), "zero_stage", "1 or 2", self.zero_stage)
        _check(self.strategy in ("auto", "deepspeed", "ddp", "single"), "strategy",
               "auto, deepspeed, ddp or single", self.strategy)
        _check(self.accelerator in ("auto", "cpu", "gpu", "cuda"), "accelerator", "auto, cpu or gpu",
               self.accelerator)
        _check(self.num_workers >= 0, "num_workers", "an integer >= 0", self.num_workers)
        _check(self.eval_every is None or self.eval_every >= 1, "eval_every", "an integer >= 1 or null",
               self.eval_every)

    def batch_layout(self, world_size: int) -> tuple[int, int]:
        """``(micro-batch size, accumulation steps)`` per rank for ``world_size`` ranks.

        Each rank trains ``global_batch_size / world_size`` examples a step, in micro-batches of
        ``micro_batch_size`` (fewer when a rank's share is smaller).

        Raises:
            DrafterError: If the global batch does not split evenly over the ranks and micro-batches.
        """
        per_rank, rest = divmod(self.global_batch_size, world_size)
        micro = min(self.micro_batch_size, per_rank)
        if rest or per_rank == 0 or per_rank % micro:
            raise DrafterError(
                "train.global_batch_size does not split evenly over the ranks and micro-batches.",
                expected=f"global_batch_size ({self.global_batch_size}) = ranks ({world_size}) x micro_batch_size "
                         f"x accumulation, with micro_batch_size <= {self.micro_batch_size}",
                found=f"{self.global_batch_size} / {world_size} ranks = {self.global_batch_size / world_size:g} "
                      f"examples per rank, micro_batch_size {self.micro_batch_size}",
                fix="Pick a global_batch_size that is a multiple of ranks x micro_batch_size (or change "
                    "devices / micro_batch_size: they are run settings and do not change the result).")
        return micro, per_rank // micro


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
    best: dict | None = None
    """With ``eval_every``: the best evaluation (``step``, ``score``, ``metric``, all ``metrics``, weights'
    ``sha256``); the module then holds those weights. None without evaluation (the last weights)."""

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0


@dataclass
class RunPlan:
    """Everything the Lightning loop needs besides the module and data."""

    cfg: TrainConfig
    staging: Path
    strategy: str
    world_size: int
    micro_batch_size: int
    accumulation: int
    total_steps: int
    start_step: int
    expected: dict
    """What a checkpoint must match (see :func:`pipeline.training.checkpoints.read_checkpoint`)."""
    resume: tuple[Path, dict] | None
    tracking_uri: str | None
    experiment: str
    run_name: str
    label: str = "training"
    """What progress lines call the run (the stage's name)."""


def trainable_parameters(module: Any) -> dict[str, Any]:
    """The parameters the harness trains and saves: every one with ``requires_grad``, by name."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


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

    from pipeline.training.loop import harness_module

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

    plugins = slurm_plugins()
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")  # frozen parts stay in eval
    quiet_lightning()
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
    plan = RunPlan(cfg=cfg, staging=staging, strategy=strategy, world_size=world, micro_batch_size=micro,
                   accumulation=accumulation, total_steps=total,
                   start_step=start, expected=expected, resume=resume, tracking_uri=tracking_uri,
                   experiment=experiment, run_name=run_name or staging.name, label=label)
    if start >= total:
        state = resume[1] if resume else {}
        return TrainResult(steps=total, start_step=start, strategy=strategy, world_size=world,
                           global_rank=trainer.global_rank, deepspeed_config=ds_config,
                           metrics=state.get("metrics", {}), mlflow_run_id=state.get("mlflow_run_id"),
                           seconds=time.perf_counter() - started, best=_take_best(module, staging, state))
    # The Trainer exists before the checkpoint is read (its rank decides who cleans up), so the steps left
    # are set here; Lightning's own step counter starts at 0, ours at `start`.
    trainer.fit_loop.epoch_loop.max_steps = total - start
    lightning_module = harness_module(module, dataset, plan)
    trainer.fit(lightning_module)
    final = ckpt.read_checkpoint(ckpt.checkpoints(staging)[-1], expected)  # every rank: written before a barrier
    return TrainResult(steps=total, start_step=start, strategy=strategy, world_size=world,
                       global_rank=trainer.global_rank, deepspeed_config=ds_config,
                       metrics=lightning_module.last_metrics, mlflow_run_id=lightning_module.mlflow_run_id,
                       seconds=time.perf_counter() - started, best=_take_best(module, staging, final))


def _take_best(module: Any, staging: Path, state: dict) -> dict | None:
    """Load the best evaluated weights the final checkpoint names into ``module``; their record, or None."""
    best = state.get("best")
    if best:
        _load_trainable(module, ckpt.load_best(staging, best))
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
    tmp = out / f".{name}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / name)
    return out / name
