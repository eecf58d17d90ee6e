"""Token frequencies over a calibration set, and the draft vocabularies built from them.

Counting is VocabTrim Alg. 1 / FR-Spec's frequency pass: only loss-masked (assistant) tokens count.
It runs at memory-bandwidth speed: each shard's list columns are flat Arrow buffers, viewed as numpy
arrays without copying, masked and reduced with one ``np.bincount`` (no Python loop per token); shards
are mapped in worker processes and the per-shard counts summed (map-reduce). From the counts come
shortlists by top-k (FR-Spec), top-p mass (VocabTrim) and min-count, and the export formats serving
stacks load: EAGLE-3 ``d2t`` (draft id → offset to target id) / ``t2d`` (bool over the target
vocabulary), and SGLang's ``--speculative-token-map`` (ids by descending frequency).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config.stages import CountConfig, top_p_name
from pipeline.data.calibration import flat_arrays, read_shard
from pipeline.errors import DrafterError
from pipeline.progress import Progress, heartbeat


def count_shard(path: str | Path, vocab_size: int) -> np.ndarray:
    """Loss-masked token counts of one shard as an int64 array of length ``vocab_size``."""
    ids, mask = flat_arrays(read_shard(Path(path)))
    # The mask is 0/1 int8: viewing it as bool costs nothing, and bincount's own output length is the
    # range check (an id >= vocab_size makes it longer; a negative id raises), so no extra passes.
    try:
        counts = np.bincount(ids[mask.view(bool)], minlength=vocab_size)
    except ValueError:
        counts = np.zeros(0)
    if counts.size != vocab_size:
        raise DrafterError(f"Shard {path} holds token ids outside the target vocabulary.",
                           expected=f"ids in [0, {vocab_size})", found=f"ids in [{ids.min()}, {ids.max()}]",
                           fix="The calibration set was tokenised for another model; regenerate it for this target.")
    return counts.astype(np.int64, copy=False)


# Starting worker processes costs ~0.5 s; one process counts ~150M tokens/s, so the pool pays only
# for calibration sets of more than a few hundred MB.
POOL_MIN_BYTES = 256 << 20


def count_shards(paths: Iterable[str | Path], vocab_size: int, workers: int = 1,
                 pool_min_bytes: int = POOL_MIN_BYTES) -> np.ndarray:
    """Map ``count_shard`` over shards (in up to ``workers`` processes when the shards are large
    enough to pay for starting them) and reduce by summing."""
    paths = [str(p) for p in paths]
    total = np.zeros(vocab_size, dtype=np.int64)
    size = sum(Path(p).stat().st_size for p in paths)
    if workers > 1 and len(paths) > 1 and size >= pool_min_bytes:
        # Map: each worker reduces its own slice of shards, so only `workers` arrays cross processes.
        n = min(workers, len(paths))
        groups = [paths[i::n] for i in range(n)]
        # each worker answers once, at its group's end: the heartbeat speaks every 30 s until then
        with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool, \
                Progress("count", len(paths), "shard") as progress, heartbeat(f"count: {n} worker processes"):
            for group, counts in zip(groups, pool.map(_count_group, groups, [vocab_size] * n), strict=True):
                total += counts
                progress.update(len(group))
    else:
        with Progress("count", len(paths), "shard") as progress:
            for path in paths:
                total += count_shard(path, vocab_size)
                progress.update(1)
    return total


def _count_group(paths: list[str], vocab_size: int) -> np.ndarray:
    total = np.zeros(vocab_size, dtype=np.int64)
    for path in paths:
        total += count_shard(path, vocab_size)
    return total


def _by_frequency(counts: np.ndarray) -> np.ndarray:
    """Token ids by descending count, ties broken by ascending id (deterministic)."""
    return np.lexsort((np.arange(counts.size), -counts))


def top_k(counts: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` most frequent ids (FR-Spec), sorted ascending."""
    return np.sort(_by_frequency(counts)[: min(k, counts.size)])


def top_p(counts: np.ndarray, p: float) -> np.ndarray:
    """The fewest ids whose counts cover share ``p`` of the total (VocabTrim), sorted ascending."""
    order = _by_frequency(counts)
    cumulative = np.cumsum(counts[order]) / max(int(counts.sum()), 1)
    n = int(np.searchsorted(cumulative, p - 1e-12) + 1)
    return np.sort(order[: min(n, counts.size)])


