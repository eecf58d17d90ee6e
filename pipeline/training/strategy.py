"""Where a training run executes and how one update is computed: the strategy choice, the DeepSpeed
ZeRO config, the AdamW optimizer and the learning-rate schedule.

Three strategies, picked by :func:`resolve_strategy` when ``strategy`` is ``auto``: ``deepspeed``
(Lightning's DeepSpeed strategy with the ZeRO config from :func:`deepspeed_config`) where CUDA is
present, ``ddp`` (one process per device, gloo on CPU) when more than one device or node is asked for,
and ``single`` (one process) otherwise. All three run the same update rule: a torch AdamW built by
:func:`build_optimizer` and a ``LambdaLR`` over :func:`lr_factor`, handed to DeepSpeed as a client
optimizer, so the DeepSpeed config carries only ZeRO, precision, batch and clipping settings and the
three paths can be compared step for step (the CPU test does, against ``deepspeed.initialize``).
"""

from __future__ import annotations

import math
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from pipeline.config.training import TrainConfig
from pipeline.errors import DrafterError

if TYPE_CHECKING:
    import torch


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def device_count(accelerator: str, devices: int | str) -> int:
    """Processes per node that ``accelerator``/``devices`` ask for (``auto`` means every GPU, or one process on CPU)."""
    if isinstance(devices, int):
        return devices
    if str(devices).isdigit():
        return int(devices)
    if devices == "auto":
        import torch

        return torch.cuda.device_count() if _cuda(accelerator) else 1
    return len([d for d in str(devices).split(",") if d.strip()])


def _device_count(cfg: TrainConfig) -> int:
    return device_count(cfg.accelerator, cfg.devices)


def _cuda(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda_available())


def _uses_cuda(cfg: TrainConfig) -> bool:
    return _cuda(cfg.accelerator)


