"""MLflow tracking against a real ``mlflow server`` on 127.0.0.1: a stage run is readable through the
client; a dead server fails fast and clearly; a server that dies mid-stage loses nothing."""

import json
import os
import time
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from pipeline.config.sections import load_config
from pipeline.errors import DrafterError
from pipeline.orchestration.artifacts import artifact_id, load_artifact
from pipeline.orchestration.dag import StagePlan, spec, stage_identity
from pipeline.orchestration.stage import BuildResult, run_stage
from pipeline.orchestration.tracking import check_reachable, flatten, redact
from tests.mlflow_server import MlflowServer, free_port

FP = {"model": "tiny:test/target", "revision": "r1", "vocab_hash": "abc"}


def _cfg(tmp_path: Path, uri: str, **extra: str):
    overrides = [f"workdir={tmp_path / 'work'}", f"mlflow.tracking_uri={uri}", "mlflow.retries=2",
                 "mlflow.timeout_s=1", "mlflow.experiment=test-tracking"]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])


def _stage(cfg, calls: list, on_build=None):
    def build(run):
        calls.append(run.artifact_id)
        if on_build:
            on_build()

        def write(out: Path) -> None:
            (out / "result.json").write_text(json.dumps({"answer": 42}))

        return BuildResult(write, {"answer": 42, "rows": 3})

    row = spec("count")
    config = stage_identity(cfg, row)
    aid = artifact_id("count", config, [], FP)
    step = StagePlan(row, aid, config, FP, inputs={}, explicit=frozenset(),
                     path=cfg.workdir_path / "artifacts" / aid)
    return run_stage(cfg, step, [], build=build)


def test_stage_run_is_logged_and_read_back(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    cfg = _cfg(tmp_path, mlflow_server.uri)
    calls: list = []
    art = _stage(cfg, calls)
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name("test-tracking")
    runs = client.search_runs([exp.experiment_id], f"tags.`drafter.artifact_id` = '{art.id}'")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.metrics["answer"] == 42 and run.data.metrics["rows"] == 3
    assert run.data.params["count.draft_vocab_size"] == str(cfg.count.draft_vocab_size)
    assert run.data.tags["drafter.vocab_hash"] == "abc" and run.data.tags["drafter.stage"] == "count"
    assert run.data.tags["git.sha"]
    names = {f.path for f in client.list_artifacts(run.info.run_id, art.id)}
    assert f"{art.id}/manifest.json" in names and f"{art.id}/result.json" in names
    # rerun: a cache hit, no work, no second run
    again = _stage(cfg, calls)
    assert again.id == art.id and len(calls) == 1
    assert len(client.search_runs([exp.experiment_id], f"tags.`drafter.artifact_id` = '{art.id}'")) == 1


def test_unreachable_server_fails_fast_before_any_work(tmp_path: Path) -> None:
    uri = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(tmp_path, uri)
    calls: list = []
    start = time.monotonic()
    with pytest.raises(DrafterError, match="unreachable after 2 attempts") as err:
        _stage(cfg, calls)
    assert "MLFLOW_TRACKING_URI" in str(err.value)
    assert calls == [] and time.monotonic() - start < 30  # bounded retries, not MLflow's minutes of backoff


def test_server_dying_mid_stage_keeps_the_artifact_and_rerun_only_logs(tmp_path: Path) -> None:
    server = MlflowServer(tmp_path / "server")
    server.start()
    cfg = _cfg(tmp_path, server.uri)
    calls: list = []
    try:
        with pytest.raises(DrafterError) as err:
            _stage(cfg, calls, on_build=server.stop)
        assert "artifact is safe" in str(err.value) or "unreachable" in str(err.value)
        stored = list((tmp_path / "work" / "artifacts").glob("count-*"))
        stored = [p for p in stored if p.is_dir()]
        assert len(stored) == 1 and load_artifact(stored[0]).manifest["metrics"]["answer"] == 42
        server.start()  # same port, same store
        art = _stage(cfg, calls)
        assert len(calls) == 1, "the rerun must be a cache hit"
        runs = MlflowClient(tracking_uri=server.uri).search_runs(
            [mlflow.get_experiment_by_name("test-tracking").experiment_id],
            f"tags.`drafter.artifact_id` = '{art.id}'")
        assert len(runs) == 1
    finally:
        server.stop()


def test_local_sqlite_store_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [f"workdir={tmp_path / 'w'}", "mlflow.experiment=local"])
    art = _stage(cfg, [])
    assert (tmp_path / "w" / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("local")
    assert exp.artifact_location.startswith("file://") and str(tmp_path / "w") in exp.artifact_location
    assert len(client.search_runs([exp.experiment_id])) == 1 and art is not None


def test_helpers() -> None:
    assert redact("https://user:secret@host/x") == "https://***@host/x"
    assert flatten({"a": {"b": 1, "c": [1, 2]}}) == {"a.b": "1", "a.c": "[1, 2]"}
    check_reachable("sqlite:///x.db", load_config(None).mlflow)  # local stores need no probe


def test_a_configured_store_does_not_leak_into_the_environment(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow.set_tracking_uri exports $MLFLOW_TRACKING_URI; a later config in the same process must still
    get its own default store, not the previous config's server."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _stage(_cfg(tmp_path, f"sqlite:///{tmp_path / 'elsewhere.db'}"), [])
    assert "MLFLOW_TRACKING_URI" not in os.environ
    later = load_config(None, [f"workdir={tmp_path / 'later'}"])
    from pipeline.orchestration.tracking import tracking_uri

    assert tracking_uri(later.mlflow, later.workdir_path) == f"sqlite:///{tmp_path / 'later' / 'mlflow.db'}"
