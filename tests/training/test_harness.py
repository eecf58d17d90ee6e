"""The training harness: config checks, step-derived data order, resume after a kill -9 (bit-identical on CPU),
refusal of foreign or damaged checkpoints, MLflow metrics and real 2-process CPU DDP. DeepSpeed's tests are in
:mod:`tests.training.test_deepspeed`; their runs execute this file's script side too.

Runs that need their own process (kill -9, DDP, DeepSpeed) execute this file as a script:
``python -m tests.training.test_harness '<json>'`` (see :func:`_main`), so Lightning's launcher re-executes
a real entry point and no process-group or environment state leaks into pytest.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from pipeline.config.schema import from_dict
from pipeline.config.training import TrainConfig
from pipeline.errors import DrafterError
from pipeline.training import checkpoints as ckpt
from pipeline.training.harness import fit, save_final
from pipeline.training.plan import trainable_parameters
from pipeline.training.strategy import deepspeed_config, lr_factor

ROOT = Path(__file__).resolve().parents[2]
N_EXAMPLES = 96
# 4 x 2 = 8 examples a step, 12 steps an epoch: 16 steps cross an epoch boundary (a new permutation).
BASE = {"max_steps": 16, "global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 2,
        "checkpoint_every": 4, "progress_bar": False, "strategy": "single", "accelerator": "cpu"}


class TinyRegressor(torch.nn.Module):
    """A small MLP with dropout (exercises the per-micro-batch seed) and a frozen layer (not saved)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 1))
        self.seen: list[int] = []
        self.losses: list[float] = []
        self.counted: list[tuple[int, int]] = []

    def training_step(self, batch: dict) -> tuple[torch.Tensor, dict]:
        if delay := float(os.environ.get("HARNESS_TEST_STEP_SLEEP", 0)):
            time.sleep(delay)  # the kill test needs steps slow enough to land a SIGKILL mid-run
        self.seen += batch["id"].tolist()
        pred = self.net(batch["x"] + self.frozen(batch["x"]))
        loss = torch.nn.functional.mse_loss(pred, batch["y"])
        self.losses.append(loss.item())
        thirds = batch["id"] % 3 == 0  # a count whose denominator differs from micro-batch to micro-batch
        self.counted.append((int((thirds & (batch["id"] % 2 == 0)).sum()), int(thirds.sum())))
        return loss, {"mae": (pred - batch["y"]).abs().mean(), "count.even": (thirds & (batch["id"] % 2 == 0)).sum(),
                      "count.thirds": thirds.sum()}

    def step_figures(self, counts: dict[str, float]) -> dict[str, float]:
        return {"even_share": counts["even"] / max(1.0, counts["thirds"])}

    forward = training_step  # deepspeed.initialize's engine calls forward

    def count_tokens(self, batch: dict) -> int:
        return batch["x"].numel()


class SimulatedCrash(Exception):
    pass


