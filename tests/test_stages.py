"""The generate and count stages end to end on the tiny kit's test profile: real Lightning predict,
real Arrow shards, real MLflow runs; resume after SIGKILL; bad input gives clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.numpy import load_file

from jobs import count, generate
from pipeline.artifacts import ArtifactWriter, load_artifact
from pipeline.data.calibration import encode_prompt, iter_rows, load_dataset_dir, read_shard, write_shard
from pipeline.data.sources import load_conversations, load_humaneval, split_heldout
from pipeline.errors import DrafterError
from pipeline.evaluation.matrix import eval_prompts
from pipeline.models.loading import load_tokenizer
from pipeline.orchestration.dag import plan
from pipeline.tracking import tracking_uri
from tests.helpers import SMALL, small_cfg
from tests.mlflow_server import MlflowServer

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "test_stages"


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory, tiny_kit, mlflow_server: MlflowServer):
    """generate → count once, logged to the real MLflow server."""
    workdir = tmp_path_factory.mktemp("pipeline")
    # Its own experiment on the session's shared server: other files run these same stages (same artifact ids)
    # against it, in whatever order xdist gives them.
    cfg = small_cfg(workdir, f"mlflow.tracking_uri={mlflow_server.uri}", f"mlflow.experiment={EXPERIMENT}")
    calibration = generate.main(cfg)
    counts = count.main(cfg)
    return cfg, calibration, counts


def test_calibration_set_is_well_formed(pipeline_run) -> None:
    cfg, calibration, _ = pipeline_run
    assert calibration.kind == "calibration"
    rows = list(iter_rows(calibration.path / "data"))
    assert len(rows) == calibration.metrics["rows"] == 40
    from pipeline.models.loading import load_tokenizer

    tok = load_tokenizer(cfg.target.model)
    for row in rows:
        ids, mask = row["input_ids"], row["loss_mask"]
        assert len(ids) == len(mask) == row["prompt_len"] + row["response_len"]
        assert mask == [0] * row["prompt_len"] + [1] * row["response_len"]  # assistant tokens only
        assert 1 <= row["response_len"] <= cfg.generate.max_new_tokens
        assert row["prompt_len"] <= cfg.generate.max_prompt_tokens
        assert row["finished"] == (ids[-1] == tok.eos_token_id)
    ds = load_dataset_dir(calibration.path / "data")  # loadable as a `datasets` dataset
    assert len(ds) == 40 and set(ds.column_names) >= {"input_ids", "loss_mask", "prompt_id"}
    assert calibration.metrics["tokens_per_s"] > 0


def test_calibration_excludes_heldout_conversations(pipeline_run) -> None:
    convs, _ = load_conversations("sharegpt")
    heldout = {c.id for c in split_heldout(convs, 0.05, heldout=True)}
    used = {row["prompt_id"] for row in iter_rows(pipeline_run[1].path / "data")}
    assert used and not used & heldout


@pytest.mark.parametrize("source", ["sharegpt", "humaneval"])
def test_the_code_task_keeps_to_humaneval_problems_no_calibration_set_drew_on(tmp_path: Path, tiny_kit,
                                                                              source: str) -> None:
    """With generate.source=humaneval the calibration set holds every HumanEval problem outside the held-out share,
    and the code task decoded the first problems regardless: most of its prompts had been trained on."""
    # every problem the code task may decode (RDK's code analysis, which takes the last ones, then has none left)
    cfg = small_cfg(tmp_path, f"generate.source={source}", "evaluate.prompts_per_task=200",
                    "estimate_rdk.code_problems=0")
    tokenizer = load_tokenizer(cfg.target.model)
    code = eval_prompts(cfg, tokenizer)["code"]
    problems = load_humaneval()
    if source == "humaneval":
        calibrated, _ = load_conversations(source)
        trained = {c.id for c in split_heldout(calibrated, cfg.generate.heldout_fraction, heldout=False)}
        problems = [c for c in problems if c.id not in trained]
        assert 0 < len(problems) < 30
    assert code == [encode_prompt(tokenizer, c.messages, cfg.evaluate.max_prompt_tokens) for c in problems]
    # which problems the code task decodes is part of what the evaluation's id names
    assert plan(cfg, ["evaluate"])["evaluate"].config["data"].get("code_prompts") == (
        "heldout" if source == "humaneval" else None)


def test_a_copy_of_humaneval_under_another_name_is_still_kept_out_of_the_code_task(tmp_path: Path, tiny_kit) -> None:
    """generate.source=./HumanEval.jsonl (the same problems, a path rather than the packaged name): HumanEval was
    recognised by name only, so the code task decoded every problem, ~95 % of them answered in the calibration set.
    Problems whose prompt opens a calibration conversation are now left out, whatever the source is called."""
    problems = load_humaneval()
    source = tmp_path / "HumanEval.jsonl"
    source.write_text("".join(json.dumps({"task_id": c.id, "prompt": c.messages[0]["content"]}) + "\n"
                              for c in problems))
    cfg = small_cfg(tmp_path, f"generate.source={source}", "evaluate.prompts_per_task=200", "evaluate.tasks=[code]",
                    "estimate_rdk.code_problems=0")
    tokenizer = load_tokenizer(cfg.target.model)
    code = eval_prompts(cfg, tokenizer)["code"]
    held = split_heldout(problems, cfg.generate.heldout_fraction, heldout=True)
    assert code == [encode_prompt(tokenizer, c.messages, cfg.evaluate.max_prompt_tokens) for c in held]


def test_the_chat_task_skips_prompts_also_posted_on_the_calibration_side(tmp_path: Path, tiny_kit) -> None:
    """The split hashes ids, so a chat posted twice under two ids (the ShareGPT dump holds such copies: 14 of the
    first 64 held-out prompts had a byte-identical twin on the calibration side) could be decoded by evaluate after
    the drafters trained on the target's answer to its twin. Such prompts are skipped."""
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question number {i}?"}]} for i in range(200)]
    rows += [{"id": f"copy{i}", "conversations": [{"from": "human", "value": f"Question number {i}?"}]}
             for i in range(200)]
    source = tmp_path / "posted-twice.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = small_cfg(tmp_path, f"generate.source={source}", "generate.heldout_fraction=0.2",
                    "evaluate.prompts_per_task=200", "evaluate.tasks=[chat]")
    tokenizer = load_tokenizer(cfg.target.model)
    chat = eval_prompts(cfg, tokenizer)["chat"]
    convs, _ = load_conversations(str(source))
    trained = {encode_prompt(tokenizer, c.messages, cfg.evaluate.max_prompt_tokens).__repr__()
               for c in split_heldout(convs, 0.2, heldout=False)}
    held = split_heldout(convs, 0.2, heldout=True)
    assert 0 < len(chat) < len(held)  # some held-out prompts had a twin in calibration, some did not
    assert not any(repr(prompt) in trained for prompt in chat)


