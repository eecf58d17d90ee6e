"""Artifacts: content ids, atomic publish, verification of hashes and fingerprints, safe formats only."""

import json
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.artifacts import (
    SCHEMA_VERSION,
    ArtifactStore,
    artifact_id,
    check_fingerprint,
    load_artifact,
    read_manifest,
    seal_manifest,
    sha256_file,
    upstream_manifests,
)
from pipeline.checksums import temp_sibling
from pipeline.errors import DrafterError
from pipeline.temporaries import FOREIGN_TMP_MAX_AGE_S, temp_owner
from tests.helpers import hand_sealed

FP = {"model": "tiny:test/target", "revision": "abc", "vocab_hash": "v1"}


def _make(store: ArtifactStore, config: dict | None = None, fingerprint: dict = FP):
    aid = artifact_id("count", config or {"k": 1}, [], fingerprint)
    writer = store.writer(aid, kind="token_counts", stage="count", config=config or {"k": 1}, inputs=[],
                          fingerprint=fingerprint)
    save_file({"counts": np.arange(10)}, str(writer.tmp / "counts.safetensors"))
    (writer.tmp / "info.json").write_text(json.dumps({"a": 1}))
    (writer.tmp / "sub").mkdir()
    (writer.tmp / "sub" / "x.txt").write_text("hello")
    return writer.commit({"tokens": 10})


def test_id_depends_on_stage_config_inputs_and_fingerprint() -> None:
    base = artifact_id("count", {"k": 1}, ["a"], FP)
    assert base == artifact_id("count", {"k": 1}, ["a"], dict(FP))
    assert base.startswith("count-")
    assert base != artifact_id("count", {"k": 2}, ["a"], FP)
    assert base != artifact_id("count", {"k": 1}, ["b"], FP)
    assert base != artifact_id("generate", {"k": 1}, ["a"], FP)
    assert base != artifact_id("count", {"k": 1}, ["a"], {**FP, "vocab_hash": "v2"})


