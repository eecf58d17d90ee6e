"""Benchmarks that print a ratio against a baseline measured in the same run on the same data.

``drafter bench count``: the vectorised Arrow-buffer counter (``pipeline.vocab.counting``) against the
obvious Python baseline (``collections.Counter`` over each row's token list), both starting from the
same shards on disk and both checked to give identical counts. Nothing here asserts a time; the
figures are printed for a person (and the README) to read.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.artifacts import load_artifact
from pipeline.data.calibration import read_shard, shard_files, shard_name, write_shard
from pipeline.engine.methods import METHOD_NAMES, stages_read
from pipeline.errors import DrafterError
from pipeline.models.target import Target
from pipeline.vocab import counting


def synthetic_calibration(directory: Path, tokens: int, vocab_size: int = 32_000, row_len: int = 512,
                          rows_per_shard: int = 256, seed: int = 0) -> None:
    """Shards of Zipf-distributed token ids (realistic skew), 70% of each row loss-masked."""
    rng = np.random.default_rng(seed)
    n_rows = max(tokens // row_len, 1)
    rows = []
    shard = 0
    for r in range(n_rows):
        ids = (rng.zipf(1.2, row_len) - 1) % vocab_size
        prompt = int(row_len * 0.3)
        rows.append({"input_ids": ids.tolist(), "loss_mask": [0] * prompt + [1] * (row_len - prompt),
                     "prompt_id": str(r), "prompt_len": prompt, "response_len": row_len - prompt, "finished": True})
        if len(rows) == rows_per_shard:
            write_shard(directory / shard_name(shard), rows)
            rows, shard = [], shard + 1
    if rows:
        write_shard(directory / shard_name(shard), rows)


def counter_baseline(paths: list[Path]) -> Counter:
    counter: Counter = Counter()
    for path in paths:
        table = read_shard(path)
        for ids, mask in zip(table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()):
            counter.update(t for t, m in zip(ids, mask) if m)
    return counter


def bench_count(tokens: int = 2_000_000, calibration: str | None = None, vocab_size: int = 32_000,
                workers: int = 2) -> str:
    """Run both counters on the same shards and return a printable report with the ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        if calibration:
            directory = Path(calibration) / "data"
            paths = shard_files(directory)
            vocab_size = int(max(int(read_shard(p).column("input_ids").combine_chunks().flatten().to_numpy().max())
                                 for p in paths)) + 1
        else:
            directory = Path(tmp)
            synthetic_calibration(directory, tokens, vocab_size)
            paths = shard_files(directory)
        t0 = time.perf_counter()
        baseline = counter_baseline(paths)
        t_base = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours_1 = counting.count_shards(paths, vocab_size, workers=1)
        t_ours_1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours_n = counting.count_shards(paths, vocab_size, workers=workers, pool_min_bytes=0)
        t_ours_n = time.perf_counter() - t0
    expected = np.zeros(vocab_size, dtype=np.int64)
    for token, n in baseline.items():
        expected[token] = n
    if not (np.array_equal(expected, ours_1) and np.array_equal(expected, ours_n)):
        raise AssertionError("vectorised counts differ from the Counter baseline")
    counted = int(expected.sum())
    return "\n".join([
        f"count benchmark: {counted:,} loss-masked tokens in {len(paths)} shards (counts identical)",
        f"  collections.Counter baseline : {t_base:8.3f} s  {counted / t_base:14,.0f} tokens/s",
        f"  vectorised, 1 process        : {t_ours_1:8.3f} s  {counted / t_ours_1:14,.0f} tokens/s  "
        f"ratio {t_base / t_ours_1:7.1f}x",
        f"  vectorised, {workers} processes      : {t_ours_n:8.3f} s  {counted / t_ours_n:14,.0f} tokens/s  "
        f"ratio {t_base / t_ours_n:7.1f}x",
    ])


def bench_eval(cfg, counts: str | None, out: str | None = None) -> str:  # noqa: ANN001 - a PipelineConfig
    """The evaluate stage's method matrix on this machine's device, without artifact store or MLflow.

    For measuring a device (e.g. a GPU box without a tracking server): loads the target and drafters of
    ``cfg``, the count artifact at ``counts`` (verified against the target's fingerprint), runs every
    method against autoregressive decoding on the same prompts, and returns the Markdown table; the full report (JSON + HTML) goes to ``out`` when given.

    Raises:
        DrafterError: Without ``counts`` (``drafter bench eval --counts DIR``).
    """
    import platform
    import sys
    from pathlib import Path

    from pipeline.evaluation.matrix import evaluate_matrix  # deferred: pulls in torch
    from pipeline.evaluation.report import markdown_table, write_report  # deferred: pulls in numpy

    if not counts:
        raise DrafterError("`drafter bench eval` needs --counts DIR (a count artifact).",
                           fix="Run `drafter count` first; its artifact is under <workdir>/artifacts/count-*.")
    say = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    # the count artifact is all it is given: the methods that read another stage's (a trained drafter, the
    # clustering, the router, RDK's moments) are left out, and said to be
    runnable = [m for m in cfg.evaluate.methods if not stages_read([m])]
    if not runnable:
        raise DrafterError("`drafter bench eval` has no method to run: every method of evaluate.methods reads an "
                           "artifact besides the count artifact.", expected="a method that reads only --counts "
                           f"(e.g. {', '.join(m for m in METHOD_NAMES if not stages_read([m]))})",
                           found=", ".join(cfg.evaluate.methods), fix="Name such methods in evaluate.methods=[...], "
                           "or run `drafter evaluate`, which builds the others' artifacts.")
    if left := [m for m in cfg.evaluate.methods if m not in runnable]:
        say(f"bench eval: leaving out {', '.join(left)} (each reads an artifact besides --counts; `drafter evaluate` "
            "runs them)")
    cfg = dataclasses.replace(cfg, evaluate=dataclasses.replace(cfg.evaluate, methods=runnable))
    fp = Target(cfg.target).fingerprint
    artifacts = {"count": load_artifact(counts, kind="token_counts", fingerprint=fp)}
    results = evaluate_matrix(cfg, artifacts, fp, say)
    provenance = {"command": " ".join(sys.argv), "host": platform.node()}
    if out:
        write_report(results, Path(out), provenance=provenance)
    verdict = "passed" if results.gates.passed else "FAILED"
    return (f"device: {results.device}; lossless: {results.lossless}; gates {verdict} "
            f"(speed metric {results.gates.speed_metric})\n\n" + markdown_table({**results.to_dict(), **provenance}))
