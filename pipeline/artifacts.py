"""Artifacts: content-addressed directories with a verified manifest, written atomically.

An artifact is a directory ``<store>/<id>/`` holding payload files (safetensors, Arrow, JSON, text —
never pickle) and ``manifest.json``: kind, schema version, producing stage, resolved config, input
artifact ids, target fingerprint, and every payload file with its sha256 and size. The id is a hash of
(stage, config, input ids, fingerprint), so a rerun with unchanged inputs finds the finished directory
and does no work. Writes go to a temporary sibling directory that is renamed into place only once
complete, so a killed job never leaves a half artifact under a real id. Loading re-hashes every file and
compares fingerprints, refusing a mismatch with an error that names both sides.

The manifest verifies itself: it carries the sha256 of its own canonical JSON (and one per field, to
name what changed), and its identity fields must hash to its id (in the store, also the directory's
name). An edited, truncated or deleted manifest is refused with "delete the directory and rerun"; the
pipeline's own store (:meth:`ArtifactStore.reusable`) instead moves such a directory aside and rebuilds,
so a cache hit never uses (or logs to MLflow) edited metrics. This guards against accidents, not an
adversary: whoever can write the store can recompute the checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.checksums import (  # noqa: F401 - sha256_file and write_json_atomic re-exported for the stages
    fsync_path,
    sha256_file,
    symlinks_under,
    temp_sibling,
    write_json_atomic,
)
from pipeline.errors import DrafterError
from pipeline.progress import heartbeat
from pipeline.temporaries import FOREIGN_TMP_MAX_AGE_S, sweep_temporaries, temp_name

SCHEMA_VERSION = 2
"""2: the manifest carries ``manifest_sha256`` and ``field_sha256`` (1 had neither and is refused)."""
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest_sha256"  # sha256 of the manifest's canonical JSON without the two digest fields
FIELD_DIGESTS = "field_sha256"  # sha256 of each other field's canonical JSON: says which one was edited
DAMAGED = ".damaged"  # where the store moves a damaged artifact before rebuilding it
STALE = ".stale"  # where it moves one built from other contents of its inputs than they hold now
# Payload formats that cannot execute code when read.
SAFE_SUFFIXES = (".safetensors", ".arrow", ".parquet", ".json", ".jsonl", ".txt", ".html", ".md", ".png", ".svg")
TOKEN_MAP = "token_map.pt"
"""The one torch file a payload may be: SGLang's ``--speculative-token-map``, which SGLang reads with
``torch.load(weights_only=True)``; this project never reads it back with pickle."""


def safe_payload(rel: str) -> bool:
    """Whether payload path ``rel`` is a format that cannot execute code when read (or the SGLang token map)."""
    return rel.endswith(SAFE_SUFFIXES) or rel.rsplit("/", 1)[-1] == TOKEN_MAP


def refuse_unsafe(names: Iterable[str], what: str) -> None:
    """Raise :class:`DrafterError` naming the first of ``names`` that :func:`safe_payload` refuses."""
    unsafe = sorted(name for name in names if not safe_payload(name))
    if unsafe:
        raise DrafterError(f"Refusing {what}: {unsafe[0]!r} is not a safe format (a pickle could run code when read).",
                           expected=f"files ending in one of {SAFE_SUFFIXES}, or SGLang's {TOKEN_MAP}",
                           found=", ".join(unsafe[:5]), fix="Do not add files to artifacts or bundles by hand.")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(stage: str, config: Any, inputs: list[str], fingerprint: dict | None) -> str:
    """Deterministic id: ``<stage>-<first 16 hex of sha256(stage, config, inputs, fingerprint)>``."""
    payload = canonical_json({"stage": stage, "config": config, "inputs": sorted(inputs),
                              "fingerprint": fingerprint, "schema": SCHEMA_VERSION})
    return f"{stage}-{hashlib.sha256(payload.encode()).hexdigest()[:16]}"


ARTIFACT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*-[0-9a-f]{16}")  # what artifact_id makes: a plain name


def check_artifact_id(aid: object, where: str, fix: str) -> str:
    """``aid``, read from ``where`` (a manifest, a ``bundle.json``), unless it is no :data:`ARTIFACT_ID`: an id is
    joined to a directory (a store, a bundle's ``components/``, ``lineage/``); ``../x`` or ``/x`` would leave it."""
    if not isinstance(aid, str) or not ARTIFACT_ID.fullmatch(aid):
        raise DrafterError(f"{where} names an artifact by {str(aid)[:120]!r}, which is not an artifact id: it would "
                           "name a directory outside the one it is read in.",
                           expected="an id <stage>-<16 hex digits>, a plain directory name",
                           found=repr(aid)[:120], fix=fix)
    return aid


def refuse_symlinks(root: Path, what: str, fix: str) -> None:
    """Refuse ``root`` (an artifact, a bundle: ``what``) holding a symbolic link: hashed or copied, a link is followed
    to what it points at, anywhere."""
    if links := symlinks_under(root):
        shown = ", ".join(f"{rel} -> {os.readlink(root / rel)}" for rel in links[:5]) + " …" * (len(links) > 5)
        raise DrafterError(f"{what} holds a symbolic link ({links[0]}): it was tampered with or put together by hand, "
                           "and a link reads whatever it points at, outside it.",
                           expected="regular files and folders only", found=shown, fix=fix)


@dataclass
class Artifact:
    """A verified artifact directory and its manifest."""

    path: Path
    manifest: dict

    @property
    def id(self) -> str:
        return self.manifest["id"]

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def fingerprint(self) -> dict | None:
        return self.manifest.get("fingerprint")

    @property
    def metrics(self) -> dict:
        return self.manifest.get("metrics", {})

    def file(self, name: str) -> Path:
        if name not in self.manifest["files"]:
            raise DrafterError(f"Artifact {self.id} has no payload file {name!r}.",
                               expected=f"one of {sorted(self.manifest['files'])}")
        return self.path / name


FINGERPRINT_KEYS = ("model", "revision", "vocab_hash", "weights", "files")
"""What identifies a target: the model, its revision, its tokenizer's vocabulary, what names its weights and, for a
local directory, its other loading files (tokenizer files, chat template, generation config)."""


def fingerprint_mismatch(expected: dict | None, found: dict | None) -> list[str]:
    """Keys on which two target fingerprints disagree (model identity, tokenizer vocabulary, weights)."""
    if not expected or not found:
        return []
    return [k for k in FINGERPRINT_KEYS if expected.get(k) != found.get(k)]


def fingerprint_error(message: str, expected: dict, found: dict | None, keys: list[str], fix: str) -> DrafterError:
    """Our error for two fingerprints that differ on ``keys``, naming both sides' values."""
    found = found or {}
    return DrafterError(message, expected=", ".join(f"{k}={expected.get(k)}" for k in keys),
                        found=", ".join(f"{k}={found.get(k)}" for k in keys), fix=fix)


def check_fingerprint(artifact: Artifact, expected: dict, what: str) -> None:
    """Refuse an artifact built for another target/tokenizer than ``expected``, or for none it names (a manifest
    without a fingerprint says nothing of what it was built for)."""
    found = artifact.fingerprint
    bad = [k for k in FINGERPRINT_KEYS if k in expected] if expected and not found else \
        fingerprint_mismatch(expected, found)
    if bad:
        raise fingerprint_error(f"{what} {artifact.id} was built for a different target than this run.",
                                expected, artifact.fingerprint, bad,
                                "Rebuild it for this target (rerun its stage with this config) or point the config "
                                "at the target it was built for.")


def load_artifact(path: str | Path, *, kind: str | None = None, fingerprint: dict | None = None,
                  verify: bool = True) -> Artifact:
    """Open an artifact directory, re-hash every payload, and check kind and fingerprint.

    Raises:
        DrafterError: missing manifest, unknown schema, a payload whose sha256 changed, a missing or
            extra payload file, an unsafe payload type, or a kind/fingerprint mismatch.
    """
    path = Path(path)
    artifact = Artifact(path, read_manifest(path, kind=kind))
    if verify:
        verify_payloads(artifact)
    if fingerprint is not None:
        check_fingerprint(artifact, fingerprint, f"Artifact ({artifact.kind})")
    return artifact


def manifest_digests(manifest: dict) -> tuple[str, dict[str, str]]:
    """The sha256 of ``manifest``'s canonical JSON (its digest fields left out) and of each field's."""
    body = {k: v for k, v in manifest.items() if k not in (MANIFEST_DIGEST, FIELD_DIGESTS)}
    fields = {k: hashlib.sha256(canonical_json(v).encode()).hexdigest() for k, v in body.items()}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest(), fields


def seal_manifest(manifest: dict) -> dict:
    """``manifest`` as it will read back from JSON, with its digests added."""
    manifest = json.loads(json.dumps(manifest, default=str))
    whole, fields = manifest_digests(manifest)
    return {**manifest, MANIFEST_DIGEST: whole, FIELD_DIGESTS: fields}


def _redo(path: Path) -> str:
    return (f"Delete {path} and rerun the stage that made it (for an artifact in a workdir's own store, rerunning "
            f"its stage, `drafter <stage>`, moves the damaged directory aside and rebuilds it by itself).")


def _changed_fields(recorded: Any, found: dict[str, str]) -> str:
    """Which fields of a manifest differ from when it was written, from its per-field digests."""
    if not isinstance(recorded, dict):
        return "its content changed (its per-field checksums are damaged too)"
    changed = [f"{k} changed" for k in sorted(set(recorded) & set(found)) if recorded[k] != found[k]]
    changed += [f"{k} added" for k in sorted(set(found) - set(recorded))]
    changed += [f"{k} removed" for k in sorted(set(recorded) - set(found))]
    return ", ".join(changed) or f"its {MANIFEST_DIGEST} changed"


def read_manifest(path: str | Path, *, kind: str | None = None) -> dict:
    """The manifest of artifact directory ``path`` (payloads not re-hashed): schema, its own checksum, its id
    (recomputed from stage, config, inputs and fingerprint) and kind checked.

    Raises:
        DrafterError: no or unparsable manifest, another schema version, an edited manifest, or the wrong
            kind; each names the file and says to delete the directory and rerun its stage.
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        what = "it is not a directory" if path.exists() else "no such directory"
        raise DrafterError(f"{path} is not an artifact: {what}.", expected="an artifact directory",
                           found="a file" if path.exists() else "nothing there",
                           fix="Pass the directory a stage wrote: <workdir>/artifacts/<artifact id> (`drafter status` "
                               "lists a config's artifact ids); check the path for typos.")
    if manifest_path.is_symlink():
        raise DrafterError(f"{manifest_path} is a symbolic link: nothing in this artifact can be trusted.",
                           expected="a regular file", found=f"a link to {os.readlink(manifest_path)}",
                           fix=f"Treat the artifact as tampered with. {_redo(path)}")
    if not manifest_path.is_file():
        raise DrafterError(f"{path} is not an artifact: it has no {MANIFEST}.",
                           fix=f"Pass the directory a stage wrote (under <workdir>/artifacts/). If a stage wrote "
                               f"it and its {MANIFEST} was deleted, nothing in it can be trusted: "
                               + _redo(path))
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DrafterError(f"{manifest_path} is corrupt: it is not JSON ({err}).", fix=_redo(path)) from err
    if not isinstance(manifest, dict):
        raise DrafterError(f"{manifest_path} is corrupt: it is not a JSON object.",
                           found=type(manifest).__name__, fix=_redo(path))
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        older = isinstance(version, int) and version < SCHEMA_VERSION
        raise DrafterError(f"{manifest_path} has schema version {version}"
                           + (", written by an older pipeline without a manifest checksum." if older else "."),
                           expected=str(SCHEMA_VERSION), found=str(version),
                           fix=f"Rebuild it with this version of the pipeline: {_redo(path)}")
    whole, fields = manifest_digests(manifest)
    if manifest.get(MANIFEST_DIGEST) != whole:
        raise DrafterError(f"{manifest_path} was changed after its stage wrote it: "
                           f"{_changed_fields(manifest.get(FIELD_DIGESTS), fields)}.",
                           expected=f"{MANIFEST_DIGEST} {manifest.get(MANIFEST_DIGEST)}",
                           found=f"{MANIFEST_DIGEST} {whole}",
                           fix=f"Do not edit manifests; nothing in this artifact can be trusted. {_redo(path)}")
    for aid in [manifest.get("id"), *list(manifest.get("inputs") or [])]:
        check_artifact_id(aid, str(manifest_path), f"Do not edit manifests; nothing in this artifact can be trusted. "
                                                   f"{_redo(path)}")
    derived = artifact_id(str(manifest.get("stage")), manifest.get("config"), list(manifest.get("inputs") or []),
                          manifest.get("fingerprint"))
    if manifest.get("id") != derived:
        raise DrafterError(f"{manifest_path} does not match its id: its stage, config, inputs and fingerprint "
                           f"hash to another one (its checksum was recomputed after an edit).",
                           expected=f"id {manifest.get('id')}", found=f"id {derived}",
                           fix=f"Do not edit manifests; nothing in this artifact can be trusted. {_redo(path)}")
    if kind is not None and manifest.get("kind") != kind:
        raise DrafterError(f"Artifact {path} is of the wrong kind (made by stage {manifest.get('stage')}).",
                           expected=kind, found=manifest.get("kind"),
                           fix=f"Pass a {kind} artifact here; this option expects the directory of the stage that "
                               f"writes {kind}, not {manifest.get('stage')}'s.")
    return manifest


def stored_manifest(path: Path, artifact_id_: str) -> dict:
    """The verified manifest of store entry ``path``, which must hold artifact ``artifact_id_`` (its name)."""
    manifest = read_manifest(path)
    if manifest["id"] != artifact_id_:
        raise DrafterError(f"Store directory {path} holds artifact {manifest['id']}, not the one its name says.",
                           expected=f"id {artifact_id_}", found=f"id {manifest['id']}", fix=_redo(path))
    return manifest


LINEAGE = "lineage"
"""A bundle's folder of the manifests of what its components were built from (``lineage/<artifact id>/manifest.json``),
so that a pulled bundle still says which calibration set, and which split of it, is behind its artifacts."""


def upstream_manifests(path: Path, store: Path | None = None) -> Iterator[tuple[Path, dict]]:
    """(directory, verified manifest) of every artifact ``path`` was built from, following the manifests' inputs
    transitively, each once. An input is looked for beside ``path`` (a workdir's store, a bundle's ``lineage/``), in
    the lineage of the bundle ``path`` is a component of, then in ``store``; one whose manifest is missing or damaged
    everywhere is passed over (what it held cannot be known)."""
    seen: set[str] = set()
    todo = [(Path(path), read_manifest(path))]
    while todo:
        here, manifest = todo.pop()
        for aid in manifest.get("inputs") or []:
            if aid in seen:
                continue
            seen.add(aid)
            check_artifact_id(aid, f"{here / MANIFEST}", _redo(here))  # before it is joined to any directory
            places = [here.parent / aid, here.parent.parent / LINEAGE / aid] + ([store / aid] if store else [])
            for where in places:
                try:
                    found = stored_manifest(where, aid) if (where / MANIFEST).is_file() else None
                except DrafterError:
                    found = None
                if found is not None:
                    yield where, found
                    todo.append((where, found))
                    break


def verify_payloads(artifact: Artifact) -> None:
    """Recompute every payload's sha256 and refuse any change, addition or removal."""
    listed = artifact.manifest["files"]
    refuse_unsafe(listed, f"artifact {artifact.id} at {artifact.path}")
    refuse_symlinks(artifact.path, f"Artifact {artifact.id} at {artifact.path}",
                    f"Treat the artifact as corrupt or tampered. {_redo(artifact.path)}")
    present = {str(p.relative_to(artifact.path)) for p in artifact.path.rglob("*")
               if p.is_file() and p != artifact.path / MANIFEST}  # a manifest.json deeper down is a payload
    missing = sorted(set(listed) - present)
    extra = sorted(present - set(listed))
    if missing or extra:
        raise DrafterError(
            f"Artifact {artifact.id} at {artifact.path} does not match its manifest.",
            expected=f"exactly the {len(listed)} files listed in {MANIFEST}",
            found=(f"missing {missing} " if missing else "") + (f"unlisted {extra}" if extra else ""),
            fix=f"Do not edit artifacts in place. {_redo(artifact.path)}",
        )
    with heartbeat(f"verifying {artifact.id}"):  # gigabytes of weights or moments: a line every 30 s
        digests = {name: sha256_file(artifact.path / name) for name in listed}
    for name, meta in listed.items():
        digest = digests[name]
        if digest != meta["sha256"]:
            raise DrafterError(
                f"Payload {name!r} of artifact {artifact.id} was modified after it was written.",
                expected=f"sha256 {meta['sha256']}",
                found=f"sha256 {digest}",
                fix=f"Treat the artifact as corrupt or tampered. {_redo(artifact.path)}",
            )


def content_digest(manifest: dict) -> str:
    """An artifact's content: the sha256 of its payloads' sha256s. Its id names only what built it, and a stage
    whose work is not bit-reproducible (sampling on a GPU) can publish other bytes under the same id when rebuilt."""
    return hashlib.sha256(canonical_json(manifest["files"]).encode()).hexdigest()


def input_contents(inputs: list[Artifact]) -> dict[str, str]:
    """Each input's :func:`content_digest`, by id: what an artifact records it was built from."""
    return {a.id: content_digest(a.manifest) for a in inputs}


def stale_inputs(manifest: dict, now: dict[str, str]) -> list[str]:
    """The inputs whose content differs from what ``manifest``'s artifact was built from (an input ``now`` does not
    hold is not compared). An artifact published before 2026-11-28 records none of its inputs' contents, so none of
    them can be checked: every input of it that ``now`` holds is listed (:func:`unrecorded_inputs`)."""
    if unrecorded_inputs(manifest):
        return sorted(k for k in manifest["inputs"] if k in now)
    built_from = manifest.get("input_contents") or {}
    return sorted(k for k, digest in built_from.items() if k in now and now[k] != digest)


def unrecorded_inputs(manifest: dict) -> bool:
    """Whether ``manifest``'s artifact has inputs but records none of their contents (published before 2026-11-28)."""
    return bool(manifest.get("inputs")) and "input_contents" not in manifest


class ArtifactWriter:
    """Collects payload files in a temporary directory, then publishes them atomically under ``id``."""

    def __init__(self, store: Path, artifact_id_: str, *, kind: str, stage: str, config: Any,
                 inputs: list[str], fingerprint: dict | None, input_contents: dict[str, str] | None = None) -> None:
        self.store = Path(store)
        self.id = artifact_id_
        self.meta = {"kind": kind, "stage": stage, "config": config, "inputs": sorted(inputs),
                     "fingerprint": fingerprint,
                     **({"input_contents": input_contents} if input_contents is not None else {})}
        self.store.mkdir(parents=True, exist_ok=True)
        self.tmp = self.store / temp_name(artifact_id_)
        self.tmp.mkdir()

    def commit(self, metrics: dict | None = None, extra: dict | None = None) -> Artifact:
        """Hash the payloads, write the manifest, fsync, and rename into place."""
        refuse_symlinks(self.tmp, f"Refusing to publish artifact {self.id}: its temporary directory {self.tmp}",
                        "Write each payload into the artifact as a file of its own (copy it, or hard-link it on the "
                        "same filesystem), never as a link. Nothing was published.")
        files = {}
        for path in sorted(p for p in self.tmp.rglob("*") if p.is_file()):
            rel = str(path.relative_to(self.tmp))
            refuse_unsafe([rel], f"to store payload {rel!r}")
            files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
            fsync_path(path)  # on the disk before the rename publishes it: a crash never leaves an empty payload
        if not files:
            raise DrafterError(f"Artifact {self.id} has no payload to publish: its temporary directory {self.tmp} "
                               "holds nothing (removed while it was written?). Nothing was published.",
                               expected="the files the stage wrote", found="no files",
                               fix="Rerun the stage; if it happens again, check that no other process on another "
                                   "machine with the same host name cleans this store's temporary directories.")
        for aid in (self.id, *self.meta["inputs"]):  # never published under a manifest read_manifest refuses
            check_artifact_id(aid, f"The writer of {self.id!r}", "Pass ids artifact_id() made. Nothing was published.")
        manifest = {"id": self.id, "schema_version": SCHEMA_VERSION, **self.meta, "files": files,
                    "metrics": metrics or {}, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    **(extra or {})}
        write_json_atomic(self.tmp / MANIFEST, seal_manifest(manifest))
        for directory in (self.tmp, *(p for p in self.tmp.rglob("*") if p.is_dir())):
            fsync_path(directory)  # the payloads' names, as their bytes above
        final = self.store / self.id
        try:
            os.rename(self.tmp, final)
            fsync_path(self.store)  # the rename itself: after this, the trainers drop their checkpoints
        except OSError:
            # Another process published the same id first; ids are content hashes, so theirs is ours.
            shutil.rmtree(self.tmp, ignore_errors=True)
        return load_artifact(final)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class ArtifactStore:
    """The ``<workdir>/artifacts`` directory: lookup by id, damaged entries moved aside, and leftovers of
    killed writes swept away."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, artifact_id_: str) -> Path:
        return self.root / artifact_id_

    def get(self, artifact_id_: str, **checks: Any) -> Artifact | None:
        """The verified artifact ``artifact_id_`` (``checks`` as for :func:`load_artifact`), or None when the
        store has no directory of that name.

        Raises:
            DrafterError: the directory is there but damaged (no, a corrupt or an edited manifest, one of
                another id, a changed payload) or fails ``checks``.
        """
        path = self.path(artifact_id_)
        if not os.path.lexists(path):
            return None
        stored_manifest(path, artifact_id_)
        return load_artifact(path, **checks)

    def reusable(self, artifact_id_: str, log: Callable[[str], None], *, move_aside: bool = True,
                 inputs: dict[str, str] | None = None) -> Artifact | None:
        """The artifact ``artifact_id_`` if the store holds it sound, else None: the caller builds it.

        A damaged entry is never used: it is moved to ``<store>/.damaged/`` with a log line saying what was
        wrong and where it went, so the rebuild can publish under the id (``move_aside=False``, for a rank or a
        look before the build lock is held, leaves it where it is). Nor is one built from other contents of its
        inputs than ``inputs`` (:func:`input_contents`: an input rebuilt under its id with other bytes since):
        it is moved to ``<store>/.stale/`` the same way.
        """
        try:
            found = self.get(artifact_id_)
        except DrafterError as err:
            return self._aside(artifact_id_, DAMAGED, move_aside, log,
                               f"{artifact_id_} in the store is damaged and will be rebuilt: {err.problem}")
        if found is not None and inputs is not None and (changed := stale_inputs(found.manifest, inputs)):
            why = (f"records no contents of its inputs {', '.join(changed)} (published before 2026-11-28), so whether "
                   "they were rebuilt under the same ids since cannot be checked; it"
                   if unrecorded_inputs(found.manifest) else
                   f"was built from other contents of {', '.join(changed)} (rebuilt under the same id since) and")
            return self._aside(artifact_id_, STALE, move_aside, log,
                               f"{artifact_id_} {why} will be rebuilt from them as they are now.")
        return found

    def _aside(self, artifact_id_: str, where: str, move_aside: bool, log: Callable[[str], None],
               why: str) -> None:
        if not move_aside:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.root / where / f"{artifact_id_}-{stamp}-{uuid.uuid4().hex[:8]}"
        aside.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self.path(artifact_id_), aside)
        except FileNotFoundError:
            return None  # another process moved it first
        log(f"{why} Moved it to {aside} (delete that once inspected).")
        return None

    def writer(self, artifact_id_: str, **meta: Any) -> ArtifactWriter:
        return ArtifactWriter(self.root, artifact_id_, **meta)

    def sweep(self, foreign_max_age_s: float = FOREIGN_TMP_MAX_AGE_S) -> int:
        """Remove temporary directories of writes that never committed (a killed job's leftovers).

        On a shared filesystem other nodes write here too, and their pids mean nothing on this host:
        a temp dir of *this* host is removed when its writer's pid is dead; one of another host (or of
        unknown origin) only once it is older than ``foreign_max_age_s``.
        """
        return sweep_temporaries(self.root, ".tmp-*", foreign_max_age_s)
