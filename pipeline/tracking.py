"""MLflow tracking for stage runs: where the store is, whether it answers, and what a run records.

Each stage run becomes one MLflow run: params are the resolved config (flattened), metrics the stage's
figures, tags the artifact id, stage, target fingerprint and git sha, and the artifact directory is
logged beside them. The default store is ``sqlite:///<workdir>/mlflow.db`` with artifacts under
``<workdir>/mlartifacts``; ``MLFLOW_TRACKING_URI`` (or ``mlflow.tracking_uri``) points at a server.
The store's URI is checked when it is resolved (a malformed one, or a local store in a directory that does not
exist, is refused: MLflow would create that directory wherever it is). A server is probed before a stage starts
work, and before ``drafter run`` builds a tiny kit (bounded retries), and logging happens only after the
artifact is safely on disk: if the server dies in between, the error says so and the artifact stays,
so a rerun is a cache hit that only logs. Credentials come from the environment (MLflow reads
``MLFLOW_TRACKING_USERNAME``/``PASSWORD``/``TOKEN`` itself) and are never logged: URIs are redacted.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.artifacts import Artifact, write_json_atomic
from pipeline.cache import default_cache_dir
from pipeline.checksums import sha256_file
from pipeline.config.sections import MlflowConfig
from pipeline.errors import (  # redact: re-exported for the CLI and the registry
    DrafterError,
    redact,
    refuse_secrets_in_uri,
    scrub,
)
from pipeline.progress import heartbeat
from pipeline.runlog import flatten

LOGGED_MARKER = "mlflow_runs.json"  # beside, not inside, the artifact: the artifact stays immutable


def tracking_uri(cfg: MlflowConfig, workdir: Path, *, create: bool = True) -> str:
    """The store to use: the config's URI, else $MLFLOW_TRACKING_URI, else a sqlite file in the workdir.

    ``create=False`` is for readers (``pull``): the workdir is not made, so a wrong one stays visible.

    Raises:
        DrafterError: a URI that is malformed, names a scheme MLflow has no store for, or a local store in a
            directory that does not exist (MLflow would create it silently, wherever it is): only the
            default ``<workdir>/mlflow.db`` gets its directory made.
    """
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    default = workdir / "mlflow.db"
    if uri:
        origin = "mlflow.tracking_uri" if cfg.tracking_uri else "$MLFLOW_TRACKING_URI"
        path = _check_uri(uri, origin)
        if path is None or path.parent.is_dir():
            return uri
        # A writer would have MLflow create that directory; a reader (pull) is told there is no store there.
        if create and path.absolute() != default.absolute():
            raise DrafterError(
                f"The MLflow store {redact(uri)} ({origin}) is in a directory that does not exist: "
                f"{path.parent.absolute()}.",
                expected="a local store in an existing directory, the pipeline's own <workdir>/mlflow.db "
                         f"({default}), or a tracking server http(s)://HOST:PORT",
                found=f"{redact(uri)} from {origin} (MLflow would create that directory, wherever it is)",
                fix=f"Create the directory first (mkdir -p {path.parent}), fix the path, or drop {origin} to use "
                    "<workdir>/mlflow.db.")
    if create:
        workdir.mkdir(parents=True, exist_ok=True)
    return uri or f"sqlite:///{default}"


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_uri(uri: str, origin: str) -> Path | None:
    """Refuse a tracking URI MLflow cannot use; returns the local store's path (None for a server)."""
    def refuse(found: str) -> DrafterError:
        return DrafterError(
            f"Cannot use {redact(uri)!r} ({origin}) as the MLflow tracking store.",
            expected="http(s)://HOST[:PORT][/PATH] of a tracking server, sqlite:////absolute/path/mlflow.db "
                     "(sqlite:///relative/path.db), file:///path or a path, or a scheme an MLflow plugin provides",
            found=found,
            fix=f"Fix {origin}, or unset it to use the pipeline's <workdir>/mlflow.db.")

    # first, as the errors below show the URI: urllib would read user info as a host name and report the server
    # unreachable, and white space (a line break, a tab) can hide a password from the pattern that redacts it
    refuse_secrets_in_uri(uri, origin, "A URI is logged, printed in errors and recorded beside the runs")
    try:
        uri.encode("utf-8")
    except UnicodeEncodeError:
        raise refuse("bytes that are not UTF-8 text in the URI") from None
    if _CONTROL.search(uri):
        raise refuse(f"a control character {_CONTROL.search(uri)[0]!r} in the URI")  # type: ignore[index]
    try:
        parts = urllib.parse.urlsplit(uri)
        port = parts.port
    except ValueError as err:  # a bad IPv6 literal, a port that is not a number or beyond 65535
        raise refuse(f"{type(err).__name__}: {err}") from err
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        if not parts.hostname or port == 0:
            raise refuse("no host (or port 0) in the server URI")
        if not uri.isascii():  # urllib cannot send it (UnicodeEncodeError in the request line)
            raise refuse("characters beyond ASCII in a server URI (percent-encode them; write a host in punycode)")
        return None
    if scheme == "sqlite":
        if uri in ("sqlite://", "sqlite:///:memory:"):
            return None
        path = local_store_path(uri) if uri.startswith("sqlite:///") else None
        if path is None or not path.name or path.is_dir():
            raise refuse("a sqlite URI without a database file (sqlite:///PATH: three slashes, then the file)")
        return path
    if scheme in ("file", ""):
        path = local_store_path(uri)
        if path is None or not str(path).strip():
            raise refuse("a file store URI without a path")
        return path
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:  # MLflow moved its registry: let MLflow judge the URI itself
        return None
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception as err:  # noqa: BLE001 - MLflow's UnsupportedModelRegistryStoreURIException
        raise refuse(f"scheme {parts.scheme!r}, for which MLflow has no store ({str(err).splitlines()[0][:200]})") \
            from err
    return None


