"""The train_dflash stage and DFlash in evaluate, end to end on the tiny kit's test profile: a real Lightning run
of the DFlash drafter on the target's own answers (checkpoint by held-out simulated τ, the artifact, both serving
exports, kill -9 then a rerun ending bit-identical), the stage outside the default run unless evaluate decodes
DFlash, and an evaluation with dflash beside eagle3 at equal γ: lossless, one drafter forward per round, gated and
registered as a ``…-dflash`` bundle."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from jobs import run, train_dflash
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.drafters.dflash import reference_keys
from pipeline.drafters.dflash_export import hidden_state_indices_of
from pipeline.drafters.dflash_export import load_config as load_dflash_config
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import default_stages, plan
from tests.helpers import SMALL, TRAIN
from tests.killing import kill_after_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DFLASH = ["train_dflash.num_layers=1", "train_dflash.block_size=4", "train_dflash.anchors_per_row=6",
          "train_dflash.eval_fraction=0.2", "train_dflash.max_length=128", "train_dflash.train.max_steps=24",
          "train_dflash.train.global_batch_size=8", "train_dflash.train.micro_batch_size=4",
          "train_dflash.train.eval_every=8", "train_dflash.train.checkpoint_every=4", "train_dflash.train.lr=3e-3",
          "train_dflash.train.warmup_steps=2", "train_dflash.train.progress_bar=false",
          "mlflow.experiment=train-dflash-tests"]


def cfg_of(workdir: Path, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *SMALL, *DFLASH, *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_kit):
    workdir = tmp_path_factory.mktemp("train-dflash")
    cfg = cfg_of(workdir)
    artifacts = run(cfg, ["train_dflash"])  # builds generate first (count is not an input)
    return cfg, artifacts["train_dflash"]


def test_artifact_holds_weights_config_exports_and_the_training_record(trained) -> None:
    cfg, art = trained
    assert art.kind == "dflash_drafter"
    config = load_dflash_config(art.path)
    assert set(load_file(str(art.file("model.safetensors")))) == set(reference_keys(config))
    for export in ("dflash", "speculators"):
        assert set(load_file(str(art.path / "exports" / export / "model.safetensors"))) == set(reference_keys(config))
        assert hidden_state_indices_of(art.path / "exports" / export) == config.hidden_state_indices
    record = json.loads(art.file("training.json").read_text())
    assert record["steps"] == 24 and record["strategy"] == "single" and record["block_size"] == 4
    assert record["rows"]["train"] + record["rows"]["heldout"] == 40 and record["resumed_from"] == 0
    client = MlflowClient(f"sqlite:///{cfg.workdir_path / 'mlflow.db'}")
    history = client.get_metric_history(record["mlflow_run_id"], "eval.simulated_tau")
    assert [m.step for m in history] == [8, 16, 24]
    best = max(history, key=lambda m: (m.value, -m.step))
    assert record["best"]["step"] == best.step and record["best"]["score"] == pytest.approx(best.value)
    assert record["best"]["score"] > 1.0  # some held-out block rows agree with the target


def test_own_head_draws_its_vocabulary_from_count(trained) -> None:
    """train_dflash.head=draft: the plan adds count (built here, seconds), and the drafter prepare() builds has its own
    head over the count artifact's draft vocabulary (its d2t/t2d), started from the target's rows of those ids."""
    from safetensors.numpy import load_file as load_numpy

    cfg, _ = trained
    draft = load_config(None, [f"workdir={cfg.workdir_path}", *SMALL, *DFLASH, "train_dflash.head=draft"])
    counts = run(draft, ["count"])["count"]
    step = plan(draft, ["train_dflash"])["train_dflash"]
    assert step.inputs["count"][0] == counts.id
    ready = train_dflash.prepare(draft, step.input("generate"), step.input("count"))
    maps = load_numpy(str(counts.file("eagle3_maps.safetensors")))
    ids = torch.arange(maps["d2t"].size) + torch.from_numpy(maps["d2t"])
    assert ready.config.draft_vocab_size == maps["d2t"].size < ready.config.vocab_size
    assert torch.equal(ready.drafter.draft_to_target, ids)
    assert torch.equal(ready.drafter.lm_head.weight, ready.target.get_output_embeddings().weight[ids])
    assert ready.drafter.lm_head.weight.requires_grad


def test_kill_minus_9_then_rerun_ends_bit_identical(trained, tmp_path: Path) -> None:
    """SIGKILL once the step-8 checkpoint landed; the rerun resumes there (the anchor draws are a function of seed
    and step, like the data order) and publishes the uninterrupted run's weights bit for bit."""
    cfg, art = trained
    workdir = tmp_path / "killed"
    calibration = art.path.parent / json.loads(art.file("training.json").read_text())["calibration"]
    named = [f"train_dflash.calibration={calibration}"]  # only train_dflash runs here
    (tmp_path / "base.yaml").write_text(f"workdir: {workdir}\n")
    cmd = [sys.executable, "-m", "jobs.cli", "train_dflash", "--config", str(tmp_path / "base.yaml"), *SMALL,
           *DFLASH, *named]
    landed = kill_after_checkpoint(cmd, workdir, at_step=8, total=24, stage="train_dflash")
    resumed = train_dflash.main(cfg_of(workdir, *named))
    assert json.loads(resumed.file("training.json").read_text())["resumed_from"] == max(landed)
    assert resumed.id == art.id  # a named input enters the id by its artifact id
    ours, reference = load_file(str(resumed.file("model.safetensors"))), load_file(str(art.file("model.safetensors")))
    assert ours.keys() == reference.keys()
    for key in ours:
        assert torch.equal(ours[key], reference[key]), key


