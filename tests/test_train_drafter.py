"""The train_drafter stage end to end on the tiny kit's test profile: a real Lightning run of the EAGLE-3
drafter on the target's own answers, checkpoint choice by held-out simulated τ, the artifact and its
serving exports, resume after SIGKILL ending bit-identical, artifact ids that ignore run settings, the
offline feature cache and its disk check, and clear errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from jobs import train_drafter
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.data.rows import CalibrationRows, pad_batch
from pipeline.drafters.eagle3 import SERVING_KEYS
from pipeline.drafters.store import load_drafter
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import plan
from pipeline.training import checkpoints as ckpt
from pipeline.training.eagle3_objective import target_features
from pipeline.training.eagle3_task import FeatureCache
from tests.helpers import SMALL, TRAIN
from tests.killing import kill_after_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# 40 conversations: ~34 training rows, ~6 held out. 24 steps of 8 rows, scored every 8 steps.


def td_cfg(workdir: Path, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *SMALL, *TRAIN, *extra])


def named_inputs(art) -> list[str]:  # noqa: ANN001 - an Artifact
    """Overrides that name the calibration set and count artifact ``art`` was trained on (only
    train_drafter then runs)."""
    record = json.loads(art.file("training.json").read_text())
    return [f"train_drafter.calibration={art.path.parent / record['calibration']}",
            f"train_drafter.counts={art.path.parent / record['counts']}"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_kit):
    workdir = tmp_path_factory.mktemp("train-drafter")
    cfg = td_cfg(workdir)
    from jobs import run

    artifacts = run(cfg, ["train_drafter"])  # builds generate and count first
    return cfg, artifacts["train_drafter"], artifacts


def test_artifact_holds_weights_config_exports_and_the_training_record(trained) -> None:
    cfg, art, _ = trained
    assert art.kind == "eagle3_drafter"
    assert set(load_file(str(art.file("model.safetensors")))) == set(SERVING_KEYS)
    for export in ("eagle3", "speculators"):
        assert (art.path / "exports" / export / "config.json").is_file()
        assert (art.path / "exports" / export / "model.safetensors").is_file()
    record = json.loads(art.file("training.json").read_text())
    assert record["steps"] == 24 and record["strategy"] == "single" and record["world_size"] == 1
    assert record["rows"]["train"] + record["rows"]["heldout"] == 40
    assert art.metrics["train_steps"] == 24 and art.metrics["best_step"] == record["best"]["step"]


def test_the_kept_checkpoint_is_the_best_by_held_out_simulated_tau(trained) -> None:
    cfg, art, _ = trained
    record = json.loads(art.file("training.json").read_text())
    client = MlflowClient(f"sqlite:///{cfg.workdir_path / 'mlflow.db'}")
    history = client.get_metric_history(record["mlflow_run_id"], "eval.simulated_tau")
    assert [m.step for m in history] == [8, 16, 24]
    best = max(history, key=lambda m: (m.value, -m.step))
    assert record["best"]["step"] == best.step and record["best"]["score"] == pytest.approx(best.value)
    acc = [record["best"]["metrics"][f"acc_{k}"] for k in range(3)]
    tau = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert record["best"]["score"] == pytest.approx(tau)
    assert record["best"]["score"] > 1.0  # it learned to agree with the target on held-out rows
    # The published weights are the kept checkpoint's: reload them and score the held-out rows again.
    from pipeline.models.target import Target
    from pipeline.training.eagle3_task import Eagle3Task

    target = Target(cfg.target).model(dtype="float32")
    drafter = load_drafter(art.path, target)
    calibration = art.path.parent / record["calibration"]
    rows = CalibrationRows(calibration / "data", max_length=cfg.train_drafter.max_length, eval_fraction=0.2,
                           eval_max_rows=64, min_length=5, what="the EAGLE-3 drafter",
                           fraction_key="train_drafter.eval_fraction")
    again = Eagle3Task(drafter, target, rows.heldout, ttt_steps=3, decay=0.8, pad_id=2).evaluate()
    assert again["simulated_tau"] == pytest.approx(record["best"]["score"], abs=1e-6)


def test_per_step_metrics_reach_mlflow(trained) -> None:
    cfg, art, _ = trained
    run_id = json.loads(art.file("training.json").read_text())["mlflow_run_id"]
    client = MlflowClient(f"sqlite:///{cfg.workdir_path / 'mlflow.db'}")
    for key in ("loss", "lr", "tokens_per_s", "acc_0", "acc_2", "train_simulated_tau"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == list(range(1, 25)), key


def test_a_rerun_is_a_cache_hit_and_run_settings_keep_the_id(trained) -> None:
    cfg, art, _ = trained
    again = train_drafter.main(cfg)
    assert again.id == art.id
    moved = td_cfg(cfg.workdir_path, "train_drafter.train.devices=2", "train_drafter.train.micro_batch_size=2",
                   "train_drafter.train.checkpoint_every=3", "train_drafter.features_disk_limit_gb=5")
    assert plan(moved, ["train_drafter"])["train_drafter"].id == art.id
    assert plan(td_cfg(cfg.workdir_path, "train_drafter.train.lr=1e-3"), ["train_drafter"])["train_drafter"].id != art.id
    # evaluate reads the drafter only when it evaluates method eagle3 (at gamma <= its 3 trained steps).
    with_head = plan(td_cfg(cfg.workdir_path, "evaluate.methods=[shortlist,eagle3]", "evaluate.gammas=[3]"),
                     ["evaluate"])["evaluate"]
    without = plan(td_cfg(cfg.workdir_path, "evaluate.methods=[shortlist]"), ["evaluate"])["evaluate"]
    assert with_head.inputs["train_drafter"][0] == art.id and "train_drafter" not in without.inputs
    # A named drafter artifact replaces the planned one, by its id; its own manifest's ttt_steps bound gamma.
    named_cfg = ["evaluate.methods=[eagle3]", f"evaluate.eagle3={art.path}", "train_drafter.ttt_steps=7"]
    named = plan(td_cfg(cfg.workdir_path, *named_cfg, "evaluate.gammas=[3]"), ["evaluate"])
    assert "train_drafter" not in named.stages and named["evaluate"].inputs["train_drafter"] == (art.id, art.path)
    with pytest.raises(DrafterError, match=r"<= 3 \(ttt_steps of the artifact"):
        plan(td_cfg(cfg.workdir_path, *named_cfg, "evaluate.gammas=[4]"), ["evaluate"])


def test_kill_minus_9_then_rerun_ends_bit_identical(trained, tmp_path: Path) -> None:
    cfg, art, _ = trained
    workdir = tmp_path / "killed"
    # Share the upstream artifacts: name them, so only train_drafter runs here.
    inputs = named_inputs(art)
    # The CLI reads configs/tiny.yaml when no --config is given; this file leaves the built-in defaults
    # that td_cfg() starts from, so the killed run and the rerun plan the same artifact.
    (tmp_path / "base.yaml").write_text(f"workdir: {workdir}\n")
    cmd = [sys.executable, "-m", "jobs.cli", "train_drafter", "--config", str(tmp_path / "base.yaml"), *SMALL,
           *TRAIN, *inputs]
    landed = kill_after_checkpoint(cmd, workdir, at_step=8, total=24, stage="train_drafter")
    resumed = train_drafter.main(td_cfg(workdir, *inputs))
    record = json.loads(resumed.file("training.json").read_text())
    assert record["resumed_from"] == max(landed)
    assert resumed.id == art.id  # named inputs enter the id by their artifact ids, not their paths
    ours, reference = load_file(str(resumed.file("model.safetensors"))), load_file(str(art.file("model.safetensors")))
    assert ours.keys() == reference.keys()
    for key in ours:
        assert torch.equal(ours[key], reference[key]), key


def test_cached_features_refuse_to_exceed_the_disk_limit(trained, tmp_path: Path) -> None:
    cfg, art, _ = trained
    named = named_inputs(art)
    tight = td_cfg(tmp_path, *named, "train_drafter.features=cached", "train_drafter.features_disk_limit_gb=1e-6")
    with pytest.raises(DrafterError, match=r"cached target features would not fit(.|\n)*GB needed"):
        train_drafter.main(tight)
    assert not list(tmp_path.glob("staging/*/features/*"))  # refused before writing anything


def test_cached_features_train_the_same_drafter_as_online(trained, tmp_path: Path) -> None:
    """Offline features are computed in other batches (other padding) than online ones, so float32 rounding
    differs in the last bits; after 24 steps every weight agrees to 1e-4 absolute."""
    cfg, art, _ = trained
    named = named_inputs(art)
    cached = train_drafter.main(td_cfg(tmp_path, *named, "train_drafter.features=cached"))
    assert list(tmp_path.glob("staging/*/features/**/*.safetensors")) == []  # scratch is dropped after publishing
    ours, reference = load_file(str(cached.file("model.safetensors"))), load_file(str(art.file("model.safetensors")))
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-4)
    record = json.loads(cached.file("training.json").read_text())
    train_rows = record["rows"]["train"]
    assert record["feature_cache"]["rows"] == train_rows and record["feature_cache"]["computed"] == [train_rows]
    assert record["feature_cache"]["device"] == "cpu"
    assert json.loads(art.file("training.json").read_text())["feature_cache"] is None  # online: no cache


def test_the_feature_cache_fills_a_ranks_share_then_waits_and_computes_only_missing_rows(trained, tmp_path: Path,
                                                                                        capsys) -> None:
    """Rank 1 of 2 computes rows 1, 3, 5, … before the barrier; with no rank 0 to fill the rest, it computes
    them after. A second fill computes nothing; one after three files were removed computes those three. Every
    file holds the target's features of its row, as the online path computes them."""
    cfg, _, artifacts = trained
    ready = train_drafter.prepare(cfg, artifacts["generate"], artifacts["count"])
    rows = ready.data.train
    cache = FeatureCache(tmp_path / "features", ready.target, ready.config.aux_layer_ids, rows)
    at_barrier: list[set[int]] = []
    filled = cache.fill(1, 2, lambda: at_barrier.append({int(p.stem) for p in cache.directory.glob("*.safetensors")}))
    assert at_barrier == [{r.index for r in rows[1::2]}]
    assert filled["computed"] == len(rows)
    assert {int(p.stem) for p in cache.directory.glob("*.safetensors")} == {r.index for r in rows}
    assert cache.fill(0, 1)["computed"] == 0
    for row in rows[:3]:
        cache.path(row.index).unlink()
    assert cache.fill(0, 1)["computed"] == 3
    # a file that survived a crash with other bytes (a flipped byte on shared storage, a torn write) was resumed as
    # done and trained on; it no longer matches its checksum, so it is computed again, and a line says so
    damaged = cache.path(rows[5].index)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert cache.fill(0, 1)["computed"] == 1
    assert f"{damaged.name}: sha256 mismatch" in capsys.readouterr().err
    row = rows[4]
    batch = pad_batch([row])
    aux, logits = target_features(ready.target, batch["input_ids"], batch["attention_mask"], ready.config.aux_layer_ids)
    stored, last = cache.load(torch.tensor([row.index]), len(row.input_ids), torch.device("cpu"))
    torch.testing.assert_close(stored, aux, rtol=0, atol=1e-5)
    torch.testing.assert_close(ready.target.get_output_embeddings()(last), logits, rtol=0, atol=1e-4)
    # the target cast as DeepSpeed bf16 casts it (a rerun under another strategy): its own features, computed anew
    ready.target.to(torch.bfloat16)
    assert cache.fill(0, 1)["computed"] == len(rows)
    assert cache.load(torch.tensor([row.index]), len(row.input_ids), torch.device("cpu"))[0].dtype == torch.bfloat16


