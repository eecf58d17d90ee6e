"""The evaluation matrix behind the ``evaluate`` stage: load, decode every configuration, gate.

:func:`evaluate_matrix` loads the target, builds each task's prompts, runs the
:class:`~pipeline.evaluation.evaluator.Evaluator` over the method × drafter × γ matrix and turns its rows
into verdicts with :func:`~pipeline.evaluation.results.decide_gates`, one gate set per bundle;
:func:`~pipeline.evaluation.publish.register_bundle` then publishes each passing bundle in the MLflow Model
Registry.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from pipeline.artifacts import Artifact, sha256_file, upstream_manifests
from pipeline.config.sections import PipelineConfig
from pipeline.config.stages import EvaluateConfig
from pipeline.data.calibration import PROMPT_DIGESTS, encode_prompt, first_prompt, prompt_digest
from pipeline.data.sources import load_conversations, split_heldout, unseen_humaneval
from pipeline.engine.methods import GATE_SETS
from pipeline.errors import DrafterError
from pipeline.evaluation.evaluator import Evaluator
from pipeline.evaluation.results import EvaluationResults, decide_gates
from pipeline.models.target import Target
from pipeline.timing import device_name


def prompts_seen(artifacts: Iterable[Artifact], store: Path) -> tuple[frozenset[str], list[str]]:
    """The prompt digests (:data:`~pipeline.data.calibration.PROMPT_DIGESTS`) of every calibration set behind
    ``artifacts`` (one of them, or one its inputs name, transitively: beside it, in a bundle's lineage, in ``store``),
    and those sets' ids. A set known by its manifest alone (a bundle's lineage holds no payload) or built before the
    digests is passed over: the plan-time split check (``check_heldout``) is all there is for it.

    Raises:
        DrafterError: A digest file that is not the one its manifest lists.
    """
    seen: set[str] = set()
    sets: dict[str, None] = {}
    for artifact in artifacts:
        for where, manifest in [(artifact.path, artifact.manifest), *upstream_manifests(artifact.path, store)]:
            listed = (manifest.get("files") or {}).get(PROMPT_DIGESTS)
            if manifest.get("stage") != "generate" or listed is None or manifest["id"] in sets:
                continue
            path = where / PROMPT_DIGESTS
            if not path.is_file():
                continue
            if sha256_file(path) != listed["sha256"]:
                raise DrafterError(f"{path} is not the file its calibration set's manifest lists.",
                                   expected=f"sha256 {listed['sha256']}", found=f"sha256 {sha256_file(path)}",
                                   fix=f"Delete {where} and rerun: the stage that built it builds it again.")
            seen.update(json.loads(path.read_text())["digests"])
            sets[manifest["id"]] = None
    return frozenset(seen), list(sets)


def eval_prompts(cfg: PipelineConfig, tokenizer: Any, log: Callable[[str], None] | None = None,
                 seen: frozenset[str] = frozenset(), source_sha256: str | None = None) -> dict[str, list[list[int]]]:
    """Token ids of the prompts of each task, under the target's chat template; ``log`` is told of a task with fewer
    than ``evaluate.prompts_per_task`` (its gates are decided on those). A prompt whose digest is in ``seen`` (a
    calibration set behind the evaluated artifacts holds it: :func:`prompts_seen`) is left out. ``source_sha256``:
    what a local ``generate.source`` hashed to when the stage was planned (its bytes must still be those)."""
    ev = cfg.evaluate
    prompts: dict[str, list[list[int]]] = {}
    left_out: dict[str, int] = {}
    if "chat" in ev.tasks:
        convs, _ = load_conversations(cfg.generate.source, revision=cfg.generate.source_revision, sha256=source_sha256)
        held = split_heldout(convs, cfg.generate.heldout_fraction, heldout=True)
        # the split hashes ids: a chat posted twice under two ids can sit on both sides, and its prompt would be
        # scored after the drafters trained on the target's answer to it
        here = {json.dumps(m) for c in split_heldout(convs, cfg.generate.heldout_fraction, heldout=False)
                if (m := first_prompt(c)) is not None}
        msgs = [m for c in held if (m := first_prompt(c)) is not None and json.dumps(m) not in here]
        kept = [m for m in msgs if prompt_digest(m) not in seen]
        left_out["chat"] = len(msgs) - len(kept)
        prompts["chat"] = [encode_prompt(tokenizer, m, ev.max_prompt_tokens, "evaluate.max_prompt_tokens")
                           for m in kept[: ev.prompts_per_task]]
    if "code" in ev.tasks:
        code = unseen_humaneval(cfg.generate.source, cfg.generate.heldout_fraction,
                                revision=cfg.generate.source_revision)
        kept_code = [c for c in code if prompt_digest(first_prompt(c) or c.messages) not in seen]
        left_out["code"] = len(code) - len(kept_code)
        prompts["code"] = [encode_prompt(tokenizer, c.messages, ev.max_prompt_tokens, "evaluate.max_prompt_tokens")
                           for c in kept_code[: ev.prompts_per_task]]
    for task, count in left_out.items():
        if count and log is not None:
            log(f"evaluate: {count} held-out {task} prompt(s) left out: a calibration set behind the evaluated "
                "artifacts was built from them (its source was named otherwise, or its split has moved since)")
    for task, items in prompts.items():
        if not items:
            raise DrafterError(f"No evaluation prompts for task {task!r}.",
                               fix="Raise generate.heldout_fraction or use a larger source.")
        if len(items) < ev.prompts_per_task and log is not None:
            log(f"evaluate: {len(items)} {task} prompts, not evaluate.prompts_per_task={ev.prompts_per_task}: the "
                "held-out share holds no more (raise generate.heldout_fraction for more)")
    return prompts


def resolve_device(ev: EvaluateConfig) -> str:

    if ev.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if ev.device == "cuda" and not torch.cuda.is_available():
        raise DrafterError("evaluate.device=cuda but no CUDA device is visible.", fix="Use evaluate.device=auto.")
    return ev.device


def speed_metric(ev: EvaluateConfig, device: str) -> str:
    if ev.gate_speed_metric != "auto":
        return ev.gate_speed_metric
    return "speedup" if device == "cuda" else "mbsu"


INPUT_KEYS = {"count": "counts", "train_drafter": "eagle3"}
"""Upstream stage → its key in the results' ``inputs`` record where that is not the stage's name (report.json's
names, kept as they were)."""


def evaluate_matrix(cfg: PipelineConfig, artifacts: dict[str, Artifact], target_fingerprint: dict,
                    log: Callable[[str], None], staging: Path | None = None,
                    source_sha256: str | None = None) -> EvaluationResults:
    """Load the target, build the prompts, run the whole matrix and decide the gates of every bundle whose
    artifacts were read (:data:`~pipeline.engine.methods.GATE_SETS`: the draft-vocabulary bundle's always; the
    EAGLE-3, DynaSpec and RDK bundles' when their train_drafter, cluster + train_router and estimate_rdk
    artifacts are among ``artifacts``).

    Args:
        artifacts: Upstream stage → its artifact: ``count`` always, and whichever others the evaluated methods
            read (the evaluate stage's plan inputs).
        staging: Where the evaluator stages each finished piece, for a rerun after a kill to keep (the stage's
            staging directory); None stages nothing.
        source_sha256: As :func:`eval_prompts` (the stage's plan).
    """
    ev = cfg.evaluate
    device = resolve_device(ev)
    target_ = Target(cfg.target)
    tokenizer = target_.tokenizer()
    target = target_.model(device)
    seen, _ = prompts_seen(artifacts.values(), cfg.workdir_path / "artifacts")
    evaluator = Evaluator(cfg, target, tokenizer, eval_prompts(cfg, tokenizer, log, seen, source_sha256), artifacts, device, log,
                          staging)
    rows, checks = evaluator.run()
    thresholds = {"speed_metric": speed_metric(ev, device), "tau_min": ev.gate_tau_min,
                  "speed_min": ev.gate_speed_min}
    verdicts = {gate.results_field: decide_gates(rows, checks, gate=gate, evaluated=ev.methods, **thresholds)
                for gate in GATE_SETS.values() if all(stage in artifacts for stage in gate.artifacts)}
    inputs = {INPUT_KEYS.get(stage, stage): artifact.id for stage, artifact in artifacts.items()}
    eagle3_training = simulated_figures(artifacts["train_drafter"]) if "train_drafter" in artifacts else None
    dflash_training = simulated_figures(artifacts["train_dflash"]) if "train_dflash" in artifacts else None
    rdk_analysis = rdk_record(artifacts["estimate_rdk"]) if "estimate_rdk" in artifacts else None
    return EvaluationResults(rows=rows, checks=checks, device=device_name(device), target=target_fingerprint,
                             inputs=inputs,
                             eagle3_training=eagle3_training, dynaspec_policy=evaluator.policy_record,
                             rdk_analysis=rdk_analysis, dflash_training=dflash_training,
                             decode_path=evaluator.options.path,
                             first_token="prefill" if evaluator.options.first_token == "prefill" else None, **verdicts)


def rdk_record(rdk: Artifact) -> dict:
    """estimate_rdk's choices and held-out α per kept set, for the report (no τ curves: they stay in rdk.json)."""
    import json

    record = json.loads(rdk.file("rdk.json").read_text())
    def brief(item: dict) -> dict:
        return {k: brief(v) if k == "code" else v for k, v in item.items() if k != "tau_curve"}

    levels = {name: brief(item) for name, item in record["levels"].items()}
    keep = ("top_k", "count", "covered", "nnz", "sparse_bytes", "dense_bytes", "contexts_per_s", "positions")
    return {"artifact": rdk.id, "levels": levels, **{k: record.get(k) for k in keep}}


def simulated_figures(trained: Artifact) -> dict:
    """A training stage's prediction for its drafter (train_drafter, train_dflash): the kept checkpoint's held-out
    simulated τ and accuracies."""
    import json

    best = json.loads(trained.file("training.json").read_text()).get("best") or {}
    return {"artifact": trained.id, "step": best.get("step"), **(best.get("metrics") or {})}
