"""Verified pulls: fetch a registered bundle by alias or version, check every byte, then publish it.

``NAME@ALIAS`` is resolved to a version number once, and that exact version's artifact location is
downloaded, so an alias moving mid-pull cannot mix two versions. Every MLflow call names the store
(config, ``$MLFLOW_TRACKING_URI`` or the workdir's sqlite file) explicitly, so a pull from any
directory reads that store and never MLflow's default in the current directory. The download lands
in a temporary sibling of the destination; it is published (renamed) only after ``bundle.json`` matches
the version's bundle-sha256 tag, every file matches ``bundle.json``, every component re-verifies against
its own manifest, and every fingerprint agrees with the version's tags and with the caller's target.
A refused pull therefore leaves nothing at the destination.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pipeline.config.sections import MlflowConfig
from pipeline.errors import DrafterError
from pipeline.registry.bundle import BUNDLE_JSON, publish_dir, verify_bundle
from pipeline.registry.store import (
    BUNDLE_SHA,
    FINGERPRINT,
    READY,
    STATUS,
    connect,
    download_version,
    error_code,
    registry_errors,
)
from pipeline.temporaries import owned_temp_dir
from pipeline.tracking import http_limits

_REF = re.compile(r"^(?:models:/)?(?P<name>[^/@:]+)(?:@(?P<alias>[\w-]+)|/(?P<version>[0-9]+))$")
_MAX_VERSION = 2**63 - 1  # MLflow keeps version numbers in a 64-bit INTEGER column


def parse_ref(ref: str) -> tuple[str, str | None, str | None]:
    """Split ``NAME@ALIAS`` or ``NAME/VERSION`` (a ``models:/`` prefix is allowed) into its parts.

    Raises:
        DrafterError: the ref has neither form, or its version is beyond what a registry can hold.
    """
    expected = "NAME@ALIAS (e.g. drafter-x-eagle@champion) or NAME/VERSION (e.g. drafter-x-eagle/3)"
    fix = "Name a registered model and an alias (@champion, @candidate) or a version number."
    match = _REF.match(ref.strip())
    if match is None:
        raise DrafterError(f"Cannot read the model reference {ref!r}.", expected=expected, found=repr(ref), fix=fix)
    if match["version"] is not None and int(match["version"]) > _MAX_VERSION:
        raise DrafterError(f"The version in {ref!r} is out of range.", expected=f"{expected}, VERSION <= {_MAX_VERSION}",
                           found=f"version {match['version'][:40]}", fix=fix)
    return match["name"], match["alias"], match["version"]


def pull(
    ref: str, to: Path, cfg: MlflowConfig, workdir: Path, *, expect_fingerprint: dict | None = None
) -> Path:
    """Download a registered bundle, verify it completely, and publish it at ``to``.

    Args:
        ref: ``NAME@ALIAS`` or ``NAME/VERSION``.
        to: Destination directory; must be new, empty, or an earlier pulled bundle (replaced).
        cfg: MLflow settings (store, retries).
        workdir: Pipeline workdir (locates the default sqlite store).
        expect_fingerprint: Your target's fingerprint; every key given must match the bundle's.

    Returns:
        ``to``, holding ``bundle.json``, ``components/<id>/`` and possibly ``report/``.

    Raises:
        DrafterError: unknown model/alias/version, an incomplete version, a file or fingerprint that
            does not match (named, with expected and found values), or an unreachable server.
    """
    with http_limits(cfg):
        return _pull(ref, to, cfg, workdir, expect_fingerprint=expect_fingerprint)


def _pull(
    ref: str, to: Path, cfg: MlflowConfig, workdir: Path, *, expect_fingerprint: dict | None = None
) -> Path:
    """``pull`` under MLflow's HTTP limits."""
    name, alias, number = parse_ref(ref)
    to = Path(to)
    _check_destination(to)
    uri, client = connect(cfg, workdir, existing=True)
    with registry_errors(uri, f"Resolving {ref}"):
        version = _resolve(client, name, alias, number)
    number = str(version.version)
    tags = dict(version.tags)
    if tags.get(STATUS) != READY:
        raise DrafterError(
            f"{name} version {number} is not a finished registration.",
            expected=f"tag {STATUS}={READY}",
            found=f"{STATUS}={tags.get(STATUS)}",
            fix="Pull by alias (@champion or @candidate), or rerun register to finish it.",
        )
    with owned_temp_dir(to.parent, f"{to.name}.pull") as work:  # a killed pull's leftovers go with the next pull
        tmp = work / "bundle"
        with registry_errors(
            uri, f"Downloading {name} version {number}", state=f" Nothing was written to {to}."
        ):
            download_version(client, uri, name, number, tmp)
        try:
            verify_bundle(
                tmp,
                sha256=tags.get(BUNDLE_SHA) or "(missing tag)",
                fingerprint=_fingerprint_tag(tags),
                expect_fingerprint=expect_fingerprint,
            )
        except DrafterError as err:
            # the download's temporary folder is gone by the time the user reads this: name the version instead
            raise DrafterError(
                f"Refusing {name} version {number}: "
                f"{err.problem.replace(f'Bundle {tmp}', 'The bundle').replace(str(tmp), 'the bundle')} Nothing was "
                f"written to {to}.",
                expected=err.expected,
                found=err.found,
                fix=err.fix or f"Treat the registry copy of {name} version {number} as tampered with: re-register the "
                               "bundle, or pull another version.",
            ) from err
        publish_dir(tmp, to)
    return to


def _fingerprint_tag(tags: dict) -> dict:
    """The version's target fingerprint tag, which the bundle must carry: a missing or garbled tag is refused (an empty
    one would check nothing)."""
    text = tags.get(FINGERPRINT)
    try:
        found = json.loads(text) if text else None
    except ValueError:
        found = None
    if not isinstance(found, dict) or not found:
        raise DrafterError(f"The version's {FINGERPRINT} tag is not a target fingerprint.",
                           expected="the JSON object register wrote (model, revision, vocab_hash, ...)",
                           found=repr(text)[:120] if text else "no such tag",
                           fix="Treat the registry copy as tampered with; re-register the bundle.")
    return found


def _check_destination(to: Path) -> None:
    # Checked before downloading so a bad destination costs nothing; publish_dir checks again.
    if to.exists() and not (to.is_dir() and (not any(to.iterdir()) or (to / BUNDLE_JSON).is_file())):
        raise DrafterError(
            f"{to} already exists and does not hold a bundle.",
            expected="a new or empty directory, or an earlier pulled bundle to replace",
            found="a file" if not to.is_dir() else f"a directory without {BUNDLE_JSON}",
            fix="Choose another --to directory or remove it first.",
        )


def _resolve(client: Any, name: str, alias: str | None, number: str | None) -> Any:
    try:
        return (
            client.get_model_version_by_alias(name, alias)
            if alias
            else client.get_model_version(name, number)
        )
    except Exception as err:
        if error_code(err) not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            raise
        try:
            model = client.get_registered_model(name)
        except Exception:  # noqa: BLE001 - the model itself is missing
            raise DrafterError(
                f"There is no registered model {name!r}.",
                expected="the name of a registered model (drafter-<target>-<kind>) in this store",
                found=f"no model named {name!r}",
                fix="Check the name (drafter-<target>-<kind>) and the tracking URI.",
            ) from err
        what = f"alias {alias!r}" if alias else f"version {number}"
        raise DrafterError(
            f"Registered model {name!r} has no {what}.",
            expected=f"an alias or version of {name!r}",
            found=f"aliases {dict(model.aliases)}",
            fix="Pull @champion, @candidate or an existing version number.",
        ) from err
