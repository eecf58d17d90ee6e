"""A real ``mlflow server --app-name basic-auth``: credentials from the environment work, wrong or missing ones stop
the run before any work with an error that names the user but not the password, and the password appears in no
log, artifact, param, tag, workdir file or server file (README "Faults")."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SMALL
from tests.mlflow_server import MlflowServer

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "pipeline-admin"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MlflowServer, str]]:
    """A basic-auth tracking server whose admin password is random; yields it and the password."""
    password = "pw-" + secrets.token_hex(12)
    config_dir = tmp_path_factory.mktemp("auth-config")  # the server's own secret file, outside its store
    config = config_dir / "basic_auth.ini"
    config.write_text("[mlflow]\ndefault_permission = READ\n"
                      f"database_uri = sqlite:///{config_dir / 'basic_auth.db'}\n"
                      f"admin_username = {ADMIN}\nadmin_password = {password}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-auth"), app_name="basic-auth",
                          env={"MLFLOW_AUTH_CONFIG_PATH": str(config),
                               "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16)})
    server.start()
    yield server, password
    server.stop()


def _drafter(workdir: Path, uri: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args, f"workdir={workdir}", *SMALL,
                           "generate.limit=16", f"mlflow.tracking_uri={uri}", "mlflow.log_artifacts=true",
                           "mlflow.retries=2"],
                          cwd=ROOT, capture_output=True, text=True, env=base | env, timeout=900)


def _files_containing(root: Path, secret: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


@pytest.mark.slow
def test_basic_auth_server_env_credentials_work_wrong_ones_fail_and_never_leak(tmp_path: Path, tiny_kit,
                                                                              auth_server) -> None:
    server, password = auth_server
    good = {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": password}

    # wrong password, then none: stopped before any work, the user named, the password never shown
    for env, found in (({"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": "not-" + password},
                        f"user '{ADMIN}' from MLFLOW_TRACKING_USERNAME (password not shown)"),
                       ({}, "no MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the environment")):
        workdir = tmp_path / f"refused-{len(env)}"
        out = _drafter(workdir, server.uri, env, "run", "--stages", "count")
        assert out.returncode == 2, out.stderr[-3000:]
        assert "refused the credentials (UNAUTHENTICATED)" in out.stderr and found in out.stderr, out.stderr[-3000:]
        assert password not in out.stdout + out.stderr
        assert not list(workdir.glob("staging/*/*")) and not list(workdir.glob("artifacts/*"))

    # the right ones from the environment: both stages run and are logged, artifacts uploaded
    workdir = tmp_path / "ok"
    out = _drafter(workdir, server.uri, good, "run", "--stages", "count")
    assert out.returncode == 0, out.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    os.environ.update(good)
    try:
        client = MlflowClient(server.uri)
        (experiment,) = [e for e in client.search_experiments() if e.name == "stages"]
        runs = client.search_runs([experiment.experiment_id])
        assert sorted(r.data.tags["drafter.stage"] for r in runs) == ["count", "generate"]
        uploaded = [f.path for r in runs for f in client.list_artifacts(r.info.run_id)]
        assert uploaded, "log_artifacts=true uploaded nothing"
        for r in runs:  # the password is in no param or tag value
            values = [*r.data.params.values(), *r.data.tags.values(), *r.data.params, *r.data.tags]
            assert not [v for v in values if password in v]
    finally:
        for key in good:
            os.environ.pop(key, None)
    assert password not in out.stdout + out.stderr
    # nor in any file the run or the server wrote: workdir (artifacts, staging, logs, markers), the server's
    # sqlite store, uploaded artifacts and its log (its own basic_auth.ini, written by the test, is elsewhere)
    leaks = _files_containing(tmp_path, password.encode()) + _files_containing(server.root, password.encode())
    assert leaks == []
