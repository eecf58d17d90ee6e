"""Bundles: the set of verified artifacts one registered model version holds, and its ``bundle.json``.

A bundle directory is ``bundle.json`` (name, metrics, gate verdict, target fingerprint, component ids,
the sha256 of every other file) beside ``components/<artifact id>/`` (each a copy of an artifact with its own
manifest), ``lineage/<artifact id>/manifest.json`` (the manifests, payloads left out, of the artifacts the
components were built from: the calibration set, its source and split) and an optional ``report/``. The bundle's
sha256 is the hash of ``bundle.json``'s canonical JSON; since that lists every file's sha256 it names the content
exactly, carries no timestamp and no commit (the version's ``git.sha`` tag names the registering one), and so lets
a rerun of ``register`` recognise a version it already made, from any commit. :func:`verify_bundle` is the check a
consumer runs on a downloaded bundle: every file, every component manifest, every fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifacts import (
    FINGERPRINT_KEYS,
    LINEAGE,
    MANIFEST,
    Artifact,
    canonical_json,
    check_artifact_id,
    fingerprint_error,
    fingerprint_mismatch,
    fsync_path,
    load_artifact,
    refuse_symlinks,
    refuse_unsafe,
    sha256_file,
    upstream_manifests,
    write_json_atomic,
)
from pipeline.checksums import exchange_paths
from pipeline.errors import DrafterError

BUNDLE_JSON = "bundle.json"
BUNDLE_FORMAT = "drafter-bundle"
BUNDLE_SCHEMA = 1
TAMPERED = "Treat the registry copy as tampered with; re-register the bundle."
_MAX_NAME = 200  # far below MLflow's limits, short enough to type after `drafter pull`


@dataclass
class Bundle:
    """What the evaluate stage hands to :func:`pipeline.registry.register`."""

    name: str
    """Registered model name (see :func:`registered_name`)."""
    artifacts: list[Artifact]
    """Component artifacts (each with its own manifest and payload sha256s)."""
    metrics: dict[str, float]
    """Evaluation figures, e.g. ``{"tau": 2.1, "speedup": 1.3, "acceptance_rate": 0.6}``."""
    primary_metric: str
    """The metric the champion comparison uses; higher is better."""
    gates: dict
    """The gate verdict ``{"passed": bool, "checks": {...}}``, recorded on the model version."""
    fingerprint: dict
    """The target fingerprint every component must share."""
    report: Path | None = None
    """Optional report directory (JSON/HTML) shipped inside the bundle under ``report/``."""
    measured_on: str | None = None
    """The device the wall-clock metrics were measured on (``NVIDIA H100 80GB HBM3``, ``cpu (2 threads)``): a
    speedup ranks against a champion's only when both were measured on the same device."""

    def __post_init__(self) -> None:
        if not self.artifacts:
            raise DrafterError(
                f"Bundle {self.name!r} has no component artifacts.", expected="at least one verified artifact"
            )
        ids = [a.id for a in self.artifacts]
        if len(set(ids)) != len(ids):
            raise DrafterError(f"Bundle {self.name!r} lists an artifact twice.", found=", ".join(sorted(ids)))
        if self.primary_metric not in self.metrics:
            raise DrafterError(
                f"Bundle {self.name!r} has no value for its primary metric.",
                expected=f"{self.primary_metric!r} among the metrics",
                found=", ".join(sorted(self.metrics)) or "no metrics",
            )
        bad = [k for k, v in self.metrics.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise DrafterError(
                f"Bundle {self.name!r} has non-numeric metrics.",
                expected="numbers",
                found=", ".join(f"{k}={self.metrics[k]!r}" for k in bad),
            )


def registered_name(target_model: str, kind: str) -> str:
    """The registered model name for a target and an artifact kind, e.g. ``drafter-org-model-eagle``.

    MLflow forbids ``/`` and ``:`` in names and ``@`` would clash with alias refs, so anything but
    letters, digits, ``.``, ``_`` and ``-`` becomes ``-``. A name longer than 200 characters is cut
    and suffixed with a hash of the full target so two long targets never share a name.

    Raises:
        DrafterError: the target or kind has no usable characters.
    """
    slug, kind_slug = (re.sub(r"[^A-Za-z0-9._-]+", "-", s).strip("-.") for s in (target_model, kind))
    if not slug or not kind_slug:
        raise DrafterError(
            "Cannot build a registered model name.",
            expected="a target model and kind with letters or digits",
            found=f"target={target_model!r}, kind={kind!r}",
        )
    name = f"drafter-{slug}-{kind_slug}"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(target_model.encode()).hexdigest()[:10]
        keep = _MAX_NAME - len(kind_slug) - len(digest) - len("drafter---")
        name = f"drafter-{slug[:keep]}-{digest}-{kind_slug}"
    return name


def bundle_sha256(document: dict) -> str:
    """The bundle's identity: sha256 of its ``bundle.json`` content in canonical JSON."""
    return hashlib.sha256(canonical_json(document).encode()).hexdigest()


def write_bundle(bundle: Bundle, directory: Path) -> Path:
    """Copy the components (and report) into ``directory`` with a ``bundle.json``, atomically.

    The copy is re-verified against each component's manifest, so a payload changed since its stage
    wrote it is refused here rather than registered. ``directory`` is replaced if it holds an older
    bundle; any other non-empty directory is refused.

    Returns:
        ``directory``.

    Raises:
        DrafterError: a component fails verification or a report file is not a safe format.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        files: dict[str, dict] = {}
        components = []
        for artifact in sorted(bundle.artifacts, key=lambda a: a.id):
            dest = tmp / "components" / check_artifact_id(artifact.id, f"Artifact {artifact.path}", _rebuild(artifact))
            refuse_symlinks(artifact.path, f"Artifact {artifact.id} at {artifact.path}", _rebuild(artifact))
            shutil.copytree(artifact.path, dest, symlinks=True)  # a link made since is copied as one, then refused
            # Verifying the copy proves source and copy both match the manifest: one hashing pass.
            copy = load_artifact(dest, verify=True)
            for name, meta in copy.manifest["files"].items():
                files[f"components/{artifact.id}/{name}"] = {"sha256": meta["sha256"], "bytes": meta["bytes"]}
            files[f"components/{artifact.id}/{MANIFEST}"] = _file_entry(dest / MANIFEST)
            components.append(
                {
                    "id": copy.id,
                    "kind": copy.kind,
                    "stage": copy.manifest.get("stage"),
                    "fingerprint": copy.fingerprint,
                }
            )
        ids = {a.id for a in bundle.artifacts}
        for artifact in sorted(bundle.artifacts, key=lambda a: a.id):
            for where, manifest in upstream_manifests(artifact.path):
                if manifest["id"] in ids:
                    continue
                ids.add(manifest["id"])
                dest = tmp / LINEAGE / check_artifact_id(manifest["id"], f"{where / MANIFEST}", _rebuild(artifact))
                dest = dest / MANIFEST
                dest.parent.mkdir(parents=True)
                shutil.copyfile(where / MANIFEST, dest)
                files[dest.relative_to(tmp).as_posix()] = _file_entry(dest)
        if bundle.report is not None:
            refuse_symlinks(Path(bundle.report), f"Report {bundle.report}", "Copy the files it links to into it.")
            shutil.copytree(bundle.report, tmp / "report", symlinks=True)
            for path in sorted(p for p in (tmp / "report").rglob("*") if p.is_file()):
                rel = path.relative_to(tmp).as_posix()
                refuse_unsafe([rel], f"to bundle report file {rel!r}")
                files[rel] = _file_entry(path)
        document = {
            "format": BUNDLE_FORMAT,
            "schema_version": BUNDLE_SCHEMA,
            "name": bundle.name,
            "metrics": {k: float(v) for k, v in bundle.metrics.items()},
            "primary_metric": bundle.primary_metric,
            "gates": bundle.gates,
            "fingerprint": bundle.fingerprint,
            "components": components,
            "files": files,
            **({"measured_on": bundle.measured_on} if bundle.measured_on is not None else {}),
        }
        write_json_atomic(tmp / BUNDLE_JSON, document)
        publish_dir(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def _rebuild(artifact: Artifact) -> str:
    return (f"Treat the artifact as corrupt or tampered: delete {artifact.path}, rerun its stage "
            f"({artifact.manifest.get('stage')}) and then evaluate.")


def _file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def publish_dir(tmp: Path, final: Path) -> None:
    """Rename a finished directory into place; an older bundle there is swapped out in one step where the filesystem
    can (:func:`~pipeline.checksums.exchange_paths`), anything else refused. Its files and folders reach the disk
    before the rename, and the rename after it: a crash never leaves a verified bundle's name on empty files, nor
    the name without a bundle."""
    for path in sorted(tmp.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)
    fsync_path(tmp)
    _rename_into_place(tmp, final)
    fsync_path(final.parent)


def _rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        elif (final / BUNDLE_JSON).is_file():
            if unlisted := _unlisted_files(final):  # the earlier bundle is replaced whole: nothing else may go with it
                raise DrafterError(
                    f"{final} holds an earlier bundle and files its {BUNDLE_JSON} does not list.",
                    expected="a new or empty directory, or an earlier bundle with nothing added",
                    found=", ".join(unlisted[:5]) + (" …" if len(unlisted) > 5 else ""),
                    fix="Move those files out of it, or choose another destination.",
                )
            if exchange_paths(tmp, final):  # one step: the destination always holds a whole bundle
                shutil.rmtree(tmp, ignore_errors=True)  # the earlier one, swapped out
                return
            old = final.parent / f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            os.rename(final, old)  # a filesystem without the swap: a crash here leaves the old bundle in `old`
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
            return
        else:
            raise DrafterError(
                f"{final} already exists and does not hold a bundle.",
                expected="a new or empty directory, or an earlier bundle to replace",
                fix="Choose another destination or remove it first.",
            )
    os.rename(tmp, final)


def _unlisted_files(directory: Path) -> list[str]:
    """Files under ``directory`` (a bundle) its ``bundle.json`` does not list, sorted; every file if it cannot be
    read."""
    try:
        listed = set(json.loads((directory / BUNDLE_JSON).read_text()).get("files") or {})
    except (OSError, ValueError, AttributeError):
        listed = set()
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()} - {BUNDLE_JSON}
    return sorted(present - listed)


def read_bundle_json(path: Path) -> dict:
    """Parse ``<path>/bundle.json``; refuse a directory that is not a bundle."""
    file = Path(path) / BUNDLE_JSON
    try:
        document = json.loads(file.read_text())
    except FileNotFoundError as err:
        raise DrafterError(f"{path} is not a bundle: it has no {BUNDLE_JSON}.") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DrafterError(f"{file} is corrupt: {err}.", fix="Pull the bundle again.") from err
    if not isinstance(document, dict):
        raise DrafterError(f"{file} is corrupt: not a JSON object.", expected="the bundle's manifest, a JSON object",
                           found=type(document).__name__, fix="Pull the bundle again.")
    if document.get("format") != BUNDLE_FORMAT or document.get("schema_version") != BUNDLE_SCHEMA:
        raise DrafterError(
            f"{file} is not a bundle this pipeline reads.",
            expected=f"format {BUNDLE_FORMAT}, schema {BUNDLE_SCHEMA}",
            found=f"format {document.get('format')}, schema {document.get('schema_version')}",
        )
    missing = [
        k
        for k in ("name", "metrics", "primary_metric", "gates", "fingerprint", "components", "files")
        if k not in document
    ]
    if missing:
        raise DrafterError(
            f"{file} lacks required fields.",
            expected="name, metrics, primary_metric, gates, fingerprint, components, files",
            found=f"missing {missing}",
        )
    return document


def verify_bundle(
    path: Path,
    *,
    sha256: str | None = None,
    fingerprint: dict | None = None,
    expect_fingerprint: dict | None = None,
) -> dict:
    """Check a bundle directory file by file and return its ``bundle.json`` document.

    Args:
        path: The bundle directory.
        sha256: The bundle sha256 it must have (the model version's tag); None skips the check.
        fingerprint: The fingerprint it must carry (the model version's tag); None skips the check.
        expect_fingerprint: The consumer's target fingerprint; every key given must match.

    Raises:
        DrafterError: naming the file (or fingerprint key) with the expected and found values.
    """
    path = Path(path)
    refuse_symlinks(path, f"Bundle {path}", TAMPERED)
    document = read_bundle_json(path)
    if sha256 is not None and (found := bundle_sha256(document)) != sha256:
        raise DrafterError(
            f"{BUNDLE_JSON} of {path} is not the one that was registered.",
            expected=f"bundle sha256 {sha256}",
            found=f"bundle sha256 {found}",
            fix=TAMPERED,
        )
    for component in document["components"]:  # each names its directory, components/<id>: never a path out
        check_artifact_id(component.get("id") if isinstance(component, dict) else component,
                          f"{BUNDLE_JSON} of {path}", TAMPERED)
    listed = document["files"]
    refuse_unsafe(listed, f"bundle {path}")
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {BUNDLE_JSON}
    missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
    if missing or extra:
        raise DrafterError(
            f"Bundle {path} does not match its {BUNDLE_JSON}.",
            expected=f"exactly the {len(listed)} files listed",
            found=(f"missing {missing} " if missing else "") + (f"unlisted {extra}" if extra else ""),
            fix=TAMPERED,
        )
    components = {component["id"] for component in document["components"]}
    for rel, meta in sorted(listed.items()):
        parts = rel.split("/")
        if parts[0] == "components" and len(parts) > 2 and parts[1] in components and parts[-1] != MANIFEST:
            continue  # a listed component's payloads are hashed once, by load_artifact below
        _check_file(path, rel, meta["sha256"])
    for component in document["components"]:
        artifact = _load_component(path, component["id"])
        for name, meta in artifact.manifest["files"].items():
            rel = f"components/{artifact.id}/{name}"
            if listed[rel]["sha256"] != meta["sha256"]:
                raise DrafterError(
                    f"Bundle file {rel!r} disagrees with {BUNDLE_JSON}.",
                    expected=f"sha256 {listed[rel]['sha256']}",
                    found=f"sha256 {meta['sha256']}",
                    fix=TAMPERED,
                )
        _check_same(document["fingerprint"], artifact.fingerprint, f"component {artifact.id}", rel_only=False)
    if fingerprint is not None:
        _check_same(
            fingerprint, document["fingerprint"], "the bundle (vs. its registry tags)", rel_only=False
        )
    if expect_fingerprint is not None:
        _check_same(
            expect_fingerprint, document["fingerprint"], "the bundle (vs. your target)", rel_only=True
        )
    return document


def _check_file(root: Path, rel: str, expected: str) -> None:
    found = sha256_file(root / rel)
    if found != expected:
        raise DrafterError(
            f"Bundle file {rel!r} was modified after it was registered.",
            expected=f"sha256 {expected}",
            found=f"sha256 {found}",
            fix=TAMPERED,
        )


def _load_component(root: Path, artifact_id: str) -> Artifact:
    try:
        artifact = load_artifact(root / "components" / artifact_id, verify=True)
    except DrafterError as err:
        raise DrafterError(
            f"Bundle component {artifact_id} failed verification: {err.problem}",
            expected=err.expected,
            found=err.found,
            fix=TAMPERED,
        ) from err
    if artifact.id != artifact_id:
        raise DrafterError(
            f"Bundle component directory {artifact_id} holds another artifact.",
            expected=artifact_id,
            found=artifact.id,
            fix=TAMPERED,
        )
    return artifact


def _check_same(expected: dict, found: dict | None, what: str, *, rel_only: bool) -> None:
    """Refuse a fingerprint mismatch: identity keys always, or every key ``expected`` names."""
    found = found or {}
    if rel_only:
        bad = [k for k in expected if expected[k] != found.get(k)]
        if str(expected.get("weights", "")).startswith("commit:") and "weights" not in bad:
            bad = [k for k in bad if k != "revision"]  # one hub commit, whether it was named by branch or by sha
    else:
        bad = fingerprint_mismatch(expected, found) if found else [k for k in FINGERPRINT_KEYS if k in expected]
    if bad:
        raise fingerprint_error(f"The target fingerprint of {what} does not match.", expected, found, bad,
                                "Pull a version built for your target (check the version's drafter.target and "
                                "drafter.vocab_hash tags).")


def check_registrable(bundle: Bundle) -> None:
    """Refuse, before touching the registry, a bundle whose gates failed or whose components disagree.

    Raises:
        DrafterError: gates did not pass, the primary metric is not finite, a component has no
            fingerprint or one that differs from the bundle's.
    """
    if bundle.gates.get("passed") is not True:
        failed = [
            k
            for k, v in (bundle.gates.get("checks") or {}).items()
            if not (v.get("passed") if isinstance(v, dict) else v)
        ]
        raise DrafterError(
            f"Bundle {bundle.name!r} did not pass its gates; refusing to register it.",
            expected="gates.passed == true",
            found=f"failed checks: {failed or bundle.gates}",
            fix="Read the evaluate report, fix the drafter or the data, and rerun evaluate.",
        )
    if not math.isfinite(float(bundle.metrics[bundle.primary_metric])):
        raise DrafterError(
            f"Bundle {bundle.name!r} has a non-finite primary metric.",
            expected=f"a finite {bundle.primary_metric}",
            found=str(bundle.metrics[bundle.primary_metric]),
        )
    if not bundle.fingerprint:
        raise DrafterError(
            f"Bundle {bundle.name!r} has no target fingerprint.",
            expected="the fingerprint of the target its components were built for",
        )
    for artifact in bundle.artifacts:
        _check_same(
            bundle.fingerprint,
            artifact.fingerprint,
            f"component {artifact.id} ({artifact.kind})",
            rel_only=False,
        )
