"""Timing for the benchmarks: the median of repeated calls after warm-up, CUDA synchronised."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def device_name(device: torch.device | str) -> str:
    """What a figure was measured (or a shard computed) on: the GPU's name, or ``cpu (<threads> threads)``."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` warm-up calls (CUDA synchronised)."""
    _timed_at_least_once(repeats)
    for _ in range(warmup):
        fn()
    return float(np.median([_seconds_of(fn, device) for _ in range(repeats)]))


def _timed_at_least_once(repeats: int) -> None:
    if repeats < 1:  # the median of no times is NaN, printed as a figure
        raise ValueError(f"a timing needs at least one timed call, got repeats={repeats}")


def _seconds_of(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one call of ``fn``, the device synchronised before and after it (on a GPU, the work it queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved_times(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int,
                      warmup: int = 3, before: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Seconds of each call of each of ``fns``, timed in turn within each of ``repeats`` rounds (after ``warmup``
    rounds), so a load that comes and goes on a shared machine moves every variant alike and their ratios hold.
    ``before`` (e.g. a :class:`CacheFlusher`) runs ahead of every call, untimed."""
    _timed_at_least_once(repeats)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_index in range(warmup + repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            seconds = _seconds_of(fn, device)
            if round_index >= warmup:
                times[name].append(seconds)
    return times


def interleaved_medians(fns: dict[str, Callable[[], Any]], device: torch.device, repeats: int,
                        warmup: int = 3) -> dict[str, float]:
    """The median of each of ``fns`` over :func:`interleaved_times`."""
    return {name: float(np.median(values)) for name, values in interleaved_times(fns, device, repeats, warmup).items()}


def last_level_cache_bytes(device: torch.device) -> int | None:
    """The size of the device's last-level cache: a GPU's L2, or the CPU's highest cache level that sysfs lists;
    None where neither can be read."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or None
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((entry / "level").read_text()), (entry / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KkMmGg")
        if digits.isdigit():
            sizes.append((level, int(digits) * scale))
    return max(sizes)[1] if sizes else None


FLUSH_FALLBACK_BYTES = 256 * 2**20
"""What :class:`CacheFlusher` writes where the last-level cache's size cannot be read."""


class CacheFlusher:
    """A call that evicts the device's caches: it writes a buffer of :attr:`bytes`, four times the last-level cache
    (:func:`last_level_cache_bytes`, else :data:`FLUSH_FALLBACK_BYTES`). Run before each timed call, it times a
    forward as a decode round meets it: with its weights evicted by the other model's forward."""

    def __init__(self, device: torch.device) -> None:
        self.bytes = 4 * (last_level_cache_bytes(device) or FLUSH_FALLBACK_BYTES // 4)
        self._buffer = torch.zeros(self.bytes // 4, dtype=torch.float32, device=device)

    def __call__(self) -> None:
        self._buffer.add_(1.0)
