"""The README's pull line from a fresh shell (issue 20): a new process with no MLFLOW_* variables, run from a
directory other than the store's, names the store only by its config (workdir, mlflow.tracking_uri or a --config
file); MLflow's own defaults (./mlflow.db, ./mlruns) are never opened or created there. Tampered bundles are refused
on this path too, and the line says which target was (or was not) checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint
from pipeline.registry import bundle_sha256, pull, read_bundle_json, register, registered_name
from tests.mlflow_server import MlflowServer
from tests.registry_support import make_bundle, make_components, registry_cfg, stored_copy

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tiny:test/target"


def _fresh_shell(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``drafter ARGS`` in a new process from ``cwd`` whose environment names no MLflow store."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(cwd)), "PYTHONPATH": str(ROOT)}
    if "DRAFTER_CACHE" in os.environ:  # set by the tiny_kit fixture: where tiny:test/target lives
        env["DRAFTER_CACHE"] = os.environ["DRAFTER_CACHE"]
    drafter = Path(sys.executable).with_name("drafter")
    return subprocess.run([str(drafter), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _readme_pull(cwd: Path, name: str, to: str, *store: str) -> subprocess.CompletedProcess:
    return _fresh_shell(cwd, "pull", f"{name}@champion", "--to", to, "--expect-target", TARGET, *store)


def _tamper(payload: Path) -> None:
    data = payload.read_bytes()
    payload.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))


def test_readme_pull_in_a_fresh_shell_reads_the_local_store_it_is_given(
    tmp_path: Path, tiny_kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store `make run` writes (sqlite:///<workdir>/mlflow.db, artifacts in <workdir>/mlartifacts)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    fp, name = fingerprint(TARGET), registered_name(TARGET, "draft-vocab")
    workdir = tmp_path / "clone" / "runs" / "tiny"
    components = make_components(tmp_path, fp)
    result = register(make_bundle(name, components, 2.0, fingerprint=fp), registry_cfg(None), workdir)
    config = tmp_path / "clone" / "mine.yaml"
    config.write_text(f"workdir: {workdir}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    for to, store in (("by-workdir", [f"workdir={workdir}"]),
                      ("by-uri", [f"mlflow.tracking_uri=sqlite:///{workdir / 'mlflow.db'}"]),
                      ("by-config", ["--config", str(config)])):
        done = _readme_pull(elsewhere, name, f"./{to}", *store)
        assert done.returncode == 0, f"{store}: {done.stderr}"
        assert bundle_sha256(read_bundle_json(elsewhere / to)) == result.bundle_sha256
    assert sorted(p.name for p in elsewhere.iterdir()) == ["by-config", "by-uri", "by-workdir"]

    # The tampered-bundle refusal holds on this path too: named file, both hashes, nothing written.
    stored = Path(result.source.removeprefix("file://")) / "components" / components[1].id
    _tamper(stored / "weights.safetensors")
    done = _readme_pull(elsewhere, name, "./tampered", f"workdir={workdir}")
    assert done.returncode == 2 and "weights.safetensors" in done.stderr, done.stderr
    assert components[1].manifest["files"]["weights.safetensors"]["sha256"] in done.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["by-config", "by-uri", "by-workdir"]


def test_readme_pull_in_a_fresh_shell_reads_the_server_it_is_given(
    tmp_path: Path, tiny_kit, mlflow_server: MlflowServer
) -> None:
    fp, name = fingerprint(TARGET), registered_name(TARGET, "fresh-shell")  # not the evaluate tests' name
    components = make_components(tmp_path, fp)
    result = register(make_bundle(name, components, 2.0, fingerprint=fp), registry_cfg(mlflow_server.uri), tmp_path / "work")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    done = _readme_pull(elsewhere, name, "./bundle", f"mlflow.tracking_uri={mlflow_server.uri}")
    assert done.returncode == 0, done.stderr
    assert bundle_sha256(read_bundle_json(elsewhere / "bundle")) == result.bundle_sha256
    assert f"built for your target {TARGET}" in done.stdout, done.stdout
    # Without --expect-target nothing compares the bundle with the caller's target: the line says so (it said
    # "every sha256 and fingerprint verified") and names the target the bundle was built for.
    done = _fresh_shell(elsewhere, "pull", f"{name}@champion", "--to", "./unchecked",
                        f"mlflow.tracking_uri={mlflow_server.uri}")
    assert done.returncode == 0, done.stderr
    assert f"built for target {fp['model']}" in done.stdout and "not checked against yours" in done.stdout, done.stdout
    assert "fingerprint verified" not in done.stdout

    _tamper(stored_copy(mlflow_server, result.source) / "components" / components[1].id / "weights.safetensors")
    done = _readme_pull(elsewhere, name, "./tampered", f"mlflow.tracking_uri={mlflow_server.uri}")
    assert done.returncode == 2 and "weights.safetensors" in done.stderr, done.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["bundle", "unchecked"]


def test_pull_from_a_missing_local_store_says_so_and_creates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The default workdir (runs/tiny) is relative: from another directory it names no store.
    done = _fresh_shell(elsewhere, "pull", "drafter-tiny-default-target-draft-vocab@champion", "--to", "./bundle")
    assert done.returncode == 2, done.stderr
    assert f"no MLflow store at {elsewhere / 'runs' / 'tiny' / 'mlflow.db'}" in done.stderr, done.stderr
    assert "workdir=" in done.stderr and "reachable" not in done.stderr
    assert list(elsewhere.iterdir()) == []

    monkeypatch.chdir(elsewhere)
    missing = tmp_path / "nowhere" / "mlflow.db"
    with pytest.raises(DrafterError, match=f"no MLflow store at {missing}"):
        pull("m@champion", elsewhere / "bundle", registry_cfg(f"sqlite:///{missing}"), tmp_path / "work")
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "nowhere").exists()
    assert not (tmp_path / "work").exists()