def local_store_path(uri: str) -> Path | None:
    """The file or directory a local store URI names (``sqlite:///x.db``, ``file:///dir``, a bare path);
    None for a server or an in-memory database."""
    if is_remote(uri) or uri in ("sqlite://", "sqlite:///:memory:"):
        return None
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    if uri.startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path))
    return None if "://" in uri else Path(uri)


def is_remote(uri: str) -> bool:
    return uri.lower().startswith(("http://", "https://"))  # schemes are case-insensitive (MLflow's too)


def check_reachable(uri: str, cfg: MlflowConfig, kept: Path | None = None) -> None:
    """Probe a tracking server's ``/health`` with bounded retries; raise a clear error if it is down (saying that the
    finished artifact at ``kept`` is safe, where one is)."""
    if not is_remote(uri):
        return
    last: Exception | None = None
    for attempt in range(cfg.retries):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=cfg.timeout_s) as resp:
                if resp.status == 200:
                    return _check_credentials(uri, cfg)
        # HTTPException: InvalidURL for a netloc urllib reads otherwise than urlsplit (``http://:@0``), a bad status
        # line; ValueError: a URL urllib cannot encode
        except (urllib.error.URLError, OSError, TimeoutError, ValueError, http.client.HTTPException) as err:
            last = err
        if attempt + 1 < cfg.retries:
            time.sleep(min(2.0**attempt * 0.5, 4.0))
    raise DrafterError(
        f"The MLflow tracking server at {redact(uri)} is unreachable after {cfg.retries} attempts "
        f"({type(last).__name__ if last else 'bad status'}: {scrub(str(last), uri)})."
        + ("" if kept is None else f" The artifact is safe at {kept}."),
        expected="a running `mlflow server` answering GET /health",
        fix="Start the server or fix MLFLOW_TRACKING_URI (unset it to log to the local sqlite store), "
            "then rerun: finished artifacts are reused, nothing is recomputed.",
    )


def check_store(cfg: MlflowConfig, workdir: Path, *, probe: bool = True) -> str:
    """The tracking store, checked before any work: a malformed URI or a local store in a missing directory is
    refused (:func:`tracking_uri`), a server is probed (:func:`check_reachable`) when ``probe`` is set (the
    first rank of a launch; the others would only probe it again). Returns the URI."""
    uri = tracking_uri(cfg, workdir)
    if probe:
        check_reachable(uri, cfg)
    return uri