def test_the_schema_version_is_part_of_every_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new manifest schema (SCHEMA_VERSION raised) gives every artifact a new id: otherwise a store written under
    the old schema would be found under the same ids, and its artifacts refused (or misread) instead of rebuilt."""
    import pipeline.artifacts as artifacts

    base = artifact_id("count", {"k": 1}, ["a"], FP)
    monkeypatch.setattr(artifacts, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    assert artifact_id("count", {"k": 1}, ["a"], FP) != base
    monkeypatch.setattr(artifacts, "SCHEMA_VERSION", SCHEMA_VERSION)
    assert artifact_id("count", {"k": 1}, ["a"], FP) == base


def test_write_then_load_verifies(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    art = _make(store)
    again = load_artifact(art.path, kind="token_counts", fingerprint=FP)
    assert again.id == art.id and again.metrics == {"tokens": 10}
    assert set(again.manifest["files"]) == {"counts.safetensors", "info.json", "sub/x.txt"}
    assert again.manifest["files"]["info.json"]["sha256"] == sha256_file(art.path / "info.json")
    assert store.get(art.id) is not None
    assert not list(tmp_path.glob(".tmp-*")), "temporary directory must be gone after commit"


def test_payloads_and_their_names_reach_the_disk_before_the_rename_publishes_them(tmp_path: Path, monkeypatch) -> None:
    """Only the manifest was fsynced: a crash soon after a trainer published (and dropped its checkpoints) could
    bring the artifact back with empty payloads. Every payload, every directory and the rename are flushed now,
    in that order (the real ``os.fsync``, with each call's path and each rename recorded)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:  # noqa: ANN001
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    art = _make(ArtifactStore(tmp_path))
    published = events.index(("rename", str(art.path)))
    synced = [Path(path).relative_to(tmp_path).parts for kind, path in events[:published] if kind == "fsync"]
    before = {parts[1:] for parts in synced if parts and parts[0].startswith(".tmp-")}  # in the writer's directory
    for name in ("counts.safetensors", "info.json", "sub/x.txt", "sub"):  # (the manifest: its own atomic write)
        assert tuple(Path(name).parts) in before, (name, events)
    assert () in before  # the temporary directory's own entries
    assert ("fsync", str(tmp_path)) in events[published:]  # and the store's, after the rename


def test_edited_payload_is_refused_naming_both_hashes(tmp_path: Path) -> None:
    art = _make(ArtifactStore(tmp_path))
    before = art.manifest["files"]["info.json"]["sha256"]
    (art.path / "info.json").write_text(json.dumps({"a": 2}))
    with pytest.raises(DrafterError, match="(modified|does not match its manifest|different target)") as err:
        load_artifact(art.path)
    msg = str(err.value)
    assert "info.json" in msg and before in msg and sha256_file(art.path / "info.json") in msg


def test_added_or_removed_payload_is_refused(tmp_path: Path) -> None:
    art = _make(ArtifactStore(tmp_path))
    (art.path / "extra.json").write_text("{}")
    with pytest.raises(DrafterError, match="extra.json"):
        load_artifact(art.path)
    os.remove(art.path / "extra.json")
    (art.path / "sub" / "manifest.json").write_text("{}")  # only the top-level manifest is not a payload
    with pytest.raises(DrafterError, match=r"unlisted \['sub/manifest.json'\]"):
        load_artifact(art.path)
    os.remove(art.path / "sub" / "manifest.json")
    os.remove(art.path / "sub" / "x.txt")
    with pytest.raises(DrafterError, match="missing"):
        load_artifact(art.path)


def test_fingerprint_mismatch_names_both_sides(tmp_path: Path) -> None:
    art = _make(ArtifactStore(tmp_path))
    other = {**FP, "vocab_hash": "v2"}
    with pytest.raises(DrafterError, match="(modified|does not match its manifest|different target)") as err:
        load_artifact(art.path, fingerprint=other)
    assert "vocab_hash=v2" in str(err.value) and "vocab_hash=v1" in str(err.value)
    with pytest.raises(DrafterError, match="wrong kind") as err:
        load_artifact(art.path, kind="calibration")
    assert "what to do: Pass a calibration artifact here" in str(err.value)
    check_fingerprint(art, FP, "x")  # same target: no error
    # A manifest without a fingerprint (hand-made, or written by a tool that records none) says nothing of the
    # target it was built for; it passed every check as if it matched.
    unnamed = _make(ArtifactStore(tmp_path / "unnamed"), fingerprint=None)
    with pytest.raises(DrafterError, match=r"built for a different target(.|\n)*model=None"):
        check_fingerprint(unnamed, FP, "x")


def test_pickle_payloads_are_refused_and_nothing_is_published(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    writer = store.writer("count-x", kind="k", stage="count", config={}, inputs=[], fingerprint=FP)
    (writer.tmp / "model.pkl").write_bytes(b"\x80\x04")
    with pytest.raises(DrafterError, match="safe format"):
        writer.commit()
    writer.abort()
    assert store.get("count-x") is None and not list(tmp_path.glob(".tmp-*"))


def test_a_write_whose_files_vanished_publishes_nothing(tmp_path: Path) -> None:
    """A writer's temporary directory removed while it wrote (a sweep from another container with this host name
    and its own process ids): commit hashed no files, recreated the directory for the manifest and published an
    artifact with no payload, which verified and stayed a cache hit. It is refused and nothing is published."""
    import shutil

    store = ArtifactStore(tmp_path)
    writer = store.writer("count-x", kind="k", stage="count", config={}, inputs=[], fingerprint=FP)
    (writer.tmp / "info.json").write_text("{}")
    shutil.rmtree(writer.tmp)
    with pytest.raises(DrafterError, match="has no payload to publish"):
        writer.commit()
    writer.abort()
    assert store.get("count-x") is None and not list(tmp_path.glob(".tmp-*"))


def test_a_killed_write_leaves_no_artifact_and_is_swept(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    here = socket.gethostname()
    dead = tmp_path / f".tmp-count-abc@{here}@999999999@1"  # this host, a pid that does not exist: killed
    dead.mkdir()
    (dead / "counts.safetensors").write_bytes(b"partial")
    alive = store.writer("count-def", kind="k", stage="count", config={}, inputs=[], fingerprint=FP)
    assert temp_owner(alive.tmp.name) == (here, os.getpid())
    assert store.get("count-abc") is None
    assert store.sweep() == 1 and not dead.exists() and alive.tmp.exists()  # our own live write is kept


def test_sweep_keeps_another_hosts_in_flight_write(tmp_path: Path) -> None:
    """On a shared filesystem a pid from another node means nothing here: its temp dir is swept only
    once it is older than the foreign age limit, never because the pid is not alive on this host."""
    store = ArtifactStore(tmp_path)
    theirs = tmp_path / ".tmp-count-abc@other-node-17@999999999@1"
    theirs.mkdir()
    (theirs / "counts.safetensors").write_bytes(b"being written on other-node-17")
    assert store.sweep() == 0 and theirs.exists()
    old = time.time() - FOREIGN_TMP_MAX_AGE_S - 60
    os.utime(theirs, (old, old))
    assert store.sweep() == 1 and not theirs.exists()


def test_not_an_artifact_and_corrupt_manifest(tmp_path: Path) -> None:
    """No manifest, one that is not JSON, and one that is JSON but not an object: each refused naming the
    manifest and saying to delete the directory and rerun (never a raw JSON or attribute error)."""
    with pytest.raises(DrafterError, match="no manifest.json") as err:
        load_artifact(tmp_path)
    assert f"Delete {tmp_path} and rerun" in str(err.value)
    (tmp_path / "a-file").write_text("x")
    for name, problem in (("no-such-dir", "no such directory"), ("a-file", "it is not a directory")):
        with pytest.raises(DrafterError, match=problem) as err:  # a typo, not a damaged artifact to delete
            load_artifact(tmp_path / name)
        assert "Delete" not in str(err.value) and "check the path for typos" in str(err.value)
    art = _make(ArtifactStore(tmp_path / "s"))
    manifest = art.path / "manifest.json"
    manifest.write_text("{not json")
    with pytest.raises(DrafterError, match="corrupt: it is not JSON") as err:
        load_artifact(art.path)
    assert str(manifest) in str(err.value) and f"Delete {art.path} and rerun" in str(err.value)
    manifest.write_text("[1, 2]")
    with pytest.raises(DrafterError, match="corrupt: it is not a JSON object"):
        load_artifact(art.path)


def test_edited_manifest_is_refused_naming_what_changed(tmp_path: Path) -> None:
    """Edited metrics are refused naming the manifest, the field and the fix; an edited fingerprint whose
    checksums were recomputed is still refused: the manifest's identity no longer hashes to its id."""
    art = _make(ArtifactStore(tmp_path))
    manifest = art.path / "manifest.json"
    original = json.loads(manifest.read_text())
    assert original["schema_version"] == SCHEMA_VERSION and original["manifest_sha256"]
    edited = json.loads(manifest.read_text())
    edited["metrics"]["tokens"] = 10**6
    manifest.write_text(json.dumps(edited))
    with pytest.raises(DrafterError, match="was changed after its stage wrote it: metrics changed") as err:
        load_artifact(art.path)
    assert str(manifest) in str(err.value) and f"Delete {art.path} and rerun" in str(err.value)
    resealed = seal_manifest({**original, "fingerprint": {**FP, "vocab_hash": "v2"}})
    manifest.write_text(json.dumps(resealed))
    with pytest.raises(DrafterError, match="does not match its id") as err:
        load_artifact(art.path)
    assert f"id {art.id}" in str(err.value)
    manifest.write_text(json.dumps(original, indent=4))  # the same content laid out differently is still sound
    assert load_artifact(art.path).metrics == {"tokens": 10}


def test_manifest_of_an_older_schema_is_refused(tmp_path: Path) -> None:
    """A manifest written before manifests carried their checksum (schema 1) cannot be verified: refused,
    saying to rebuild (the pipeline's own store never meets one: the schema is part of every id)."""
    art = _make(ArtifactStore(tmp_path))
    manifest = art.path / "manifest.json"
    old = {k: v for k, v in json.loads(manifest.read_text()).items()
           if k not in ("manifest_sha256", "field_sha256")}
    manifest.write_text(json.dumps({**old, "schema_version": 1}))
    with pytest.raises(DrafterError, match="schema version 1, written by an older pipeline") as err:
        load_artifact(art.path)
    assert f"Delete {art.path} and rerun" in str(err.value)


def test_store_moves_a_damaged_artifact_aside_and_rebuilds_under_its_id(tmp_path: Path) -> None:
    """The pipeline's own store never hands out a damaged entry: edited metrics, a deleted manifest, a
    directory holding another id and a changed payload are each moved to .damaged/ with a line saying what was
    wrong, and the rebuild publishes under the id again (a deleted manifest no longer blocks it)."""
    store = ArtifactStore(tmp_path)
    lines: list[str] = []
    art = _make(store)
    manifest = art.path / "manifest.json"
    edited = json.loads(manifest.read_text())
    edited["metrics"]["tokens"] = 10**6
    manifest.write_text(json.dumps(edited))
    with pytest.raises(DrafterError, match="metrics changed"):
        store.get(art.id)
    assert store.reusable(art.id, lines.append, move_aside=False) is None and art.path.is_dir() and not lines
    assert store.reusable(art.id, lines.append) is None and not art.path.exists()
    assert "damaged and will be rebuilt" in lines[-1] and "metrics changed" in lines[-1] and ".damaged" in lines[-1]
    rebuilt = _make(store)
    assert store.reusable(rebuilt.id, lines.append).metrics == {"tokens": 10}
    manifest.unlink()
    assert store.reusable(art.id, lines.append) is None and "no manifest.json" in lines[-1]
    assert _make(store).id == art.id
    other = _make(store, config={"k": 2})
    os.rename(art.path, tmp_path / "moved")
    os.rename(other.path, art.path)
    assert store.reusable(art.id, lines.append) is None and f"holds artifact {other.id}" in lines[-1]
    rebuilt = _make(store)
    (rebuilt.path / "info.json").write_text(json.dumps({"a": 2}))  # a payload changed: the same treatment
    assert store.reusable(art.id, lines.append) is None and "'info.json' of artifact" in lines[-1]
    assert len(list((tmp_path / ".damaged").iterdir())) == 4 and len(lines) == 4


def test_two_writers_of_one_file_never_share_a_temporary_file(tmp_path: Path) -> None:
    """Ranks on two nodes write the same EAGLE-3 feature rows over a shared filesystem, and in containers their pids
    can be equal: temporary names held the pid alone, so two writers could fill one temporary file together and
    rename the mix into place."""
    target = tmp_path / "000000001.safetensors"
    names = {temp_sibling(target) for _ in range(64)}  # one process, as two with the same pid would be
    assert len(names) == 64
    for name in names:
        assert name.parent == tmp_path and name.name.startswith(f".{target.name}.tmp-{socket.gethostname()}-")


def test_an_artifact_id_that_is_a_path_is_refused_before_anything_outside_is_read(tmp_path: Path) -> None:
    """A manifest whose stage, so its id, or one of its inputs was ``../../outside/x`` or an absolute path, checksums
    and id recomputed: read_manifest took it, and upstream_manifests read the manifest of the directory outside the
    store the input named (a bundle then wrote its copy there too). An id is a plain ``<stage>-<16 hex>`` now,
    checked wherever one is read, and a writer publishes none that is not."""
    store = ArtifactStore(tmp_path / "a" / "store")
    outside = hand_sealed(store.root, "../../outside/x", [], FP)
    absolute = hand_sealed(store.root, str(tmp_path / "elsewhere" / "y"), [], FP)
    assert (tmp_path / "outside").is_dir() and (tmp_path / "elsewhere").is_dir()  # what those ids name
    for bad in (outside, absolute):
        with pytest.raises(DrafterError, match=r"names an artifact by .*, which is not an artifact id") as err:
            read_manifest(store.root / bad)
        assert err.value.found == repr(bad) and "Do not edit manifests" in err.value.fix
        naming = store.root / hand_sealed(store.root, "count", [bad], FP)
        with pytest.raises(DrafterError, match=r"not an artifact id(.|\n)*Delete .* and rerun") as err:
            list(upstream_manifests(naming))
        assert str(naming / "manifest.json") in err.value.problem
        writer = store.writer(artifact_id("count", {"k": 2}, [bad], FP), kind="token_counts", stage="count",
                              config={"k": 2}, inputs=[bad], fingerprint=FP)
        (writer.tmp / "a.json").write_text("{}")
        with pytest.raises(DrafterError, match=r"not an artifact id(.|\n)*Nothing was published"):
            writer.commit()
        writer.abort()
        assert not store.path(writer.id).exists()


def test_a_symbolic_link_in_an_artifact_is_refused_when_it_is_published_or_verified(tmp_path: Path) -> None:
    """A payload written as a symbolic link to a file outside the artifact was hashed through the link, published and
    verified every time after; a payload, a folder or the manifest replaced by a link to a copy of itself (the same
    sha256) verified too. A link anywhere in an artifact is refused, naming it and where it points."""
    secret = tmp_path / "outside" / "secret.json"
    secret.parent.mkdir()
    secret.write_text('{"k": 1}')
    store = ArtifactStore(tmp_path / "store")
    writer = store.writer(artifact_id("count", {}, [], FP), kind="token_counts", stage="count", config={}, inputs=[],
                          fingerprint=FP)
    os.symlink(secret, writer.tmp / "counts.json")
    with pytest.raises(DrafterError, match=r"holds a symbolic link \(counts.json\)(.|\n)*Nothing was published") as err:
        writer.commit()
    assert err.value.found == f"counts.json -> {secret}"
    writer.abort()
    assert store.get(writer.id) is None
    art = _make(store)
    for name in ("info.json", "sub", "manifest.json"):
        original, copy = art.path / name, tmp_path / "outside" / name
        shutil.move(original, copy)
        original.symlink_to(copy)
        with pytest.raises(DrafterError, match="symbolic link") as err:
            load_artifact(art.path)
        assert name in err.value.problem and str(copy) in err.value.found and "tampered" in err.value.fix
        original.unlink()
        shutil.move(copy, original)
    assert load_artifact(art.path).id == art.id
