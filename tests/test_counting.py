"""Counting: vectorised loss-masked counts equal a plain Python count; shortlists and EAGLE-3 maps."""

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.config.stages import CountConfig
from pipeline.data.calibration import read_shard, shard_files, shard_name, write_shard
from pipeline.errors import DrafterError
from pipeline.evaluation.bench import bench_count, synthetic_calibration
from pipeline.vocab import counting


def _rows(rng: np.random.Generator, n: int, vocab: int) -> list[dict]:
    rows = []
    for i in range(n):
        length = int(rng.integers(1, 40))
        prompt = int(rng.integers(0, length))
        rows.append({"input_ids": rng.integers(0, vocab, length).tolist(),
                     "loss_mask": [0] * prompt + [1] * (length - prompt), "prompt_id": str(i),
                     "prompt_len": prompt, "response_len": length - prompt, "finished": True})
    return rows


def test_counts_equal_python_counter_over_masked_tokens(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    expected: Counter = Counter()
    for shard in range(3):
        rows = _rows(rng, 50, 97)
        write_shard(tmp_path / shard_name(shard), rows)
        for r in rows:
            expected.update(t for t, m in zip(r["input_ids"], r["loss_mask"]) if m)
    counts = counting.count_shards(shard_files(tmp_path), 97)
    assert counts.sum() == sum(expected.values()) > 0
    assert all(counts[t] == n for t, n in expected.items())
    # the process-pool map-reduce gives the same answer
    pooled = counting.count_shards(shard_files(tmp_path), 97, workers=2, pool_min_bytes=0)
    assert np.array_equal(pooled, counts)


def test_ids_outside_vocabulary_are_a_clear_error(tmp_path: Path) -> None:
    write_shard(tmp_path / shard_name(0), _rows(np.random.default_rng(1), 5, 50))
    with pytest.raises(DrafterError, match="outside the target vocabulary"):
        counting.count_shards(shard_files(tmp_path), 10)


def test_shortlists() -> None:
    counts = np.array([5, 0, 9, 1, 9, 3, 0, 2])
    assert counting.top_k(counts, 3).tolist() == [0, 2, 4]          # ties broken by lower id
    assert counting.top_p(counts, 0.5).tolist() == [2, 4]           # 18/29 >= 0.5 with two tokens
    assert counting.top_p(counts, 1.0).tolist() == [0, 2, 3, 4, 5, 7]
    assert counting.min_count(counts, 3).tolist() == [0, 2, 4, 5]
    assert counting.with_specials(np.array([2, 4]), [7, 2]).tolist() == [2, 4, 7]
    assert counting.coverage(counts, np.array([2, 4])) == pytest.approx(18 / 29)


def test_every_top_p_mass_names_its_own_shortlist() -> None:
    """Shortlists were named ``top_p_{p:g}`` (6 significant digits): ``count.top_p=[0.9999991, 0.9999992]`` made one
    name, the second mass's shortlist silently replacing the first's. Masses 6 digits can tell apart keep their
    names (the configs and ``evaluate.shortlists`` spell them)."""
    counts = np.arange(10_000_000, 0, -1_000) ** 2  # a long tail: the last two masses need different tokens
    rules = CountConfig(top_k=[], top_p=[0.95, 1.0, 0.9999991, 0.9999992], min_count=[], always_include_special=False)
    found = counting.shortlists(counts, rules, specials=[])
    assert list(found) == ["top_p_0.95", "top_p_1", "top_p_0.9999991", "top_p_0.9999992"]
    assert found["top_p_0.9999991"].size < found["top_p_0.9999992"].size


def test_eagle3_d2t_holds_offsets_and_t2d_a_mask() -> None:
    """EAGLE-3/SGLang convention: draft id i is the i-th smallest shortlisted target id, and
    target_id = draft_id + d2t[draft_id] (d2t holds offsets, not ids)."""
    draft = np.array([40, 3, 11, 10])                                 # any order in, sorted out
    d2t, t2d = counting.eagle3_offset_maps(draft, 50)
    assert d2t.tolist() == [3, 9, 9, 37] and d2t.dtype == np.int64  # offsets, not the ids [3, 10, 11, 40]
    for draft_id, target_id in enumerate([3, 10, 11, 40]):
        assert draft_id + d2t[draft_id] == target_id
    assert t2d.shape == (50,) and t2d.dtype == bool
    assert np.flatnonzero(t2d).tolist() == [3, 10, 11, 40]


def test_synthetic_shards_are_valid(tmp_path: Path) -> None:
    synthetic_calibration(tmp_path, 5000, vocab_size=100, row_len=100, rows_per_shard=20)
    tables = [read_shard(p) for p in shard_files(tmp_path)]
    assert sum(t.num_rows for t in tables) == 50 and len(tables) == 3


def test_count_benchmark_prints_ratio_against_counter(capsys: pytest.CaptureFixture) -> None:
    """Benchmark, not a timing assertion: prints throughput and the ratio to collections.Counter on the
    same shards in the same run (the README quotes a larger run). Fails only if the counts differ."""
    report = bench_count(tokens=300_000)
    print(report)
    assert "counts identical" in report and "ratio" in report
