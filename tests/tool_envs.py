"""Where tests keep tool environments, virtualenvs for tools whose pins conflict with ours (speculators), and how
they are built.

They live apart from the artifact cache (``$DRAFTER_CACHE``, the tiny kits): a venv is over a gigabyte of
someone else's packages, not an artifact, and clearing one must not cost the other. The directory is
``$DRAFTER_TOOLS`` if set, else ``~/.cache/drafter-pipeline-tools``; ``rm -rf`` it to reclaim the space
(the next interop run rebuilds what it needs).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.progress import heartbeat, stamped


def tools_dir() -> Path:
    """``$DRAFTER_TOOLS`` if set, else ``~/.cache/drafter-pipeline-tools``."""
    env = os.environ.get("DRAFTER_TOOLS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "drafter-pipeline-tools"


def tool_env_dir(name: str) -> Path:
    """The directory of tool environment ``name`` (e.g. ``speculators-0.9.0``)."""
    return tools_dir() / name


def clean_env() -> dict[str, str]:
    """Our environment without what would leak our venv or repo into the other interpreter; offline HF."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONNOUSERSITE="1")
    return env


def _run(cmd: list[str], what: str, venv: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a build step; on failure, fail the test with the command and the end of its output."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"Building the {venv.name} venv: {what} took over {timeout:.0f} s: {' '.join(cmd)}")
    if done.returncode:
        noise = "WARNING: Location 'file:"  # pip's notes on absent local indexes configured on this machine
        tail = "\n".join(line for line in (done.stdout + done.stderr).splitlines() if noise not in line)[-3000:]
        pytest.fail(f"Building the {venv.name} venv: {what} failed (exit {done.returncode}).\n"
                    f"command: {' '.join(cmd)}\n{tail}\n"
                    f"It needs pip to reach PyPI; delete {venv} to start over.")
    return done


def _uv_install(python: Path, venv: Path, pins: tuple[str, ...], remove: tuple[str, ...], timeout: float) -> bool:
    """Install the pins with the uv beside our interpreter (``make setup`` installs it: the same versions as pip,
    in a fraction of the time), passing on pip's find-links from the environment (uv does not read pip's
    configuration). False where there is no uv or it failed (an index only pip.conf names): pip then installs."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        return False
    links = [arg for links in os.environ.get("PIP_FIND_LINKS", "").split() for arg in ("--find-links", links)]
    command = [str(uv), "pip", "install", "-q", "--compile-bytecode", "--python", str(python), *links, *pins]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean_env())
    if done.returncode:
        return False
    if remove:
        _run([str(uv), "pip", "uninstall", "-q", "--python", str(python), *remove], f"removing {'/'.join(remove)}",
             venv, 300)
    return True


def ensure_tool_venv(name: str, pins: tuple[str, ...], *, remove: tuple[str, ...] = (), check: str,
                     timeout: float) -> Path:
    """The python of tool environment ``name`` with ``pins`` installed and ``remove`` uninstalled after them, built
    first unless a complete one exists (a stamp holding its pins, written after ``check``, a line of Python, ran in
    it); a second pytest waits on the first one's build, and a half-built one is built again."""
    venv = tool_env_dir(name)
    python, stamp = venv / "bin" / "python", venv / ".complete"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and json.loads(stamp.read_text()).get("pins") == list(pins) and python.exists():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        # minutes of installing with its output captured: a line every 30 s on the terminal pytest does not capture
        with heartbeat(f"building the {name} venv in {venv}", stamped(sys.__stderr__)):
            _run([sys.executable, "-m", "venv", str(venv)], "creating the venv", venv, 300)
            if not _uv_install(python, venv, pins, remove, timeout):
                pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
                _run([*pip, "install", "-q", *pins], f"pip install {' '.join(pins)}", venv, timeout)
                if remove:
                    _run([*pip, "uninstall", "-y", "-q", *remove], f"removing {'/'.join(remove)}", venv, 300)
            _run([str(python), "-c", check], f"running {check!r}", venv, 300)
        stamp.write_text(json.dumps({"pins": list(pins), "build_seconds": round(time.monotonic() - started, 1)}))
        return python
