"""The life of one stage run: cache lookup, preflight, build, atomic publish, MLflow logging.

Every job in ``jobs/`` describes *what* its stage computes (a ``build`` function) and hands it, with
its :class:`~pipeline.orchestration.dag.StagePlan` (artifact id, identity, inputs, fingerprint), to
:func:`run_stage`, which owns *how* a stage runs: a cache hit that does no work, a tracking-server probe before any expensive work, a
persistent staging directory (``<workdir>/staging/<id>``) where resumable stages keep finished shards
across a killed run, the atomic publish, and the MLflow run. On a multi-rank launch every rank builds
its share; only global rank zero publishes and logs. Two runs on one workdir never build the same artifact at
once: the second waits for the first's lock and then reuses its artifact (:mod:`pipeline.orchestration.lock`).

A full disk anywhere in the build or the publish is reported as such, with the partial artifact removed and
the staging shards kept. A damaged entry in the store (edited, corrupt or missing manifest, changed payload) is
never a cache hit: it is moved aside with a log line and rebuilt, so edited metrics are never used or logged.
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import Artifact, ArtifactStore, input_contents, write_json_atomic
from pipeline.config.sections import PipelineConfig
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import StagePlan
from pipeline.orchestration.lock import Launch, artifact_lock
from pipeline.progress import log  # noqa: F401 - the stages' log line, re-exported for the recipes
from pipeline.tracking import check_reachable, log_stage_run, logged_run, tracking_uri


@dataclass
class BuildResult:
    """What a stage's build hands back: a function that writes the payloads, and the figures."""

    write: Callable[[Path], None]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageRun:
    """Everything a build function may need to know about the run it is part of."""

    cfg: PipelineConfig
    stage: str
    artifact_id: str
    staging: Path
    fingerprint: dict
    inputs: list[Artifact]

    def log(self, message: str) -> None:
        log(self.stage, message)


def _cache_hit(cfg: PipelineConfig, step: StagePlan, existing: Artifact, uri: str, launch: Launch) -> Artifact:
    if launch.first_rank:
        log(step.spec.name, f"cache hit: {existing.id} (no work done)")
        if logged_run(existing, uri) is None:
            log_stage_run(existing, cfg.mlflow, cfg.workdir_path, params=step.config, metrics=existing.metrics)
    return existing


def run_stage(cfg: PipelineConfig, step: StagePlan, inputs: list[Artifact],
              build: Callable[[StageRun], BuildResult | None], launch: Launch | None = None) -> Artifact | None:
    """Run (or reuse) the planned stage ``step`` and return its verified artifact (None on ranks other
    than zero). ``inputs`` are the upstream artifacts ``build`` reads (from ``step.input``); ``launch`` says how
    the process was started (the CLI passes the one it read at start; None reads the environment now)."""
    launch = launch if launch is not None else Launch.from_environ()
    workdir = cfg.workdir_path
    store = ArtifactStore(workdir / "artifacts")
    stage, aid = step.spec.name, step.id
    if step.spec.one_process and not launch.first_rank:
        # launched as several ranks (srun of a job with more tasks): a second copy would time its decoding on the
        # first copy's GPU, and register the bundle beside it
        log(stage, "runs as one process: the first rank of this launch runs it, this rank stops here")
        return None
    uri = tracking_uri(cfg.mlflow, workdir)
    built_from = input_contents(inputs)  # an artifact built from other contents of its inputs is rebuilt
    existing = store.reusable(aid, lambda message: log(stage, message), move_aside=False, inputs=built_from)
    if existing is not None:
        return _cache_hit(cfg, step, existing, uri, launch)
    if launch.first_rank:
        check_reachable(uri, cfg.mlflow)  # fail before hours of work (and before taking the lock), not after
    try:
        with artifact_lock(workdir, aid, stage, lambda message: log(stage, message), launch):
            # published by the run this one waited for; a damaged entry is moved aside (by the lock holder only)
            existing = store.reusable(aid, lambda message: log(stage, message), move_aside=launch.first_rank,
                                      inputs=built_from)
            if existing is not None:
                return _cache_hit(cfg, step, existing, uri, launch)
            return _build_and_publish(cfg, step, inputs, build, store, uri, launch)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) and "No space left on device" not in str(err):
            raise
        raise DrafterError(f"No space left on the device while stage {stage} built or wrote {aid}.",
                           expected=f"free space under {workdir} for the staging shards and the artifact",
                           found=f"{type(err).__name__}: {err}",
                           fix="Free space (or point workdir at a larger disk) and rerun: finished shards "
                               "and checkpoints in the staging directory are kept, no partial artifact "
                               "was published.") from err


