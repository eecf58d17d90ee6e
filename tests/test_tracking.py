"""MLflow tracking against a real ``mlflow server`` on 127.0.0.1: a stage run is readable through the
client; a dead server fails fast and clearly; a server that dies mid-stage loses nothing."""

import hashlib
import json
import os
import time
from pathlib import Path

import mlflow
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from pipeline.artifacts import artifact_id, load_artifact
from pipeline.config.sections import MlflowConfig, load_config
from pipeline.errors import DrafterError, scrub
from pipeline.orchestration.dag import StagePlan, spec, stage_identity
from pipeline.orchestration.stage import BuildResult, run_stage
from pipeline.tracking import (
    HTTP_LIMIT_VARIABLES,
    check_reachable,
    flatten,
    http_limits,
    redact,
    seed_local_store,
    tracking_uri,
)
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
    assert not set(HTTP_LIMIT_VARIABLES) & set(os.environ), "MLflow's HTTP limits leaked into the environment"
    # the local record of that run damaged (a JSONDecodeError stopped every later run before), or gone (a kill after
    # the run finished, before the record was written): the finished run is found by its tag and reused
    marker = art.path.parent / f"{art.id}.mlflow_runs.json"
    for damage in (lambda: marker.write_text("{not json"), lambda: marker.write_text("[1]"), marker.unlink):
        damage()
        assert _stage(cfg, calls).id == art.id and len(calls) == 1
        assert [r.info.run_id for r in client.search_runs([exp.experiment_id],
                                                          f"tags.`drafter.artifact_id` = '{art.id}'")] == [run.info.run_id]
        assert json.loads(marker.read_text()) == {redact(mlflow_server.uri): run.info.run_id}