def test_answers_end_at_the_generation_configs_end_of_turn_ids_too(tmp_path: Path, tiny_kit) -> None:
    """An instruct model's end-of-turn token is often only in its generation config's eos_token_id list (Llama-3's
    <|eot_id|>, Gemma's <end_of_turn>). generate passed the tokenizer's EOS alone, which replaced that list, so answers
    ran past the end of their turn to max_new_tokens with every extra token marked as the assistant's. Here a local
    copy of the test target lists, beside its EOS, the token its first greedy answer opens with: that answer is now
    that one token, finished."""
    import shutil

    from pipeline.models.loading import resolve_ref

    first = generate.main(small_cfg(tmp_path / "plain", "generate.limit=8"))
    row = next(iter_rows(first.path / "data"))
    opener = row["input_ids"][row["prompt_len"]]
    local = tmp_path / "target"
    shutil.copytree(resolve_ref("tiny:test/target").location, local)
    config = json.loads((local / "generation_config.json").read_text())
    tokenizer = load_tokenizer(str(local))
    assert opener != tokenizer.eos_token_id
    config["eos_token_id"] = [tokenizer.eos_token_id, opener]
    (local / "generation_config.json").write_text(json.dumps(config))
    ended = generate.main(small_cfg(tmp_path / "local", "generate.limit=8", f"target.model={local}"))
    same = next(r for r in iter_rows(ended.path / "data") if r["prompt_id"] == row["prompt_id"])
    assert same["input_ids"][same["prompt_len"]:] == [opener] and same["finished"]


