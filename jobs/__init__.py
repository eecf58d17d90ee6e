"""Stage recipes: one module per pipeline stage, each exposing ``main(cfg: PipelineConfig) -> Artifact``.

The DAG itself is data in :mod:`pipeline.orchestration.dag` (``STAGES``: name, recipe module, artifact
kind, upstream stages). :func:`run` runs the stages asked for plus the upstream stages they still need,
in DAG order; each recipe takes its inputs from its plan, never by calling another recipe. Recipes may
import ``pipeline``; ``pipeline`` never imports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pipeline.orchestration.dag import STAGE_NAMES, default_stages, plan
from pipeline.orchestration.launching import check_one_multi_rank_stage
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import log
from pipeline.tiny import build_kit
from pipeline.tracking import check_store

if TYPE_CHECKING:
    from pipeline.artifacts import Artifact
    from pipeline.config.sections import PipelineConfig
    from pipeline.orchestration.dag import Plan

STAGES: tuple[str, ...] = STAGE_NAMES


def run(cfg: PipelineConfig, stages: Iterable[str] | None = None, launch: Launch | None = None) -> dict[str, Artifact]:
    """Run ``stages`` and whatever upstream stages they need (not cached, not named in the config).

    Args:
        cfg: The resolved config.
        stages: Stages wanted (their uncached upstreams run too); None: the config's default run
            (:func:`~pipeline.orchestration.dag.default_stages`).
        launch: How the process was started (the CLI reads it once at start); None reads the environment now.

    Returns:
        Stage → artifact for every stage that ran or was a cache hit, in DAG order. On a rank other
        than zero of a multi-rank launch the first sharded stage returns no artifact and this stops
        there (rank zero publishes and goes on).
    """
    wanted = list(stages) if stages is not None else list(default_stages(cfg))
    launch = launch if launch is not None else Launch.from_environ()  # before any stage's Lightning edits it
    artifacts: dict[str, Artifact] = {}
    the_plan = plan(cfg, wanted)
    needed = the_plan.needed(wanted)
    if needed:
        # What needs no model is checked before the kits are built (minutes on a fresh machine): plan() refused a
        # missing prompt source; the tracking store is checked here (each stage checks it again before its work).

        check_store(cfg.mlflow, cfg.workdir_path, probe=launch.first_rank)
        if the_plan.provisional:
            _build_kits(the_plan)
            the_plan = plan(cfg, wanted)  # the ids now name the kit's weights: some may be cached under them
            needed = the_plan.needed(wanted)
        check_one_multi_rank_stage(cfg, needed, launch)
    for name in needed:
        artifact = importlib.import_module(the_plan[name].spec.job).main(cfg, launch)
        if artifact is None:
            break
        artifacts[name] = artifact
    return artifacts


def _build_kits(the_plan: Plan) -> None:
    """Build the tiny kits the plan names before the first stage, as a phase of its own with progress (a stage
    loading a kit model would otherwise build it silently inside its own first step)."""

    for kit in the_plan.kits:
        if not kit.built:
            log("tiny kit", f"building {kit.profile}-{kit.kit_hash} (once; cached under {kit.path.parent})")
            build_kit(kit.profile, log=lambda line: log("tiny kit", line.strip()))
