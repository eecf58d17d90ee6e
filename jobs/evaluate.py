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
from typing import Any

from jobs import count
from pipeline.artifacts import Artifact
from pipeline.configs import EvaluateConfig, PipelineConfig
from pipeline.errors import DrafterError
from pipeline.models import fingerprint, load_model, load_tokenizer
from pipeline.stage import BuildResult, StageRun, find_input, log, run_stage

KIND = "evaluation"
REGISTERED_KIND = "draft-vocab"


def eval_prompts(cfg: PipelineConfig, tokenizer: Any) -> dict[str, list[list[int]]]:
    """Token ids of the prompts of each task, under the target's chat template."""
    from pipeline.data.calibration import encode_prompt, first_prompt
    from pipeline.data.sources import load_conversations, load_humaneval, split_heldout

    ev = cfg.evaluate
    prompts: dict[str, list[list[int]]] = {}
    if "chat" in ev.tasks:
        convs, _ = load_conversations(cfg.generate.source)
        held = split_heldout(convs, cfg.generate.heldout_fraction, heldout=True)
        msgs = [m for c in held if (m := first_prompt(c)) is not None][: ev.prompts_per_task]
        prompts["chat"] = [encode_prompt(tokenizer, m, ev.max_prompt_tokens) for m in msgs]
    if "code" in ev.tasks:
        code = load_humaneval()[: ev.prompts_per_task]
        prompts["code"] = [encode_prompt(tokenizer, c.messages, ev.max_prompt_tokens) for c in code]
    for task, items in prompts.items():
        if not items:
            raise DrafterError(f"No evaluation prompts for task {task!r}.",
                               fix="Raise generate.heldout_fraction or use a larger source.")
    return prompts


def resolve_device(ev: EvaluateConfig) -> str:
    import torch

    if ev.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if ev.device == "cuda" and not torch.cuda.is_available():
        raise DrafterError("evaluate.device=cuda but no CUDA device is visible.", fix="Use evaluate.device=auto.")
    return ev.device


def speed_metric(ev: EvaluateConfig, device: str) -> str:
    if ev.gate_speed_metric != "auto":
        return ev.gate_speed_metric
    return "speedup" if device == "cuda" else "mbsu"


def _build(cfg: PipelineConfig, run: StageRun, counts_art: Artifact) -> BuildResult:
    import torch

    from pipeline.evaluation import Evaluator
    from pipeline.report import write_report

    ev = cfg.evaluate
    device = resolve_device(ev)
    tokenizer = load_tokenizer(cfg.target.tokenizer or cfg.target.model, cfg.target.revision)
    target = load_model(cfg.target.model, cfg.target.revision, dtype=cfg.target.dtype, device=device,
                        trust_remote_code=cfg.target.trust_remote_code)
    prompts = eval_prompts(cfg, tokenizer)
    evaluator = Evaluator(cfg, target, tokenizer, prompts, counts_art, device, run.log)
    started = time.perf_counter()
    results = evaluator.run()
    results["device"] = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    results["target"] = run.fingerprint
    results["inputs"] = {"counts": counts_art.id}
    results["gates"] = evaluator.gates(results, speed_metric(ev, device))
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
        from pipeline.evaluation import register_bundle

        register_bundle(cfg, artifact, counts_art, fp)
    return artifact


def summary_line(artifact: Artifact) -> str:
    m = artifact.metrics
    verdict = "passed" if m.get("gates_passed") else "FAILED"
    return f"gates {verdict}; chosen tau={m.get('chosen.tau')}, mbsu={m.get('chosen.mbsu')}"


__all__ = ["main", "KIND", "log"]
