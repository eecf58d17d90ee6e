"""A real ``mlflow server`` on 127.0.0.1 for tests: started in a subprocess on a free port, stopped after.

Registered as a pytest plugin (``addopts`` in ``pyproject.toml``); use the ``mlflow_server`` fixture (session
scoped: one server per xdist worker) to get its URI.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.tracking import seed_local_store


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    def __init__(self, root: Path, app_name: str | None = None, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.app_name = app_name  # e.g. "basic-auth"
        self.env = env or {}
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        seed_local_store(f"sqlite:///{self.root / 'mlflow.db'}")  # the server opens it as one it made (as a run does)
        log = open(self.root / "server.log", "ab")
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
               "--artifacts-destination", (self.root / "artifacts").as_uri()]
        if self.app_name:
            cmd += ["--app-name", self.app_name]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")} | self.env
        # The server's background job runner (five consumer processes) is not used by the pipeline.
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer within {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """Start a server in a fresh directory, yield it, stop it (the body of a fixture)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A running tracking + registry server; ``.uri`` is its http address. One per xdist worker, so the files a
    worker runs share it: a module whose checks read registry-wide state (which version holds ``champion`` of a
    bundle name that other files register too) overrides this fixture with a module-scoped one over
    :func:`serve`."""
    yield from serve(tmp_path_factory)
