"""The README's pull line from a fresh shell (issue 20): a new process with no MLFLOW_* variables, run from a
directory other than the store's, names the store only by its config (workdir, mlflow.tracking_uri or a --config
file); MLflow's own defaults (./mlflow.db, ./mlruns) are never opened or created there. Tampered bundles are refused
on this path too, and the line says which target was (or was not) checked. Then pull's refusals through the API
(a tampered payload, an edited or corrupt bundle.json, a garbled fingerprint tag, an unlisted file or a pickle),
verify_bundle's refusal of a component without a fingerprint or of a listed hash unlike its component's manifest, and
what a killed registration or pull leaves for the next one to remove."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.artifacts import Artifact
from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint
from pipeline.registry import bundle_sha256, pull, read_bundle_json, register, registered_name, verify_bundle
from pipeline.registry.bundle import write_bundle
from pipeline.temporaries import temp_name
from tests.helpers import hand_sealed
from tests.mlflow_server import MlflowServer
from tests.registry_support import FP, make_bundle, make_components, registry_cfg, stored_copy

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


# --- tampered bundles and killed pulls (moved from test_registry.py) -------------------------------


def _left_by_a_killed_process(parent: Path, label: str) -> Path:
    """The temporary directory a process killed (SIGKILL) while registering or pulling leaves in ``parent``."""
    code = ("import os, sys; from pathlib import Path; from pipeline.temporaries import temp_name; "
            "p = Path(sys.argv[1]) / temp_name(sys.argv[2]); p.mkdir(); (p / 'weights.safetensors').write_bytes("
            "b'0' * 4096); print(p, flush=True); os.kill(os.getpid(), 9)")
    done = subprocess.run([sys.executable, "-c", code, str(parent), label], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    left = Path(done.stdout.strip())
    assert left.is_dir()
    return left


def test_a_killed_registration_or_pull_leaves_nothing_after_the_next_one(tmp_path: Path,
                                                                         mlflow_server: MlflowServer) -> None:
    """A registration's bundle copy, its check of a stored version and a pull's download live in temporary
    directories; a kill left them in the workdir (the bundle copy holds every weight). The next registration or pull
    removes those whose process is dead, and keeps a live one's."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-leftovers", "drafter")
    workdir = tmp_path / "work"
    workdir.mkdir()
    left = [_left_by_a_killed_process(workdir, label) for label in ("bundle", "stored")]
    live = workdir / temp_name("bundle")  # this process's own: alive
    live.mkdir()
    register(make_bundle(name, make_components(tmp_path), 2.0), cfg, workdir)
    assert not any(path.exists() for path in left) and live.is_dir()
    pulled = _left_by_a_killed_process(tmp_path, "pulled.pull")
    pull(f"{name}@champion", tmp_path / "pulled", cfg, workdir)
    assert not pulled.exists() and (tmp_path / "pulled" / "bundle.json").is_file()
    assert sorted(p.name for p in tmp_path.glob(".tmp-*")) == []


