"""DeepSpeed in the training harness: the config it generates, that config through ``deepspeed.initialize`` on CPU
(the same losses as the harness's own path, and a bit-identical resume of the ZeRO optimizer state), Lightning's
DeepSpeed backward dividing the loss by the accumulation count once, and Lightning's DeepSpeed strategy end to end
on a GPU. The runs execute :mod:`tests.training.harness_script` (its ``_deepspeed`` and ``_train``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.config.training import TrainConfig
from pipeline.training import checkpoints as ckpt
from pipeline.training.harness import fit
from pipeline.training.strategy import deepspeed_config
from tests.training.harness_script import BASE, TinyRegressor, config, dataset, run_script, weights


def test_deepspeed_config_is_pure_function_of_typed_fields() -> None:
    cfg = TrainConfig(global_batch_size=8, micro_batch_size=2, gradient_clipping=0.5, offload_optimizer=True)
    ds = deepspeed_config(cfg)
    same = TrainConfig(global_batch_size=8, micro_batch_size=2, gradient_clipping=0.5, offload_optimizer=True)
    assert deepspeed_config(same) == ds and json.loads(json.dumps(ds)) == ds  # equal fields, equal config; JSON-clean
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 4
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": True}
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert "optimizer" not in ds and "scheduler" not in ds  # the harness's AdamW/LambdaLR are passed in


@pytest.fixture(scope="module")
def zero2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One process of the ZeRO-2 script (fp32): a run with each backward (DeepSpeed's own, through the harness's
    Lightning plugin, through Lightning's stock plugin), then how a bf16 engine leaves a module's dtypes."""
    tmp = tmp_path_factory.mktemp("zero2")
    return run_script({"mode": "deepspeed", "cfg": {**BASE, "bf16": False}, "staging": str(tmp / "ds"),
                       "out": str(tmp / "ds-out"), "backwards": ["engine", "lightning", "lightning_stock"],
                       "bf16_dtypes": {**BASE, "bf16": True}}, timeout=600)


@pytest.fixture(scope="module")
def harness_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Every micro-batch loss of the harness's own single-process run of the fp32 config the ZeRO-2 runs use."""
    model = TinyRegressor()
    fit(model, dataset(), config(bf16=False), tmp_path_factory.mktemp("harness"))
    return model.losses


@pytest.mark.slow
def test_a_finished_runs_rerun_holds_the_module_in_the_dtype_deepspeeds_engine_leaves_it(zero2: dict) -> None:
    """DeepSpeed with bf16 casts the whole module to bfloat16, so an uninterrupted run publishes bfloat16 weights and
    computes its after-training figures (the router's curves) in bfloat16. A run killed after its last checkpoint
    builds no engine when rerun: it published float32 weights and float32 figures under the same id. The rerun
    now casts as the engine does (``as_trained``); here the real engine on CPU and ``as_trained`` agree on every
    parameter's and buffer's dtype, and the other strategies keep float32."""
    from pipeline.training.harness import as_trained

    found = zero2["dtypes"]
    assert found["engine"] == found["as_trained"]
    assert set(found["engine"].values()) == {"torch.bfloat16"}
    for strategy in ("single", "ddp"):
        assert {p.dtype for p in as_trained(TinyRegressor(), config(bf16=True), strategy).parameters()} == {
            torch.float32}
    assert {p.dtype for p in as_trained(TinyRegressor(), config(bf16=False), "deepspeed").parameters()} == {
        torch.float32}


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu_matches_harness_and_resumes(harness_losses: list[float], zero2: dict) -> None:
    """The harness's exact ZeRO-2 config (fp32 on CPU) through ``deepspeed.initialize``, fed the same
    batches, seeds, AdamW and schedule as the harness's single-process path. Tolerance: 1e-4 relative on
    every micro-batch loss over 16 steps. Both paths compute the same fp32 update; they differ only in
    rounding, measured at most 1.8e-7 (ZeRO clips by ``grad / ((norm + 1e-6) / max_norm)`` on one flat buffer, torch by
    ``grad * max_norm / (norm + 1e-6)`` per tensor); a wrong lr, beta, clip or
    accumulation scale moves the losses by more than 1e-3 within two steps at lr 1e-2. The ZeRO optimizer
    state also goes through the harness's checkpoint files and back: resuming gives bit-identical weights."""
    assert zero2["deepspeed_config"] == deepspeed_config(config(bf16=False))
    ds = zero2["runs"]["engine"]
    assert ds["losses"] == pytest.approx(harness_losses, rel=1e-4)
    assert ds["resumed_bit_identical"] is True


@pytest.mark.slow
def test_lightnings_deepspeed_backward_divides_the_loss_by_the_accumulation_once(harness_losses: list[float],
                                                                                 zero2: dict) -> None:
    """Lightning divides each micro-batch's loss by the accumulation count and its DeepSpeed plugin's backward let
    DeepSpeed divide it again, so ZeRO clipped (0.5) a gradient half the mean's here (accumulation 2) and the
    weights depended on how many micro-batches a step took. Through the harness's plugin, the same engine and
    batches give the single-process harness's losses (1e-4 relative, as above); through Lightning's stock plugin
    they do not (the losses move by more than 1e-3)."""
    runs = zero2["runs"]
    assert runs["lightning"]["losses"] == pytest.approx(harness_losses, rel=1e-4)
    assert max(abs(a - b) / abs(b) for a, b in zip(runs["lightning_stock"]["losses"], harness_losses)) > 1e-3


@pytest.mark.gpu
@pytest.mark.slow
def test_lightning_deepspeed_stage_2_end_to_end_on_gpu(tmp_path: Path) -> None:
    cfg = {**BASE, "strategy": "deepspeed", "accelerator": "gpu", "devices": 1, "max_steps": 8}
    first = run_script({"mode": "train", "cfg": cfg, "staging": str(tmp_path / "s"), "out": str(tmp_path / "o"),
                        "stop_after": 4})
    assert first["stopped"] and [p.name for p in ckpt.checkpoints(tmp_path / "s")] == ["step-00000004"]
    done = run_script({"mode": "train", "cfg": cfg, "staging": str(tmp_path / "s"), "out": str(tmp_path / "o")})
    assert done["strategy"] == "deepspeed" and done["start_step"] == 4 and done["steps"] == 8
    assert done["deepspeed_config"]["zero_optimization"]["stage"] == 2
    assert math.isfinite(done["metrics"]["loss"]) and len(done["losses"]) == 4 * 2
    assert set(weights(tmp_path / "o" / "model.safetensors")) == {"net.0.weight", "net.0.bias", "net.3.weight",
                                                                   "net.3.bias"}
