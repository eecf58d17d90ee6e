"""Stage ``train_drafter``: an EAGLE-3 drafter trained on the target's own answers (EAGLE-3, §3).

Run alone with ``drafter train_drafter --config configs/tiny.yaml`` (it reuses, or first builds, the
calibration set of ``generate`` and the draft vocabulary of ``count``). The frozen target computes its
low/mid/high features and logits inside every training step (no hidden-state dump; ``features=cached``
writes one to the staging directory after printing its size), the drafter learns by the unrolled
training-time test on the assistant tokens, and the checkpoint kept is the one with the best simulated
accepted length on held-out calibration rows. Training runs under the harness
(:mod:`pipeline.training.harness`): DeepSpeed ZeRO on GPUs, DDP or one process on CPU, resumable after
a kill from ``<workdir>/staging/<id>``. The artifact holds ``model.safetensors`` +
``eagle3_config.json`` (:mod:`pipeline.drafters.store`), the serving exports under ``exports/``, and
``training.json`` (steps, best evaluation, strategy, DeepSpeed config, throughput).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import Artifact
from pipeline.config.schema import identity
from pipeline.config.sections import PipelineConfig
from pipeline.errors import DrafterError
from pipeline.models.target import Target
from pipeline.orchestration.dag import plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, run_stage
from pipeline.tracking import tracking_uri
from pipeline.training.harness import fit
from pipeline.training.plan import Prepared, frozen_target

SUMMARY: tuple[str, ...] = ("train_steps", "best.simulated_tau", "train_seconds")
"""Metrics ``drafter run`` prints for this stage: steps, the kept checkpoint's held-out simulated τ, training
time."""


def _check_disk(rows: list, cfg: PipelineConfig, run: StageRun, hidden: int, dtype: object) -> None:
    from pipeline.training.eagle3_task import feature_bytes  # deferred: pulls in torch

    need = feature_bytes(rows, hidden, dtype)
    free = shutil.disk_usage(run.staging).free
    limit = cfg.train_drafter.features_disk_limit_gb * 1e9
    run.log(f"features=cached: the feature cache needs {need / 1e9:.3f} GB for {len(rows)} rows "
            f"({free / 1e9:.1f} GB free under {run.staging}, limit {limit / 1e9:g} GB)")
    if need > limit or need > free:
        raise DrafterError(
            "The cached target features would not fit.",
            expected=f"at most {min(limit, free) / 1e9:.3f} GB (train_drafter.features_disk_limit_gb and the "
                     "free disk)", found=f"{need / 1e9:.3f} GB needed",
            fix="Use train_drafter.features=online (no disk), fewer rows (generate.limit, max_length), or "
                "raise features_disk_limit_gb on a larger disk.")


def prepare(cfg: PipelineConfig, calibration: Artifact, counts: Artifact) -> Prepared:
    """The frozen target, a freshly initialised drafter on the count artifact's draft vocabulary, and the
    calibration rows split into training and held-out (the DeepSpeed test trains exactly this)."""
    import torch

    from pipeline.data.rows import CalibrationRows  # deferred: pulls in torch
    from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter  # deferred: pulls in torch
    from pipeline.vocab.counting import draft_vocab_maps  # deferred: pulls in pyarrow

    td = cfg.train_drafter
    target, tokenizer, pad = frozen_target(cfg.target)
    d2t, t2d = draft_vocab_maps(counts, int(target.config.vocab_size))
    config = Eagle3Config.from_target(target.config, draft_vocab_size=int(d2t.size),
                                      aux_layer_ids=tuple(td.aux_layer_ids) if td.aux_layer_ids else None)
    torch.manual_seed(td.init_seed)
    drafter = Eagle3Drafter(config, target.get_input_embeddings())
    drafter.set_vocab_maps(d2t, t2d)
    if td.head_init == "target":
        drafter.init_head_from(target)
    data = CalibrationRows(calibration.path / "data", max_length=td.max_length, eval_fraction=td.eval_fraction,
                           eval_max_rows=td.eval_max_rows, min_length=td.ttt_steps + 2, what="the EAGLE-3 drafter",
                           fraction_key="train_drafter.eval_fraction")
    return Prepared(target, tokenizer, config, drafter, data, pad)


def _build(cfg: PipelineConfig, run: StageRun, calibration: Artifact, counts: Artifact) -> BuildResult | None:
    from pipeline.drafters.store import save_drafter  # deferred: pulls in torch
    from pipeline.training.eagle3_task import Eagle3Task, FeatureCache  # deferred: pulls in torch

    td = cfg.train_drafter
    ready = prepare(cfg, calibration, counts)
    target, config, drafter, data = ready.target, ready.config, ready.drafter, ready.data
    run.log(f"{data.describe()}; aux layers {config.aux_layer_ids}, draft vocab {config.draft_vocab_size}")
    cache = None
    if td.features == "cached":
        _check_disk(data.train, cfg, run, config.hidden_size, target.dtype)
        cache = FeatureCache(run.staging / "features", target, config.aux_layer_ids, data.train)
    task = Eagle3Task(drafter, target, data.heldout, ttt_steps=td.ttt_steps, decay=td.ttt_decay,
                      pad_id=ready.pad_id, cache=cache)
    result = fit(task, data.train, td.train, run.staging / "train",
                 tracking_uri=tracking_uri(cfg.mlflow, cfg.workdir_path), experiment=cfg.mlflow.experiment,
                 run_name=f"{run.artifact_id}/training", label="train_drafter",
                 identity={"drafter": dataclasses.asdict(config), "train_drafter": identity(td),
                           "inputs": [calibration.id, counts.id]})
    if not result.is_global_zero:
        return None
    metrics = result.stage_metrics(data)
    if task.cache_record is not None:
        filled = task.cache_record
        run.log(f"feature cache: {sum(filled['computed'])} of {filled['rows']} rows computed in {filled['seconds']:.1f} s "
                f"(by rank: {filled['computed']})")
    run.log(result.describe())
    report = {**result.record(),
              "features": td.features, "feature_cache": task.cache_record, "rows": data.record(),
              "aux_layer_ids": list(config.aux_layer_ids), "draft_vocab_size": config.draft_vocab_size,
              "counts": counts.id, "calibration": calibration.id}

    def write(out: Path) -> None:
        save_drafter(drafter, out)
        _exports(cfg, drafter, target, out / "exports")
        (out / "training.json").write_text(json.dumps(report, indent=2))

    return BuildResult(write, metrics)


def _exports(cfg: PipelineConfig, drafter: object, target: object, out: Path) -> None:
    """The serving layouts: EAGLE-3 / SGLang (``exports/eagle3``) and ``speculators`` for vLLM."""
    from pipeline.drafters.export import export_eagle3, export_speculators  # deferred: pulls in torch

    # in the checkpoint's dtype, which the engines load the target in (SGLang reads the draft's own: float32 -> float16)
    dtype = Target(cfg.target).checkpoint_dtype()
    export_eagle3(drafter, out / "eagle3", target_model=cfg.target.model, target_config=target.config, dtype=dtype)
    export_speculators(drafter, out / "speculators", target_model=cfg.target.model, target_config=target.config,
                       dtype=dtype)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Train (or reuse) the EAGLE-3 drafter this config plans for."""
    step = plan(cfg, ["train_drafter"])["train_drafter"]
    calibration, counts = step.input("generate"), step.input("count")
    return run_stage(cfg, step, [calibration, counts], build=lambda run: _build(cfg, run, calibration, counts), launch=launch)


