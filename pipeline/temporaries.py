"""Temporary files and directories that say who writes them, and the sweep of those a dead writer left.

A stage writes an artifact into ``.tmp-<id>@<host>@<pid>@<ns>`` beside the store and renames it into place; a
registration copies its bundle, checks a stored version or downloads a pull into directories named the same way.
A kill (SIGKILL, a lost node, a Slurm time limit) leaves them behind. The next writer of the same kind removes
those whose writer is gone: one of this host whose pid is dead, one of another host only once it is a day old (on
a shared filesystem its writer may be alive there, and its pid means nothing here).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from glob import escape as glob_escape
from pathlib import Path

FOREIGN_TMP_MAX_AGE_S = 24 * 3600.0
"""A temporary directory written by another host is only swept once it is this old (its writer may be alive there)."""


def sweep_temporaries(root: Path, pattern: str, foreign_max_age_s: float = FOREIGN_TMP_MAX_AGE_S) -> int:
    """Remove the temporary directories under ``root`` matching ``pattern`` (named by :func:`temp_name`) whose
    writer is gone: one of this host whose pid is dead, one of another host (or of no known writer) once it is
    older than ``foreign_max_age_s``. Returns how many were removed."""
    removed = 0
    now = time.time()
    here = socket.gethostname().replace("@", "_")
    for tmp in Path(root).glob(pattern):
        owner = temp_owner(tmp.name)
        if owner is not None and owner[0] == here:
            dead = not _pid_alive(owner[1])
        else:
            try:
                dead = now - tmp.stat().st_mtime >= foreign_max_age_s
            except FileNotFoundError:
                continue
        if dead:
            shutil.rmtree(tmp, ignore_errors=True)
            removed += 1
    return removed


@contextmanager
def owned_temp_dir(parent: Path, label: str) -> Iterator[Path]:
    """A temporary directory ``<parent>/.tmp-<label>@<host>@<pid>@<ns>``, removed after the block; one a killed
    process left behind is removed by :func:`sweep_temporaries` (``.tmp-<label>@*``) when the next one is made."""
    label = label.replace("@", "_").replace("/", "_")
    parent.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(parent, f".tmp-{glob_escape(label)}@*")
    path = parent / temp_name(label)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def temp_name(artifact_id_: str) -> str:
    """``.tmp-<id>@<host>@<pid>@<ns>``: who is writing, so a sweep on a shared filesystem can tell."""
    host = socket.gethostname().replace("@", "_")
    return f".tmp-{artifact_id_}@{host}@{os.getpid()}@{time.monotonic_ns()}"


def temp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of a temp dir named by :func:`temp_name`, else None."""
    parts = name.split("@")
    if len(parts) != 4 or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
