"""Gated registration: a passing bundle becomes a model version; aliases are the commit point.

Consumers only ever resolve ``@candidate`` and ``@champion``, so a version is first created tagged
``drafter.status=incomplete`` together with every other tag (bundle sha256, so a rerun can find it;
metrics, component ids, fingerprint, git sha, gate verdict), then flipped to ``ready``, and only then
pointed at by aliases. If a step fails before ``ready`` the half-made version is deleted; if even that
fails it stays tagged incomplete with no alias on it, and a rerun with the same bundle finishes it
instead of adding a duplicate. ``champion`` moves only when the new version beats the current one on
the primary metric (higher is better), when there is none, when the current one was built for another
target (other weights, revision or vocabulary under the same model name), or when the caller forces it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import canonical_json, fingerprint_mismatch
from pipeline.config.sections import MlflowConfig
from pipeline.errors import DrafterError
from pipeline.progress import heartbeat
from pipeline.registry.bundle import (
    Bundle,
    bundle_sha256,
    check_registrable,
    read_bundle_json,
    verify_bundle,
    write_bundle,
)
from pipeline.registry.store import (
    BUNDLE_SHA,
    CANDIDATE,
    CHAMPION,
    DECISION,
    FINGERPRINT,
    INCOMPLETE,
    MEASURED_ON,
    METRIC_PREFIX,
    PRIMARY_METRIC,
    READY,
    STATUS,
    WALL_CLOCK_METRICS,
    connect,
    download_version,
    error_code,
    registry_errors,
    version_by_alias,
    versions_of,
    versions_of_bundle,
)
from pipeline.temporaries import owned_temp_dir, sweep_temporaries
from pipeline.tracking import ensure_experiment, git_sha, http_limits


@dataclass
class RegistrationResult:
    """What :func:`register` did."""

    name: str
    """Registered model name."""
    version: int
    """The model version holding the bundle."""
    aliases: list[str]
    """Aliases that point at this version after the call."""
    promoted: bool
    """Whether this call moved ``champion`` to this version (a call that reuses a registered version moves nothing)."""
    reason: str
    """Why champion moved or stayed, in words."""
    bundle_sha256: str
    """The bundle's identity (also the version's ``drafter.bundle_sha256`` tag)."""
    run_id: str
    """The MLflow run whose artifacts hold the bundle."""
    source: str
    """The version's source: the artifact location of the bundle."""
    reused: bool = False
    """True when an earlier version of the same bundle was reused or finished instead of a new one."""
    decision: str = ""
    """The decision made when the version was registered (its ``drafter.champion_decision`` tag: ``promoted: …`` or
    ``kept: …``), whichever call made it."""
    tags: dict[str, str] = field(default_factory=dict)
    """The tags written on the version."""

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def version_tags(document: dict, sha256: str) -> dict[str, str]:
    """Model-version tags for a bundle document (everything a serving engineer filters on)."""
    fp = document["fingerprint"]
    kinds: dict[str, list[str]] = {}
    for component in document["components"]:
        kinds.setdefault(f"drafter.component.{component['kind']}", []).append(component["id"])
    tags = {
        BUNDLE_SHA: sha256,
        PRIMARY_METRIC: document["primary_metric"],
        **{f"{METRIC_PREFIX}{k}": repr(float(v)) for k, v in document["metrics"].items()},
        "drafter.components": ",".join(c["id"] for c in document["components"]),
        **{k: ",".join(v) for k, v in kinds.items()},
        "drafter.target": str(fp.get("model")),
        "drafter.target_revision": str(fp.get("revision")),
        "drafter.vocab_hash": str(fp.get("vocab_hash")),
        FINGERPRINT: canonical_json(fp),
        "git.sha": str(document.get("git_sha") or git_sha()),  # the registering commit; bundles since 2026-11-28 omit it
        "drafter.gates.passed": str(document["gates"].get("passed")).lower(),
        "drafter.gates": canonical_json(document["gates"])[:100_000],
        **({MEASURED_ON: str(document["measured_on"])} if document.get("measured_on") is not None else {}),
    }
    return tags


