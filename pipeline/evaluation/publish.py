"""Publishing the evaluate stage's bundles: each bundle whose gates passed goes to the MLflow Model Registry,
and its registration record is written beside the evaluation artifact."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pipeline.artifacts import Artifact, write_json_atomic
from pipeline.config.sections import PipelineConfig
from pipeline.engine.methods import GATE_SETS
from pipeline.errors import redact
from pipeline.evaluation.results import EvaluationResults
from pipeline.progress import log
from pipeline.registry import Bundle, register, registered_name
from pipeline.tracking import tracking_uri

REGISTRATION_FILES = {gate.name: gate.registration for gate in GATE_SETS.values()}
"""Bundle kind → the record written beside the evaluation artifact as ``<evaluation id>.<file>``."""


def pending_registrations(cfg: PipelineConfig, evaluation: Artifact) -> list[str]:
    """The bundles of ``evaluation`` whose gates passed and that this config's store holds no registration of (a
    registration that failed after the artifact was published, or another store): what rerunning evaluate, a cache
    hit, registers. Empty with ``evaluate.register`` off. A record written before records named their store counts
    as this store's."""
    if not cfg.evaluate.register:
        return []
    store = redact(tracking_uri(cfg.mlflow, cfg.workdir_path))
    pending = []
    for gate in GATE_SETS.values():
        if not evaluation.metrics.get(gate.passed_metric):
            continue
        try:
            record = json.loads((evaluation.path.parent / f"{evaluation.id}.{gate.registration}").read_text())
        except (OSError, ValueError):
            record = None
        if not isinstance(record, dict) or record.get("store", store) != store:
            pending.append(gate.name)
    return pending


def register_bundle(cfg: PipelineConfig, results: EvaluationResults, evaluation: Artifact,
                    artifacts: dict[str, Artifact]) -> dict[str, dict | None]:
    """Register each bundle whose gates passed (:data:`~pipeline.engine.methods.GATE_SETS`): the
    draft-vocabulary bundle (count artifact + evaluation report); when evaluated, the EAGLE-3 bundle
    (train_drafter artifact with its weights, config and serving exports + the count artifact's draft
    vocabulary + the report); the DynaSpec bundle (cluster artifact + train_router artifact + the report, whose
    ``dynaspec_policy`` holds the matched budgets per γ); and the RDK bundle (estimate_rdk artifact: μ, sparse
    S, kept-token maps, τ and prior weights + the report).

    Takes the results it is given (fresh from the matrix, or read back from a cached evaluation), never
    re-reading them from the report on its own.

    Args:
        artifacts: Upstream stage → the artifact evaluate read (``count`` always).

    Returns:
        Bundle kind → its registration record, or None where the gates failed.
    """
    records = {}
    for gate in GATE_SETS.values():
        gates = getattr(results, gate.results_field)
        if gates is not None and all(stage in artifacts for stage in gate.artifacts):
            held = [artifacts[stage] for stage in gate.artifacts]
            records[gate.name] = _register_one(cfg, results, gates, gate.name, [*held, evaluation], evaluation)
    return records


def _register_one(cfg: PipelineConfig, results: EvaluationResults, gates: Any, kind: str,
                  artifacts: list[Artifact], evaluation: Artifact) -> dict | None:

    if not gates.passed or gates.chosen is None:
        why = gates.unevaluated() or "gates failed, not registered: " + "; ".join(gates.failures())
        log("evaluate", f"{kind}: {why}")
        return None
    primary = cfg.evaluate.primary_metric if cfg.evaluate.primary_metric != "auto" else gates.speed_metric
    bundle = Bundle(name=registered_name(cfg.target.model, kind), artifacts=artifacts,
                    metrics=gates.chosen.metrics(), primary_metric=primary, gates=dataclasses.asdict(gates),
                    fingerprint=results.target, measured_on=results.device)
    result = register(bundle, cfg.mlflow, cfg.workdir_path, promote=cfg.evaluate.promote)
    record = {"name": result.name, "version": result.version, "aliases": result.aliases,
              "promoted": result.promoted, "reason": result.reason, "decision": result.decision, "uri": result.uri,
              "bundle_sha256": result.bundle_sha256, "run_id": result.run_id,
              "store": redact(tracking_uri(cfg.mlflow, cfg.workdir_path))}
    # Beside the artifact, not inside it: the artifact is immutable, registration is an event about it.
    write_json_atomic(evaluation.path.parent / f"{evaluation.id}.{REGISTRATION_FILES[kind]}", record)
    log("evaluate", f"registered {result.name} version {result.version} with aliases {result.aliases}: {result.reason}")
    return record
