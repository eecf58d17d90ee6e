"""Staged shards (pipeline.orchestration.staged): written with a checksum, trusted on resume only if they match it."""

from pathlib import Path

import pytest

from pipeline.orchestration.staged import sidecar, staged_ok, staged_problem, write_staged


def _write(path: Path, data: bytes) -> None:
    write_staged(path, lambda tmp: tmp.write_bytes(data))


def test_a_staged_shard_carries_its_checksum_and_a_sound_one_is_kept(tmp_path: Path) -> None:
    shard = tmp_path / "shard-00000.arrow"
    _write(shard, b"rows" * 100)
    lines: list[str] = []
    assert staged_ok(shard, lines.append) and shard.read_bytes() == b"rows" * 100 and not lines
    assert sidecar(shard).name == "shard-00000.arrow.sha256.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == [shard.name, sidecar(shard).name]  # no temp file left
    assert not staged_ok(tmp_path / "shard-00001.arrow", lines.append) and not lines  # not written yet: no line


@pytest.mark.parametrize("damage, said", [
    (lambda p: p.write_bytes(p.read_bytes()[:150]), "truncated (150 of 400 bytes)"),
    (lambda p: p.write_bytes(p.read_bytes() + b"x"), "401 bytes where 400 were written"),
    (lambda p: p.write_bytes(b"R" + p.read_bytes()[1:]), "sha256 mismatch (expected "),
    (lambda p: sidecar(p).unlink(), "no checksum (shard-00003.arrow.sha256.json is missing"),
    (lambda p: sidecar(p).write_text("{"), "unreadable checksum shard-00003.arrow.sha256.json"),
])
def test_a_damaged_shard_is_deleted_with_a_line_naming_it(tmp_path: Path, damage, said: str) -> None:
    """Truncated, grown, a flipped byte, no checksum, an unreadable checksum: each is not done, is deleted with its
    checksum, and one line names the file and what was wrong."""
    shard = tmp_path / "shard-00003.arrow"
    _write(shard, b"rows" * 100)
    damage(shard)
    assert staged_problem(shard) is not None
    lines: list[str] = []
    assert not staged_ok(shard, lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"{shard.name}: {said}") and lines[0].endswith(", recomputing")
    assert not shard.exists() and not sidecar(shard).exists()
    _write(shard, b"redone")  # the redo is trusted again
    assert staged_ok(shard, lines.append) and len(lines) == 1


def test_a_write_that_fails_publishes_nothing(tmp_path: Path) -> None:
    shard = tmp_path / "sums-00000.safetensors"

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise OSError("disk went away")

    with pytest.raises(OSError, match="disk went away"):
        write_staged(shard, fail)
    assert not list(tmp_path.iterdir())
