"""Staged shards: the finished pieces a resumable stage keeps in ``<workdir>/staging/<id>/`` across a killed run
(calibration shards, RDK's moment sums, EAGLE-3's feature cache).

A resumed run trusts a shard only if it matches the checksum written with it. :func:`write_staged` writes a
shard to a temporary name, records its sha256 and size in a sidecar ``<shard>.sha256.json``, and only then
renames the shard into place, so a shard under its real name always has its checksum (a kill in between leaves
a sidecar without a shard: the shard is simply redone). :func:`staged_ok` checks one on resume and again before
publishing; a shard that is truncated, changed, or has no checksum (its sidecar deleted, or staged by a version
of the pipeline without checksums) is deleted with a log line naming it and what was wrong, and the stage
recomputes it. Several ranks may check the same shard at once: they reach the same verdict, and deleting is
idempotent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.checksums import sha256_file, temp_sibling, write_json_atomic

SIDECAR_SUFFIX = ".sha256.json"


def sidecar(path: Path) -> Path:
    """Where the checksum of staged file ``path`` is kept."""
    return path.with_name(path.name + SIDECAR_SUFFIX)


def write_staged(path: Path, write: Callable[[Path], None], about: dict | None = None) -> None:
    """Write a staged shard through ``write(temporary path)``, record its checksum (and ``about``: how it was
    computed, read back by :func:`staged_about`), then publish it by rename."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        write_json_atomic(sidecar(path), {"file": path.name, "sha256": sha256_file(tmp),
                                          "bytes": tmp.stat().st_size, **({"about": about} if about else {})})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_staged_json(path: Path, value: Any, about: dict | None = None) -> None:
    """:func:`write_staged` of a JSON value (read it back with ``json.loads(path.read_text())``)."""
    write_staged(path, lambda tmp: tmp.write_text(json.dumps(value)), about)


def staged_about(path: Path) -> dict:
    """What :func:`write_staged` recorded of how the sound staged shard ``path`` was computed (empty if nothing)."""
    about = json.loads(sidecar(path).read_text()).get("about")
    return about if isinstance(about, dict) else {}


def staged_problem(path: Path) -> str | None:
    """What is wrong with staged shard ``path``, which exists (None: it matches its checksum)."""
    try:
        record = json.loads(sidecar(path).read_text())
        expected_sha, expected_bytes = str(record["sha256"]), int(record["bytes"])
    except FileNotFoundError:
        return f"no checksum ({sidecar(path).name} is missing: deleted, or staged by a pipeline without checksums)"
    except (ValueError, KeyError, TypeError) as err:
        return f"unreadable checksum {sidecar(path).name} ({type(err).__name__}: {err})"
    size = path.stat().st_size
    if size != expected_bytes:
        return (f"truncated ({size} of {expected_bytes} bytes)" if size < expected_bytes
                else f"{size} bytes where {expected_bytes} were written")
    found = sha256_file(path)
    if found != expected_sha:
        return f"sha256 mismatch (expected {expected_sha}, found {found})"
    return None


def staged_ok(path: Path, log: Callable[[str], None]) -> bool:
    """Whether staged shard ``path`` is there and sound; a damaged one is deleted (with its checksum) and logged
    as "<name>: <what is wrong>, recomputing"."""
    path = Path(path)
    if not path.is_file():
        return False
    try:
        problem = staged_problem(path)
    except FileNotFoundError:
        return False  # not written yet (or just deleted by another rank that found it damaged)
    if problem is None:
        return True
    log(f"{path.name}: {problem}, recomputing")
    path.unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)
    return False
