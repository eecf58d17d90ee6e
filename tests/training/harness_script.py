"""The training harness tests' small world, and the script their own-process runs execute.

:mod:`tests.training.test_harness` and :mod:`tests.training.test_deepspeed` train :class:`TinyRegressor` on
:func:`dataset`. Runs that need their own process (kill -9, DDP, DeepSpeed) execute this module as a script:
``python -m tests.training.harness_script '<json>'`` (see :func:`_main`), so Lightning's launcher re-executes a real
entry point and no process-group or environment state leaks into pytest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from pipeline.config.schema import from_dict
from pipeline.config.training import TrainConfig
from pipeline.training import checkpoints as ckpt
from pipeline.training.harness import fit, save_final
from pipeline.training.plan import trainable_parameters
from pipeline.training.strategy import deepspeed_config

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


def deepspeed_on_one_cpu_rank() -> types.ModuleType:
    """``deepspeed``, ready for ``deepspeed.initialize`` in this process as the one rank of a CPU run (its process group
    on a free port of 127.0.0.1).

    DeepSpeed's CPU backend compiles a shared-memory allreduce (C++, with ninja) before its first engine, about a
    minute on 2 cores in every fresh environment (a new virtualenv's paths rebuild it), though only several ranks on
    one node ever call it. With one rank it is marked unavailable, so the collectives stay torch's own."""
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    import deepspeed
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return deepspeed


def run_script(args: dict, *, timeout: float = 300) -> dict:
    out = Path(args["out"])
    done = subprocess.run([sys.executable, "-m", "tests.training.harness_script", json.dumps(args)], cwd=ROOT,
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
    deepspeed = deepspeed_on_one_cpu_rank()
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

    def backward(eng: object, loss: torch.Tensor, how: str) -> None:
        if how == "engine":
            eng.backward(loss)  # DeepSpeed divides by the accumulation count itself
            return
        # As Lightning's DeepSpeed strategy on a GPU: automatic optimisation divides the loss by the accumulation
        # count, then the strategy's precision plugin runs the engine's backward. The Trainer cannot run DeepSpeed
        # on a CPU, so a stand-in holds the one thing the plugin reads of it: the engine, as `trainer.model`.
        import lightning as L
        from lightning.pytorch.plugins.precision.deepspeed import DeepSpeedPrecision

        from pipeline.training.deepspeed_precision import OnceScaledDeepSpeedPrecision

        plugin = (OnceScaledDeepSpeedPrecision if how == "lightning" else DeepSpeedPrecision)("32-true")
        holder = L.LightningModule()
        holder._trainer = types.SimpleNamespace(model=eng)
        plugin.backward(loss / k, holder, None)

    def train(eng: object, steps: range, how: str) -> None:
        for step in steps:
            for micro in range(k):  # the harness's seed and batch for (step, micro)
                torch.manual_seed(ckpt.derive_seed(cfg.seed, "micro", step, micro))
                loss, _ = eng(default_collate([data[i] for i in sampler.indices(step, micro)]))
                backward(eng, loss, how)
                eng.step()

    def run(how: str, staging: Path) -> dict:
        """Train ``total`` steps with checkpoint ``total // 2`` written on the way, then resume from it."""
        model = TinyRegressor()
        eng, zero, _ = engine(model)
        half = total // 2
        train(eng, range(half), how)
        expected = {"config_hash": "ds", "identity": {}, "trainable": {}, "world_size": 1, "strategy": "deepspeed"}
        path = ckpt.save_checkpoint(staging, half, rank=0, world_size=1, weights=trainable_parameters(model),
                                    optimizer=zero, state=expected, barrier=lambda: None)
        train(eng, range(half, total), how)
        resumed = TinyRegressor()
        state = ckpt.read_checkpoint(path, expected)
        with torch.no_grad():
            for name, tensor in ckpt.load_weights(path).items():
                trainable_parameters(resumed)[name].copy_(tensor)
        eng2, zero2, scheduler2 = engine(resumed)
        ckpt.restore_optimizer(zero2, ckpt.load_optimizer_state(path, state, 0), 1)
        position_scheduler(scheduler2, half)
        train(eng2, range(half, total), how)
        same = all(torch.equal(a, b) for a, b in zip(trainable_parameters(model).values(),
                                                      trainable_parameters(resumed).values()))
        return {"losses": list(model.losses), "resumed_bit_identical": same}

    # every backward asked for, each on its own engines, in this one process (a process costs DeepSpeed's import)
    runs = {how: run(how, Path(args["staging"]) / how) for how in args.get("backwards", ["engine"])}
    record = {"runs": runs, "deepspeed_config": ds_config}
    if "bf16_dtypes" in args:
        record["dtypes"] = _deepspeed_dtypes(from_dict(TrainConfig, args["bf16_dtypes"]))
    (out / "result.rank0.json").write_text(json.dumps(record))


def _deepspeed_dtypes(cfg: TrainConfig) -> dict[str, dict[str, str]]:
    """The dtype of every parameter and buffer of a module once DeepSpeed's engine has it (``cfg``'s config on CPU),
    and once :func:`~pipeline.training.harness.as_trained` has it (after :func:`deepspeed_on_one_cpu_rank`)."""
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
