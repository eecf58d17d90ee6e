"""What the Lightning loop is handed besides the module and data (:class:`RunPlan`), which parameters train, and what
a drafter trainer stage builds before it trains (:class:`Prepared`, from :func:`frozen_target`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.sections import TargetConfig
from pipeline.config.training import TrainConfig
from pipeline.models.target import Target


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
    seconds_before: float = 0.0
    """Seconds the run had trained before this process (the resumed checkpoint's ``train_seconds``)."""
    started: float = 0.0
    """``time.perf_counter()`` when this process's part of the run began."""

    def seconds_so_far(self) -> float:
        """Seconds the run has trained, over every process that resumed it."""
        return self.seconds_before + time.perf_counter() - self.started


def trainable_parameters(module: Any) -> dict[str, Any]:
    """The parameters the harness trains and saves: every one with ``requires_grad``, by name."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def all_finite(tensors: Any) -> bool:
    """Whether every value of every tensor is finite (no NaN, no infinity)."""
    return all(bool(t.isfinite().all()) for t in tensors)


@dataclass
class Prepared:
    """What a drafter trainer stage builds from its config and input artifacts before training (its ``prepare``)."""

    target: Any
    """The frozen target, float32 (:func:`frozen_target`)."""
    tokenizer: Any
    config: Any
    """The drafter's config."""
    drafter: Any
    """The freshly initialised drafter."""
    data: Any
    """The calibration rows, split into training and held-out (a :class:`~pipeline.data.rows.CalibrationRows`)."""
    pad_id: int


def frozen_target(cfg: TargetConfig) -> tuple[Any, Any, int]:
    """The target a drafter trains against, its tokenizer and the pad id of batches (:func:`pad_id`). The
    model loads in float32 whatever ``target.dtype`` says: the strategy casts it (DeepSpeed bf16) or keeps it."""
    target = Target(cfg)
    tokenizer = target.tokenizer()
    return target.model(dtype="float32"), tokenizer, pad_id(tokenizer)


def pad_id(tokenizer: Any) -> int:
    """The id training batches are padded with: the tokenizer's pad token, else 0 (padding is masked out)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