def test_shortlists_keep_the_generation_configs_end_of_turn_ids(tmp_path: Path, tiny_kit) -> None:
    """FR-Spec's shortlists and EAGLE-3's draft vocabulary added the tokenizer's special tokens, not the ids an answer
    ends at: Llama-3.1-Instruct's <|eom_id|> is only in its generation config, rarely counted, and fell out of every
    frequency cut, so no shortlist drafter could end such a turn. Here a copy of the test target lists a token no
    answer used beside its EOS: every shortlist and the draft vocabulary hold it."""
    import shutil

    from safetensors.numpy import load_file as load_numpy

    from jobs import run as run_stages
    from pipeline.models.loading import resolve_ref

    plain = run_stages(small_cfg(tmp_path / "plain", "generate.limit=8"), ["count"])["count"]
    counts = load_numpy(str(plain.file("counts.safetensors")))["counts"]
    local = tmp_path / "target"
    shutil.copytree(resolve_ref("tiny:test/target").location, local)
    tokenizer = load_tokenizer(str(local))
    unused = next(t for t in range(len(counts) - 1, 0, -1)
                  if counts[t] == 0 and t not in tokenizer.all_special_ids)
    config = json.loads((local / "generation_config.json").read_text())
    config["eos_token_id"] = [tokenizer.eos_token_id, unused]
    (local / "generation_config.json").write_text(json.dumps(config))
    art = run_stages(small_cfg(tmp_path / "local", "generate.limit=8", f"target.model={local}"), ["count"])["count"]
    assert load_numpy(str(art.file("counts.safetensors")))["counts"][unused] == 0
    lists = load_numpy(str(art.file("shortlists.safetensors")))
    assert lists and all(unused in ids for ids in lists.values()), {k: v.size for k, v in lists.items()}
    maps = load_numpy(str(art.file("eagle3_maps.safetensors")))
    assert unused in (np.arange(maps["d2t"].size) + maps["d2t"]).tolist() and bool(maps["t2d"][unused])


@pytest.mark.parametrize("extras", [{}, {"top_k": 5, "repetition_penalty": 3.0}], ids=["plain", "hub-extras"])
def test_sampled_answers_follow_temperature_and_top_p_alone(tmp_path: Path, tiny_kit, extras: dict) -> None:
    """generate sampled with temperature and top_p, but transformers also filtered to its default 50 likeliest tokens
    and applied whatever the model's generation_config.json set (a hub model's top_k, repetition_penalty), so the
    calibration answers followed another law than the one configured and evaluated. Here 4,000 first answer tokens
    to one prompt (temperature 1.5, top_p 0.98) are binned as the law ranks them (each of its 10 likeliest tokens,
    ranks 11-50, the rest) and tested against that law by a chi-square test with 11 degrees of freedom at
    p = 1e-6 (48.9). Under the old law the last bin, about a fifth of the mass here, was never drawn."""
    import shutil

    from scipy.stats import chi2

    from pipeline.engine.sampling import SamplingParams, standardise
    from pipeline.models.loading import resolve_ref

    local = tmp_path / "target"
    shutil.copytree(resolve_ref("tiny:test/target").location, local)
    config = json.loads((local / "generation_config.json").read_text())
    (local / "generation_config.json").write_text(json.dumps({**config, **extras}))
    cfg = small_cfg(tmp_path, f"target.model={local}", "generate.temperature=1.5", "generate.top_p=0.98",
                    "generate.max_new_tokens=1")
    ids = encode_prompt(load_tokenizer(str(local)), [{"role": "user", "content": "Tell me about rivers."}],
                        cfg.generate.max_prompt_tokens)
    module = generate._make_module(cfg, [], [], tmp_path / "staging")
    n = 4000
    torch.manual_seed(0)
    drawn = torch.tensor([row["input_ids"][-1] for row in module._answer([(str(i), ids) for i in range(n)])])
    with torch.no_grad():
        law = standardise(module.lm(torch.tensor([ids])).logits[0, -1], SamplingParams(1.5, 0, 0.98))
    order = torch.argsort(law, descending=True, stable=True)
    rank_of = torch.empty(law.numel(), dtype=torch.long).scatter_(0, order, torch.arange(law.numel()))
    rank = rank_of[drawn]
    ranked = law[order]
    bins = [*[(r, r + 1) for r in range(10)], (10, 50), (50, law.numel())]
    expected = torch.tensor([float(ranked[a:b].sum()) * n for a, b in bins])
    observed = torch.tensor([float(((rank >= a) & (rank < b)).sum()) for a, b in bins])
    assert expected.min() >= 5 and expected[-1] > 0.1 * n  # the test can see the top-k cut
    statistic = float(((observed - expected) ** 2 / expected).sum())
    assert statistic < chi2.isf(1e-6, len(bins) - 1), (statistic, observed.tolist(), expected.tolist())


