"""Kill a stage's CLI run with SIGKILL once a resumable checkpoint has landed (the kill -9 resume tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from pipeline.training import checkpoints as ckpt

ROOT = Path(__file__).resolve().parents[1]


def kill_when(cmd: list[str], workdir: Path, pattern: str, *, stage: str) -> list[Path]:
    """Run ``cmd`` (a ``python -m jobs.cli <stage> ...`` line), SIGKILL it as soon as a file matching ``pattern``
    (a glob under ``workdir``) exists, and return the matching files then. Asserts it was still running and that
    nothing was published."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not list(workdir.glob(pattern)):
        time.sleep(0.01)
    assert proc.poll() is None, f"{stage} ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list((workdir / "artifacts").glob(f"{stage}-*"))  # nothing published
    return sorted(workdir.glob(pattern))


def kill_after_checkpoint(cmd: list[str], workdir: Path, *, at_step: int, total: int, stage: str) -> list[int]:
    """Run ``cmd`` (a ``python -m jobs.cli <stage> ...`` line), SIGKILL it once a checkpoint of step
    ``at_step`` or later exists under ``workdir/staging/*/train``, and return the steps that had landed.

    CPU results are bit-identical at a fixed thread count (it sets the reduction order); other tests in the
    worker may have changed this process's count, so the killed run gets the same one. Asserts the kill
    landed mid-run (before ``total``) and that nothing was published.
    """
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())})
    deadline, staging = time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(workdir.glob("staging/*/train/step-*"))
        if any(int(p.name[len(ckpt.PREFIX):]) >= at_step for p in found):
            staging = found[0].parent
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"{stage} ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    landed = [int(p.name[len(ckpt.PREFIX):]) for p in ckpt.checkpoints(staging)]
    assert landed and max(landed) < total, "the kill must land mid-run"
    assert not list((workdir / "artifacts").glob(f"{stage}-*"))  # nothing published
    return landed