def test_pull_refuses_tampering_and_leaves_nothing(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-tamper", "drafter")
    components = make_components(tmp_path)
    result = register(make_bundle(name, components, 2.0), cfg, tmp_path / "work")
    stored = stored_copy(mlflow_server, result.source)
    payload = stored / "components" / components[1].id / "weights.safetensors"
    original = payload.read_bytes()
    payload.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    to = tmp_path / "pulled"
    with pytest.raises(DrafterError, match="weights.safetensors") as err:
        pull(f"{name}@champion", to, cfg, tmp_path / "work")
    assert components[1].manifest["files"]["weights.safetensors"]["sha256"] in str(err.value)
    assert not to.exists() and list(tmp_path.glob(".tmp-*")) == []

    # bundle.json itself edited (e.g. to claim the tampered payload's hash): refused on the bundle sha.
    payload.write_bytes(original)
    registered = (stored / "bundle.json").read_text()
    document = json.loads(registered)
    document["metrics"]["tau"] = 9.0
    (stored / "bundle.json").write_text(json.dumps(document))
    with pytest.raises(DrafterError, match="bundle.json") as err:
        pull(f"{name}@champion", to, cfg, tmp_path / "work")
    assert result.bundle_sha256 in str(err.value)
    assert not to.exists()
    # ... and with the version's bundle-sha256 tag deleted as well: a missing tag is no hash to skip (read as "no
    # check", the edited metrics would pull), it is refused
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    client.delete_model_version_tag(name, str(result.version), "drafter.bundle_sha256")
    with pytest.raises(DrafterError, match="bundle.json of the bundle is not the one that was registered") as err:
        pull(f"{name}@champion", to, cfg, tmp_path / "work")
    assert err.value.expected == "bundle sha256 (missing tag)" and not to.exists()
    client.set_model_version_tag(name, str(result.version), "drafter.bundle_sha256", result.bundle_sha256)
    # a file added: refused saying what to do, and naming the version, not the deleted download folder (it had
    # neither)
    (stored / "bundle.json").write_text(registered)
    (stored / "notes.txt").write_text("added")
    with pytest.raises(DrafterError, match=r"Refusing .* version 1: The bundle does not match") as err:
        pull(f"{name}@champion", to, cfg, tmp_path / "work")
    assert "notes.txt" in err.value.found and "tampered" in err.value.fix and ".pull" not in str(err.value)
    (stored / "notes.txt").unlink()
    # bundle.json replaced by JSON that is not an object, or by bytes that are not UTF-8: refused as corrupt, where an
    # AttributeError or UnicodeDecodeError reached the user before
    for garbage in (b"[1, 2]", b"\xff\xfe{}"):
        (stored / "bundle.json").write_bytes(garbage)
        with pytest.raises(DrafterError, match="bundle.json is corrupt") as err:
            pull(f"{name}@champion", to, cfg, tmp_path / "work")
        assert "again" in err.value.fix and not to.exists()

    # the fingerprint tag garbled, emptied ("{}": JSON, but no fingerprint) or removed: refused, not read as an empty
    # fingerprint that checks nothing
    (stored / "bundle.json").write_text(registered)
    version = client.get_model_version_by_alias(name, "champion").version
    pull(f"{name}@champion", tmp_path / "intact", cfg, tmp_path / "work")  # the bundle as registered pulls
    for garble in ("{not json", "{}", None):
        if garble is None:
            client.delete_model_version_tag(name, version, "drafter.fingerprint")
        else:
            client.set_model_version_tag(name, version, "drafter.fingerprint", garble)
        with pytest.raises(DrafterError, match="drafter.fingerprint tag is not a target fingerprint"):
            pull(f"{name}@champion", to, cfg, tmp_path / "work")
        assert not to.exists()


def test_a_bundle_file_outside_its_components_is_hashed_and_a_pickle_refused(tmp_path: Path,
                                                                              mlflow_server: MlflowServer) -> None:
    """verify_bundle hashed a file under components/ only through the component it belongs to, so a listed file in a
    directory no component names was never hashed; and a listed pickle passed as long as its hash matched."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-extra", "drafter")
    result = register(make_bundle(name, make_components(tmp_path), 2.0), cfg, tmp_path / "work")
    bundle = tmp_path / "copy"
    shutil.copytree(stored_copy(mlflow_server, result.source), bundle)
    document = json.loads((bundle / "bundle.json").read_text())
    for rel, refused in (("components/unlisted/weights.safetensors", "was modified after it was registered"),
                         ("components/unlisted/model.pkl", "not a safe format")):
        extra = bundle / rel
        extra.parent.mkdir(exist_ok=True)
        extra.write_bytes(b"payload")
        listed = {**document["files"], rel: {"sha256": "0" * 64, "bytes": 7}}
        (bundle / "bundle.json").write_text(json.dumps({**document, "files": listed}))
        with pytest.raises(DrafterError, match=refused):
            verify_bundle(bundle)
        extra.unlink()


def test_a_pulled_bundle_is_on_the_disk_before_its_name_is(tmp_path: Path, mlflow_server: MlflowServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull renamed the verified download into place without one fsync: a crash soon after could leave the
    bundle's name on empty files. Every file and folder is flushed before the rename, and the destination's folder
    after it."""
    from pipeline.registry import bundle

    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-fsync", "drafter")
    register(make_bundle(name, make_components(tmp_path), 2.0), cfg, tmp_path / "work")
    flushed: list[tuple[Path, bool]] = []
    real = bundle.fsync_path
    to = tmp_path / "pulled"

    def record(path: Path) -> None:
        flushed.append((Path(path), to.exists()))
        real(path)

    monkeypatch.setattr(bundle, "fsync_path", record)
    pull(f"{name}@champion", to, cfg, tmp_path / "work")
    before = {path.name for path, renamed in flushed if not renamed}
    assert {p.name for p in to.rglob("*")} <= before and len(before) > 3
    assert flushed[-1] == (to.parent, True)


def test_a_component_id_that_is_a_path_is_refused_by_the_pull(tmp_path: Path, mlflow_server: MlflowServer) -> None:
    """verify_bundle opened ``components/<id>`` for each id bundle.json names: an absolute path (or ``../..``) there
    opened a sound artifact outside the bundle, and a pull of such a version (its bundle-sha256 tag set to match)
    verified and published a bundle holding nothing of that component. An id that is no plain
    ``<stage>-<16 hex>`` is refused before anything is opened."""
    cfg, name = registry_cfg(mlflow_server.uri), registered_name("org/target-id-path", "drafter")
    result = register(make_bundle(name, make_components(tmp_path), 2.0), cfg, tmp_path / "work")
    stored = stored_copy(mlflow_server, result.source)
    registered = json.loads((stored / "bundle.json").read_text())
    bundle = tmp_path / "copy" / "bundle"
    shutil.copytree(stored, bundle)
    # sound artifacts (no payload: nothing for bundle.json to list) where their ids say, outside the bundle
    absolute = hand_sealed(tmp_path, str(tmp_path / "elsewhere" / "evil"), [], FP, payload=False)
    relative = hand_sealed(bundle / "components", "../../outside/evil", [], FP, payload=False)
    assert Path(absolute).is_dir() and (tmp_path / "copy" / "outside" / relative.split("/")[-1]).is_dir()

    def naming(evil: str) -> dict:
        component = {"id": evil, "kind": "drafter", "stage": evil.rsplit("-", 1)[0], "fingerprint": FP}
        return {**registered, "components": [*registered["components"], component]}

    for evil in (absolute, relative):
        (bundle / "bundle.json").write_text(json.dumps(naming(evil)))
        with pytest.raises(DrafterError, match=r"bundle.json of .* names an artifact by .*, which is not an artifact"):
            verify_bundle(bundle)
    # the same through the registry, as a pull meets it
    (stored / "bundle.json").write_text(json.dumps(naming(absolute)))
    MlflowClient(tracking_uri=cfg.tracking_uri).set_model_version_tag(
        name, str(result.version), "drafter.bundle_sha256", bundle_sha256(naming(absolute)))
    to = tmp_path / "pulled"
    with pytest.raises(DrafterError, match=r"Refusing .* version 1: bundle.json of the bundle names") as err:
        pull(f"{name}@champion", to, cfg, tmp_path / "work")
    assert err.value.found == repr(absolute) and "tampered" in err.value.fix and not to.exists()


def test_a_bundle_writes_nothing_outside_itself_for_an_input_id_that_is_a_path(tmp_path: Path) -> None:
    """write_bundle copies the manifest of each artifact a component was built from to ``lineage/<its id>/``: an
    input id ``../../../outside/x`` in a component's manifest (sealed by hand) read a manifest outside the store and
    wrote its copy outside the bundle. The component's copy is refused as it is verified; nothing is written."""
    store = tmp_path / "a" / "b" / "store"
    upstream = hand_sealed(store, "../../../outside/x", [], FP)
    assert (tmp_path / "outside").is_dir()
    component = hand_sealed(store, "count", [upstream], FP)
    artifact = Artifact(store / component, json.loads((store / component / "manifest.json").read_text()))
    dest = tmp_path / "r1" / "r2" / "bundle"
    with pytest.raises(DrafterError, match=r"names an artifact by '\.\./\.\./\.\./outside/x-.*not an artifact id"):
        write_bundle(make_bundle("drafter-org-target-x", [artifact], 2.0), dest)
    assert [p for p in (tmp_path / "r1").rglob("*") if p.name != "r2"] == []


def test_a_symbolic_link_in_a_bundle_or_its_components_is_refused(tmp_path: Path) -> None:
    """A bundle file or folder replaced by a symbolic link (to a copy elsewhere, the same sha256) was followed, hashed
    and accepted by verify_bundle; a component artifact holding a link was copied into a bundle as the file it pointed
    at. Each is refused as tampering, naming the link."""
    components = make_components(tmp_path)
    bundle = write_bundle(make_bundle("drafter-org-target-links", components, 2.0), tmp_path / "bundle")
    outside = tmp_path / "outside"
    outside.mkdir()
    for rel in (f"components/{components[1].id}/weights.safetensors", f"components/{components[0].id}"):
        shutil.move(bundle / rel, outside / "moved")
        (bundle / rel).symlink_to(outside / "moved")
        with pytest.raises(DrafterError, match=rf"Bundle .* holds a symbolic link \({rel}\)") as err:
            verify_bundle(bundle)
        assert err.value.found == f"{rel} -> {outside / 'moved'}" and "tampered" in err.value.fix
        (bundle / rel).unlink()
        shutil.move(outside / "moved", bundle / rel)
    assert verify_bundle(bundle)["name"] == "drafter-org-target-links"
    info = components[0].path / "info.json"
    shutil.move(info, outside / "info.json")
    info.symlink_to(outside / "info.json")
    with pytest.raises(DrafterError, match=rf"Artifact {components[0].id} at .* holds a symbolic link \(info\.json"):
        write_bundle(make_bundle("drafter-org-target-links", components, 2.0), tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_a_bundle_replacing_an_earlier_one_is_swapped_in_one_step(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle written (or pulled) over an earlier one moved the earlier one aside, then renamed the new one in: a
    process killed between the two renames left the destination missing, its bundle hidden in ``.NAME.old-*``. The
    two now swap in one step (renameat2's exchange), so a kill at any point leaves a whole bundle there. The kill is
    a rename that fails once the earlier bundle has gone: the swap makes no rename."""
    from pipeline.registry import bundle as bundles

    dest = tmp_path / "bundle"
    write_bundle(make_bundle("drafter-x", make_components(tmp_path / "one"), 2.0), dest)
    real = os.rename

    def killed_midway(src, dst, *args, **kwargs):
        if Path(src).name.startswith(f".{dest.name}.old-"):
            return real(src, dst, *args, **kwargs)
        if Path(dst) == dest:
            raise OSError("killed between the renames")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(bundles.os, "rename", killed_midway)
    write_bundle(make_bundle("drafter-x", make_components(tmp_path / "two", seed=1), 3.0), dest)
    verify_bundle(dest)
    assert read_bundle_json(dest)["metrics"]["tau"] == 3.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "one", "two"]  # the earlier one removed


def test_a_component_without_a_target_fingerprint_is_refused(tmp_path: Path) -> None:
    """A component whose manifest records no fingerprint (a stage that stamped none, or a manifest sealed by hand)
    could be read as one that agrees with every target: registration and verification compare it with the bundle's
    fingerprint key by key, and a missing fingerprint differs on every key the bundle names."""
    from pipeline.registry.bundle import check_registrable

    bare = make_components(tmp_path / "bare", fp=None)[1]
    assert bare.fingerprint is None
    bundle = make_bundle("drafter-org-target-bare", [*make_components(tmp_path), bare], 2.0)
    with pytest.raises(DrafterError, match=rf"target fingerprint of component {bare.id} \(drafter\) does not match"):
        check_registrable(bundle)
    written = write_bundle(bundle, tmp_path / "bundle")  # a bundle written without the registration's check
    with pytest.raises(DrafterError, match=rf"target fingerprint of component {bare.id} does not match") as err:
        verify_bundle(written)
    assert "model=org/target" in err.value.expected and "model=None" in err.value.found


def test_a_payload_hash_in_bundle_json_unlike_its_components_manifest_is_refused(tmp_path: Path) -> None:
    """A component's payloads are hashed once, against the component's own manifest; bundle.json lists them too. An
    entry of bundle.json edited to another sha256 (the rest of the bundle sound, no registry tag to check the
    bundle's own hash against) must be refused, or bundle.json and what it ships disagree unseen."""
    components = make_components(tmp_path)
    bundle = write_bundle(make_bundle("drafter-org-target-listed", components, 2.0), tmp_path / "bundle")
    document = json.loads((bundle / "bundle.json").read_text())
    rel = f"components/{components[1].id}/weights.safetensors"
    real = document["files"][rel]["sha256"]
    document["files"][rel]["sha256"] = "0" * 64
    (bundle / "bundle.json").write_text(json.dumps(document))
    with pytest.raises(DrafterError, match=f"Bundle file '{rel}' disagrees with bundle.json") as err:
        verify_bundle(bundle)
    assert (err.value.expected, err.value.found) == ("sha256 " + "0" * 64, f"sha256 {real}")