def test_counts_and_exports_match_the_calibration_set(pipeline_run) -> None:
    cfg, calibration, counts_art = pipeline_run
    counts = load_file(str(counts_art.file("counts.safetensors")))["counts"]
    expected = np.zeros_like(counts)
    for row in iter_rows(calibration.path / "data"):
        for t, m in zip(row["input_ids"], row["loss_mask"]):
            expected[t] += m
    assert np.array_equal(counts, expected) and counts.sum() == counts_art.metrics["tokens_counted"]
    lists = load_file(str(counts_art.file("shortlists.safetensors")))
    assert set(lists) == {"top_k_16", "top_k_64", "top_p_0.9", "min_count_2"}
    from pipeline.models.loading import load_tokenizer

    eos = load_tokenizer(cfg.target.model).eos_token_id
    for ids in lists.values():
        assert np.all(np.diff(ids) > 0) and eos in ids  # sorted, unique, EOS always included
    maps = load_file(str(counts_art.file("eagle3_maps.safetensors")))
    draft_ids = np.arange(maps["d2t"].size) + maps["d2t"]
    assert np.array_equal(np.flatnonzero(maps["t2d"]), draft_ids)
    token_map = torch.load(counts_art.file("token_map.pt"), weights_only=True)
    assert sorted(token_map.tolist()) == draft_ids.tolist()
    assert counts[token_map[0]] == counts[draft_ids].max()  # most frequent first
    summary = json.loads(counts_art.file("shortlists.json").read_text())
    assert summary["calibration"] == calibration.id


def test_stage_runs_are_in_mlflow(pipeline_run, mlflow_server: MlflowServer) -> None:
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    for art in pipeline_run[1:]:
        runs = client.search_runs([exp.experiment_id], f"tags.`drafter.artifact_id` = '{art.id}'")
        assert len(runs) == 1
        assert runs[0].data.tags["drafter.vocab_hash"] == art.fingerprint["vocab_hash"]
        assert runs[0].data.params["target.model"] == "tiny:test/target"


def test_rerun_is_a_cache_hit(pipeline_run) -> None:
    cfg, calibration, counts_art = pipeline_run
    mtime = calibration.path.stat().st_mtime_ns
    assert generate.main(cfg).id == calibration.id and count.main(cfg).id == counts_art.id
    assert calibration.path.stat().st_mtime_ns == mtime
    changed = small_cfg(cfg.workdir_path, "count.top_k=[8]")
    assert count.main(changed).id != counts_art.id  # a changed config is a new artifact


def test_sigkilled_generate_resumes_to_identical_rows(tmp_path: Path, tiny_kit) -> None:
    """Kill `drafter generate` with SIGKILL after its first shard lands; the rerun must finish with exactly
    the rows of an uninterrupted run (same order, none lost or doubled)."""
    extra = ["generate.limit=48", "generate.max_new_tokens=24", "mlflow.log_artifacts=false"]
    reference = generate.main(small_cfg(tmp_path / "ref", *extra))
    workdir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jobs.cli", "generate", f"workdir={workdir}", *SMALL, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if list((workdir / "staging").glob("*/shard-*.arrow")):
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"generate ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    staged = list((workdir / "staging").glob("*/shard-*.arrow"))
    assert 1 <= len(staged) < 12, "the kill must land mid-run"
    resumed = generate.main(small_cfg(workdir, *extra))
    assert resumed.id == reference.id
    assert 1 <= resumed.metrics["resumed_shards"] < 12
    assert list(iter_rows(resumed.path / "data")) == list(iter_rows(reference.path / "data"))
    assert not list((workdir / "artifacts").glob(".tmp-*"))