def bench(cfg: PipelineConfig, steps: int = 10) -> str:
    """One training step (target features online, the unrolled test forward and backward, AdamW) against
    the frozen target's forward alone on the same micro-batch: the floor online training cannot beat.
    Both are timed in this run on this device (CUDA when present); the result is a table of ratios."""
    import torch

    from pipeline.timing import device_name  # deferred: pulls in torch
    from pipeline.training.eagle3_objective import target_features  # deferred: pulls in torch
    from pipeline.training.eagle3_task import Eagle3Task  # deferred: pulls in torch

    step = plan(cfg, ["train_drafter"])["train_drafter"]
    ready = prepare(cfg, step.input("generate"), step.input("count"))
    td = cfg.train_drafter
    device = "cuda" if torch.cuda.is_available() else "cpu"
    task = Eagle3Task(ready.drafter, ready.target, ready.data.heldout, ttt_steps=td.ttt_steps, decay=td.ttt_decay,
                      pad_id=ready.pad_id).to(device)
    micro = min(td.train.micro_batch_size, len(ready.data.train))
    batch = {k: v.to(device) for k, v in task.collate(ready.data.train[:micro]).items()}
    optimizer = torch.optim.AdamW([p for p in task.parameters() if p.requires_grad], lr=td.train.lr)

    def forward() -> None:
        target_features(ready.target, batch["input_ids"], batch["attention_mask"], ready.config.aux_layer_ids)

    def train_step() -> None:
        loss, _ = task.training_step(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed(fn: Any) -> float:
        for _ in range(2):  # warm-up: allocator, kernels
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    target_s, step_s = timed(forward), timed(train_step)
    tokens = int(batch["attention_mask"].sum())
    lines = [f"EAGLE-3 training step vs target forward on {device_name(device)}: micro-batch {micro} rows, "
             f"{tokens} tokens, "
             f"ttt_steps {td.ttt_steps}, draft vocab {ready.config.draft_vocab_size}, {steps} timed repetitions",
             "| what | ms | tokens/s | vs target forward |", "|---|---|---|---|",
             f"| target forward (features + logits) | {target_s * 1e3:.1f} | {tokens / target_s:.0f} | 1.00× |",
             f"| training step (online features + TTT fwd/bwd + AdamW) | {step_s * 1e3:.1f} | {tokens / step_s:.0f} "
             f"| {step_s / target_s:.2f}× |"]
    return "\n".join(lines)
