"""The training harness: config checks, step-derived data order, resume after a kill -9 (bit-identical on CPU),
refusal of foreign or damaged checkpoints, MLflow metrics and real 2-process CPU DDP. DeepSpeed's tests are in
:mod:`tests.training.test_deepspeed`. Runs that need their own process execute
:mod:`tests.training.harness_script`, which also holds the model and data both files train.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from pipeline.config.training import TrainConfig
from pipeline.errors import DrafterError
from pipeline.training import checkpoints as ckpt
from pipeline.training.harness import fit, save_final, shard_trainer
from pipeline.training.plan import trainable_parameters
from pipeline.training.strategy import lr_factor
from tests.training.harness_script import (
    BASE,
    N_EXAMPLES,
    ROOT,
    TinyRegressor,
    assert_bit_identical,
    config,
    dataset,
    run_script,
    weights,
)


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


# --- fast, in-process --------------------------------------------------------------------------------

def test_training_seconds_add_up_over_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train_seconds (training.json, the stage's summary) counted only the last process: a run resumed after a kill
    reported the time since the resume, and a rerun of a finished run about nothing. Each checkpoint now carries the
    seconds trained so far. The harness reads a fake clock here, which only the steps move: every micro-batch's
    "sleep" of 0.1 s advances it. 12 steps x 2 micro-batches before the crash (2.4 s) and 4 x 2 after it (0.8 s): the
    resumed run reports 3.2 s, and the finished run's rerun the same 3.2 s."""
    import types

    from pipeline.training import harness, plan
    from tests.training import harness_script

    clock = [0.0]

    def fake_clock() -> None:
        def advance(seconds: float) -> None:
            clock[0] += seconds

        monkeypatch.setattr(harness, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        monkeypatch.setattr(plan, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
        monkeypatch.setattr(harness_script, "time", types.SimpleNamespace(sleep=advance))
        monkeypatch.setenv("HARNESS_TEST_STEP_SLEEP", "0.1")

    fake_clock()
    crash_after_checkpoint(monkeypatch, 12)
    with pytest.raises(SimulatedCrash, match="after the step-12 checkpoint"):
        fit(TinyRegressor(), dataset(), config(), tmp_path / "run")
    assert clock[0] == pytest.approx(2.4)
    monkeypatch.undo()
    fake_clock()
    resumed = fit(TinyRegressor(), dataset(), config(), tmp_path / "run")
    assert resumed.start_step == 12 and resumed.seconds == pytest.approx(3.2), resumed.seconds
    rerun = fit(TinyRegressor(), dataset(), config(), tmp_path / "run")
    assert rerun.start_step == 16 and rerun.seconds == pytest.approx(3.2), rerun.seconds


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


def test_a_server_dying_mid_training_stops_it_with_a_clear_error_that_carries_no_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-step logging called MLflow bare: a server that died mid-run ended training in MLflow's own traceback,
    whose "API request to <url> failed" quotes the URL with its user and password (and a Slurm log keeps it). Here a
    real server stops right after the step-4 checkpoint: the next step's logging fails with a DrafterError that says
    which call failed and that the checkpoints are kept, and no part of the error holds the password."""
    from tests.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path / "server")
    server.start()
    password = "pw-" + os.urandom(6).hex()
    uri = server.uri.replace("//", f"//alice:{password}@", 1)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own back-off would take minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    real_save = ckpt.save_checkpoint

    def save_then_stop(*args: object, **kwargs: object) -> Path:
        path = real_save(*args, **kwargs)
        if args[1] == 4:
            server.stop()
        return path

    monkeypatch.setattr(ckpt, "save_checkpoint", save_then_stop)
    try:
        with pytest.raises(DrafterError, match=r"Cannot log step \d+'s metrics at http://\*\*\*@127.0.0.1") as err:
            fit(TinyRegressor(), dataset(), config(max_steps=8, log_every=1), tmp_path / "s", tracking_uri=uri,
                experiment="harness-test")
    finally:
        server.stop()
    assert "checkpoints are kept" in str(err.value) and password not in str(err.value), str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # a traceback prints no MLflow error
    assert password not in "".join(traceback.format_exception(err.value))
    assert ckpt.checkpoints(tmp_path / "s"), "the checkpoints written before the failure are kept"


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


class DivergingRegressor(TinyRegressor):
    """Its loss is NaN from step ``after + 1`` on, and its held-out score rises at every evaluation, as a top-1
    agreement over NaN logits still reads a number (argmax picks one fixed id): only the weights say they diverged."""

    selection_metric = "score"

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.evaluations = after, 0

    def training_step(self, batch: dict) -> tuple[torch.Tensor, dict]:
        loss, metrics = super().training_step(batch)
        step = (len(self.seen) + 7) // 8  # 8 examples a step (one rank)
        return (loss * float("nan") if step > self.after else loss), metrics

    def evaluate(self) -> dict[str, float]:
        self.evaluations += 1
        return {"score": float(self.evaluations)}


def test_weights_that_diverged_are_never_kept_and_a_run_that_only_diverged_publishes_nothing(tmp_path: Path) -> None:
    """The first evaluation was kept whatever it scored, and a later one on NaN weights could outscore a healthy one:
    a diverged run finished with exit 0 and handed back NaN weights as its best."""
    cfg = config(eval_every=2, warmup_steps=0)
    model = DivergingRegressor(after=6)
    result = fit(model, dataset(), cfg, tmp_path / "a")
    assert model.evaluations == 8 and result.best["step"] == 6 and result.best["score"] == 3.0
    assert all(bool(p.isfinite().all()) for p in trainable_parameters(model).values())
    with pytest.raises(DrafterError, match=r"Training diverged(.|\n)*no finite held-out evaluation(.|\n)*train.lr"):
        fit(DivergingRegressor(after=0), dataset(), cfg, tmp_path / "b")
    with pytest.raises(DrafterError, match=r"Training diverged"):  # no evaluation at all: the last step's weights
        fit(DivergingRegressor(after=0), dataset(), config(warmup_steps=0), tmp_path / "c")


class ScheduledRegressor(TinyRegressor):
    """Its held-out score at step s is ``SCHEDULE[s]`` (a run started at ``start``)."""

    selection_metric = "score"
    schedule = {2: 1.0, 4: 2.0, 6: 3.0, 8: 2.5, 10: 4.0, 12: 5.0, 14: 1.0, 16: 1.0}

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.start = start

    def evaluate(self) -> dict[str, float]:
        return {"score": self.schedule[self.start + len(self.seen) // 8]}


def test_a_kill_after_new_bests_keeps_the_best_the_last_checkpoint_names(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoint 8 names the best of step 6; new bests at 10 and 12 then deleted its file. Killed before checkpoint 16,
    the run resumed at 8, could not load that best unless its re-evaluation beat it again, and never finished."""
    cfg, staging = config(eval_every=2, checkpoint_every=8), tmp_path / "s"
    real_prune = ckpt.prune_best

    def prune_then_kill(where: Path, keep: set[int]) -> None:
        real_prune(where, keep)
        if 12 in keep:
            raise SimulatedCrash("killed after the step-12 evaluation")

    monkeypatch.setattr(ckpt, "prune_best", prune_then_kill)
    with pytest.raises(SimulatedCrash, match="step-12 evaluation"):
        fit(ScheduledRegressor(), dataset(), cfg, staging)
    monkeypatch.undo()
    assert json.loads((ckpt.checkpoints(staging)[-1] / "state.json").read_text())["best"]["step"] == 6
    assert (staging / "best-00000006.safetensors").exists()
    # the resumed run's re-evaluations score lower this time (a GPU's nondeterminism, another micro_batch_size)
    monkeypatch.setattr(ScheduledRegressor, "schedule", {**ScheduledRegressor.schedule, 10: 2.9, 12: 2.9})
    result = fit(ScheduledRegressor(start=8), dataset(), cfg, staging)
    assert result.start_step == 8 and result.best["step"] == 6 and result.best["score"] == 3.0


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
    (last / ckpt.WEIGHTS).write_bytes(blob)
    # a state.json that lists only some of the files (a shard another node renamed in and this one did not see):
    # the unlisted file would be loaded unchecked
    state = json.loads((last / ckpt.STATE).read_text())
    assert sorted(state["files"]) == ["optimizer.rank0.safetensors", "weights.safetensors"]
    del state["files"]["optimizer.rank0.safetensors"]
    (last / ckpt.STATE).write_text(json.dumps(state))
    with pytest.raises(DrafterError, match="state.json lists no optimizer.rank0.safetensors"):
        fit(TinyRegressor(), data, cfg, tmp_path)
    # damaged, or valid JSON of another shape (an AttributeError, KeyError or ValueError reached the user before)
    for damaged in ("{not json", json.dumps({**state, "files": list(state["files"])}),
                    json.dumps({**state, "files": {ckpt.WEIGHTS: {"sha256": "0" * 64}}}),
                    json.dumps({**state, "world_size": "two"})):
        (last / ckpt.STATE).write_text(damaged)
        with pytest.raises(DrafterError, match="state.json is missing or unreadable"):
            fit(TinyRegressor(), data, cfg, tmp_path)


def test_a_checkpoint_waits_for_every_ranks_file_and_refuses_one_that_never_shows(tmp_path: Path) -> None:
    """Rank 0 described the files its directory listing showed: on a shared filesystem another node's shard may show
    late, and the checkpoint was published without it. It now names the files every rank writes and waits for them."""
    import threading

    names = ckpt.checkpoint_files(world_size=2, sharded=True)
    assert names == ["weights.safetensors", "optimizer.rank0.safetensors", "optimizer.rank1.safetensors"]
    for name in names[:2]:
        (tmp_path / name).write_bytes(b"x")
    late = threading.Timer(0.3, (tmp_path / names[2]).write_bytes, args=(b"x",))
    late.start()
    assert ckpt._arrived(tmp_path, names, wait=10.0) == names  # the late shard is waited for
    late.join()
    (tmp_path / names[2]).unlink()
    with pytest.raises(DrafterError, match=r"did not all arrive(.|\n)*missing optimizer.rank1.safetensors after 0.2 s"):
        ckpt._arrived(tmp_path, names, wait=0.2)


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
    proc = subprocess.Popen([sys.executable, "-m", "tests.training.harness_script", json.dumps(args)], cwd=ROOT,
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


SRUN_HINT = "The `srun` command is available on your system but is not used"


@pytest.mark.parametrize("in_job", [False, True], ids=["local run", "inside a Slurm job"])
def test_the_srun_hint_shows_only_inside_a_slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     in_job: bool) -> None:
    """Lightning hints at ``srun`` whenever it is on PATH. A local run on a machine with Slurm's tools (a login node)
    printed it at every trainer; inside a job, where a multi-rank stage needs ``srun``, it must stay."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "srun").write_text("#!/bin/sh\nexit 1\n")  # only found on PATH, never run: what Lightning checks
    (tools / "srun").chmod(0o755)
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ.get('PATH', '')}")
    if in_job:
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with warnings.catch_warnings(record=True) as caught:  # the filters the trainer installs end with the block
        warnings.simplefilter("always")
        trainer = shard_trainer("generate", "cpu", 1, 1)
    assert trainer.world_size == 1
    shown = [str(w.message) for w in caught if SRUN_HINT in str(w.message)]
    assert bool(shown) == in_job, [str(w.message) for w in caught]