def min_count(counts: np.ndarray, c: int) -> np.ndarray:
    """Every id seen at least ``c`` times, sorted ascending."""
    return np.flatnonzero(counts >= c)


def with_specials(ids: np.ndarray, specials: Iterable[int]) -> np.ndarray:
    return np.union1d(ids, np.asarray(sorted(set(specials)), dtype=np.int64))


def eagle3_offset_maps(draft_ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """EAGLE-3's vocabulary maps for a draft vocabulary (the ``d2t``/``t2d`` its loaders read).

    Convention (EAGLE-3, SGLang): draft id ``i`` is the ``i``-th smallest target id of the shortlist,
    and ``d2t`` holds *offsets*, not ids: ``target_id = i + d2t_offsets[i]``. ``t2d`` is a mask over the
    target vocabulary. (:class:`pipeline.vocab.maps.VocabMap` holds absolute ids instead.)

    Args:
        draft_ids: Target ids in the draft vocabulary (any order, no repeats).
        vocab_size: Size of the target vocabulary.

    Returns:
        ``(d2t_offsets, t2d_mask)``: int64 ``(len(draft_ids),)`` offsets and bool ``(vocab_size,)``,
        true at the target ids in the draft vocabulary.
    """
    draft_ids = np.sort(draft_ids)
    d2t_offsets = draft_ids - np.arange(draft_ids.size)
    t2d_mask = np.zeros(vocab_size, dtype=bool)
    t2d_mask[draft_ids] = True
    return d2t_offsets.astype(np.int64), t2d_mask


def draft_vocab_maps(counts: Any, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A count artifact's draft vocabulary as EAGLE-3 ``d2t``/``t2d`` (its ``eagle3_maps.safetensors``), ``t2d``
    padded to the target's embedding rows: what the EAGLE-3 drafter and a DFlash drafter with ``head: draft`` use."""
    from safetensors.numpy import load_file

    maps = load_file(str(counts.file("eagle3_maps.safetensors")))
    d2t, t2d = maps["d2t"], maps["t2d"].astype(bool)
    if t2d.size > target_vocab_size:
        raise DrafterError(f"The draft vocabulary of count artifact {counts.id} is for a larger vocabulary.",
                           expected=f"t2d over at most the target's {target_vocab_size} embedding rows",
                           found=f"t2d of length {t2d.size}",
                           fix="Use the count artifact made with this target's tokenizer.")
    return d2t, np.pad(t2d, (0, target_vocab_size - t2d.size))


def shortlists(counts: np.ndarray, rules: CountConfig, specials: list[int]) -> dict[str, np.ndarray]:
    """Every shortlist ``rules`` asks for, keyed ``top_k_<k>``, ``top_p_<p>``, ``min_count_<c>``
    (FR-Spec top-k; VocabTrim Alg. 1 mass and count thresholds), specials added when asked."""
    out: dict[str, np.ndarray] = {}
    for k in rules.top_k:
        out[f"top_k_{k}"] = top_k(counts, k)
    for p in rules.top_p:
        out[top_p_name(p)] = top_p(counts, p)
    for m in rules.min_count:
        out[f"min_count_{m}"] = min_count(counts, m)
    if rules.always_include_special:
        out = {name: with_specials(ids, specials) for name, ids in out.items()}
    return out


def coverage(counts: np.ndarray, ids: np.ndarray) -> float:
    """Share of the counted mass a shortlist covers."""
    total = int(counts.sum())
    return float(counts[ids].sum() / total) if total else 0.0


def load_shortlists(artifact) -> dict[str, np.ndarray]:  # noqa: ANN001 - an Artifact of kind token_counts
    """The shortlists of a ``count`` artifact, by name (``top_k_512``, ``top_p_0.95``, ...)."""
    from safetensors.numpy import load_file

    return load_file(str(artifact.file("shortlists.safetensors")))


def frequency_ranking(artifact) -> np.ndarray:  # noqa: ANN001 - an Artifact of kind token_counts
    """Every token id of a ``count`` artifact, most frequent first (ties: lower id first), as FR-Spec ranks."""
    from safetensors.numpy import load_file

    counts = load_file(str(artifact.file("counts.safetensors")))["counts"]
    return _by_frequency(counts).astype(np.int64)
