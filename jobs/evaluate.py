"""Stage ``evaluate``: speculative decoding against autoregressive decoding, gates, registration.

Run alone with ``drafter evaluate --config configs/tiny.yaml`` (reusing or first building the count
artifact). For each task (held-out chat prompts, HumanEval code prompts) it decodes every prompt
autoregressively, then with each method of the matrix — same-tokenizer drafter with its full head and
with each shortlist from ``count``; different-tokenizer drafter with TLI, Union and SLEM — for each γ.
Losslessness is checked, not assumed: every method's greedy output must equal the autoregressive
greedy output token for token on every prompt, and at temperature 1 the first emitted token's empirical
distribution must pass a chi-square test against the target's p. Gates (losslessness, τ, speed) decide
whether the bundle (the count artifact's draft vocabularies + this report) is registered in MLflow.
"""

from __future__ import annotations

import time
from pathlib import Path

from jobs import count
from pipeline.config.sections import PipelineConfig
from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint
from pipeline.orchestration.artifacts import Artifact
from pipeline.orchestration.stage import BuildResult, StageRun, find_input, run_stage

KIND = "evaluation"
REGISTERED_KIND = "draft-vocab"


def _build(cfg: PipelineConfig, run: StageRun, counts_art: Artifact) -> BuildResult:
    from pipeline.evaluation.matrix import evaluate_matrix
    from pipeline.evaluation.report import write_report

    started = time.perf_counter()
    results = evaluate_matrix(cfg, counts_art, run.fingerprint, run.log)
    metrics = {"eval_seconds": round(time.perf_counter() - started, 2), "gates_passed": int(results["gates"]["passed"]),
               "lossless_passed": int(results["lossless"]["passed"])}
    chosen = results["gates"].get("chosen") or {}
    for key in ("tau", "speedup", "mbsu", "acceptance_rate"):
        if chosen.get(key) is not None:
            metrics[f"chosen.{key}"] = chosen[key]
    for row in results["rows"]:
        tag = f"{row['task']}.{row['method']}" + (f".{row['shortlist']}" if row.get("shortlist") else "") + f".g{row['gamma']}"
        metrics[f"{tag}.tau"] = row["tau"]
        if row.get("speedup") is not None:
            metrics[f"{tag}.speedup"] = row["speedup"]

    def write(out: Path) -> None:
        write_report(results, out)

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig) -> Artifact | None:
    """Evaluate (or reuse the evaluation of) this config's drafters and register what passes."""
    ev = cfg.evaluate
    fp = fingerprint(cfg.target.model, cfg.target.revision, cfg.target.tokenizer, cfg.target.trust_remote_code)
    drafters = {"drafter": fingerprint(ev.drafter)}
    if ev.drafter_other and {"tli", "union", "slem"} & set(ev.methods):
        drafters["drafter_other"] = fingerprint(ev.drafter_other)
    if {"full", "shortlist"} & set(ev.methods) and drafters["drafter"]["vocab_hash"] != fp["vocab_hash"]:
        raise DrafterError(
            f"The same-tokenizer drafter {ev.drafter!r} does not share the target's tokenizer.",
            expected=f"vocab_hash {fp['vocab_hash'][:16]} (the target's)",
            found=f"vocab_hash {drafters['drafter']['vocab_hash'][:16]}",
            fix="Set evaluate.drafter to a drafter trained for this target, or move it to "
                "evaluate.drafter_other (TLI/Union/SLEM handle different tokenizers).")
    counts_art = find_input(cfg, ev.counts, count.KIND, lambda: count.main(cfg), fp)
    artifact = run_stage(cfg, stage="evaluate", kind=KIND, section=ev, fingerprint=fp, inputs=[counts_art],
                         build=lambda run: _build(cfg, run, counts_art), identity={"drafters": drafters})
    if artifact is not None and ev.register:
        from pipeline.evaluation.matrix import register_bundle

        register_bundle(cfg, artifact, counts_art, fp)
    return artifact


