"""Gated registration and verified pulls against a real ``mlflow server`` on 127.0.0.1.

One session-scoped server holds every test's registered model (each test uses its own name); the
dead-server test starts and stops a second one. Components are small real artifacts (safetensors and
JSON payloads) written with ``ArtifactStore``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow import MlflowClient

from pipeline.artifacts import sha256_file
from pipeline.errors import DrafterError
from pipeline.registry import (
    bundle_sha256,
    parse_ref,
    pull,
    read_bundle_json,
    register,
    registered_name,
    write_bundle,
)
from tests.mlflow_server import MlflowServer
from tests.registry_support import FP, make_bundle, make_components, registry_cfg, stored_copy


def _client(server: MlflowServer) -> MlflowClient:
    return MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)


def _aliases(server: MlflowServer, name: str) -> dict[str, str]:
    return dict(_client(server).get_registered_model(name).aliases)


def test_registered_name_and_refs() -> None:
    assert registered_name("meta-llama/Llama-3.1-8B", "eagle") == "drafter-meta-llama-Llama-3.1-8B-eagle"
    assert registered_name("tiny:default/target", "count") == "drafter-tiny-default-target-count"
    long_a, long_b = registered_name("x" * 300 + "a", "k"), registered_name("x" * 300 + "b", "k")
    assert len(long_a) <= 200 and long_a != long_b
    assert parse_ref("m@champion") == ("m", "champion", None)
    assert parse_ref("models:/m/3") == ("m", None, "3")
    with pytest.raises(DrafterError, match="NAME@ALIAS"):
        parse_ref("m:3")


def test_register_moves_candidate_and_champion_by_primary_metric(
    tmp_path: Path, mlflow_server: MlflowServer, monkeypatch
) -> None:
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-aliases", "drafter")
    components = make_components(tmp_path)
    first = register(make_bundle(name, components, 2.0), cfg, tmp_path / "work")
    assert (first.version, first.aliases, first.promoted) == (1, ["candidate", "champion"], True)
    version = _client(mlflow_server).get_model_version(name, "1")
    tags = version.tags
    assert tags["drafter.status"] == "ready" and tags["drafter.bundle_sha256"] == first.bundle_sha256
    assert float(tags["drafter.metric.tau"]) == 2.0 and tags["drafter.primary_metric"] == "tau"
    assert tags["drafter.components"] == ",".join(sorted(a.id for a in components))
    assert tags["drafter.component.drafter"] in tags["drafter.components"]
    assert tags["drafter.target"] == "org/target" and tags["drafter.vocab_hash"] == FP["vocab_hash"]
    assert json.loads(tags["drafter.fingerprint"]) == FP and tags["drafter.gates.passed"] == "true"
    assert tags["git.sha"] and version.source == first.source and version.run_id == first.run_id

    worse = register(make_bundle(name, components, 1.5), cfg, tmp_path / "work")
    assert (worse.version, worse.promoted) == (2, False) and "does not beat" in worse.reason
    assert _aliases(mlflow_server, name) == {"candidate": "2", "champion": "1"}
    decisions = {v: _client(mlflow_server).get_model_version(name, v).tags["drafter.champion_decision"]
                 for v in ("1", "2")}
    assert decisions == {"1": "promoted: no champion yet",
                         "2": "kept: tau 1.5 does not beat champion version 1 (2)"}

    better = register(make_bundle(name, components, 2.5), cfg, tmp_path / "work")
    assert (better.version, better.promoted, better.aliases) == (3, True, ["candidate", "champion"])
    assert (_client(mlflow_server).get_model_version(name, "3").tags["drafter.champion_decision"]
            == "promoted: tau 2.5 beats champion version 1 (2)")

    forced = register(make_bundle(name, components, 0.5), cfg, tmp_path / "work", promote=True)
    assert forced.promoted and "forced" in forced.reason
    assert _aliases(mlflow_server, name) == {"candidate": "4", "champion": "4"}

    # Registering an already registered bundle reuses its version instead of adding a duplicate.
    again = register(make_bundle(name, components, 2.5), cfg, tmp_path / "work")
    assert (again.version, again.reused) == (3, True)
    assert len(_client(mlflow_server).search_model_versions(f"name = '{name}'")) == 4
    # ... and leaves the aliases where the forced rollback put them (it compared metrics again and took champion
    # back, and candidate with it); it moved nothing, and says so beside the decision made when the version was
    # registered (it reported promoted=True, and the evaluation's registration record a promotion, with champion at 4)
    assert _aliases(mlflow_server, name) == {"candidate": "4", "champion": "4"}
    assert (again.promoted, again.decision) == (False, "promoted: tau 2.5 beats champion version 1 (2)")
    assert "champion at version 4" in again.reason and again.aliases == []
    assert (better.decision, forced.decision.startswith("promoted: forced")) == (again.decision, True)
    # from another commit too: the bundle's sha names its content, not the code that registered it (bundle.json
    # held the git sha, so every commit registered the same artifacts as a new version)
    monkeypatch.setenv("DRAFTER_GIT_SHA", "f" * 40)
    later = register(make_bundle(name, components, 2.5), cfg, tmp_path / "work")
    assert (later.version, later.reused) == (3, True)
    assert len(_client(mlflow_server).search_model_versions(f"name = '{name}'")) == 4
    # the champion's metric tag edited in the registry to something that is not a number: kept, saying why (a
    # ValueError reached the user before)
    _client(mlflow_server).set_model_version_tag(name, "4", "drafter.metric.tau", "n/a")
    edited = register(make_bundle(name, components, 3.0), cfg, tmp_path / "work")
    assert (edited.version, edited.promoted) == (5, False)
    assert edited.reason == ("champion version 4 has no tau to compare with (its drafter.metric.tau tag reads "
                             "'n/a'); pass promote=True to replace it")


def test_a_version_that_only_ties_the_champion_does_not_take_it(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    """@champion moves only to a version that beats it: another bundle with the same primary metric (other weights,
    the same tau) becomes the candidate, and the champion stays where it was."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-tie", "drafter")
    register(make_bundle(name, make_components(tmp_path / "one"), 2.0), cfg, tmp_path / "work")
    tied = register(make_bundle(name, make_components(tmp_path / "two", seed=1), 2.0), cfg, tmp_path / "work")
    assert (tied.version, tied.reused, tied.promoted) == (2, False, False)
    assert tied.reason == "tau 2 does not beat champion version 1 (2)"
    assert _aliases(mlflow_server, name) == {"candidate": "2", "champion": "1"}