def test_two_ranks_each_compute_half_the_feature_cache_and_train_the_one_rank_drafter(trained, tmp_path: Path) -> None:
    """features=cached on one node running two Lightning ranks (DDP over gloo, a real second process): each rank
    computes every second row of the cache (17 and 17 of the 34 training rows), and the drafter agrees with the
    one-rank online one as the one-rank cached run does (to 1e-4: the features' padding differs)."""
    _, art, _ = trained
    workdir = tmp_path / "two-ranks"
    workdir.mkdir()
    (workdir / "base.yaml").write_text(f"workdir: {workdir}\n")
    cmd = [sys.executable, "-m", "jobs.cli", "train_drafter", "--config", str(workdir / "base.yaml"), *SMALL, *TRAIN,
           *named_inputs(art), "train_drafter.features=cached", "train_drafter.train.accelerator=cpu",
           "train_drafter.train.devices=2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (artifact,) = (workdir / "artifacts").glob("train_drafter-*/")
    record = json.loads((artifact / "training.json").read_text())
    assert record["world_size"] == 2 and record["strategy"] == "ddp", record
    rows = record["rows"]["train"]
    assert record["feature_cache"]["computed"] == [(rows + 1) // 2, rows // 2], record["feature_cache"]
    assert f"feature cache: {rows} of {rows} rows computed" in done.stderr
    ours, reference = load_file(str(artifact / "model.safetensors")), load_file(str(art.file("model.safetensors")))
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-4)


def test_bad_input_is_refused_before_training(trained, tmp_path: Path) -> None:
    cfg, art, _ = trained
    named = named_inputs(art)
    with pytest.raises(DrafterError, match=r"aux_layer_ids name hidden states(.|\n)*\[0, 2\]"):
        train_drafter.main(td_cfg(tmp_path, *named, "train_drafter.aux_layer_ids=[0,1,7]"))
    with pytest.raises(DrafterError, match="leaves no rows to train"):
        train_drafter.main(td_cfg(tmp_path, *named, "train_drafter.eval_fraction=0.999999"))
    with pytest.raises(DrafterError, match="train_drafter.ttt_steps"):
        td_cfg(tmp_path, "train_drafter.ttt_steps=0")
    assert not list((tmp_path / "artifacts").glob("train_drafter-*"))


def test_a_calibration_set_without_loss_mask_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa

    table = pa.table({"input_ids": [[1, 2, 3, 4, 5, 6]], "prompt_id": ["a"]})
    (tmp_path / "data").mkdir()
    with pa.OSFile(str(tmp_path / "data" / "shard-00000.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    with pytest.raises(DrafterError, match=r"no loss_mask column(.|\n)*columns \['input_ids', 'prompt_id'\]"):
        CalibrationRows(tmp_path / "data", max_length=64, eval_fraction=0.1, eval_max_rows=4, min_length=4,
                        what="the EAGLE-3 drafter", fraction_key="train_drafter.eval_fraction")


def test_too_few_rows_name_the_stages_own_fraction_key(tmp_path: Path) -> None:
    """The errors for no training or no held-out rows told every stage to change train_drafter's or train_router's
    eval_fraction; estimate_rdk's share is estimate_rdk.heldout_fraction, and its own messages were never reached."""
    import pyarrow as pa

    table = pa.table({"input_ids": [[1, 2, 3, 4, 5, 6]], "loss_mask": [[0, 0, 1, 1, 1, 1]], "prompt_id": ["a"]})
    (tmp_path / "data").mkdir()
    with pa.OSFile(str(tmp_path / "data" / "shard-00000.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    for fraction, problem, advice in ((1e-9, "No held-out calibration rows", "Raise estimate_rdk.heldout_fraction"),
                                      (1 - 1e-9, "leaves no rows to train", "lower estimate_rdk.heldout_fraction")):
        with pytest.raises(DrafterError, match=rf"{problem}(.|\n)*what to do: .*{advice}"):
            CalibrationRows(tmp_path / "data", max_length=64, eval_fraction=fraction, eval_max_rows=4, min_length=2,
                            what="the RDK moments", fraction_key="estimate_rdk.heldout_fraction")


def test_a_draft_vocabulary_from_another_tokenizer_is_refused(trained, tmp_path: Path) -> None:
    """A count artifact made for the other-tokenizer drafter's vocabulary: its fingerprint names another
    vocab hash, and the stage refuses it before loading anything."""
    cfg, art, artifacts = trained
    other = load_config(None, [f"workdir={tmp_path / 'other'}", *SMALL, "target.model=tiny:test/drafter_other"])
    from jobs import run

    foreign = run(other, ["count"])["count"]
    with pytest.raises(DrafterError, match=r"built for a different target(.|\n)*vocab_hash"):
        train_drafter.main(td_cfg(tmp_path, f"train_drafter.counts={foreign.path}",
                                  f"train_drafter.calibration={artifacts['generate'].path}"))


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu_trains_the_stage_module_like_the_harness(trained, tmp_path: Path) -> None:
    """The ZeRO-2 config the stage generates (bf16 off: CPU trains fp32), through ``deepspeed.initialize``
    on CPU, training the stage's own Eagle3Task on the same batches, seeds, AdamW and schedule as the
    harness run of the fixture. Tolerance: 1e-4 relative on each of the first 8 step losses (both compute
    the same fp32 update and differ only in clipping arithmetic; a wrong lr, beta, clip or accumulation
    scale moves them by far more at lr 3e-3)."""
    cfg, art, _ = trained
    record = json.loads(art.file("training.json").read_text())
    client = MlflowClient(f"sqlite:///{cfg.workdir_path / 'mlflow.db'}")
    harness = [m.value for m in sorted(client.get_metric_history(record["mlflow_run_id"], "loss"),
                                       key=lambda m: m.step)][:8]
    args = {"overrides": [f"workdir={cfg.workdir}", *SMALL, *TRAIN, "train_drafter.train.bf16=false"],
            "calibration": str(art.path.parent / record["calibration"]),
            "counts": str(art.path.parent / record["counts"]), "steps": 8, "out": str(tmp_path / "ds.json")}
    done = subprocess.run([sys.executable, "-m", "tests.test_train_drafter", json.dumps(args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "ds.json").read_text())
    from pipeline.training.strategy import deepspeed_config

    assert result["deepspeed_config"] == deepspeed_config(td_cfg(tmp_path, "train_drafter.train.bf16=false")
                                                          .train_drafter.train)
    assert result["deepspeed_config"]["zero_optimization"]["stage"] == 2
    assert result["losses"] == pytest.approx(harness, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.slow
def test_lightning_deepspeed_stage_2_trains_the_drafter_on_gpu(trained, tmp_path: Path) -> None:
    """On a CUDA machine: the stage under Lightning's DeepSpeed ZeRO-2 strategy in bf16, end to end, and the
    published drafter decodes losslessly on the GPU (greedy output equals the target's own)."""
    cfg, art, _ = trained
    named = named_inputs(art)
    gpu = td_cfg(tmp_path, *named, "train_drafter.train.strategy=deepspeed", "train_drafter.train.accelerator=gpu",
                 "train_drafter.train.devices=1", "train_drafter.train.bf16=true")
    head = train_drafter.main(gpu)
    trained_on = json.loads(head.file("training.json").read_text())
    assert trained_on["strategy"] == "deepspeed" and trained_on["deepspeed_config"]["bf16"] == {"enabled": True}
    assert trained_on["deepspeed_config"]["zero_optimization"]["stage"] == 2
    assert trained_on["best"]["score"] > 1.0
    from pipeline.engine.inputs import FeatureInputs
    from pipeline.engine.loop import generate_autoregressive, generate_speculative
    from pipeline.engine.methods import build_proposer
    from pipeline.engine.sampling import SamplingParams
    from pipeline.models.target import Target

    target = Target(gpu.target).model("cuda", dtype="float32")
    proposer = build_proposer("eagle3", FeatureInputs(load_drafter(head.path, target)))
    prompt = Target(gpu.target).tokenizer()("The weather today is")["input_ids"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    greedy = SamplingParams()
    ar = generate_autoregressive(target, prompt, 24, greedy, gen, None)
    spec = generate_speculative(target, proposer, prompt, 24, 3, greedy, gen, None)
    assert spec.tokens == ar.tokens


@pytest.mark.gpu
@pytest.mark.slow
def test_cached_features_are_computed_on_the_gpu_the_drafter_trains_on(trained, tmp_path: Path) -> None:
    """features=cached on a CUDA machine: the target computes the cache where Lightning put it (it used to run on
    the CPU, before the trainer moved the model), and the drafter agrees with the one-rank CPU online one as the
    CPU cached run does, to float32 rounding on another device (1e-3)."""
    _, art, _ = trained
    cached = train_drafter.main(td_cfg(tmp_path, *named_inputs(art), "train_drafter.features=cached",
                                       "train_drafter.train.accelerator=gpu", "train_drafter.train.devices=1"))
    record = json.loads(cached.file("training.json").read_text())
    assert record["feature_cache"]["device"].startswith("cuda"), record["feature_cache"]
    assert record["feature_cache"]["computed"] == [record["rows"]["train"]]
    ours, reference = load_file(str(cached.file("model.safetensors"))), load_file(str(art.file("model.safetensors")))
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-3)


def _deepspeed_script(args: dict) -> None:
    """Train the stage's module with deepspeed.initialize on CPU, as the harness would (see the test)."""
    from tests.training.harness_script import deepspeed_on_one_cpu_rank

    deepspeed = deepspeed_on_one_cpu_rank()

    from jobs.train_drafter import prepare
    from pipeline.artifacts import load_artifact
    from pipeline.training.eagle3_task import Eagle3Task
    from pipeline.training.plan import trainable_parameters
    from pipeline.training.strategy import build_optimizer, build_scheduler, deepspeed_config

    cfg = load_config(None, args["overrides"])
    td, train = cfg.train_drafter, cfg.train_drafter.train
    ready = prepare(cfg, load_artifact(Path(args["calibration"])), load_artifact(Path(args["counts"])))
    task = Eagle3Task(ready.drafter, ready.target, ready.data.heldout, ttt_steps=td.ttt_steps, decay=td.ttt_decay,
                      pad_id=ready.pad_id)
    micro, accumulation = train.batch_layout(1)
    total = train.max_steps
    sampler = ckpt.StepBatchSampler(len(ready.data.train), micro_batch_size=micro, accumulation=accumulation,
                                    world_size=1, rank=0, seed=train.seed, start_step=0, total_steps=total)
    params = list(trainable_parameters(task).values())
    optimizer = build_optimizer(params, train, deepspeed=True)
    scheduler = build_scheduler(optimizer, train, total)
    ds_config = deepspeed_config(train)
    engine, _, _, _ = deepspeed.initialize(model=task, model_parameters=params, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=dict(ds_config))
    losses = []
    for step in range(args["steps"]):
        step_losses = []
        for m in range(accumulation):
            torch.manual_seed(ckpt.derive_seed(train.seed, "micro", step, m))
            batch = task.collate([ready.data.train[i] for i in sampler.indices(step, m)])
            loss, _ = engine(batch)
            engine.backward(loss)
            engine.step()
            step_losses.append(float(loss))
        losses.append(sum(step_losses) / len(step_losses))
    Path(args["out"]).write_text(json.dumps({"losses": losses, "deepspeed_config": ds_config}))


if __name__ == "__main__":
    _deepspeed_script(json.loads(sys.argv[1]))
