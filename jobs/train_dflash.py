"""Stage ``train_dflash``: a DFlash block drafter trained on the target's own answers.

Run alone with ``drafter train_dflash --config configs/tiny-dflash.yaml`` (it reuses, or first builds, the
calibration set of ``generate``, and with ``train_dflash.head: draft`` the draft vocabulary of ``count``); ``drafter
run`` includes it only when ``evaluate.methods`` names ``dflash``
(the embedded default does not: see the README's "DFlash"). The frozen target computes its tapped layers and
logits inside every training step (online, no hidden-state dump), the drafter learns the decayed block loss
on anchored blocks of the assistant tokens (:mod:`pipeline.training.dflash_task`), and the checkpoint kept is
the one with the best held-out simulated τ. Training runs under the same harness as ``train_drafter``
(:mod:`pipeline.training.harness`: DeepSpeed ZeRO on GPUs, DDP or one process on CPU, resumable after a kill
from ``<workdir>/staging/<id>``). The artifact holds ``model.safetensors`` + ``dflash_config.json``, the serving
exports under ``exports/`` (``dflash/``: the reference layout vLLM and SGLang load; ``speculators/``) and
``training.json`` (the same fields as ``train_drafter``'s).
"""

from __future__ import annotations

import dataclasses
import json
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


SGLANG_MASK_TOKEN = "<|MASK|>"
"""The mask token SGLang's DFlash worker (0.5.23) checks ``dflash_config.mask_token_id`` against when a drafter's
config names none: a tokenizer holding it at another id stops the server ("mask_token_id conflicts with tokenizer
vocab id")."""


def mask_token_id(configured: int | None, tokenizer: Any, vocab_size: int) -> int:
    """``train_dflash.mask_token_id``, else the tokenizer's ``<|MASK|>`` token (the reference drafters' and SGLang's),
    else its pad token, else its unknown token, else the last id."""
    if configured is not None and not 0 <= configured < vocab_size:
        raise DrafterError("train_dflash.mask_token_id is not a row of the target's embedding.",
                           expected=f"a token id in [0, {vocab_size}) or null", found=str(configured),
                           fix="Leave train_dflash.mask_token_id null for the tokenizer's pad token, or name a token "
                               "id of the target's vocabulary.")
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    own = vocab.get(SGLANG_MASK_TOKEN)
    own = own if own is not None and 0 <= own < vocab_size else None
    if configured is not None and own is not None and configured != own:
        raise DrafterError(f"train_dflash.mask_token_id is not the target tokenizer's {SGLANG_MASK_TOKEN} token.",
                           expected=f"{own} (SGLang refuses a DFlash drafter whose mask token id differs from "
                                    f"the tokenizer's {SGLANG_MASK_TOKEN})",
                           found=f"train_dflash.mask_token_id={configured}",
                           fix=f"Leave train_dflash.mask_token_id null (it then takes {own}), or set it to {own}.")
    pad, unknown = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "unk_token_id", None)
    for candidate in (configured, own, pad, unknown):
        if candidate is not None:
            return int(candidate)
    return vocab_size - 1


