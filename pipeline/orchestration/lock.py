"""One builder per artifact: an advisory lock so two runs on one workdir never build the same artifact at once.

Publishing alone is already race-safe (an id is a content hash and the second rename yields to the first), but
two runs building the same id share its staging directory (``<workdir>/staging/<id>``): shards, checkpoints,
and the first run's cleanup after its publish. So the first rank of a run takes ``<workdir>/locks/<id>.lock``
(``flock``; released by the kernel when the process dies, so a killed run leaves no stale lock) around the build
and publish. A second run that finds it held waits, naming the holder, and then finds the artifact in the
store (a cache hit). Only the launching rank locks: Lightning's spawned ranks (``LOCAL_RANK`` > 0) and the
ranks of an ``srun``/``torchrun`` launch (``RANK``/``SLURM_PROCID`` > 0) work inside their rank 0's lock. A rank
0 whose peers were started by an external launcher cannot make them wait, so it stops at once with an error
instead. ``flock`` is emulated over NFS (v4) by Linux; on a filesystem without locks the error says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import DrafterError
from pipeline.progress import heartbeat

RANK_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK")
"""A process is a run's first rank when none of these is set to anything but 0 (Lightning's subprocess
launcher gives its child ranks only ``LOCAL_RANK``)."""
PEER_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")


@dataclass(frozen=True)
class Launch:
    """How this process was started: the rank variables its launcher (srun, torchrun, Lightning's children) set.

    Built once where the process starts (the CLI) and passed down: when Lightning launches ranks from inside a run it
    also sets ``WORLD_SIZE``, ``LOCAL_RANK`` and ``NODE_RANK`` in the launching process, and those must not make its
    next stage look like one rank of an external launch.
    """

    variables: dict[str, str | None] = field(default_factory=dict)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Launch:
        """The launch as ``environ`` (default: this process's environment, now) describes it."""
        environ = os.environ if environ is None else environ
        return cls({var: environ.get(var) for var in RANK_VARIABLES + PEER_VARIABLES})

    @property
    def first_rank(self) -> bool:
        """Whether this is its run's first rank (it locks, publishes and logs)."""
        return all((self.variables.get(var) or "0") == "0" for var in RANK_VARIABLES)

    @property
    def external_peers(self) -> bool:
        """Whether other ranks of this run were started next to this process (srun, torchrun), not by it."""
        return any(int(self.variables.get(var) or 1) > 1 for var in PEER_VARIABLES)


def _holder(path: Path) -> str:
    try:
        owner = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        owner = {}
    if not owner:
        return "another run"
    return f"pid {owner.get('pid')} on {owner.get('host')} (since {owner.get('since')})"


@contextmanager
def artifact_lock(workdir: Path, artifact_id: str, stage: str, log: Callable[[str], None],
                  launch: Launch) -> Iterator[None]:
    """Hold ``<workdir>/locks/<artifact_id>.lock`` while the body builds and publishes (first rank only)."""
    if not launch.first_rank:
        yield
        return

    def cannot_wait(holder: str, path: Path) -> DrafterError:
        return DrafterError(f"Artifact {artifact_id} is being built in this workdir by {holder}.",
                            expected="one run building each artifact of a workdir", found=f"{path} held",
                            fix="Wait for that run (the rerun then reuses its artifact) or give this run another "
                                "workdir; this multi-rank launch cannot wait with its peers.")

    with held(workdir / "locks" / f"{artifact_id}.lock", artifact_id, f"building {artifact_id} in this workdir",
              stage, log, refuse=cannot_wait if launch.external_peers else None):
        yield


@contextmanager
def held(path: Path, subject: str, doing: str, stage: str, log: Callable[[str], None], *,
         refuse: Callable[[str, Path], DrafterError] | None = None) -> Iterator[None]:
    """Hold the ``flock`` of ``path`` while the body runs. Held by another process: wait for it, naming the holder
    (``waiting for pid … on host …, which is <doing>``, then a line every 30 s), or raise ``refuse(holder, path)``
    where this process cannot wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DrafterError(f"Cannot lock {path}, needed while {doing}.", found=f"{type(err).__name__}: {err}",
                                   fix="Put workdir on a filesystem with file locks (local disk, NFSv4, Lustre "
                                       "mounted with flock).") from err
            holder = _holder(path)
            if refuse is not None:
                raise refuse(holder, path) from err
            log(f"waiting for {holder}, which is {doing} ({path})")
            started = time.monotonic()
            with heartbeat(f"waiting for the lock on {subject}", log):
                fcntl.flock(fd, fcntl.LOCK_EX)
            log(f"lock on {subject} acquired after {time.monotonic() - started:.1f} s")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "stage": stage,
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