def crash_after_checkpoint(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make the harness raise :class:`SimulatedCrash` right after checkpoint ``step`` lands."""
    real_save = ckpt.save_checkpoint

    def crash(*args: object, **kwargs: object) -> Path:
        path = real_save(*args, **kwargs)
        if args[1] == step:
            raise SimulatedCrash(f"after the step-{step} checkpoint")
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", crash)


def dataset(n: int = N_EXAMPLES) -> list[dict]:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * 2 - x[:, 1:2]).tanh() + 0.05 * torch.randn(n, 1, generator=g)
    return [{"x": x[i], "y": y[i], "id": i} for i in range(n)]


def config(**overrides: object) -> TrainConfig:
    return from_dict(TrainConfig, {**BASE, **overrides})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(args: dict, *, timeout: float = 300) -> dict:
    out = Path(args["out"])
    done = subprocess.run([sys.executable, "-m", "tests.training.test_harness", json.dumps(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **args.get("env", {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "result.rank0.json").read_text())


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs: max |diff| {(a[key] - b[key]).abs().max()}"


# --- fast, in-process --------------------------------------------------------------------------------

def test_training_seconds_add_up_over_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train_seconds (training.json, the stage's summary) counted only the last process: a run resumed after a kill
    reported the time since the resume, and a rerun of a finished run about nothing. Each checkpoint now carries the
    seconds trained so far. Every micro-batch here sleeps 0.1 s: 12 steps x 2 micro-batches before the crash (2.4 s)
    and 4 x 2 after it (0.8 s); the resumed run and the finished run's rerun report at least the 3.2 s slept."""
    crash_after_checkpoint(monkeypatch, 12)
    monkeypatch.setenv("HARNESS_TEST_STEP_SLEEP", "0.1")
    with pytest.raises(SimulatedCrash, match="after the step-12 checkpoint"):
        fit(TinyRegressor(), dataset(), config(), tmp_path / "run")
    monkeypatch.undo()
    monkeypatch.setenv("HARNESS_TEST_STEP_SLEEP", "0.1")
    resumed = fit(TinyRegressor(), dataset(), config(), tmp_path / "run")
    assert resumed.start_step == 12 and resumed.seconds >= 3.2, resumed.seconds
    rerun = fit(TinyRegressor(), dataset(), config(), tmp_path / "run")
    assert rerun.start_step == 16 and 3.2 <= rerun.seconds <= resumed.seconds, (rerun.seconds, resumed.seconds)


def test_config_checks_raise_drafter_error() -> None:
    with pytest.raises(DrafterError, match="train.schedule"):
        TrainConfig(schedule="linear")
    with pytest.raises(DrafterError, match="train.zero_stage"):
        TrainConfig(zero_stage=3)
    with pytest.raises(DrafterError, match="train.betas"):
        TrainConfig(betas=[0.9])
    with pytest.raises(DrafterError, match="needs CUDA"):
        from pipeline.training.strategy import resolve_strategy

        resolve_strategy(TrainConfig(strategy="deepspeed", accelerator="cpu"))


def test_lr_schedule_warmup_then_cosine_or_constant() -> None:
    cosine = [lr_factor(s, total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) for s in range(10)]
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[-1] > 0.1
    assert cosine[2:] == sorted(cosine[2:], reverse=True)
    assert lr_factor(10, total_steps=10, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert {lr_factor(s, total_steps=10, warmup_steps=0, schedule="constant", min_lr_ratio=0) for s in range(10)} == {1.0}


def test_data_order_is_a_function_of_seed_epoch_and_step() -> None:
    def sampler(start: int = 0, rank: int = 0, world: int = 1, seed: int = 0) -> ckpt.StepBatchSampler:
        return ckpt.StepBatchSampler(N_EXAMPLES, micro_batch_size=4, accumulation=2 // world, world_size=world,
                                     rank=rank, seed=seed, start_step=start, total_steps=30)

    full = list(sampler())
    assert list(sampler(start=7)) == full[7 * 2 :]  # resume at step 7 continues with the same batches
    epoch0 = [i for batch in full[:24] for i in batch]
    assert sorted(epoch0) == list(range(N_EXAMPLES))  # an epoch is a permutation (12 steps x 8)
    assert full[:24] != full[24:48] and list(sampler(seed=1)) != full  # reshuffled per epoch and per seed
    ranks = [list(sampler(rank=r, world=2)) for r in range(2)]
    for step in range(30):  # 2 ranks x 1 micro-batch see the same examples as 1 rank x 2 micro-batches
        assert not set(ranks[0][step]) & set(ranks[1][step])
        assert ranks[0][step] + ranks[1][step] == full[2 * step] + full[2 * step + 1]


def test_per_step_metrics_go_to_mlflow(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = fit(TinyRegressor(), dataset(), config(max_steps=6, log_every=1), tmp_path / "s", tracking_uri=uri,
                 experiment="harness-test")
    assert set(result.metrics) >= {"loss", "mae", "lr", "tokens_per_s", "examples_per_s"}
    client = MlflowClient(uri)
    for key in ("loss", "mae", "lr", "tokens_per_s"):
        assert [m.step for m in client.get_metric_history(result.mlflow_run_id, key)] == list(range(1, 7)), key
    lrs = [m.value for m in client.get_metric_history(result.mlflow_run_id, "lr")]
    assert lrs[:2] == [5e-3, 1e-2] and lrs[-1] < lrs[2]  # warmup 2 steps, then cosine
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "0.01"


def test_resume_after_a_crash_is_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, cfg = dataset(), config()
    reference = TinyRegressor()
    result = fit(reference, data, cfg, tmp_path / "a")
    assert result.steps == 16 and result.start_step == 0 and result.strategy == "single"

    crash_after_checkpoint(monkeypatch, 8)
    with pytest.raises(SimulatedCrash, match="after the step-8 checkpoint"):
        fit(TinyRegressor(), data, cfg, tmp_path / "b")
    monkeypatch.undo()
    assert [p.name for p in ckpt.checkpoints(tmp_path / "b")] == ["step-00000008"]
    resumed = TinyRegressor()
    again = fit(resumed, data, cfg, tmp_path / "b")
    assert again.start_step == 8 and again.steps == 16
    assert_bit_identical(trainable_parameters(reference), trainable_parameters(resumed))
    done = fit(TinyRegressor(), data, cfg, tmp_path / "b")  # already finished: no training, same result
    assert done.start_step == 16


def test_global_batch_splits_over_ranks_and_micro_batches() -> None:
    cfg = TrainConfig(global_batch_size=8, micro_batch_size=4)
    assert [cfg.batch_layout(w) for w in (1, 2, 4, 8)] == [(4, 2), (4, 1), (2, 1), (1, 1)]
    with pytest.raises(DrafterError, match=r"does not split evenly(.|\n)*8 / 3 ranks"):
        cfg.batch_layout(3)
    with pytest.raises(DrafterError, match="does not split evenly"):
        TrainConfig(global_batch_size=8, micro_batch_size=3).batch_layout(1)
    # Micro-batching and devices are run settings: not in the hashed identity.
    from pipeline.config.schema import identity

    assert identity(TrainConfig(micro_batch_size=2, devices=4)) == identity(TrainConfig(micro_batch_size=8))
    assert identity(TrainConfig(global_batch_size=16)) != identity(TrainConfig())


def test_a_steps_counted_figures_pool_its_micro_batches(tmp_path: Path) -> None:
    """Figures such as a drafter's training agreement (``final.acc_*``) were the mean of each micro-batch's ratio:
    a micro-batch with 1 learnable row weighed as much as one with 40. Metrics a module names ``count.*`` are summed
    over the step's micro-batches (and ranks: the DDP test below) and its ``step_figures`` makes the ratio."""
    model = TinyRegressor()
    result = fit(model, dataset(), config(max_steps=3, micro_batch_size=2), tmp_path / "s")  # 4 micro-batches a step
    last = model.counted[-4:]
    pooled = sum(n for n, _ in last) / sum(d for _, d in last)
    mean_of_ratios = sum(n / max(1, d) for n, d in last) / len(last)
    assert pooled != pytest.approx(mean_of_ratios)  # the draw tells the two apart
    assert result.metrics["even_share"] == pytest.approx(pooled, rel=1e-12)
    assert not any(key.startswith("count.") for key in result.metrics)


def test_micro_batching_does_not_change_the_result(tmp_path: Path) -> None:
    """1 micro-batch of 8 vs 4 of 2 per step (no dropout): the same gradients up to float summation order
    (bound 1e-5 relative on every weight after 16 steps)."""
    data = dataset()

    def trained(micro: int) -> dict[str, torch.Tensor]:
        model = TinyRegressor()
        model.net[2].p = 0.0  # dropout draws depend on the micro-batch index; the math must not
        fit(model, data, config(micro_batch_size=micro), tmp_path / f"m{micro}")
        return {k: p.detach().clone() for k, p in trainable_parameters(model).items()}

    whole, split = trained(8), trained(2)
    assert not torch.equal(whole["net.0.weight"], TinyRegressor().net[0].weight)  # it trained
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], rtol=1e-5, atol=1e-7)


class ScoredRegressor(TinyRegressor):
    """TinyRegressor whose ``evaluate()`` scores the weights by negative MSE on held-out rows."""

    selection_metric = "neg_mse"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.scores: list[float] = []

    def evaluate(self) -> dict[str, float]:
        held = dataset(24)  # another draw of x with the same seed: rows the run never trains on differ
        x = torch.stack([e["x"] for e in held]) * 1.5
        y = -torch.stack([e["y"] for e in held])  # a shifted task: the best weights come mid-run
        score = -float(torch.nn.functional.mse_loss(self.net(x + self.frozen(x)), y))
        self.scores.append(score)
        return {"neg_mse": score, "mse": -score}


def test_best_evaluated_weights_are_kept_and_survive_a_resume(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    data, cfg = dataset(), config(eval_every=2, lr=0.2, warmup_steps=0)
    model = ScoredRegressor()
    result = fit(model, data, cfg, tmp_path / "a")
    steps = list(range(2, 17, 2))
    assert len(model.scores) == len(steps)
    best = max(range(len(steps)), key=lambda i: (model.scores[i], -i))  # the first of equal scores wins
    assert result.best["step"] == steps[best] and result.best["score"] == model.scores[best]
    assert result.best["metrics"]["mse"] == -model.scores[best]
    kept = sorted(p.name for p in (tmp_path / "a").glob("best-*"))
    assert kept == [f"best-{steps[best]:08d}.safetensors"]
    assert_bit_identical(weights(tmp_path / "a" / kept[0]),
                         {k: p.detach() for k, p in trainable_parameters(model).items()})
    assert steps[best] < 16  # the shifted held-out task peaks mid-run: the module holds those weights
    last = ckpt.load_weights(ckpt.checkpoints(tmp_path / "a")[-1])
    assert not all(torch.equal(last[k], p) for k, p in trainable_parameters(model).items())

    crash_after_checkpoint(monkeypatch, 8)
    with pytest.raises(SimulatedCrash, match="after the step-8 checkpoint"):
        fit(ScoredRegressor(), data, cfg, tmp_path / "b")
    monkeypatch.undo()
    resumed = ScoredRegressor()
    again = fit(resumed, data, cfg, tmp_path / "b")
    assert again.start_step == 8 and again.best == result.best
    assert_bit_identical(trainable_parameters(model), trainable_parameters(resumed))


def test_foreign_config_checkpoint_is_refused(tmp_path: Path) -> None:
    data = dataset()
    fit(TinyRegressor(), data, config(max_steps=4), tmp_path)
    with pytest.raises(DrafterError, match=r"another training config(.|\n)*train\.lr=0\.02 \(checkpoint: 0\.01\)"):
        fit(TinyRegressor(), data, config(max_steps=4, lr=2e-2), tmp_path)
    with pytest.raises(DrafterError, match="another training config"):
        fit(TinyRegressor(), data, config(max_steps=4), tmp_path, identity={"drafter": "other"})


def test_corrupt_or_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    data, cfg = dataset(), config(max_steps=4)
    fit(TinyRegressor(), data, cfg, tmp_path)
    (last,) = ckpt.checkpoints(tmp_path)
    blob = (last / ckpt.WEIGHTS).read_bytes()
    (last / ckpt.WEIGHTS).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DrafterError, match=r"corrupt or truncated(.|\n)*weights.safetensors has \d+ bytes"):
        fit(TinyRegressor(), data, cfg, tmp_path)
    (last / ckpt.WEIGHTS).write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(DrafterError, match="does not match its sha256"):
        fit(TinyRegressor(), data, cfg, tmp_path)
    (last / ckpt.STATE).write_text("{not json")
    with pytest.raises(DrafterError, match="state.json is missing or unreadable"):
        fit(TinyRegressor(), data, cfg, tmp_path)


def test_save_final_writes_only_trainable_state(tmp_path: Path) -> None:
    model = TinyRegressor()
    path = save_final(model, tmp_path / "out")
    saved = weights(path)
    assert set(saved) == {"net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias"}
    assert_bit_identical(saved, {k: p.detach() for k, p in trainable_parameters(model).items()})


# --- subprocesses ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_kill_minus_9_then_rerun_ends_bit_identical(tmp_path: Path) -> None:
    cfg = {**BASE, "max_steps": 60, "checkpoint_every": 5}
    reference = run_script({"mode": "train", "cfg": cfg, "staging": str(tmp_path / "ref"), "out": str(tmp_path / "o1")})
    staging, out = tmp_path / "killed", tmp_path / "o2"
    args = {"mode": "train", "cfg": cfg, "staging": str(staging), "out": str(out)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.training.test_harness", json.dumps(args)], cwd=ROOT,
                            env={**os.environ, "HARNESS_TEST_STEP_SLEEP": "0.03"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not any(int(p.name[len(ckpt.PREFIX):]) >= 15 for p in ckpt.checkpoints(staging)):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before a checkpoint landed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    landed = [int(p.name[len(ckpt.PREFIX):]) for p in ckpt.checkpoints(staging)]
    assert max(landed) < 60 and not (out / "model.safetensors").exists()
    resumed = run_script(args)
    assert resumed["start_step"] == max(landed) and resumed["steps"] == reference["steps"] == 60
    assert_bit_identical(weights(tmp_path / "o1" / "model.safetensors"), weights(out / "model.safetensors"))


@pytest.mark.slow
def test_two_process_cpu_ddp_trains_on_disjoint_shards(tmp_path: Path) -> None:
    """2 ranks x accumulation 1 against 1 rank x accumulation 2: the same examples per step, so the same
    per-micro-batch losses up to float rounding (DDP averages two gradients where accumulation sums two
    halves; bound 1e-5 relative over 8 steps, measured exactly equal here)."""
    ddp = {**BASE, "max_steps": 8, "strategy": "ddp", "devices": 2}
    run_script({"mode": "train", "cfg": ddp, "staging": str(tmp_path / "ddp"), "out": str(tmp_path / "ddp-out")})
    ranks = [json.loads((tmp_path / "ddp-out" / f"result.rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2] and [r["global_rank"] for r in ranks] == [0, 1]
    single = run_script({"mode": "train", "cfg": {**BASE, "max_steps": 8}, "staging": str(tmp_path / "one"),
                         "out": str(tmp_path / "one-out")})
    mb = BASE["micro_batch_size"]
    for step in range(8):
        shard0, shard1 = (r["seen"][step * mb : (step + 1) * mb] for r in ranks)
        assert not set(shard0) & set(shard1)
        assert shard0 + shard1 == single["seen"][2 * step * mb : 2 * (step + 1) * mb]
    interleaved = [loss for pair in zip(ranks[0]["losses"], ranks[1]["losses"]) for loss in pair]
    assert interleaved == pytest.approx(single["losses"], rel=1e-5)
    assert ranks[0]["metrics"]["loss"] < ranks[0]["losses"][0]
    both = [ranks[0]["counted"][-1], ranks[1]["counted"][-1]]  # the last step's micro-batch on each rank
    pooled = sum(n for n, _ in both) / max(1, sum(d for _, d in both))
    assert ranks[0]["metrics"]["even_share"] == ranks[1]["metrics"]["even_share"] == pytest.approx(pooled, rel=1e-12)
    assert (tmp_path / "ddp-out" / "model.safetensors").exists()


# --- the script side ---------------------------------------------------------------------------------

def _train(args: dict, out: Path) -> None:
    model, cfg = TinyRegressor(), from_dict(TrainConfig, args["cfg"])
    if stop_after := args.get("stop_after"):  # end the process right after checkpoint `stop_after` lands
        real_save = ckpt.save_checkpoint

        def save_then_stop(*a: object, **k: object) -> Path:
            path = real_save(*a, **k)
            if a[1] == stop_after:
                (out / "result.rank0.json").write_text(json.dumps({"stopped": True}))
                os._exit(0)
            return path

        ckpt.save_checkpoint = save_then_stop
    result = fit(model, dataset(), cfg, args["staging"])
    record = {"steps": result.steps, "start_step": result.start_step, "world_size": result.world_size,
              "global_rank": result.global_rank, "strategy": result.strategy, "metrics": result.metrics,
              "deepspeed_config": result.deepspeed_config, "seen": model.seen, "losses": model.losses,
              "counted": model.counted}
    (out / f"result.rank{result.global_rank}.json").write_text(json.dumps(record))
    if result.is_global_zero:
        save_final(model, out)


def _deepspeed(args: dict, out: Path) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    import deepspeed
    from torch.utils.data import default_collate

    from pipeline.training.strategy import build_optimizer, build_scheduler, position_scheduler

    cfg, data = from_dict(TrainConfig, args["cfg"]), dataset()
    ds_config, total, k = deepspeed_config(cfg), cfg.max_steps, cfg.batch_layout(1)[1]
    sampler = ckpt.StepBatchSampler(len(data), micro_batch_size=cfg.micro_batch_size, accumulation=k,
                                    world_size=1, rank=0, seed=cfg.seed, start_step=0, total_steps=total)

    def engine(model: TinyRegressor) -> tuple:
        params = list(trainable_parameters(model).values())
        optimizer = build_optimizer(params, cfg, deepspeed=True)
        scheduler = build_scheduler(optimizer, cfg, total)
        eng, zero, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                               lr_scheduler=scheduler, config=dict(ds_config))
        return eng, zero, scheduler

    def backward(eng: object, loss: torch.Tensor) -> None:
        if args.get("backward", "engine") == "engine":
            eng.backward(loss)  # DeepSpeed divides by the accumulation count itself
            return
        # As Lightning's DeepSpeed strategy on a GPU: automatic optimisation divides the loss by the accumulation
        # count, then the strategy's precision plugin runs the engine's backward. The Trainer cannot run DeepSpeed
        # on a CPU, so a stand-in holds the one thing the plugin reads of it: the engine, as `trainer.model`.
        import lightning as L
        from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

        from pipeline.training.deepspeed_precision import OnceScaledDeepSpeedPrecision

        plugin = (OnceScaledDeepSpeedPrecision if args["backward"] == "lightning" else DeepSpeedPrecision)("32-true")
        holder = L.LightningModule()
        holder._trainer = types.SimpleNamespace(model=eng)
        plugin.backward(loss / k, holder, None)

    def train(eng: object, steps: range) -> None:
        for step in steps:
            for micro in range(k):  # the harness's seed and batch for (step, micro)
                torch.manual_seed(ckpt.derive_seed(cfg.seed, "micro", step, micro))
                loss, _ = eng(default_collate([data[i] for i in sampler.indices(step, micro)]))
                backward(eng, loss)
                eng.step()

    model = TinyRegressor()
    eng, zero, _ = engine(model)
    half = total // 2
    train(eng, range(half))
    staging = Path(args["staging"])
    expected = {"config_hash": "ds", "identity": {}, "trainable": {}, "world_size": 1, "strategy": "deepspeed"}
    path = ckpt.save_checkpoint(staging, half, rank=0, world_size=1, weights=trainable_parameters(model),
                                optimizer=zero, state=expected, barrier=lambda: None)
    train(eng, range(half, total))
    losses = list(model.losses)

    resumed = TinyRegressor()
    state = ckpt.read_checkpoint(path, expected)
    with torch.no_grad():
        for name, tensor in ckpt.load_weights(path).items():
            trainable_parameters(resumed)[name].copy_(tensor)
    eng2, zero2, scheduler2 = engine(resumed)
    ckpt.restore_optimizer(zero2, ckpt.load_optimizer_state(path, state, 0), 1)
    position_scheduler(scheduler2, half)
    train(eng2, range(half, total))
    same = all(torch.equal(a, b) for a, b in zip(trainable_parameters(model).values(),
                                                  trainable_parameters(resumed).values()))
    record = {"losses": losses, "deepspeed_config": ds_config, "resumed_bit_identical": same}
    if "bf16_dtypes" in args:
        record["dtypes"] = _deepspeed_dtypes(from_dict(TrainConfig, args["bf16_dtypes"]))
    (out / "result.rank0.json").write_text(json.dumps(record))


def _deepspeed_dtypes(cfg: TrainConfig) -> dict[str, dict[str, str]]:
    """The dtype of every parameter and buffer of a module once DeepSpeed's engine has it (``cfg``'s config on CPU),
    and once :func:`~pipeline.training.harness.as_trained` has it."""
    import deepspeed

    from pipeline.training.harness import as_trained
    from pipeline.training.strategy import build_optimizer

    def dtypes(model: torch.nn.Module) -> dict[str, str]:
        return {name: str(t.dtype) for name, t in [*model.named_parameters(), *model.named_buffers()]}

    model = TinyRegressor()
    params = list(trainable_parameters(model).values())
    deepspeed.initialize(model=model, model_parameters=params, optimizer=build_optimizer(params, cfg, deepspeed=True),
                         config=dict(deepspeed_config(cfg)))
    return {"engine": dtypes(model), "as_trained": dtypes(as_trained(TinyRegressor(), cfg, "deepspeed"))}


def _main(argv: list[str]) -> None:
    args = json.loads(argv[0])
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    {"train": _train, "deepspeed": _deepspeed}[args["mode"]](args, out)


if __name__ == "__main__":
    _main(sys.argv[1:])