def _stop_before_publishing(*_args, **_kwargs) -> None:
    raise RuntimeError("stopped before publishing")


def test_damaged_staged_shards_are_redone_naming_each(tmp_path: Path, tiny_kit, monkeypatch, capsys) -> None:
    """A run stopped after staging its shards, before publishing (what a kill or a failed publish leaves); one
    staged shard gets a flipped byte, another is truncated. The rerun redoes exactly those two, with a line naming
    each and what was wrong, and publishes the rows of an uninterrupted run under its id (before checksums the
    flipped shard was published as-is and the truncated one failed with an Arrow error naming no file)."""
    extra = ["generate.limit=24", "generate.max_new_tokens=12"]  # 6 shards of 4 prompts
    reference = generate.main(small_cfg(tmp_path / "ref", *extra))
    cfg = small_cfg(tmp_path / "stopped", *extra)
    with monkeypatch.context() as patch:
        patch.setattr(ArtifactWriter, "commit", _stop_before_publishing)
        with pytest.raises(RuntimeError, match="stopped before publishing"):
            generate.main(cfg)
    staged = sorted((tmp_path / "stopped" / "staging").glob("*/shard-*.arrow"))
    assert len(staged) == 6
    flipped, truncated = staged[1], staged[4]
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    capsys.readouterr()
    resumed = generate.main(cfg)
    err = capsys.readouterr().err
    assert f"{flipped.name}: sha256 mismatch (expected " in err and f"{truncated.name}: truncated (" in err, err[-3000:]
    assert resumed.id == reference.id and resumed.metrics["resumed_shards"] == 4
    assert list(iter_rows(resumed.path / "data")) == list(iter_rows(reference.path / "data"))


def test_a_run_resumed_on_another_device_says_which_shards_came_from_where(tmp_path: Path, tiny_kit, monkeypatch,
                                                                           capsys) -> None:
    """A GPU job requeued on the CPU (or on another GPU model) resumes the shards staged before it: the calibration
    set then mixes answers from two devices, whose sampling is not bit-reproducible across them, and nothing said
    so. Each staged shard now records the device that answered it; the published manifest counts shards by device
    and the log names the mix. Here a stopped run's staged shards are relabelled as an H100 had staged them (a GPU
    cannot run here) and half are deleted, so the rerun answers those on this CPU."""
    from pipeline.staged import sidecar
    from pipeline.timing import device_name

    extra = ["generate.limit=24", "generate.max_new_tokens=12"]  # 6 shards of 4 prompts
    cfg = small_cfg(tmp_path, *extra)
    with monkeypatch.context() as patch:
        patch.setattr(ArtifactWriter, "commit", _stop_before_publishing)
        with pytest.raises(RuntimeError, match="stopped before publishing"):
            generate.main(cfg)
    staged = sorted((tmp_path / "staging").glob("*/shard-*.arrow"))
    here, gpu = device_name("cpu"), "NVIDIA H100 80GB HBM3"
    assert len(staged) == 6 and all(json.loads(sidecar(p).read_text())["about"] == {"device": here} for p in staged)
    for path in staged[:3]:
        record = json.loads(sidecar(path).read_text())
        sidecar(path).write_text(json.dumps({**record, "about": {"device": gpu}}))
    for path in staged[3:]:
        path.unlink()
    capsys.readouterr()
    resumed = generate.main(cfg)
    assert resumed.metrics["computed_on"] == {gpu: 3, here: 3} and resumed.metrics["resumed_shards"] == 3
    assert (f"mixes answers computed on several devices (sampling is not bit-reproducible across them): 3 shard(s) "
            f"on {gpu}; 3 shard(s) on {here}") in capsys.readouterr().err


