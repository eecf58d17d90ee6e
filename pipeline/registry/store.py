"""The registry connection shared by ``register`` and ``pull``: client, error translation, tag names.

A registry call starts with the same preflight as a stage run (bounded HTTP retries, a ``/health`` probe
with a clear error for a dead server), then talks to MLflow through one ``MlflowClient`` whose tracking
and registry URIs are the same store. Every MLflow exception is turned into a :class:`DrafterError`
that says which step failed and what state the registry was left in.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.config.sections import MlflowConfig
from pipeline.errors import DrafterError, scrub
from pipeline.progress import heartbeat
from pipeline.tracking import (
    check_reachable,
    is_remote,
    local_store_path,
    quiet_store_logs,
    redact,
    seed_local_store,
    tracking_uri,
)

# Tags written on every model version (the verdict lives on the version, per the MLOps templates).
STATUS = "drafter.status"
INCOMPLETE, READY = "incomplete", "ready"
BUNDLE_SHA = "drafter.bundle_sha256"
FINGERPRINT = "drafter.fingerprint"
PRIMARY_METRIC = "drafter.primary_metric"
METRIC_PREFIX = "drafter.metric."
MEASURED_ON = "drafter.measured_on"
"""The device a version's wall-clock metrics were measured on (absent on versions registered before 2026-11-28)."""
WALL_CLOCK_METRICS = ("speedup",)
"""Metrics timed on the device, which rank two versions only when both were measured on the same one (τ and MBSU
are counts and parameter ratios: the same on any device)."""
DECISION = "drafter.champion_decision"
"""Why alias champion moved to this version or stayed where it was (``promoted: ...`` / ``kept: ...``)."""
CANDIDATE, CHAMPION = "candidate", "champion"


def connect(cfg: MlflowConfig, workdir: Path, *, existing: bool = False) -> tuple[str, Any]:
    """Resolve the store, probe it, and return ``(uri, MlflowClient)``.

    Args:
        cfg: MLflow settings.
        workdir: Pipeline workdir (locates the default sqlite store).
        existing: The store must already exist (``pull``): a missing local store is an error instead
            of a new empty one (MLflow creates a sqlite file, and its directory, on first use).

    Raises:
        DrafterError: the tracking server does not answer within ``cfg.retries`` attempts, or
            ``existing`` is set and the local store is not there.
    """
    from mlflow import MlflowClient

    uri = tracking_uri(cfg, Path(workdir), create=not existing)
    if existing:
        _require_local_store(uri, cfg)
    quiet_store_logs()
    check_reachable(uri, cfg)
    if not existing:
        seed_local_store(uri)
    return uri, MlflowClient(tracking_uri=uri, registry_uri=uri)


def _require_local_store(uri: str, cfg: MlflowConfig) -> None:
    path = local_store_path(uri)
    if path is None or path.exists():
        return
    origin = ("mlflow.tracking_uri" if cfg.tracking_uri
              else "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI")
              else "the workdir (<workdir>/mlflow.db)")
    raise DrafterError(
        f"There is no MLflow store at {path.absolute()}.",
        expected="the store the bundle was registered in: <workdir>/mlflow.db (`make run` writes "
                 "runs/tiny/mlflow.db inside its clone) or a tracking server",
        found=f"{redact(uri)} from {origin}, which does not exist (relative paths are read from the "
              f"current directory, {Path.cwd()})",
        fix="Name the store: workdir=/path/to/clone/runs/tiny, "
            "mlflow.tracking_uri=sqlite:////path/to/clone/runs/tiny/mlflow.db or http://HOST:PORT, "
            "or export MLFLOW_TRACKING_URI; then rerun.",
    )


def error_code(err: BaseException) -> str:
    """MLflow's error code (``RESOURCE_DOES_NOT_EXIST``...), or '' for other exceptions."""
    return str(getattr(err, "error_code", "") or "")


@contextmanager
def registry_errors(uri: str, action: str, state: str = "", fix: str | None = None) -> Iterator[None]:
    """Turn any MLflow failure inside the block into a DrafterError naming ``action`` and ``state``."""
    try:
        yield
    except DrafterError:
        raise
    except Exception as err:  # noqa: BLE001 - MLflow raises many types for one cause: the store failed
        first_line = scrub((str(err).splitlines() or [""])[0], uri)[:300]
        default_fix = (
            "Check that the tracking server is running and reachable, then rerun the same command."
            if is_remote(uri)
            else "Check that the store's database and its artifact directory (<workdir>/mlartifacts for "
            "the default store) exist and are readable, then rerun the same command."
        )
        raise DrafterError(
            f"{action} in MLflow at {redact(uri)} failed: {type(err).__name__}: {first_line}.{state}",
            expected="a tracking store that answers the registry's calls",
            found=f"{type(err).__name__}: {first_line}",
            fix=fix or default_fix,
        ) from err


def version_by_alias(client: Any, name: str, alias: str) -> Any | None:
    """The model version ``alias`` points at, or None when the model or the alias does not exist."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except Exception as err:  # noqa: BLE001
        if error_code(err) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def versions_of(client: Any, name: str, where: str = "") -> list[Any]:
    """Model versions of ``name`` (those ``where``, a search clause, also holds), oldest first."""
    escaped = name.replace("'", "\\'")
    found = client.search_model_versions(f"name = '{escaped}'" + (f" and {where}" if where else ""))
    return sorted(found, key=lambda v: int(v.version))


def versions_of_bundle(client: Any, name: str, sha256: str) -> list[Any]:
    """Model versions of ``name`` already made from the bundle with this sha256, oldest first."""
    return versions_of(client, name, f"tags.`{BUNDLE_SHA}` = '{sha256}'")


def download_version(client: Any, uri: str, name: str, number: str, to: Path) -> None:
    """Download the files of ``name`` version ``number`` into the new directory ``to``, from the store ``uri``.

    Not ``download_artifacts("models:/...")``: MLflow resolves a models:/ URI through the process's default registry
    ($MLFLOW_TRACKING_URI, else ./mlflow.db), ignoring registry_uri. The client says where the version lives, and
    that location is read with the store named explicitly."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    source = client.get_model_version_download_uri(name, number)
    to.mkdir()
    with heartbeat(f"downloading {name} version {number}"):  # MLflow's own bar counts files, not bytes
        get_artifact_repository(source, tracking_uri=uri, registry_uri=uri).download_artifacts("", dst_path=str(to))