def _check_credentials(uri: str, cfg: MlflowConfig) -> None:
    """One authenticated read (``/health`` is open even on an auth server), so refused credentials stop a run
    before its work, not at logging time. MLflow's client sends them (basic auth from
    ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, a bearer ``MLFLOW_TRACKING_TOKEN``, or an auth plugin); the
    password is never read or shown here."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        with http_limits(cfg):
            MlflowClient(uri).search_experiments(max_results=1)
    except MlflowException as err:
        code = getattr(err, "error_code", "")
        if code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return  # anything else is the logging step's to report, with the artifact kept
        user = os.environ.get("MLFLOW_TRACKING_USERNAME")
        found = (f"user {user!r} from MLFLOW_TRACKING_USERNAME (password not shown)" if user
                 else "a token from MLFLOW_TRACKING_TOKEN" if os.environ.get("MLFLOW_TRACKING_TOKEN")
                 else "no MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the environment")
        what = "refused the credentials" if code == "UNAUTHENTICATED" else "denied this user read access"
        raise DrafterError(
            f"The MLflow tracking server at {redact(uri)} {what} ({code}).",
            expected="MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD of a user of that server (or "
                     "MLFLOW_TRACKING_TOKEN) in the environment",
            found=found,
            fix="Export the right credentials (never in the config or the URI: those are logged) and rerun: "
                "finished artifacts are reused, nothing is recomputed.") from None


def git_sha() -> str:
    """The code version for tags: $DRAFTER_GIT_SHA, else ``git rev-parse HEAD`` of this checkout."""
    if sha := os.environ.get("DRAFTER_GIT_SHA"):
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def quiet_store_logs() -> None:
    """A new local store's table creation is logged at INFO: noise in a stage's log."""
    for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
        logging.getLogger(name).setLevel(logging.WARNING)


HTTP_LIMIT_VARIABLES = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")


@contextmanager
def http_limits(cfg: MlflowConfig) -> Iterator[None]:
    """MLflow's HTTP retry budget and timeout from ``cfg`` for the calls made inside the block.

    MLflow's REST client reads these two limits only from its environment variables, at each request, and
    its defaults are minutes of backoff: a dead server's error would come late. They are set for the
    block's duration and restored after it, so nothing leaks into the rest of the process or its children;
    a value the user exported wins.
    """
    wanted = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(max(cfg.retries - 1, 0)),
              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(max(cfg.timeout_s * 2, 10)))}
    mine = {var: value for var, value in wanted.items() if var not in os.environ}
    os.environ.update(mine)
    try:
        yield
    finally:
        for var, value in mine.items():
            if os.environ.get(var) == value:
                os.environ.pop(var, None)


def seed_local_store(uri: str) -> None:
    """Start a new local sqlite store as a copy of an empty one, made once per MLflow version on this machine.

    MLflow initialises a new sqlite store by running every schema migration it has (about sixty: 1.5–3.5 s of CPU in
    each new workdir). The empty store under ``<cache>/mlflow`` was initialised by MLflow's own code, holds its tables
    at its current schema and no rows, and is checked against the sha256 recorded when it was made (rebuilt if it
    differs). MLflow then opens the copy as any store of its version: its schema check, then its default
    experiment, created with this store's artifact root. The copy is linked into place, never over a store another
    process created meanwhile. A store that exists, a server or another scheme is left alone; where no empty store
    can be made (an MLflow without that initialiser, a cache that cannot be written) MLflow initialises the store.
    """
    path = local_store_path(uri) if uri.startswith("sqlite:///") else None
    if path is None or path.exists() or not path.parent.is_dir():
        return
    try:
        empty = _empty_store()
    except Exception:  # noqa: BLE001 - any failure here leaves the store to MLflow, which reports its own errors
        return
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        shutil.copyfile(empty, tmp)
        os.link(tmp, path)
    except OSError:  # created by another process meanwhile, or no hard links here: MLflow opens or initialises it
        pass
    finally:
        tmp.unlink(missing_ok=True)


def _empty_store() -> Path:
    """The empty store of this MLflow version (see :func:`seed_local_store`), made if missing or altered. Each one made
    is named by its sha256; ``empty-<version>.json`` names the current one and records that sha256."""
    # MLflow's own initialiser of a new store (it has no public one); without it, MLflow initialises each store
    import mlflow
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    folder = default_cache_dir() / "mlflow"
    record = folder / f"empty-{mlflow.__version__}.json"
    try:
        known = json.loads(record.read_text())
        digest = str(known["sha256"])
        path = folder / f"empty-{mlflow.__version__}-{digest[:16]}.db"  # as made below: the record names no path
        if (re.fullmatch("[0-9a-f]{64}", digest) and known["file"] == path.name and not path.is_symlink()
                and sha256_file(path) == digest):
            return path
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not made yet, or altered (a name or a link this code never makes): made again
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".empty-{uuid.uuid4().hex}.tmp"
    engine = sqlalchemy.create_engine(f"sqlite:///{tmp}")
    try:
        _initialize_tables(engine)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        engine.dispose()
    digest = sha256_file(tmp)
    path = folder / f"empty-{mlflow.__version__}-{digest[:16]}.db"
    os.replace(tmp, path)
    write_json_atomic(record, {"file": path.name, "sha256": digest})
    return path


def use_store(uri: str) -> None:
    """Point MLflow's fluent API at ``uri`` without touching ``$MLFLOW_TRACKING_URI`` (a new local store is seeded
    first: :func:`seed_local_store`).

    ``mlflow.set_tracking_uri`` also exports the URI to the environment (for subprocesses); this pipeline
    reads that variable as the user's choice, so a stage logged to one config's store would otherwise
    send the next config in the same process (a notebook, a test session) to it.
    """
    import mlflow

    seed_local_store(uri)
    before = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


def ensure_experiment(uri: str, name: str, workdir: Path) -> str:
    """Experiment id for ``name``, created with a local artifact root when the store is a file/sqlite."""
    import mlflow

    use_store(uri)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None if is_remote(uri) else (workdir / "mlartifacts").resolve().as_uri()
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - a concurrent creator won the race
        exp = mlflow.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


@contextmanager
def _mlflow_errors(uri: str, artifact: Artifact | None) -> Iterator[None]:
    try:
        yield
    except DrafterError:
        raise
    except Exception as err:  # noqa: BLE001 - MLflow raises many types for one cause: the store failed
        kept = f" The artifact is safe at {artifact.path}." if artifact is not None else ""
        raise DrafterError(
            f"Logging to MLflow at {redact(uri)} failed: {type(err).__name__}: "
            f"{scrub((str(err).splitlines() or [''])[0], uri)[:300]}."
            + kept,
            fix="Check the tracking server, then rerun the same command: the stage is a cache hit and "
                "only the logging is redone.",
        ) from err


def _logged_runs(artifact: Artifact) -> dict[str, str]:
    """The artifact's record of the MLflow runs holding it, by store. A damaged record (a hand edit or a broken
    copy: it is written atomically) counts as none: the stage finds its finished run by tag (:func:`_finished_run`)
    or logs one, and writes the record afresh, where a ``JSONDecodeError`` stopped this stage and every later one."""
    marker = artifact.path.parent / f"{artifact.id}.{LOGGED_MARKER}"
    try:
        runs = json.loads(marker.read_text()) if marker.is_file() else {}
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in runs.items() if isinstance(v, str)} if isinstance(runs, dict) else {}


def _finished_run(uri: str, experiment_id: str, artifact_id: str) -> str | None:
    """A finished run of ``experiment_id`` already holding ``artifact_id``: one a killed process logged in full
    before it could write the local record, or one whose record was damaged. Reused, not logged twice."""
    from mlflow.tracking import MlflowClient

    runs = MlflowClient(tracking_uri=uri).search_runs(
        [experiment_id], f"tags.`drafter.artifact_id` = '{artifact_id}' and attributes.status = 'FINISHED'",
        max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def logged_run(artifact: Artifact, uri: str) -> str | None:
    """The MLflow run id already holding this artifact in store ``uri``, if any."""
    return _logged_runs(artifact).get(redact(uri))


def log_stage_run(artifact: Artifact, cfg: MlflowConfig, workdir: Path, *, params: dict,
                  metrics: dict[str, float], tags: dict[str, str] | None = None) -> str:
    """Record a finished artifact as an MLflow run (once per store); returns the run id."""
    import mlflow

    uri = tracking_uri(cfg, workdir)
    if (run_id := logged_run(artifact, uri)) is not None:
        return run_id
    quiet_store_logs()
    check_reachable(uri, cfg, kept=artifact.path)
    fp = artifact.fingerprint or {}
    all_tags = {"drafter.artifact_id": artifact.id, "drafter.stage": artifact.manifest["stage"],
                "drafter.kind": artifact.kind, "drafter.target": str(fp.get("model")),
                "drafter.target_revision": str(fp.get("revision")), "drafter.vocab_hash": str(fp.get("vocab_hash")),
                "drafter.inputs": ",".join(artifact.manifest.get("inputs", [])), "git.sha": git_sha(),
                **(tags or {})}
    with _mlflow_errors(uri, artifact), http_limits(cfg):
        experiment_id = ensure_experiment(uri, cfg.experiment, workdir)
        run_id = _finished_run(uri, experiment_id, artifact.id)
        if run_id is None:
            # tagged from the start, so that a run a kill leaves unfinished is known for what it is (its status
            # stays RUNNING or FAILED, and the rerun logs a finished one)
            with mlflow.start_run(experiment_id=experiment_id, run_name=artifact.id, tags=all_tags) as run:
                mlflow.log_params(flatten(params))
                numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
                if numeric:
                    mlflow.log_metrics(numeric)
                if cfg.log_artifacts:
                    with heartbeat(f"uploading {artifact.id} to MLflow"):
                        mlflow.log_artifacts(str(artifact.path), artifact_path=artifact.id)
                run_id = run.info.run_id
    runs = _logged_runs(artifact)
    runs[redact(uri)] = run_id
    write_json_atomic(artifact.path.parent / f"{artifact.id}.{LOGGED_MARKER}", runs)
    return run_id