def register(
    bundle: Bundle,
    cfg: MlflowConfig,
    workdir: Path | str,
    *,
    promote: bool = False,
    run_id: str | None = None,
) -> RegistrationResult:
    """Register a bundle that passed its gates as a new model version and move the aliases.

    Args:
        bundle: The evaluated bundle.
        cfg: MLflow settings (store, experiment, retries).
        workdir: Pipeline workdir (default sqlite store; temporary bundle copy).
        promote: Make the new version champion even if it does not beat the current one.
        run_id: Log the bundle into this existing run instead of a new run in ``cfg.experiment``.

    Returns:
        The version, the aliases on it, and whether and why champion moved.

    Raises:
        DrafterError: gates failed or fingerprints disagree (nothing is written), the server is
            unreachable, or a registry step failed (the message says what was left behind).
    """
    with http_limits(cfg):
        return _register(bundle, cfg, workdir, promote=promote, run_id=run_id)


def _register(
    bundle: Bundle,
    cfg: MlflowConfig,
    workdir: Path,
    *,
    promote: bool = False,
    run_id: str | None = None,
) -> RegistrationResult:
    """``register`` under MLflow's HTTP limits."""
    check_registrable(bundle)
    workdir = Path(workdir)
    uri, client = connect(cfg, workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(workdir, ".tmp-stored@*")  # a killed check of a stored version (the bundle's: below)
    with owned_temp_dir(workdir, "bundle") as tmp:
        bundle_dir = write_bundle(bundle, Path(tmp) / "bundle")
        document = read_bundle_json(bundle_dir)
        sha = bundle_sha256(document)
        tags = version_tags(document, sha)
        name = bundle.name
        with registry_errors(uri, f"Looking up {name}"):
            earlier = versions_of_bundle(client, name, sha)
            holder = _held_for_another_model(client, name, bundle.fingerprint)
        if holder is not None:
            number, model = holder
            raise DrafterError(
                f"{name} holds drafters for another target model: version {number} was built for {model!r}, this "
                f"bundle for {bundle.fingerprint.get('model')!r}. Both spell the same registered name, and a name "
                "holds one target (its @champion is what serving pulls for it). Nothing was registered.",
                expected=f"target.model spelt {model!r}, as the versions of {name} are",
                found=repr(bundle.fingerprint.get("model")),
                fix=f"Spell target.model as {model!r} if it is the same model (a different path to the same "
                    f"directory counts as another model), or delete the registered model {name} if its versions "
                    "are stale.")
        # Prefer a finished version; otherwise finish the oldest incomplete one whose stored copy is whole (one left
        # by a failed run may lack files, or MLflow may have failed its registration): one that is not is deleted.
        version = next((v for v in earlier if v.tags.get(STATUS) == READY), None)
        for candidate in ([] if version is not None else earlier):
            if _stored_problem(client, uri, name, str(candidate.version), sha, workdir) is None:
                version = candidate
                break
            _cleanup(client, name, str(candidate.version), skip=False)
        reused = version is not None
        if version is None:
            version = _create_version(
                client, uri, cfg, workdir, name, bundle_dir, document, tags, run_id
            )
        number = str(version.version)
        made_here = not reused
        try:
            if version.tags.get(STATUS) != READY:
                # A version made here got its tags at creation; one left by a failed run may lack some.
                for key, value in tags.items():
                    if version.tags.get(key) != value:
                        client.set_model_version_tag(name, number, key, value)
                client.set_model_version_tag(name, number, STATUS, READY)
        except Exception as err:  # noqa: BLE001 - translated below, after cleanup
            state = _cleanup(client, name, number, skip=not made_here)
            with registry_errors(
                uri,
                f"Registering {name} version {number}",
                state=state,
                fix="Check the tracking server, then rerun with the same bundle: the "
                "incomplete version is finished, not duplicated.",
            ):
                raise err
        with registry_errors(
            uri,
            f"Setting aliases on {name} version {number}",
            state=f" Version {number} is complete (tagged ready) but the aliases may not point at it yet.",
            fix="Rerun register with the same bundle: it reuses the version and sets the aliases.",
        ):
            decided = version.tags.get(DECISION) if reused and not promote else None
            if decided is not None:
                # Its aliases were set when it was registered (the decision is tagged after them); since then later
                # versions, or a forced rollback, may have moved them: a rerun that reuses it leaves them there.
                champion = client.get_registered_model(name).aliases.get(CHAMPION)
                promoted, reason = False, (f"version {number} was registered before (then {decided}); aliases left "
                                           f"as they are, champion at version {champion}")
            else:
                promoted, reason = _champion_decision(client, name, number, bundle, promote)
                client.set_registered_model_alias(name, CANDIDATE, number)
                if promoted:
                    client.set_registered_model_alias(name, CHAMPION, number)
                # why champion moved or stayed, on the version itself (the registry UI shows it beside the metrics)
                decided = f"{'promoted' if promoted else 'kept'}: {reason}"
                client.set_model_version_tag(name, number, DECISION, decided)
            aliases = sorted(
                a for a, v in client.get_registered_model(name).aliases.items() if str(v) == number
            )
    return RegistrationResult(
        name=name,
        version=int(number),
        aliases=aliases,
        promoted=promoted,
        reason=reason,
        decision=decided,
        bundle_sha256=sha,
        run_id=str(version.run_id),
        source=version.source,
        reused=reused,
        tags=tags,
    )


def _create_version(
    client: Any,
    uri: str,
    cfg: MlflowConfig,
    workdir: Path,
    name: str,
    bundle_dir: Path,
    document: dict,
    tags: dict[str, str],
    run_id: str | None,
) -> Any:
    """Log the bundle as run artifacts and create an ``incomplete`` version whose source is that location.

    The version gets all its tags in the create call (one request instead of one per tag, each of which
    MLflow's client doubles with a lookup), still marked incomplete until :func:`register` flips it.
    """
    from mlflow.entities import Metric

    sha = tags[BUNDLE_SHA]
    artifact_path = f"bundle-{sha[:16]}"
    new_run = run_id is None
    with registry_errors(
        uri, f"Logging bundle {name} as run artifacts", state=" Nothing was registered yet."
    ):
        if new_run:
            experiment_id = ensure_experiment(uri, cfg.experiment, workdir)
            run = client.create_run(
                experiment_id,
                run_name=f"register-{name}",
                tags={BUNDLE_SHA: sha, "drafter.registered_model": name},
            )
            run_id = run.info.run_id
            step_ms = int(time.time() * 1000)
            client.log_batch(
                run_id, metrics=[Metric(k, float(v), step_ms, 0) for k, v in document["metrics"].items()]
            )
        try:
            with heartbeat(f"uploading bundle {name}"):  # gigabytes of weights and moments to a remote store
                client.log_artifacts(run_id, str(bundle_dir), artifact_path)
        except Exception:
            if new_run:
                _quietly(client.set_terminated, run_id, "FAILED")
            raise
        if new_run:
            client.set_terminated(run_id, "FINISHED")
        source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
    with registry_errors(uri, f"Creating a version of {name}",
                         state=" No version was created, or one is left tagged incomplete: a rerun with the same "
                               "bundle checks its stored copy and finishes or replaces it."):
        try:
            client.create_registered_model(
                name,
                description="Drafter bundles for speculative decoding; pull @champion (see drafter.* tags).",
            )
        except Exception as err:  # noqa: BLE001
            if error_code(err) != "RESOURCE_ALREADY_EXISTS":
                raise
        return client.create_model_version(
            name, source, run_id=run_id, tags={**tags, STATUS: INCOMPLETE}, await_creation_for=60
        )


def _champion_decision(
    client: Any, name: str, number: str, bundle: Bundle, promote: bool
) -> tuple[bool, str]:
    metric = bundle.primary_metric
    ours = float(bundle.metrics[metric])
    current = version_by_alias(client, name, CHAMPION)
    if current is None:
        return True, "no champion yet"
    if str(current.version) == number:
        return False, f"version {number} is already champion"
    if promote:
        return True, f"forced (promote=True) over champion version {current.version}"
    tagged = _tagged_fingerprint(current)
    if moved := [key for key in fingerprint_mismatch(bundle.fingerprint, tagged)  # a key one side lacks says nothing
                 if bundle.fingerprint.get(key) is not None and tagged.get(key) is not None]:
        # a name holds one target model; a champion built for its old weights is no champion for the new ones, but
        # a version built for weights an earlier version had, which the champion replaced, is a step back
        if replaced := _replaced_by(client, name, current, bundle.fingerprint, moved):
            return False, (f"built for the target of version {replaced}, which champion version {current.version} "
                           f"replaced ({', '.join(moved)} differ); pass promote=True to roll back")
        return True, (f"champion version {current.version} was built for another target "
                      f"({', '.join(moved)} differ): the metrics do not compare")
    note = ""
    if metric != "tau" and f"{METRIC_PREFIX}tau" in current.tags and "tau" in bundle.metrics:
        ranked, theirs_on = current.tags.get(PRIMARY_METRIC), current.tags.get(MEASURED_ON)
        if ranked not in (None, metric):
            # evaluate.primary_metric=auto is the speed metric of the device (speedup on CUDA, MBSU on a CPU): a GPU
            # version's wall-clock speedup against a CPU champion's says which device is faster, not which drafter
            note = f"; ranked by tau: champion version {current.version} was ranked by {ranked}, this version by {metric}"
        elif metric in WALL_CLOCK_METRICS and (theirs_on is None or theirs_on != bundle.measured_on):
            # the same holds for an explicit primary_metric=speedup: a speedup ranks only against one timed on the
            # same device (a version that does not record its device was registered before that was recorded)
            note = (f"; ranked by tau: champion version {current.version}'s {metric} was measured on "
                    f"{theirs_on or 'a device it does not record'}, this version's on "
                    f"{bundle.measured_on or 'a device it does not record'}")
        if note:
            metric, ours = "tau", float(bundle.metrics["tau"])
    tag = current.tags.get(f"{METRIC_PREFIX}{metric}")
    try:
        theirs = None if tag is None else float(tag)
    except ValueError:
        theirs = None  # edited in the registry: nothing to compare with, as when it is missing
    if theirs is None:
        return False, (
            f"champion version {current.version} has no {metric} to compare with"
            + ("" if tag is None else f" (its {METRIC_PREFIX}{metric} tag reads {tag[:40]!r})")
            + "; pass promote=True to replace it"
        )
    if ours > theirs:
        return True, f"{metric} {ours:.6g} beats champion version {current.version} ({theirs:.6g}){note}"
    return (
        False,
        f"{metric} {ours:.6g} does not beat champion version {current.version} ({theirs:.6g}){note}",
    )


def _held_for_another_model(client: Any, name: str, fingerprint: dict) -> tuple[str, str] | None:
    """(version, model) of the newest version of ``name`` built for another target model than ``fingerprint``'s.

    :func:`~pipeline.registry.bundle.registered_name` maps several spellings to one name (``Qwen/Qwen3-8B`` on the
    hub and a local ``./Qwen/Qwen3-8B`` both become ``drafter-Qwen-Qwen3-8B-…``). New weights or a new revision of
    the same model are that model's next versions; another model under its name would take @champion from it."""
    ours = fingerprint.get("model")
    for version in reversed(versions_of(client, name)):
        theirs = _tagged_fingerprint(version).get("model")
        if ours and theirs and theirs != ours:
            return str(version.version), theirs
    return None


def _replaced_by(client: Any, name: str, champion: Any, fingerprint: dict, keys: list[str]) -> str | None:
    """The newest version older than ``champion`` built for the target ``fingerprint`` names (on ``keys``), if any."""
    older = [v for v in versions_of(client, name) if int(v.version) < int(champion.version)]
    for version in reversed(older):
        tagged = _tagged_fingerprint(version)
        if all(tagged.get(key) == fingerprint.get(key) for key in keys):
            return str(version.version)
    return None


def _tagged_fingerprint(version: Any) -> dict:
    """The target fingerprint a version was tagged with; empty where the tag is missing or unreadable (nothing to
    compare: the metrics decide, as before)."""
    try:
        found = json.loads(version.tags.get(FINGERPRINT) or "{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _stored_problem(client: Any, uri: str, name: str, number: str, sha: str, workdir: Path) -> str | None:
    """Why incomplete version ``number`` cannot be finished, or None: MLflow's own status is not READY, or its stored
    copy does not download and verify as the bundle ``sha`` (each file against its hash)."""
    with registry_errors(uri, f"Checking {name} version {number}"):
        status = str(client.get_model_version(name, number).status)
    if status != "READY":
        return f"MLflow status {status}"
    with owned_temp_dir(workdir, "stored") as tmp:
        try:
            with registry_errors(uri, f"Downloading {name} version {number}"):
                download_version(client, uri, name, number, Path(tmp) / "bundle")
            verify_bundle(Path(tmp) / "bundle", sha256=sha)
        except DrafterError as err:
            return err.problem
    return None


def _cleanup(client: Any, name: str, number: str, *, skip: bool) -> str:
    """Delete a half-made version; return a sentence saying what was left behind."""
    if not skip:
        try:
            client.delete_model_version(name, number)
            return f" The half-made version {number} was deleted; no alias points at it."
        except Exception:  # noqa: BLE001 - the server may be gone; the tag below still protects consumers
            pass
    return (
        f" Version {number} is left tagged {STATUS}={INCOMPLETE} and no alias points at it; "
        "a rerun with the same bundle finishes it."
    )


def _quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - best effort on a path that is already failing
        pass