def test_an_unreadable_shard_is_refused_naming_it(tmp_path: Path) -> None:
    """A truncated or missing calibration shard read anywhere is a DrafterError naming the file, not Arrow's
    message alone."""
    shard = tmp_path / "shard-00000.arrow"
    write_shard(shard, [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "prompt_id": "p", "prompt_len": 1,
                         "response_len": 2, "finished": True}] * 50)
    shard.write_bytes(shard.read_bytes()[:-200])
    with pytest.raises(DrafterError, match="cannot be read: it is missing, truncated") as err:
        read_shard(shard)
    assert str(shard) in str(err.value)
    with pytest.raises(DrafterError, match="shard-00001.arrow cannot be read"):
        read_shard(tmp_path / "shard-00001.arrow")


def test_edited_or_deleted_manifest_is_rebuilt_and_never_logged(tmp_path: Path, tiny_kit, monkeypatch,
                                                                capsys) -> None:
    """A published calibration set whose MLflow logging did not happen (a real server, stopped right after the
    publish), then its manifest's metrics edited: the plan no longer calls it cached, and the rerun moves it aside
    with a line saying so, rebuilds it, and logs the true metrics (before, the cache hit used and logged the edited
    ones). A deleted manifest is rebuilt the same way instead of blocking the stage."""
    keys = ["generate.kind=raw", "generate.limit=8", "generate.max_new_tokens=64"]
    cfg = small_cfg(tmp_path, *keys)
    server = MlflowServer(tmp_path / "server")
    server.start()
    real_commit = ArtifactWriter.commit

    def commit_then_the_server_dies(self: ArtifactWriter, *args: object, **kwargs: object) -> object:
        published = real_commit(self, *args, **kwargs)
        server.stop()
        return published

    try:
        with monkeypatch.context() as patch, pytest.raises(DrafterError, match="The artifact is safe at"):
            patch.setattr(ArtifactWriter, "commit", commit_then_the_server_dies)
            # the store is a run setting: the same id as cfg's, whose own (local) store never saw it
            generate.main(small_cfg(tmp_path, *keys, f"mlflow.tracking_uri={server.uri}", "mlflow.retries=1",
                                    "mlflow.timeout_s=2"))
    finally:
        server.stop()
    first = load_artifact(plan(cfg, ["generate"])["generate"].path)
    manifest = first.path / "manifest.json"
    edited = json.loads(manifest.read_text())
    edited["metrics"]["rows"] = 10**6
    manifest.write_text(json.dumps(edited))
    assert not plan(cfg, ["generate"])["generate"].cached
    capsys.readouterr()
    rebuilt = generate.main(cfg)
    err = capsys.readouterr().err
    assert f"{first.id} in the store is damaged and will be rebuilt" in err and "metrics changed" in err, err[-3000:]
    assert rebuilt.id == first.id and rebuilt.metrics["rows"] == first.metrics["rows"] < 10**6
    client = MlflowClient(tracking_uri=tracking_uri(cfg.mlflow, tmp_path))
    runs = client.search_runs([client.get_experiment_by_name("stages").experiment_id])
    assert [r.data.metrics["rows"] for r in runs] == [first.metrics["rows"]]
    (rebuilt.path / "manifest.json").unlink()
    again = generate.main(cfg)
    assert again.id == first.id and load_artifact(again.path).metrics["rows"] == first.metrics["rows"]
    assert "no manifest.json" in capsys.readouterr().err
    assert len(list((tmp_path / "artifacts" / ".damaged").iterdir())) == 2


