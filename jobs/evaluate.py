"""Stage ``evaluate``: speculative decoding against autoregressive decoding, gates, registration.

Run alone with ``drafter evaluate --config configs/tiny.yaml`` (reusing or first building the count
artifact). For each task (held-out chat prompts, HumanEval code prompts) it decodes every prompt
autoregressively, then with each method of the matrix — same-tokenizer drafter with its full head and
with each shortlist from ``count``; different-tokenizer drafter with TLI, Union and SLEM — for each γ.
Losslessness is checked, not assumed: every method's greedy output must equal the autoregressive
greedy output token for token on every prompt, and the first emitted token's empirical distribution, drawn under
the law the rows decode with (at temperature 1 when they decode greedily), must pass a chi-square test against the
target's p. Gates (losslessness, τ, speed) decide
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

from pipeline.artifacts import Artifact, load_artifact
from pipeline.config.sections import PipelineConfig
from pipeline.data.sources import planned_sha256
from pipeline.engine.methods import DECODE_BENCH, GATE_SETS, METHODS
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import plan, spec
from pipeline.orchestration.lock import Launch, artifact_lock
from pipeline.orchestration.stage import BuildResult, StageRun, log, run_stage
from pipeline.progress import heartbeat
from pipeline.vocab.tokens import stop_ids

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


def _build(cfg: PipelineConfig, run: StageRun, artifacts: dict[str, Artifact], source: dict) -> BuildResult:
    from pipeline.evaluation.matrix import evaluate_matrix  # deferred: pulls in torch
    from pipeline.evaluation.report import write_report  # deferred: pulls in numpy

    started = time.perf_counter()
    # the prompts come from generate.source, which must still be the file the plan hashed into this stage's id
    results = evaluate_matrix(cfg, artifacts, run.fingerprint, run.log, run.staging, planned_sha256(source))
    results.other_devices = other_devices(cfg, results.device) or None
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


def other_devices(cfg: PipelineConfig, device: str) -> list[dict]:
    """The wall-clock rows of this config's evaluations on other devices that the store holds (``evaluate.device``
    set to each other value, same decode path or ``auto``), for the report's device table; a device is listed once."""
    from dataclasses import replace

    found: dict[str, dict] = {}
    kind = device.split(" ")[0] if device.startswith("cpu") else "cuda"
    for setting in ("auto", "cpu", "cuda"):
        for path in dict.fromkeys((cfg.evaluate.decode_path, "auto")):
            if setting == cfg.evaluate.device and path == cfg.evaluate.decode_path:
                continue
            try:
                other = replace(cfg, evaluate=replace(cfg.evaluate, device=setting, decode_path=path))
                step = plan(other, ["evaluate"])["evaluate"]
            except DrafterError:  # e.g. graphs with cpu: no such evaluation
                continue
            if not step.cached:
                continue
            data = json.loads(load_artifact(step.path, kind=spec("evaluate").kind).file("report.json").read_text())
            theirs = str(data.get("device", ""))
            if (theirs.split(" ")[0] if theirs.startswith("cpu") else "cuda") == kind or theirs in found:
                continue
            found[theirs] = {"device": theirs, "decode_path": data.get("decode_path"), "evaluation": step.id,
                             "rows": data.get("rows", [])}
    return list(found.values())


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
    artifact = run_stage(cfg, step, list(artifacts.values()), build=lambda run: _build(cfg, run, artifacts, step.config["data"]["source"]),
                         launch=launch)
    if artifact is not None and cfg.evaluate.register:
        from pipeline.evaluation.publish import register_bundle  # deferred: pulls in numpy
        from pipeline.evaluation.results import EvaluationResults  # deferred: pulls in numpy

        results = EvaluationResults.from_dict(json.loads(artifact.file("report.json").read_text()))
        # two runs on one workdir would both find no version of the bundle and both create one
        with artifact_lock(cfg.workdir_path, f"{artifact.id}.registration", "evaluate",
                           lambda message: log("evaluate", message), launch or Launch.from_environ()):
            register_bundle(cfg, results, artifact, artifacts)
    return artifact