def test_champion_moves_to_a_version_built_for_the_new_weights_of_the_same_target(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    """One registered name holds one target model by name. Once that target was retrained (other weights under the
    same name), a new drafter that scored below the old champion left ``@champion`` on the drafter built for the old
    weights: a consumer pulling it without --expect-target got a drafter for another target."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-retrained", "drafter")
    first = {**FP, "weights": "sha256:" + "d" * 64}
    register(make_bundle(name, make_components(tmp_path / "old", first), 2.0, fingerprint=first), cfg, tmp_path / "work")
    retrained = {**FP, "weights": "sha256:" + "e" * 64}
    lower = register(make_bundle(name, make_components(tmp_path / "new", retrained), 1.5, fingerprint=retrained),
                     cfg, tmp_path / "work")
    assert (lower.version, lower.promoted) == (2, True)
    assert lower.reason == "champion version 1 was built for another target (weights differ): the metrics do not compare"
    assert _aliases(mlflow_server, name) == {"candidate": "2", "champion": "2"}
    same = register(make_bundle(name, make_components(tmp_path / "again", retrained, seed=1), 1.0,
                                fingerprint=retrained), cfg, tmp_path / "work")
    assert (same.promoted, same.reason) == (False, "tau 1 does not beat champion version 2 (1.5)")  # same target
    # a key the champion's tag lacks (tagged before the pipeline recorded it) is no sign of another target
    newer = {**retrained, "files": "sha256:" + "f" * 64}
    later = register(make_bundle(name, make_components(tmp_path / "later", newer, seed=2), 1.2, fingerprint=newer),
                     cfg, tmp_path / "work")
    assert (later.promoted, later.reason) == (False, "tau 1.2 does not beat champion version 2 (1.5)")
    # a drafter for the old weights again (a stale checkout, a host whose cache still resolves the old commit) is a
    # step back, not a new target: champion stays, whatever its metric; so does a rerun of version 1's registration
    stale = register(make_bundle(name, make_components(tmp_path / "stale", first, seed=3), 9.0, fingerprint=first),
                     cfg, tmp_path / "work")
    assert (stale.promoted, stale.reason) == (False, "built for the target of version 1, which champion version 2 "
                                                     "replaced (weights differ); pass promote=True to roll back")
    rerun = register(make_bundle(name, make_components(tmp_path / "old", first), 2.0, fingerprint=first), cfg,
                     tmp_path / "work")
    assert rerun.reused and rerun.version == 1
    assert _aliases(mlflow_server, name)["champion"] == "2"


def test_a_champion_ranked_on_another_devices_speed_metric_is_compared_by_tau(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    """evaluate.primary_metric=auto is the device's speed metric: MBSU on a CPU, wall-clock speedup on CUDA. A GPU
    version's speedup compared with a CPU champion's speedup tag (a CPU's wall clock, never gated) said which device
    is faster; champion then flipped with the device, not the drafter. Versions ranked by different metrics are
    compared by τ, and the decision says so."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-devices", "drafter")
    components = make_components(tmp_path)
    cpu = {"tau": 2.0, "mbsu": 1.5, "speedup": 0.6}
    register(make_bundle(name, components, 2.0, metrics=cpu, primary_metric="mbsu"), cfg, tmp_path / "work")
    gpu = register(make_bundle(name, components, 1.8, metrics={"tau": 1.8, "mbsu": 1.2, "speedup": 1.25},
                               primary_metric="speedup"), cfg, tmp_path / "work")
    assert (gpu.promoted, gpu.reason) == (False, "tau 1.8 does not beat champion version 1 (2); ranked by tau: champion "
                                                 "version 1 was ranked by mbsu, this version by speedup")
    better = register(make_bundle(name, components, 2.2, metrics={"tau": 2.2, "mbsu": 1.4, "speedup": 1.1},
                                  primary_metric="speedup"), cfg, tmp_path / "work")
    assert better.promoted and better.reason.startswith("tau 2.2 beats champion version 1 (2); ranked by tau")


def test_a_speedup_ranks_against_a_champion_only_when_both_were_timed_on_the_same_device(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    """With an explicit ``evaluate.primary_metric: speedup`` both versions are ranked by speedup, so the check above
    (different metrics) let a CPU version's wall-clock speedup be ranked against a GPU champion's. Each bundle now
    records the device its speed was timed on (``measured_on``, also the version's ``drafter.measured_on`` tag):
    a speedup ranks only against one timed on the same device, else τ decides and the decision says why."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-measured-on", "drafter")
    components = make_components(tmp_path)
    gpu = register(make_bundle(name, components, 2.0, metrics={"tau": 2.0, "speedup": 1.3}, primary_metric="speedup",
                               measured_on="NVIDIA H100 80GB HBM3"), cfg, tmp_path / "work")
    assert gpu.tags["drafter.measured_on"] == "NVIDIA H100 80GB HBM3"
    assert read_bundle_json(stored_copy(mlflow_server, gpu.source))["measured_on"] == "NVIDIA H100 80GB HBM3"
    cpu = register(make_bundle(name, components, 1.8, metrics={"tau": 1.8, "speedup": 1.6}, primary_metric="speedup",
                               measured_on="cpu (2 threads)"), cfg, tmp_path / "work")
    assert (cpu.promoted, cpu.reason) == (
        False, "tau 1.8 does not beat champion version 1 (2); ranked by tau: champion version 1's speedup was "
               "measured on NVIDIA H100 80GB HBM3, this version's on cpu (2 threads)")
    same = register(make_bundle(name, components, 1.9, metrics={"tau": 1.9, "speedup": 1.4}, primary_metric="speedup",
                                measured_on="NVIDIA H100 80GB HBM3"), cfg, tmp_path / "work")
    assert (same.promoted, same.reason) == (True, "speedup 1.4 beats champion version 1 (1.3)")
    unknown = register(make_bundle(name, components, 2.1, metrics={"tau": 2.1, "speedup": 9.0},
                                   primary_metric="speedup"), cfg, tmp_path / "work")
    assert (unknown.promoted, unknown.reason) == (
        True, "tau 2.1 beats champion version 3 (1.9); ranked by tau: champion version 3's speedup was measured on "
              "NVIDIA H100 80GB HBM3, this version's on a device it does not record")


def test_pull_round_trip_is_verified_and_identical(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-pull", "drafter")
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.json").write_text(json.dumps({"tau": 2.0}))
    (report / "index.html").write_text("<html>tau 2.0</html>")
    bundle = make_bundle(name, make_components(tmp_path), 2.0, report=report)
    result = register(bundle, cfg, tmp_path / "work")

    pulled = pull(f"{name}@champion", tmp_path / "pulled", cfg, tmp_path / "work", expect_fingerprint=FP)
    local = write_bundle(bundle, tmp_path / "local")
    document = read_bundle_json(pulled)
    assert bundle_sha256(document) == result.bundle_sha256
    assert "report/index.html" in document["files"]
    for rel in [*document["files"], "bundle.json"]:
        assert (pulled / rel).read_bytes() == (local / rel).read_bytes(), rel
    for artifact in bundle.artifacts:
        for payload in artifact.manifest["files"]:
            assert sha256_file(pulled / "components" / artifact.id / payload) == sha256_file(
                artifact.file(payload)
            )
    # A second pull over an earlier one replaces it; pulling by version number works too.
    assert (
        pull(f"{name}/{result.version}", tmp_path / "pulled", cfg, tmp_path / "work") == tmp_path / "pulled"
    )
    # ... but not one a user added files to: it was deleted whole, their files with it
    (tmp_path / "pulled" / "notes.md").write_text("my notes")
    with pytest.raises(DrafterError, match=r"files its bundle.json does not list(.|\n)*notes.md"):
        pull(f"{name}@champion", tmp_path / "pulled", cfg, tmp_path / "work")
    assert (tmp_path / "pulled" / "notes.md").read_text() == "my notes"

    plain = mlflow.artifacts.download_artifacts(
        f"models:/{name}@champion",
        dst_path=str(tmp_path / "plain"),
        tracking_uri=mlflow_server.uri,
        registry_uri=mlflow_server.uri,
    )
    assert json.loads((Path(plain) / "bundle.json").read_text()) == document


def test_a_name_holds_one_target_model_however_its_spellings_collide(tmp_path: Path,
                                                                     mlflow_server: MlflowServer) -> None:
    """`Qwen/Qwen3-8B` on the hub and a local `./Qwen/Qwen3-8B` spell the same registered name. The second target's
    bundle was registered there and, built for "another target", took @champion whatever its metric: serving
    pulled a drafter for the other model. Now it is refused before anything is written, naming both."""
    cfg = registry_cfg(mlflow_server.uri)
    hub, local = {**FP, "model": "Qwen/Qwen3-8B"}, {**FP, "model": "./Qwen/Qwen3-8B", "weights": "sha256:" + "a" * 64}
    name = registered_name(hub["model"], "collide")
    assert registered_name(local["model"], "collide") == name
    register(make_bundle(name, make_components(tmp_path / "hub", hub), 2.0, fingerprint=hub), cfg, tmp_path / "work")
    with pytest.raises(DrafterError, match=r"version 1 was built for 'Qwen/Qwen3-8B', this bundle for "
                                           r"'\./Qwen/Qwen3-8B'(.|\n)*Nothing was registered"):
        register(make_bundle(name, make_components(tmp_path / "local", local), 1.0, fingerprint=local), cfg,
                 tmp_path / "work")
    assert [v.version for v in _client(mlflow_server).search_model_versions(f"name = '{name}'")] == ["1"]
    assert _aliases(mlflow_server, name) == {"candidate": "1", "champion": "1"}


def test_pull_refuses_another_target(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-fingerprint", "drafter")
    register(make_bundle(name, make_components(tmp_path), 2.0), cfg, tmp_path / "work")
    other = {**FP, "vocab_hash": "w" * 64}
    with pytest.raises(DrafterError, match="vocab_hash") as err:
        pull(f"{name}@champion", tmp_path / "pulled", cfg, tmp_path / "work", expect_fingerprint=other)
    assert "w" * 64 in str(err.value) and "v" * 64 in str(err.value)
    assert not (tmp_path / "pulled").exists()
    with pytest.raises(DrafterError, match="no alias 'prod'"):
        pull(f"{name}@prod", tmp_path / "pulled", cfg, tmp_path / "work")


def test_pull_takes_a_hub_commit_however_its_revision_was_written(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    """A bundle built from target.revision=main, which resolved to commit C, was refused to a consumer whose serving
    pins C by its sha: the revision strings differ though the weights are the same commit."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-by-branch", "drafter")
    built = {**FP, "revision": "main", "weights": "commit:" + "c" * 40}
    register(make_bundle(name, make_components(tmp_path, built), 2.0, fingerprint=built), cfg, tmp_path / "work")
    pinned = {**built, "revision": "c" * 40}
    assert pull(f"{name}@champion", tmp_path / "pulled", cfg, tmp_path / "work", expect_fingerprint=pinned).is_dir()
    moved = {**built, "revision": "c" * 40, "weights": "commit:" + "d" * 40}  # another commit: refused
    with pytest.raises(DrafterError, match="weights"):
        pull(f"{name}@champion", tmp_path / "again", cfg, tmp_path / "work", expect_fingerprint=moved)
    assert not (tmp_path / "again").exists()


def test_failed_gates_or_mixed_targets_register_nothing(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-gates", "drafter")
    components = make_components(tmp_path)
    failed = {"passed": False, "checks": {"lossless": {"passed": True}, "speedup": {"passed": False}}}
    with pytest.raises(DrafterError, match="did not pass its gates") as err:
        register(make_bundle(name, components, 2.0, gates=failed), cfg, tmp_path / "work")
    assert "speedup" in str(err.value)
    stranger = make_components(tmp_path / "other", fp={**FP, "revision": "r2"}, seed=1)[0]
    with pytest.raises(DrafterError, match="revision=r2"):
        register(make_bundle(name, [*components, stranger], 2.0), cfg, tmp_path / "work")
    client = _client(mlflow_server)
    assert client.search_registered_models(f"name = '{name}'") == []
    assert client.search_model_versions(f"name = '{name}'") == []


def test_dead_server_fails_fast_and_registers_nothing(tmp_path: Path) -> None:
    """A second server's address while it is down: register and pull fail with a clear error. The server
    is then started on that same port and store (one start instead of start-stop-start, ~20 s saved)
    to show the registry is empty and the same call now succeeds, i.e. only the outage made it fail."""
    server = MlflowServer(tmp_path / "dead")
    cfg, name = registry_cfg(server.uri), registered_name("org/target-dead", "drafter")
    cfg.retries = 1
    bundle = make_bundle(name, make_components(tmp_path), 2.0)
    with pytest.raises(DrafterError, match="unreachable") as err:
        register(bundle, cfg, tmp_path / "work")
    assert "Start the server" in str(err.value)
    with pytest.raises(DrafterError, match="unreachable"):
        pull(f"{name}@champion", tmp_path / "pulled", cfg, tmp_path / "work")
    assert not (tmp_path / "pulled").exists()
    assert list((tmp_path / "work").glob("*")) == []  # not even a bundle was staged
    server.start()
    try:
        assert _client(server).search_registered_models() == []
        assert register(bundle, cfg, tmp_path / "work").version == 1
    finally:
        server.stop()


class _DyingClient:
    """The real MlflowClient, except that the chosen calls fail as they would when the store dies."""

    def __init__(self, client: Any, failing: dict[str, Callable[..., bool]]) -> None:
        self._client, self._failing = client, failing

    def __getattr__(self, name: str) -> Any:
        real, fails = getattr(self._client, name), self._failing.get(name)
        if fails is None:
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            if fails(*args, **kwargs):
                raise ConnectionError(f"tracking server went away during {name}")
            return real(*args, **kwargs)

        return call


@contextlib.contextmanager
def store_dies(monkeypatch: pytest.MonkeyPatch, **failing: Callable[..., bool]) -> Iterator[None]:
    """Within the block, registration talks to a store whose named client calls fail."""
    register_module = importlib.import_module("pipeline.registry.register")  # the package exports a function of that name
    real_connect = register_module.connect

    def connect(cfg: Any, workdir: Path) -> tuple[str, Any]:
        uri, client = real_connect(cfg, workdir)
        return uri, _DyingClient(client, failing)

    with monkeypatch.context() as patch:
        patch.setattr(register_module, "connect", connect)
        yield


def _marks_ready(name: str, version: str, key: str, value: str) -> bool:
    return key == "drafter.status" and value == "ready"


def _always(*_args: Any, **_kwargs: Any) -> bool:
    return True


def test_midway_failure_leaves_no_alias_and_rerun_does_not_duplicate(
    tmp_path: Path, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-midway", "drafter")
    client = _client(mlflow_server)
    components = make_components(tmp_path)
    register(make_bundle(name, components, 1.0), cfg, tmp_path / "work")  # v1: champion to protect
    better = make_bundle(name, components, 3.0)

    # Failure after tags, cleanup succeeds: the half-made version is gone, aliases untouched.
    with pytest.raises(DrafterError, match="was deleted"):
        with store_dies(monkeypatch, set_model_version_tag=_marks_ready):
            register(better, cfg, tmp_path / "work")
    assert _aliases(mlflow_server, name) == {"candidate": "1", "champion": "1"}
    assert [v.version for v in client.search_model_versions(f"name = '{name}'")] == ["1"]

    # Failure after tags and the delete fails too: an incomplete version without aliases, not pullable.
    with pytest.raises(DrafterError, match="left tagged drafter.status=incomplete"):
        with store_dies(monkeypatch, set_model_version_tag=_marks_ready, delete_model_version=_always):
            register(better, cfg, tmp_path / "work")
    half = max(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    assert (
        half.tags["drafter.status"] == "incomplete"
        and half.version not in _aliases(mlflow_server, name).values()
    )
    with pytest.raises(DrafterError, match="not a finished registration"):
        pull(f"{name}/{half.version}", tmp_path / "pulled", cfg, tmp_path / "work")
    client.delete_model_version_tag(name, half.version, "drafter.metric.tau")  # as if tagging died too

    # The rerun finishes that same version and moves the aliases.
    done = register(better, cfg, tmp_path / "work")
    assert (done.version, done.reused, done.promoted) == (int(half.version), True, True)
    sha_versions = client.search_model_versions(
        f"name = '{name}' and tags.`drafter.bundle_sha256` = '{done.bundle_sha256}'"
    )
    assert [v.version for v in sha_versions] == [half.version]
    finished = client.get_model_version(name, half.version).tags
    assert finished["drafter.status"] == "ready" and float(finished["drafter.metric.tau"]) == 3.0
    assert _aliases(mlflow_server, name) == {"candidate": half.version, "champion": half.version}

    # A failure after the version is complete but before aliases: kept, reused by the rerun.
    newer = make_bundle(name, components, 4.0)
    with pytest.raises(DrafterError, match="may not point at it"):
        with store_dies(monkeypatch, set_registered_model_alias=_always):
            register(newer, cfg, tmp_path / "work")
    assert _aliases(mlflow_server, name)["candidate"] == half.version
    rerun = register(newer, cfg, tmp_path / "work")
    assert rerun.reused and rerun.aliases == ["candidate", "champion"]
    assert len(client.search_model_versions(f"name = '{name}'")) == 3

    # An incomplete version whose stored copy lost a file since: the rerun does not finish it (it was flipped to
    # ready unchecked, and @champion pointed at a bundle no pull could verify); it is deleted and a new one made.
    newest = make_bundle(name, components, 5.0)
    with pytest.raises(DrafterError, match="left tagged drafter.status=incomplete"):
        with store_dies(monkeypatch, set_model_version_tag=_marks_ready, delete_model_version=_always):
            register(newest, cfg, tmp_path / "work")
    broken = max(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version))
    stored = stored_copy(mlflow_server, broken.source)
    next(p for p in sorted(stored.rglob("*.safetensors"))).unlink()
    replaced = register(newest, cfg, tmp_path / "work")
    assert not replaced.reused and replaced.version == int(broken.version) + 1
    assert broken.version not in [v.version for v in client.search_model_versions(f"name = '{name}'")]
    assert replaced.aliases == ["candidate", "champion"]
    pull(f"{name}@champion", tmp_path / "newest", cfg, tmp_path / "work")  # the replacement verifies


def test_local_sqlite_store_without_a_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded default (``sqlite:///<workdir>/mlflow.db``, local artifacts) registers and pulls too."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg, name = registry_cfg(None), registered_name("org/target-local", "drafter")
    result = register(make_bundle(name, make_components(tmp_path), 2.0), cfg, tmp_path / "work")
    assert result.aliases == ["candidate", "champion"] and (tmp_path / "work" / "mlflow.db").is_file()
    pulled = pull(f"{name}@champion", tmp_path / "pulled", cfg, tmp_path / "work", expect_fingerprint=FP)
    assert bundle_sha256(read_bundle_json(pulled)) == result.bundle_sha256