def test_unreachable_server_fails_fast_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded retries, not MLflow's minutes of backoff: the config's 2 probes of /health with one 0.5 s pause
    between them (every sleep in the process is recorded, none slept), then the error, before the stage's work."""
    import urllib.request

    uri = f"http://127.0.0.1:{free_port()}"
    cfg = _cfg(tmp_path, uri)
    calls: list = []
    opened: list[str] = []
    slept: list[float] = []
    real_open = urllib.request.urlopen

    def urlopen(url: str, *args: object, **kwargs: object) -> object:
        opened.append(url)
        return real_open(url, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(time, "sleep", slept.append)
    with pytest.raises(DrafterError, match="unreachable after 2 attempts") as err:
        _stage(cfg, calls)
    assert "MLFLOW_TRACKING_URI" in str(err.value)
    assert calls == [] and opened == [f"{uri}/health"] * 2 and slept == [0.5], (opened, slept)


def test_a_token_in_the_server_uri_never_reaches_an_error(tmp_path: Path, monkeypatch) -> None:
    """``https://user:TOKEN@host`` without a port: urllib reads ``TOKEN@host`` as the port and says so in its error,
    which the unreachable-server message quoted (stderr, the Slurm log, `drafter status`, the CI summary). Every
    credential (the URI's user and password, $MLFLOW_TRACKING_PASSWORD/TOKEN) is now hidden from any DrafterError,
    whichever tool's message it quotes."""
    token = "tok-" + os.urandom(8).hex()
    uri = f"http://alice:{token}@127.0.0.1"
    with pytest.raises(DrafterError, match="unreachable after 1 attempts") as err:
        check_reachable(uri, MlflowConfig(retries=1, timeout_s=1))
    assert "nonnumeric port" in str(err.value) and token not in str(err.value), str(err.value)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://bob:{token[::-1]}@mlflow.example.com/x")
    quoted = DrafterError(f"a store failed: 401 for {token}", found=f"password {token[::-1]} refused",
                          fix=f"retry https://bob:{token[::-1]}@mlflow.example.com")
    assert token not in str(quoted) and token[::-1] not in str(quoted), str(quoted)
    assert "a store failed: 401 for ***" in quoted.problem and quoted.found == "password *** refused"


def test_server_dying_mid_stage_keeps_the_artifact_and_rerun_only_logs(tmp_path: Path) -> None:
    server = MlflowServer(tmp_path / "server")
    server.start()
    cfg = _cfg(tmp_path, server.uri)
    calls: list = []
    try:
        with pytest.raises(DrafterError, match="The artifact is safe at ") as err:
            _stage(cfg, calls, on_build=server.stop)
        stored = list((tmp_path / "work" / "artifacts").glob("count-*"))
        stored = [p for p in stored if p.is_dir()]
        # whether the probe before logging or a logging call meets the dead server, the error says where the artifact is
        assert f"The artifact is safe at {stored[0]}." in str(err.value), str(err.value)
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


def _schema(uri: str) -> dict:
    """What MLflow opened at ``uri``: its tables and columns, migration head, and the default experiment it made."""
    import sqlalchemy

    client = MlflowClient(tracking_uri=uri)
    default = client.get_experiment("0")
    engine = sqlalchemy.create_engine(uri)
    try:
        inspector = sqlalchemy.inspect(engine)
        tables = {t: sorted(c["name"] for c in inspector.get_columns(t)) for t in inspector.get_table_names()}
        with engine.connect() as db:
            head = db.execute(sqlalchemy.text("select version_num from alembic_version")).scalar_one()
            experiments = db.execute(sqlalchemy.text("select count(*) from experiments")).scalar_one()
    finally:
        engine.dispose()
    return {"tables": tables, "head": head, "experiments": experiments, "default": (default.name,
            default.artifact_location.replace(str(Path(uri.removeprefix("sqlite:///")).parent), "<dir>"))}


def test_a_new_local_store_starts_from_the_empty_one_mlflow_made_once(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow ran its ~60 schema migrations in every new workdir (2-4 s of CPU each). A new sqlite store is now a
    copy of an empty store MLflow's own initialiser made once per MLflow version, under <cache>/mlflow: MLflow opens
    it as the store it would have made (the same tables, columns and migration head, and its default experiment
    with this store's artifact root). An existing store is never replaced, and an altered empty store is made again
    (its sha256 is recorded)."""
    from pipeline.tracking import seed_local_store

    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlflow-made").mkdir()
    (tmp_path / "seeded").mkdir()
    made = _schema(f"sqlite:///{tmp_path / 'mlflow-made' / 'mlflow.db'}")  # MLflow initialises it itself
    seeded_uri = f"sqlite:///{tmp_path / 'seeded' / 'mlflow.db'}"
    seed_local_store(seeded_uri)
    (record,) = (tmp_path / "cache" / "mlflow").glob("empty-*.json")
    empty = tmp_path / "cache" / "mlflow" / json.loads(record.read_text())["file"]
    assert (tmp_path / "seeded" / "mlflow.db").read_bytes() == empty.read_bytes()
    assert _schema(seeded_uri) == made and made["experiments"] == 1 and made["default"][0] == "Default"

    # a store that exists is left as it is, runs and all
    mlflow_store = tmp_path / "seeded" / "mlflow.db"
    before = mlflow_store.read_bytes()
    seed_local_store(seeded_uri)
    assert mlflow_store.read_bytes() == before != empty.read_bytes()

    # an altered empty store is made again, and the new store is MLflow's own again
    empty.write_bytes(empty.read_bytes()[:4096])
    (tmp_path / "again").mkdir()
    seed_local_store(again := f"sqlite:///{tmp_path / 'again' / 'mlflow.db'}")
    remade = tmp_path / "cache" / "mlflow" / json.loads(record.read_text())["file"]
    assert remade.stat().st_size > 4096 and _schema(again) == made

    # a stage run in a new workdir logs to a seeded store (the default <workdir>/mlflow.db)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [f"workdir={tmp_path / 'w'}", "mlflow.experiment=local"])
    assert _stage(cfg, []) is not None
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'w' / 'mlflow.db'}")
    assert len(client.search_runs([client.get_experiment_by_name("local").experiment_id])) == 1


def test_a_record_naming_a_file_outside_the_cache_never_becomes_a_new_store(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``<cache>/mlflow/empty-<version>.json`` names the empty store a new workdir's mlflow.db is copied from: a name
    there that was a path (absolute, or ``../``) was read, and copied in as the new store when its sha256 matched the
    record's. The file is the one the recorded sha256 names in that folder, as the pipeline makes them; any other
    record makes the empty store again."""
    monkeypatch.setenv("DRAFTER_CACHE", str(tmp_path / "cache"))
    outside = tmp_path / "not-in-the-cache.db"
    outside.write_bytes(b"bytes chosen by whoever wrote the record")
    record = tmp_path / "cache" / "mlflow" / f"empty-{mlflow.__version__}.json"
    record.parent.mkdir(parents=True)
    for n, name in enumerate((str(outside), "../../not-in-the-cache.db")):
        record.write_text(json.dumps({"file": name, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}))
        (tmp_path / f"w{n}").mkdir()
        seed_local_store(uri := f"sqlite:///{tmp_path / f'w{n}' / 'mlflow.db'}")
        assert (tmp_path / f"w{n}" / "mlflow.db").read_bytes() != outside.read_bytes()
        assert _schema(uri)["experiments"] == 1  # MLflow's own empty store, made again
        remade = json.loads(record.read_text())["file"]
        assert remade.startswith(f"empty-{mlflow.__version__}-") and (record.parent / remade).is_file()


def test_helpers() -> None:
    assert redact("https://user:secret@host/x") == "https://***@host/x"
    # a password holding "@": urllib splits the netloc at its last "@", so the whole of it goes
    assert redact("https://alice:s3cr3t@Pa55word@host:5000/x") == "https://***@host:5000/x"
    assert scrub("GET https://alice:s3cr3t@Pa55word@host/api failed; try http://host/x?q=a b@c") == (
        "GET https://***@host/api failed; try http://host/x?q=a b@c")
    assert flatten({"a": {"b": 1, "c": [1, 2]}}) == {"a.b": "1", "a.c": "[1, 2]"}
    assert redact("sqlite:////home/a@b/mlflow.db") == "sqlite:////home/a@b/mlflow.db"  # a path, no authority


def test_a_password_with_a_space_is_hidden_and_white_space_in_a_server_uri_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``https://alice:hunter 2@host``: the user info pattern stopped at white space, so redact() and every error
    showed that URI whole and $MLFLOW_TRACKING_URI was taken as one without credentials. The user info runs to the
    authority's last ``@`` (a URL quoted in a message is still cut at the white space after its path); the URI is
    refused as credentials, and other white space in a server URI is refused without showing the URI. A local
    store's path may hold a space."""
    uri = "https://alice:hunter 2@mlflow.example.com"
    assert redact(uri) == "https://***@mlflow.example.com"
    assert redact("https://alice:hunter\t2@host:5000/x") == "https://***@host:5000/x"
    assert scrub(f"GET {uri}/api failed; try http://host/x?q=a b@c") == (
        "GET https://***@mlflow.example.com/api failed; try http://host/x?q=a b@c")
    cfg = load_config(None, [f"workdir={tmp_path}"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(DrafterError, match=r"MLFLOW_TRACKING_URI holds credentials(.|\n)*not shown") as err:
        tracking_uri(cfg.mlflow, cfg.workdir_path)
    assert "hunter" not in str(err.value) and "alice" not in str(err.value)
    for server in ("https://tracking.corp.internal/my runs", "http://tracking.corp.internal:5000 ",
                   "https://tracking.corp.internal\n/x"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
        with pytest.raises(DrafterError, match="MLFLOW_TRACKING_URI holds white space") as err:
            tracking_uri(cfg.mlflow, cfg.workdir_path)
        assert "corp" not in str(err.value) and "MLFLOW_TRACKING_PASSWORD" in err.value.fix
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    (tmp_path / "my runs").mkdir()
    local = f"sqlite:///{tmp_path / 'my runs' / 'mlflow.db'}"
    assert tracking_uri(MlflowConfig(tracking_uri=local), tmp_path / "work") == local


@pytest.mark.parametrize("password", ["s3cr/Et+tok", "1234/secret", "pa?ss-word", "pa#ss-word"])
def test_a_password_urllib_would_cut_short_is_hidden_whole_and_refused_from_the_environment(
        password: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A password with "/", "?" or "#" in it (base64 tokens hold "/") ends the authority for urllib: the config's
    guard let it through, redact() left it whole and an error's found: line showed its first part. From
    $MLFLOW_TRACKING_URI it reached urllib as a host name, and the error said the server was unreachable."""
    uri = f"http://alice:{password}@127.0.0.1:5999"
    assert redact(f"see {uri}/x") == "see http://***@127.0.0.1:5999/x"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert str(DrafterError(f"failed: {password}", found=f"for {password}")) == "failed: ***\n  found:    for ***"
    cfg = load_config(None, [f"workdir={tmp_path}"])
    with pytest.raises(DrafterError, match=r"MLFLOW_TRACKING_URI holds credentials(.|\n)*not shown") as err:
        tracking_uri(cfg.mlflow, cfg.workdir_path)
    shown = str(err.value)
    assert all(piece not in shown for piece in (password, password[:4], password.split("/")[-1], "alice")), shown
    check_reachable("sqlite:///x.db", load_config(None).mlflow)  # local stores need no probe


def test_a_configured_store_does_not_leak_into_the_environment(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow.set_tracking_uri exports $MLFLOW_TRACKING_URI; a later config in the same process must still
    get its own default store, not the previous config's server."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _stage(_cfg(tmp_path, f"sqlite:///{tmp_path / 'elsewhere.db'}"), [])
    assert "MLFLOW_TRACKING_URI" not in os.environ
    later = load_config(None, [f"workdir={tmp_path / 'later'}"])
    assert tracking_uri(later.mlflow, later.workdir_path) == f"sqlite:///{tmp_path / 'later' / 'mlflow.db'}"


def test_http_limits_hold_only_inside_their_block_and_an_exported_value_wins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow reads its retry budget from the environment at each request: the limits come from the config
    as a value, hold for the calls made in the block, and leave the process as they found it."""
    for var in HTTP_LIMIT_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    cfg = MlflowConfig(retries=3, timeout_s=7.0)
    with http_limits(cfg):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "2"
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "14"
    assert not set(HTTP_LIMIT_VARIABLES) & set(os.environ)
    with pytest.raises(RuntimeError, match="a failed call"), http_limits(cfg):
        raise RuntimeError("a failed call")
    assert not set(HTTP_LIMIT_VARIABLES) & set(os.environ)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "9")
    with http_limits(cfg):
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "9"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "9" and "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


# --- the store is checked before any work (issue 21) ------------------------------------------------

def test_a_sqlite_store_in_a_missing_directory_is_refused_before_any_work(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "deeper" / "mlflow.db"
    cfg = _cfg(tmp_path, f"sqlite:///{missing}")
    calls: list = []
    with pytest.raises(DrafterError, match="in a directory that does not exist") as err:
        _stage(cfg, calls)
    assert err.value.expected and "mkdir -p" in err.value.fix
    assert calls == [] and not (tmp_path / "nowhere").exists()


def test_the_default_store_named_explicitly_gets_its_directory(tmp_path: Path) -> None:
    """sqlite:///<workdir>/mlflow.db is the pipeline's own location: its directory is made, as for the default."""
    workdir = tmp_path / "new" / "work"
    cfg = load_config(None, [f"workdir={workdir}", f"mlflow.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
                             "mlflow.experiment=explicit-default"])
    assert _stage(cfg, []) is not None and (workdir / "mlflow.db").is_file()


def test_a_dead_server_stops_drafter_run_before_the_kit_is_built(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit takes minutes to build on a fresh machine; a dead server must not wait for it."""
    import pipeline.tiny
    from jobs import run

    cache = tmp_path / "empty-cache"
    monkeypatch.setenv("DRAFTER_CACHE", str(cache))
    built: list[str] = []
    real_build_kit = pipeline.tiny.build_kit

    def build_kit(profile: str, *args: object, **kwargs: object) -> object:
        built.append(profile)
        raise AssertionError(f"the {profile} kit was built before the tracking store was checked")

    monkeypatch.setattr(pipeline.tiny, "build_kit", build_kit)
    for uri, message in ((f"http://127.0.0.1:{free_port()}", "unreachable after 2 attempts"),
                         (f"sqlite:///{tmp_path / 'gone' / 'mlflow.db'}", "directory that does not exist"),
                         ("htp://127.0.0.1:5000", "no store")):
        with pytest.raises(DrafterError, match=message):
            run(_cfg(tmp_path, uri), ["generate"])
    assert built == [] and not any(cache.rglob("*")), "no kit may be built or started"
    assert real_build_kit is not build_kit


@pytest.mark.parametrize(("uri", "found"), [
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://127.0.0.1:port", "Port could not be cast"),
    ("http://", "no host"),
    ("sqlite:/relative.db", "without a database file"),
    ("sqlite:///", "without a database file"),
    ("s3://bucket/mlflow", "no store"),
    ("sqlite:///x.db\n", "control character"),
    ("http://host\x08/", "control character"),  # urllib's InvalidURL
    ("http://bücher.example/\U00051903", "beyond ASCII"),  # urllib's UnicodeEncodeError
])
def test_a_malformed_tracking_uri_is_refused_naming_it(tmp_path: Path, uri: str, found: str) -> None:
    with pytest.raises(DrafterError, match="as the MLflow tracking store") as err:
        tracking_uri(MlflowConfig(tracking_uri=uri), tmp_path / "work")
    assert found in err.value.found and "mlflow.tracking_uri" in err.value.fix


# Hypothesis over tracking URIs: every one is used or refused with expected and what to do; none creates a
# file or directory anywhere (the check runs from an empty directory and looks at it afterwards).
URI_PART = st.text(st.characters(exclude_categories=()), max_size=12)
URI = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=40),
    st.tuples(st.sampled_from(["http://", "https://", "sqlite:///", "sqlite://", "sqlite:", "file://", "file:", "",
                               "databricks", "postgresql://", "s3://", "HTTP://", "mlflow-artifacts:/", "://"]),
              st.lists(st.one_of(URI_PART, st.sampled_from(["/", ":", "@", "[", "]", "?", "#", "%", "127.0.0.1",
                                                            ":5000", ":0", ":-1", ":65536", "x.db", ".."])),
                       max_size=6).map("".join)).map("".join),
)


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(URI)
@example("sqlite:///a\x00b.db")  # a NUL no path can hold
def test_any_tracking_uri_is_used_or_refused(tmp_path_factory: pytest.TempPathFactory, uri: str) -> None:
    import socket
    import urllib.parse

    from pipeline.tracking import check_store

    here = tmp_path_factory.mktemp("cwd")

    def offline(*args: object, **kwargs: object) -> None:  # urllib still parses the URL, as it would online
        raise OSError("no network in this test")

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(here)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.setattr(socket, "create_connection", offline)
        try:  # refused when the config is built (credentials in the URI) or when the store is checked
            check_store(MlflowConfig(tracking_uri=uri or None, retries=1, timeout_s=0.1), here / "work")
            # offline: a server URI is always probed, and the probe fails
            assert urllib.parse.urlsplit(uri).scheme.lower() not in ("http", "https"), "a server was not probed"
        except DrafterError as err:
            assert err.expected and err.fix, f"a DrafterError without expected/what to do:\n{err}"
    made = sorted(str(p.relative_to(here)) for p in here.rglob("*"))
    assert made in ([], ["work"]), made  # only the default store's workdir