def bench_decode(cfg: PipelineConfig, shape: str = "tiny", steps: int = 20, methods: str | None = None,
                 cold: bool = False) -> str:
    """``drafter bench decode``: :mod:`pipeline.evaluation.decode_bench` on this config's kit (``tiny``), and with
    ``llama3-8b`` also at Llama-3.1-8B's shape with random weights, projected with the kit's acceptance.

    The kit pass decodes evaluate's own prompts (``evaluate.prompts_per_task`` per task, ``evaluate.max_new_tokens``,
    ``evaluate.gammas``) with the registry's :data:`~pipeline.engine.methods.DECODE_BENCH` methods whose artifacts
    this config's plan finds built (``methods``, a comma-separated list: only those of them),
    through evaluate's own configurations; the decode path is ``evaluate.decode_path`` on this device. With ``cold``
    each bare forward is timed after evicting the device's caches (see :func:`~pipeline.evaluation.decode_bench.measure`).
    Each shape also prints the target's forward time by tokens fed, 1 .. max γ + 1
    (:func:`~pipeline.evaluation.decode_bench.verify_curve`): what a shorter block would save in verification.

    Raises:
        DrafterError: When the count artifact is not built (evaluate's configurations read it), or ``methods``
            names a method the bench does not time.
    """
    import sys
    from dataclasses import replace

    import torch

    from pipeline.evaluation.configurations import Configurations  # deferred: pulls in torch
    from pipeline.evaluation.decode_bench import (  # deferred: pulls in torch
        decode_table,
        llama3_8b_models,
        measure,
        verify_curve,
        verify_curve_line,
    )
    from pipeline.evaluation.evaluator import decode_options  # deferred: pulls in torch
    from pipeline.evaluation.matrix import eval_prompts, resolve_device  # deferred: pulls in torch
    from pipeline.models.target import Target  # deferred: pulls in transformers

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    timed = DECODE_BENCH if methods is None else tuple(m.strip() for m in methods.split(",") if m.strip())
    unknown = [m for m in timed if m not in DECODE_BENCH]
    if unknown or not timed:
        raise DrafterError("`drafter bench decode --methods` names methods the bench does not time.",
                           expected=f"a comma-separated list of {', '.join(DECODE_BENCH)}",
                           found=", ".join(unknown) or repr(methods), fix="Leave --methods out to time them all.")
    step = plan(cfg, ["evaluate"])["evaluate"]
    built = {stage for stage, (_, path) in step.inputs.items() if (path / "manifest.json").is_file()}
    if "count" not in built:
        raise DrafterError("`drafter bench decode` decodes with evaluate's configurations, which read the count "
                           "artifact.", expected="the count artifact of this config built", found="not built",
                           fix="Run `drafter count --config <this config>` first (seconds on the kit).")
    runnable = [m for m in DECODE_BENCH if m in timed and set(METHODS[m].stages) <= built]
    skipped = [m for m in DECODE_BENCH if m in timed and m not in runnable]
    ev = replace(cfg.evaluate, methods=runnable)
    device = resolve_device(ev)
    target_ = Target(cfg.target)
    tokenizer, target = target_.tokenizer(), target_.model(device)
    prompts = [p for task in eval_prompts(cfg, tokenizer).values() for p in task]
    artifacts = {stage: step.input(stage) for stage in step.inputs if stage in built}
    configs = Configurations(replace(cfg, evaluate=ev), target, tokenizer, {"bench": prompts}, artifacts, device, log)
    proposers = {c.method: c.proposer for c in configs}
    options = decode_options(ev, device)
    curves: list[str] = []

    def curve(shape: str, model: Any, shape_prompts: list[list[int]]) -> None:
        with heartbeat(f"bench decode {shape}: the target's forward by tokens fed", log):
            line = verify_curve_line(shape, verify_curve(model, shape_prompts, ev.max_new_tokens,
                                                         max(ev.gammas) + 1, options, steps, cold))
        log(f"bench decode {line}")
        curves.append(line)

    with torch.no_grad():
        rows = measure("tiny", target, proposers, prompts, ev.gammas, ev.max_new_tokens, options, steps, log=log,
                       eos=stop_ids(tokenizer, target), cold=cold)
        curve("tiny", target, prompts)
    notes = [f"Not built for this config, so not timed: {', '.join(skipped)} (run `drafter run --config ...` first)."
             ] if skipped else []
    if shape == "llama3-8b":
        if device != "cuda":
            notes.append("llama3-8b: needs a CUDA device (8B parameters in bf16); not run on this CPU.")
        else:
            kit_alpha = {(r.method, r.gamma): r.alpha for r in rows if r.alpha is not None}
            big, big_proposers = llama3_8b_models(torch.device(device), methods=timed)
            big_prompts = [torch.randint(3, 128_000, (128,), generator=torch.Generator().manual_seed(i)).tolist()
                           for i in range(2)]
            with torch.no_grad():
                rows += measure("llama3-8b", big, big_proposers, big_prompts, ev.gammas, ev.max_new_tokens, options,
                                steps, kit_alpha=kit_alpha, log=log, cold=cold)
                curve("llama3-8b", big, big_prompts)
    notes += curves
    if cold:
        notes.append("Bare forwards timed with cold caches (a buffer of 4x the last-level cache written before each).")
    return "\n".join([decode_table(rows), "", *notes])