def ddp_strategy(collective_timeout: int) -> Any:
    """Lightning's DDP strategy whose collectives give up after ``collective_timeout`` seconds.

    The timeout reaches ``torch.distributed.init_process_group``: a rank whose peer died or hung fails its next
    collective (gloo and NCCL alike) instead of waiting forever, and under ``srun --kill-on-bad-exit`` that ends
    the whole job. Lightning reads ranks and the rendezvous address from its cluster environment (Slurm's under
    ``srun``)."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(timeout=timedelta(seconds=collective_timeout))


def resolve_strategy(cfg: TrainConfig) -> str:
    """``deepspeed``, ``ddp`` or ``single`` for this config on this machine (see the module docstring)."""
    uses_cuda = _uses_cuda(cfg)
    if cfg.strategy == "auto":
        if uses_cuda:
            return "deepspeed"
        return "ddp" if _device_count(cfg) > 1 or cfg.num_nodes > 1 else "single"
    if cfg.strategy == "deepspeed" and not uses_cuda:
        raise DrafterError(
            "train.strategy=deepspeed needs CUDA GPUs (Lightning's DeepSpeed strategy refuses CPU).",
            expected="a machine where torch.cuda.is_available() is true",
            found=f"accelerator={cfg.accelerator!r}, CUDA available: {cuda_available()}",
            fix="Use train.strategy=auto (ddp or a single process on CPU) or run on a GPU node.",
        )
    if cfg.strategy == "single" and (_device_count(cfg) > 1 or cfg.num_nodes > 1):
        raise DrafterError(
            "train.strategy=single runs one process but more devices or nodes were asked for.",
            expected="train.devices=1 and train.num_nodes=1",
            found=f"devices={cfg.devices!r}, num_nodes={cfg.num_nodes}",
            fix="Use train.strategy=ddp (or auto), or set train.devices=1.",
        )
    return cfg.strategy


def planned_world_size(cfg: TrainConfig, strategy: str) -> int:
    """Ranks the run will have: processes per node x nodes (one for ``single``)."""
    return (_device_count(cfg) if strategy != "single" else 1) * cfg.num_nodes


def deepspeed_config(cfg: TrainConfig, world_size: int = 1) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg`` on ``world_size`` ranks: a pure function of its typed fields (the
    micro-batch and accumulation from :meth:`TrainConfig.batch_layout`), returned so the caller can write
    it into the artifact for provenance.

    The optimizer and schedule are not in it on purpose: DeepSpeed gets the harness's own AdamW and
    ``LambdaLR`` as client objects, so every strategy runs the same update. ``train_batch_size`` is left
    for DeepSpeed to derive (micro batch x accumulation x ranks). Lightning sets
    ``gradient_accumulation_steps`` itself from the Trainer (same value), see :func:`trainer_arguments`.
    """
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 200_000_000,
        "allgather_bucket_size": 200_000_000,
    }
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    micro, accumulation = cfg.batch_layout(world_size)
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": cfg.gradient_clipping,
        "bf16": {"enabled": cfg.bf16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def trainer_arguments(cfg: TrainConfig, strategy: str, world_size: int = 1) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that depend on the strategy."""
    if strategy == "deepspeed":
        from lightning.pytorch.strategies import DeepSpeedStrategy

        from pipeline.training.deepspeed_precision import (  # deferred: pulls in lightning
            OnceScaledDeepSpeedPrecision,
        )

        ds = deepspeed_config(cfg, world_size)
        del ds["gradient_accumulation_steps"]  # Lightning refuses it in the dict and sets the same value
        precision = OnceScaledDeepSpeedPrecision("bf16-mixed" if cfg.bf16 else "32-true")
        return {"accelerator": "gpu", "devices": cfg.devices, "num_nodes": cfg.num_nodes,
                "strategy": DeepSpeedStrategy(config=ds, timeout=timedelta(seconds=cfg.collective_timeout),
                                              precision_plugin=precision)}
    # CPU and plain-GPU paths train in float32 (bf16 is a DeepSpeed setting, and fp32 keeps CPU runs exact),
    # unless cpu_bf16 asks for autocast on the CPU.
    clip = cfg.gradient_clipping or None
    cpu_bf16 = cfg.cpu_bf16 and not _uses_cuda(cfg)
    common = {"gradient_clip_val": clip, "gradient_clip_algorithm": "norm" if clip else None,
              "precision": "bf16-mixed" if cpu_bf16 else "32-true", "num_nodes": cfg.num_nodes}
    if strategy == "ddp":
        accelerator = "gpu" if _uses_cuda(cfg) else "cpu"
        devices = cfg.devices if cfg.devices != "auto" or accelerator == "gpu" else 1
        return {"accelerator": accelerator, "devices": devices, "strategy": ddp_strategy(cfg.collective_timeout),
                **common}
    accelerator = "gpu" if _uses_cuda(cfg) else "cpu"
    return {"accelerator": accelerator, "devices": 1, "strategy": "auto", **common}


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier on ``lr`` at optimizer step ``step`` (0-based).

    Warmup: linear from ``1/warmup_steps`` to 1 over the first ``warmup_steps`` steps. Then ``constant``
    stays at 1, and ``cosine`` follows half a cosine from 1 down to ``min_lr_ratio`` at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, *, deepspeed: bool = False
                    ) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; DeepSpeed's CPU Adam (the same AdamW update) when ZeRO offloads
    the optimizer to CPU, which DeepSpeed requires of a client optimizer there."""
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if deepspeed and cfg.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    import torch

    return torch.optim.AdamW(params, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> Any:
    """``LambdaLR`` over :func:`lr_factor`, stepped once per optimizer step."""
    import torch

    factor = partial(lr_factor, total_steps=total_steps, warmup_steps=cfg.warmup_steps, schedule=cfg.schedule,
                     min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def position_scheduler(scheduler: Any, step: int) -> None:
    """Put a fresh :func:`build_scheduler` schedule at ``step`` (as if stepped ``step`` times), setting the
    optimizer's learning rates exactly as ``LambdaLR`` computes them (``base_lr * factor(step)``)."""
    scheduler.last_epoch = step
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