STAGED_INPUTS = "inputs.json"
"""In a staging directory: the content of the inputs its shards and checkpoints were computed from."""
STAGED_INPUTS_WAIT_S = 600.0




def _staging_for(staging: Path, inputs: list[Artifact], launch: Launch, say: Callable[[str], None]) -> None:
    """Make ``staging`` hold only work computed from ``inputs`` as they are now.

    An input can be rebuilt under its id with other bytes (moved aside as damaged, or deleted, then built again on a
    GPU, where sampling is not bit-reproducible): shards and checkpoints staged from the old one would be resumed and
    mixed with the new. The first rank empties such a staging directory, with a line saying why, and records the
    inputs' content; the other ranks wait for that record before they read anything there. A directory staged before
    the record existed is kept (nothing says it is stale).
    """
    record, now = staging / STAGED_INPUTS, input_contents(inputs)

    def recorded() -> dict | None:
        try:
            return json.loads(record.read_text())
        except (OSError, ValueError):
            return None

    before = recorded()
    if before == now:
        return
    if not launch.first_rank:
        deadline = time.monotonic() + STAGED_INPUTS_WAIT_S
        while (seen := recorded()) != now:
            if time.monotonic() > deadline:
                raise DrafterError(f"The first rank did not prepare the staging directory {staging}.",
                                   expected=f"{STAGED_INPUTS} naming this run's inputs {now}",
                                   found=str(seen), fix="Rerun the job: it resumes what was staged.")
            time.sleep(0.5)
        return
    if before is not None:
        changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        say(f"the staged work was computed from other contents of {', '.join(changed)} (rebuilt since): starting over")
        for entry in staging.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    write_json_atomic(record, now)


def _build_and_publish(cfg: PipelineConfig, step: StagePlan, inputs: list[Artifact],
                       build: Callable[[StageRun], BuildResult | None], store: ArtifactStore,
                       uri: str, launch: Launch) -> Artifact | None:
    workdir = cfg.workdir_path
    stage, aid = step.spec.name, step.id
    if launch.first_rank:
        store.sweep()
    staging = workdir / "staging" / aid
    staging.mkdir(parents=True, exist_ok=True)
    _staging_for(staging, inputs, launch, lambda message: log(stage, message))
    run = StageRun(cfg, stage, aid, staging, step.fingerprint, inputs)
    started = time.perf_counter()
    result = build(run)
    if result is None or not launch.first_rank:
        # A non-zero rank: its shards or checkpoints are in staging, rank zero publishes. Builds return None
        # there themselves; a build that found nothing left to do (every shard staged, say, after a requeue)
        # returns on every rank, and only the first may publish and log it.
        return None
    writer = store.writer(aid, kind=step.spec.kind, stage=stage, config=step.config,
                          inputs=[a.id for a in inputs], fingerprint=step.fingerprint,
                          input_contents=input_contents(inputs))
    try:
        result.write(writer.tmp)
        metrics = {**result.metrics, "stage_seconds": round(time.perf_counter() - started, 3)}
        artifact = writer.commit(metrics)
    except BaseException:
        writer.abort()
        raise
    shutil.rmtree(staging, ignore_errors=True)
    log(stage, f"wrote {artifact.id} -> {artifact.path}")
    log_stage_run(artifact, cfg.mlflow, workdir, params=step.config, metrics=artifact.metrics)
    return artifact