def test_the_micro_batch_layout_does_not_change_what_is_learnt(trained, tmp_path: Path) -> None:
    """micro_batch_size is a run setting (the same id): two micro-batches of 2 instead of one of 4 per rank must train
    the same drafter. Each row's anchors are seeded by the step and the row's own index; they were drawn from the
    micro-batch's generator, so another layout (a smaller micro-batch after an out-of-memory, more GPUs) trained
    another drafter under the same id. The rows' target features are computed in other batches (other padding), so
    the weights agree to float32 rounding, 1e-4 after 24 steps, as cached and online EAGLE-3 features do."""
    cfg, art = trained
    calibration = art.path.parent / json.loads(art.file("training.json").read_text())["calibration"]
    smaller = train_dflash.main(cfg_of(tmp_path, f"train_dflash.calibration={calibration}",
                                       "train_dflash.train.micro_batch_size=2"))
    assert smaller.id == art.id
    assert json.loads(smaller.file("training.json").read_text())["batch_layout"] == {"micro_batch_size": 2,
                                                                                  "accumulation": 4}
    ours, reference = load_file(str(smaller.file("model.safetensors"))), load_file(str(art.file("model.safetensors")))
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-4, msg=key)


def test_two_ranks_train_the_one_rank_drafter(trained, tmp_path: Path) -> None:
    """train_dflash on one node running two Lightning ranks (DDP over gloo, a real second process, one thread each):
    each rank takes half of every global batch, draws each row's anchors from the row's own seed, and the two ranks'
    gradients are averaged, so the drafter is the one-rank run's (which accumulates two micro-batches) to float32
    rounding (1e-4, as the micro-batch layout test)."""
    _, art = trained
    workdir = tmp_path / "two-ranks"
    workdir.mkdir()
    (workdir / "base.yaml").write_text(f"workdir: {workdir}\n")
    calibration = art.path.parent / json.loads(art.file("training.json").read_text())["calibration"]
    cmd = [sys.executable, "-m", "jobs.cli", "train_dflash", "--config", str(workdir / "base.yaml"), *SMALL, *DFLASH,
           f"train_dflash.calibration={calibration}", "train_dflash.train.accelerator=cpu",
           "train_dflash.train.devices=2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (artifact,) = (workdir / "artifacts").glob("train_dflash-*/")
    assert artifact.name == art.id
    record = json.loads((artifact / "training.json").read_text())
    assert (record["world_size"], record["strategy"], record["batch_layout"]) == (
        2, "ddp", {"micro_batch_size": 4, "accumulation": 1})
    ours, reference = load_file(str(artifact / "model.safetensors")), load_file(str(art.file("model.safetensors")))
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-4, msg=key)


def test_the_stage_is_outside_the_default_run_unless_evaluate_decodes_dflash(trained) -> None:
    cfg, art = trained
    assert "train_dflash" not in default_stages(cfg)
    assert "train_dflash" not in plan(cfg).stages and "train_dflash" not in plan(cfg)["evaluate"].inputs
    with_dflash = cfg_of(cfg.workdir_path, "evaluate.methods=[full,dflash]", "evaluate.gammas=[3]")
    assert "train_dflash" in default_stages(with_dflash)
    assert plan(with_dflash)["evaluate"].inputs["train_dflash"][0] == art.id
    # run settings keep the id; what it learns does not
    assert plan(cfg_of(cfg.workdir_path, "train_dflash.train.micro_batch_size=2"), ["train_dflash"])[
        "train_dflash"].id == art.id
    assert plan(cfg_of(cfg.workdir_path, "train_dflash.block_size=5"), ["train_dflash"])["train_dflash"].id != art.id
    with pytest.raises(DrafterError, match=r"block_size - 1 = 3"):
        plan(cfg_of(cfg.workdir_path, "evaluate.methods=[dflash]", "evaluate.gammas=[4]"))


