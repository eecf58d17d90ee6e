"""Timing for the benchmarks: the median of repeated calls after warm-up, CUDA synchronised."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` warm-up calls (CUDA synchronised)."""
    for _ in range(warmup):
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


def interleaved_times(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int,
                      warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of each call of each of ``fns``, timed in turn within each of ``repeats`` rounds (after ``warmup``
    rounds), so a load that comes and goes on a shared machine moves every variant alike and their ratios hold."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int,
                        warmup: int = 3) -> dict[str, float]:
    """The median of each of ``fns`` over :func:`interleaved_times`."""
    return {name: float(np.median(values)) for name, values in interleaved_times(fns, device, repeats, warmup).items()}
