"""What the Lightning loop is handed besides the module and data (:class:`RunPlan`), and which parameters train."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.training import TrainConfig


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