@pytest.mark.parametrize("kind", ["target", "raw"])
def test_the_trainers_held_out_rows_keep_a_chats_parts_together(tmp_path: Path, tiny_kit, kind: str) -> None:
    """The trainers choose their kept checkpoint on held-out calibration rows, split by a hash of each row's
    prompt_id. A long ShareGPT chat is several records (`<base>_0`, `<base>_1`, ...) and each one's first prompt is
    a row, so parts of one chat landed on both sides and the held-out simulated tau scored rows from chats trained
    on. Rows now carry their chat's group and split by it: here 150 three-part chats, each whole on one side."""
    from pipeline.data.rows import CalibrationRows

    chats = [{"id": f"chat{c}_{k}", "conversations": [
        {"from": "human", "value": f"Tell me about river {c}, part {k}."},
        {"from": "gpt", "value": f"River {c} is long and its part {k} flows north past many towns."}]}
        for c in range(150) for k in range(3)]
    source = tmp_path / "chats.json"
    source.write_text(json.dumps(chats))
    art = generate.main(small_cfg(tmp_path, f"generate.source={source}", f"generate.kind={kind}",
                                  "generate.max_new_tokens=8", "generate.limit=null"))
    chat_of = {tuple(r["input_ids"]): r["prompt_id"].rsplit("_", 1)[0] for r in iter_rows(art.path / "data")}
    rows = CalibrationRows(art.path / "data", max_length=256, eval_fraction=0.3, eval_max_rows=1000, min_length=2,
                           what="the EAGLE-3 drafter", fraction_key="train_drafter.eval_fraction")
    held = {chat_of[tuple(r.input_ids)] for r in rows.heldout}
    trained = {chat_of[tuple(r.input_ids)] for r in rows.train}
    assert held and trained and held.isdisjoint(trained)
    assert len(rows.heldout) + len(rows.train) > 2 * len(held | trained)  # chats with several parts were split


def test_drafter_calibration_kind(tmp_path: Path, tiny_kit) -> None:
    art = generate.main(small_cfg(tmp_path, "generate.kind=drafter", "generate.drafter=tiny:test/drafter",
                                  "generate.limit=4"))
    assert art.metrics["rows"] == 4 and art.metrics["generated_tokens"] > 0
    with pytest.raises(DrafterError, match="shares the target's tokenizer"):
        generate.main(small_cfg(tmp_path, "generate.kind=drafter", "generate.drafter=tiny:test/drafter_other"))


def test_missing_and_empty_prompt_files(tmp_path: Path, tiny_kit) -> None:
    with pytest.raises(DrafterError, match=r"nope\.jsonl does not exist"):
        generate.main(small_cfg(tmp_path, f"generate.source={tmp_path / 'nope.jsonl'}"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DrafterError, match=r"empty\.jsonl is empty"):
        generate.main(small_cfg(tmp_path, f"generate.source={empty}"))
    assert not list((tmp_path / "artifacts").glob("generate-*"))


def test_dataset_without_assistant_tokens(tmp_path: Path, tiny_kit) -> None:
    data = tmp_path / "users_only.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"u{i}", "conversations": [{"from": "human", "value": f"hi {i}"}]})
                              for i in range(6)))
    with pytest.raises(DrafterError, match="no assistant tokens"):
        generate.main(small_cfg(tmp_path, "generate.kind=raw", f"generate.source={data}",
                                "generate.heldout_fraction=0"))
    assert not [p for p in (tmp_path / "artifacts").glob("generate-*") if p.is_dir()]


def test_calibration_for_another_tokenizer_is_refused(tmp_path: Path, tiny_kit) -> None:
    other = generate.main(small_cfg(tmp_path, "target.model=tiny:test/drafter_other", "generate.limit=4"))
    with pytest.raises(DrafterError, match="built for a different target") as err:
        count.main(small_cfg(tmp_path, f"count.calibration={other.path}"))
    msg = str(err.value)
    assert "vocab_hash" in msg and other.fingerprint["vocab_hash"] in msg
    assert load_artifact(other.path).id == other.id  # nothing lost


def test_mlflow_down_fails_before_work_and_loses_nothing(tmp_path: Path, tiny_kit) -> None:
    from tests.mlflow_server import free_port

    cfg = small_cfg(tmp_path, f"mlflow.tracking_uri=http://127.0.0.1:{free_port()}", "mlflow.retries=1",
                    "mlflow.timeout_s=1", "generate.limit=4")
    with pytest.raises(DrafterError, match="unreachable"):
        generate.main(cfg)
    # Refused before any work: no staging dir, no shard, no artifact (nothing to lose, nothing half-made).
    assert not (tmp_path / "staging").exists()
    assert not list(tmp_path.rglob("shard-*.arrow")) and not list(tmp_path.rglob("generate-*"))
