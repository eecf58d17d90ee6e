"""Timing for the benchmarks: the median of repeated calls after warm-up, CUDA synchronised."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after 3 warm-up calls (CUDA synchronised)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))
