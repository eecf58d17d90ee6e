"""Stage ``evaluate``: speculative decoding against autoregressive decoding, gates, registration.

Run alone with ``drafter evaluate --config configs/tiny.yaml`` (reusing or first building the count
artifact). For each task (held-out chat prompts, HumanEval code prompts) it decodes every prompt
autoregressively, then with each method of the matrix — same-tokenizer drafter with its full head and
with each shortlist from ``count``; different-tokenizer drafter with TLI, Union and SLEM — for each γ.
Losslessness is checked, not assumed: every method's greedy output must equal the autoregressive
greedy output token for token on every prompt, and at temperature 1 the first emitted token's empirical
distribution must pass a chi-square test against the target's p. Gates (losslessness, τ, speed) decide
whether the bundle (the count artifact's draft vocabularies + this report) is registered in MLflow; with
method ``eagle3`` the EAGLE-3 drafter of ``train_drafter`` is decoded too and, gated on its own best γ,
registered as a second bundle (weights, config, serving exports, draft vocabulary, report). With
methods ``dynaspec``/``dynaspec_pa`` the router of ``train_router`` routes over the clusters of ``cluster``;
those rows and ``pa_fr`` are run at the mean shortlist size of the FR-Spec shortlist
``evaluate.dynaspec_match``, and the DynaSpec bundle (clusters, router, report) is gated and registered.
With the RDK methods the same-tokenizer drafter is pruned to each level of ``estimate_rdk`` (``pruned``: TLI only;
``rdk``/``rdk_taylor``/``rdk_prior``: redistributed) and the other-tokenizer drafter drafts through
``tli_rdk*``; the RDK bundle (moments, kept sets, τ, report) is gated on the best redistributed configuration.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.engine.methods import GATE_SETS
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, run_stage

SUMMARY: tuple[str, ...] = ("lossless_passed",
                             *(key for gate in GATE_SETS.values() for key in gate.summary_metrics()))
"""Metrics ``drafter run`` prints for this stage: losslessness, then each bundle's verdict and headline figures
(the method registry's bundles, :data:`~pipeline.engine.methods.GATE_SETS`)."""


def _chosen_metrics(prefix: str, gates: Any) -> dict[str, float]:
    """The headline figures of a gate set's chosen configuration, as ``<prefix>.<metric>``."""
    if gates.chosen is None:
        return {}
    return {f"{prefix}.{k}": v for k, v in gates.chosen.metrics().items()
            if k in ("tau", "speedup", "mbsu", "acceptance_rate")}


def _build(cfg: PipelineConfig, run: StageRun, artifacts: dict[str, Artifact]) -> BuildResult:
    from pipeline.evaluation.matrix import evaluate_matrix  # deferred: pulls in torch
    from pipeline.evaluation.report import write_report  # deferred: pulls in numpy

    started = time.perf_counter()
    results = evaluate_matrix(cfg, artifacts, run.fingerprint, run.log)
    metrics = {"eval_seconds": round(time.perf_counter() - started, 2), "lossless_passed": int(results.lossless)}
    for gate in GATE_SETS.values():
        gates = getattr(results, gate.results_field)
        if gates is not None:
            metrics[gate.passed_metric] = int(gates.passed)
            metrics.update(_chosen_metrics(gate.metric_prefix, gates))
    for row in results.rows:
        metrics[f"{row.tag}.tau"] = row.tau
        if row.speedup is not None:
            metrics[f"{row.tag}.speedup"] = row.speedup

    def write(out: Path) -> None:
        write_report(results, out)

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Evaluate (or reuse the evaluation of) this config's drafters and register what passes."""
    step = plan(cfg, ["evaluate"])["evaluate"]
    drafter = step.config.get("models", {}).get("drafter")
    if drafter is not None and drafter["vocab_hash"] != step.fingerprint["vocab_hash"]:
        raise DrafterError(
            f"The same-tokenizer drafter {cfg.evaluate.drafter!r} does not share the target's tokenizer.",
            expected=f"vocab_hash {step.fingerprint['vocab_hash'][:16]} (the target's)",
            found=f"vocab_hash {drafter['vocab_hash'][:16]}",
            fix="Set evaluate.drafter to a drafter trained for this target, or move it to "
                "evaluate.drafter_other (TLI/Union/SLEM handle different tokenizers).")
    # count, then whichever of train_drafter, cluster, train_router, estimate_rdk the evaluated methods read
    artifacts = {stage: step.input(stage) for stage in step.inputs}
    artifact = run_stage(cfg, step, list(artifacts.values()), build=lambda run: _build(cfg, run, artifacts), launch=launch)
    if artifact is not None and cfg.evaluate.register:
        from pipeline.evaluation.publish import register_bundle  # deferred: pulls in numpy
        from pipeline.evaluation.results import EvaluationResults  # deferred: pulls in numpy

        results = EvaluationResults.from_dict(json.loads(artifact.file("report.json").read_text()))
        register_bundle(cfg, results, artifact, artifacts)
    return artifact