def prepare(cfg: PipelineConfig, calibration: Artifact, counts: Artifact | None = None) -> Prepared:
    """The frozen target, a freshly initialised DFlash drafter on its embedding and head (or, with ``head: draft``,
    its own head over the draft vocabulary of ``counts``), and the calibration rows split into training and
    held-out."""
    import torch

    from pipeline.data.rows import CalibrationRows  # deferred: pulls in torch
    from pipeline.drafters.dflash import DFlashConfig, DFlashDrafter  # deferred: pulls in torch
    from pipeline.vocab.counting import draft_vocab_maps  # deferred: pulls in pyarrow

    tc = cfg.train_dflash
    target, tokenizer, pad = frozen_target(cfg.target)
    vocab = int(target.config.vocab_size)
    maps = None
    if tc.head == "draft":
        if counts is None:
            raise DrafterError("train_dflash.head is draft but no count artifact was given.",
                               expected="the count artifact the plan names", found="none",
                               fix="Run `drafter train_dflash` (it builds count first) or set train_dflash.counts.")
        maps = draft_vocab_maps(counts, vocab)
    mask = mask_token_id(tc.mask_token_id, tokenizer, vocab)
    try:
        config = DFlashConfig.from_target(
            target.config, num_hidden_layers=tc.num_layers, block_size=tc.block_size, mask_token_id=mask,
            target_layer_ids=tuple(tc.target_layer_ids) if tc.target_layer_ids else None,
            num_key_value_heads=tc.num_key_value_heads, intermediate_size=tc.intermediate_size,
            num_attention_heads=tc.num_attention_heads, draft_vocab_size=None if maps is None else int(maps[0].size))
    except DrafterError as error:  # the drafter's shape is the target's, changed by this section: say which keys
        if error.fix is not None:
            raise
        raise DrafterError(error.problem, expected=error.expected, found=error.found,
                           fix="The draft layers copy the target's shape except where train_dflash sets "
                               "num_attention_heads, num_key_value_heads or intermediate_size (null copies the "
                               "target's): change the one named above.") from None
    torch.manual_seed(tc.init_seed)
    drafter = DFlashDrafter(config, target.get_input_embeddings(), target.get_output_embeddings())
    if maps is not None:
        drafter.set_vocab_maps(*maps)
    final_norm = getattr(getattr(target, "model", None), "norm", None)
    if getattr(final_norm, "weight", None) is not None:
        with torch.no_grad():  # the frozen LM head reads the drafter's norm: start it at the target's own scale
            drafter.norm.weight.copy_(final_norm.weight)
    data = CalibrationRows(calibration.path / "data", max_length=tc.max_length, eval_fraction=tc.eval_fraction,
                           eval_max_rows=tc.eval_max_rows, min_length=3, what="the DFlash drafter",
                           fraction_key="train_dflash.eval_fraction")
    return Prepared(target, tokenizer, config, drafter, data, pad)


def _build(cfg: PipelineConfig, run: StageRun, calibration: Artifact, counts: Artifact | None) -> BuildResult | None:
    from pipeline.drafters.dflash_export import export_layouts, save_dflash  # deferred: pulls in torch
    from pipeline.training.dflash_task import DFlashTask  # deferred: pulls in torch

    tc = cfg.train_dflash
    ready = prepare(cfg, calibration, counts)
    target, config, drafter, data = ready.target, ready.config, ready.drafter, ready.data
    run.log(f"{data.describe()}; tapped layers {config.target_layer_ids} (hidden_states "
            f"{list(config.hidden_state_indices)}), {config.num_hidden_layers} layer(s), block {config.block_size}, "
            f"mask token {config.mask_token_id}, head {tc.head}"
            + ("" if config.draft_vocab_size is None else f" ({config.draft_vocab_size} ids of count {counts.id})"))
    task = DFlashTask(drafter, target, data.heldout, anchors_per_row=tc.anchors_per_row, decay=tc.loss_decay,
                      loss=tc.loss, next_round_anchors=tc.next_round_anchors, pad_id=ready.pad_id)
    result = fit(task, data.train, tc.train, run.staging / "train",
                 tracking_uri=tracking_uri(cfg.mlflow, cfg.workdir_path), experiment=cfg.mlflow.experiment,
                 run_name=f"{run.artifact_id}/training", label="train_dflash",
                 identity={"drafter": dataclasses.asdict(config), "train_dflash": identity(tc),
                           "inputs": [a.id for a in (calibration, counts) if a is not None]})
    if not result.is_global_zero:
        return None
    metrics = result.stage_metrics(data)
    run.log(result.describe())
    report = {**result.record(),
              "features": "online", "rows": data.record(),
              "target_layer_ids": list(config.target_layer_ids), "block_size": config.block_size,
              "calibration": calibration.id, "head": tc.head, "draft_vocab_size": config.draft_vocab_size,
              "counts": None if counts is None else counts.id}

    def write(out: Path) -> None:
        save_dflash(drafter, out)
        export_layouts(drafter, out / "exports", target_model=cfg.target.model, target_config=target.config,
                       dtype=Target(cfg.target).checkpoint_dtype())  # the engines' dtype for the target
        (out / "training.json").write_text(json.dumps(report, indent=2))

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Train (or reuse) the DFlash drafter this config plans for."""
    step = plan(cfg, ["train_dflash"])["train_dflash"]
    inputs = {stage: step.input(stage) for stage in step.inputs}  # count only with head draft (the DAG's `when`)
    calibration, counts = inputs["generate"], inputs.get("count")
    return run_stage(cfg, step, list(inputs.values()), build=lambda run: _build(cfg, run, calibration, counts),
                     launch=launch)