def test_a_mask_token_or_head_count_the_target_cannot_take_is_refused_naming_the_keys_and_builds_nothing(trained) -> None:
    cfg, art = trained
    bad = cfg_of(cfg.workdir_path, "train_dflash.mask_token_id=999999")
    bad_id = plan(bad, ["train_dflash"])["train_dflash"].id
    before = sorted(p.name for p in art.path.parent.iterdir())
    with pytest.raises(DrafterError, match=r"train_dflash.mask_token_id is not a row") as refused:
        run(bad, ["train_dflash"])
    assert "found:    999999" in str(refused.value) and "what to do: Leave train_dflash.mask_token_id null" in str(
        refused.value)
    assert bad_id != art.id and sorted(p.name for p in art.path.parent.iterdir()) == before
    with pytest.raises(DrafterError, match=r"not a multiple of key/value heads") as refused:
        run(cfg_of(cfg.workdir_path, "train_dflash.num_key_value_heads=3"), ["train_dflash"])  # 4 query heads
    assert "what to do: The draft layers copy the target's shape" in str(refused.value)
    assert sorted(p.name for p in art.path.parent.iterdir()) == before


EVAL = ["evaluate.methods=[eagle3,dflash]", "evaluate.gammas=[3]", "evaluate.prompts_per_task=2",
        "evaluate.max_new_tokens=16", "evaluate.max_prompt_tokens=64", "evaluate.sampling_check_samples=200",
        "evaluate.gate_tau_min=1.0",
        "evaluate.gate_speed_min=0.1", *TRAIN, "mlflow.experiment=train-dflash-tests"]


def test_dflash_beside_eagle3_is_lossless_one_forward_per_round_and_registered(trained) -> None:
    cfg, art = trained
    evaluation = run(cfg_of(cfg.workdir_path, *EVAL), ["evaluate"])["evaluate"]
    results = json.loads(evaluation.file("report.json").read_text())
    assert results["lossless"]["passed"], results["lossless"]["checks"]
    dflash = [r for r in results["rows"] if r["method"] == "dflash"]
    assert {r["task"] for r in dflash} == {"chat", "code"} and all(r["greedy_equal"] for r in dflash)
    for row in dflash:  # at most one drafter forward per round (calls per token × tokens per round; a round that
        # drafts nothing, e.g. the last one, costs none; tests/engine/test_dflash.py counts them exactly)
        assert 0 < row["drafter_calls_per_token"] * row["tau"] <= 1.0
    assert results["inputs"]["train_dflash"] == art.id
    assert results["dflash_training"]["artifact"] == art.id
    assert "Block drafting (DFlash) beside EAGLE-3" in evaluation.file("report.md").read_text()
    for row in results["rows"]:  # τ's per-prompt parts, kept for paired comparisons, add up to the row's τ
        assert len(row["kept_per_prompt"]) == len(row["rounds_per_prompt"]) == row["prompts"] == 2
        assert sum(row["kept_per_prompt"]) / sum(row["rounds_per_prompt"]) == pytest.approx(row["tau"])
    assert re.search(r"\| dflash \| [0-9.]+ \| [+-][0-9.]+ ± [0-9.]+ \|", evaluation.file("report.md").read_text())
    gates = results["dflash_gates"]
    assert gates["passed"] and gates["chosen"]["gamma"] == 3, gates
    record = json.loads((evaluation.path.parent / f"{evaluation.id}.registration-dflash.json").read_text())
    assert record["name"].endswith("-dflash") and "champion" in record["aliases"]


def test_the_mask_token_is_the_tokenizers_own_mask_where_it_has_one() -> None:
    """SGLang checks dflash_config.mask_token_id against the tokenizer's <|MASK|> and refuses to serve a drafter whose
    id differs; the default took the pad token whatever the tokenizer held."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "<pad>": 1, "<|MASK|>": 2, "b": 3}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                                        pad_token="<pad>")
    assert train_dflash.mask_token_id(None, tokenizer, 4) == 2 and train_dflash.mask_token_id(2, tokenizer, 4) == 2
    with pytest.raises(DrafterError, match=r"not the target tokenizer's <\|MASK\|>(.|\n)*expected: 2"):
        train_dflash.mask_token_id(1, tokenizer, 4)
    del vocab["<|MASK|>"]
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="a")),
                                    pad_token="<pad>")
    assert train_dflash.mask_token_id(None, plain, 4) == 1 and train_dflash.mask_token_id(3, plain, 4) == 3
