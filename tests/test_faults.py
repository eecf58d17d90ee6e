"""Fault-table rows that no stage-specific test covers (README "Faults"): a kill -9 at a random moment of a
multi-stage run, a full disk, and prompts that are too long, empty or not
UTF-8."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import run
from pipeline.artifacts import load_artifact
from pipeline.data.calibration import iter_rows
from pipeline.data.sources import load_conversations
from pipeline.errors import DrafterError
from pipeline.orchestration.dag import plan
from pipeline.orchestration.stage import STAGED_INPUTS
from pipeline.staged import staged_about, write_staged_json
from tests.helpers import SMALL, TIMED_ROW_FIELDS, skip_unless, small_cfg

ROOT = Path(__file__).resolve().parents[1]
FAST = ["generate.limit=24", "generate.max_new_tokens=12", "mlflow.log_artifacts=false"]


def _cli(workdir: Path, *args: str) -> list[str]:
    """The command line of ``args`` on ``workdir`` with the shared settings; the caller's overrides come after them
    and win, as in ``small_cfg(workdir, *SMALL-then-extra)``, so a test's plan ids are the subprocess's."""
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    words = [a for a in args if a not in overrides]
    return [sys.executable, "-m", "jobs.cli", *words, f"workdir={workdir}", *SMALL, *FAST, *overrides]


def _payloads(path: Path) -> dict[str, str]:
    return {name: e["sha256"] for name, e in load_artifact(path).manifest["files"].items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> tuple[dict, float]:
    """generate + count run once in-process, and how long that took."""
    started = time.monotonic()
    artifacts = run(small_cfg(tmp_path_factory.mktemp("reference"), *FAST), ["count"])
    return artifacts, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kill_minus_9_at_a_random_moment_then_rerun_is_identical(seed: int, tmp_path: Path, reference) -> None:
    """`drafter run --stages count` (generate then count) killed with SIGKILL after a seeded random delay
    (5-60 % of the in-process reference's duration); the rerun ends with the reference's ids and
    payload bytes and no temporary directory left in the store.

    The kill must interrupt work: one that landed after count's artifact was published (the run then only logs and
    exits, about a tenth of its time) left the rerun nothing but cache hits, and the test passed testing nothing.
    Such an attempt, or one whose run ended before the kill, is set aside: the run is started again in a fresh
    workdir and killed at half the delay (at most four attempts), so the test never passes on a finished run."""
    artifacts, duration = reference
    # the CLI run needs its start-up (imports, kit load) on top of the reference's work, so a delay within 60 %
    # of the in-process duration mostly lands while it works: during start-up, generate, count or the publish
    delay = random.Random(seed).uniform(0.05, 0.6) * duration
    for attempt in range(4):
        workdir = tmp_path / f"killed-{attempt}"
        proc = subprocess.Popen(_cli(workdir, "run", "--stages", "count"), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        killed = proc.wait() == -signal.SIGKILL
        if killed and not list((workdir / "artifacts").glob("count-*")):
            break  # killed before count was published: the rerun has work to redo
        delay /= 2
    else:
        pytest.fail(f"four kills, the last after {delay * 2:.1f} s, all came after count was published or the run "
                    "ended: the test would prove nothing")
    run(small_cfg(workdir, *FAST), ["count"])
    for stage in ("generate", "count"):
        step = plan(small_cfg(workdir, *FAST), [stage])[stage]
        assert step.id == artifacts[stage].id and _payloads(step.path) == _payloads(artifacts[stage].path)
    assert not list((workdir / "artifacts").glob(".tmp-*"))


EVALUATE = ["evaluate.methods=[full,shortlist]", "evaluate.shortlists=[top_k_16]", "evaluate.gammas=[2,3]",
            "evaluate.sampling_check_samples=100",
            "evaluate.register=false"]


def _pieces(staging: Path, cells: bool = False) -> int:
    """Pieces of an evaluation staged (their sidecar checksums and the inputs record aside); ``cells``: only cells."""
    return sum(1 for f in staging.glob("*.json") if not f.name.endswith(".sha256.json")
               and f.name != STAGED_INPUTS and (not cells or "-g" in f.name))


def _decoded(results: dict) -> tuple[list[dict], list[dict]]:
    """An evaluation's rows without their timings, and its checks."""
    rows = [{k: v for k, v in row.items() if k not in TIMED_ROW_FIELDS} for row in results["rows"]]
    return rows, results["lossless"]["checks"]


@pytest.mark.slow
def test_an_evaluation_killed_midway_keeps_its_finished_cells_and_the_rerun_decodes_only_the_rest(
        tmp_path: Path, reference, capfd: pytest.CaptureFixture) -> None:
    """`drafter evaluate` killed with SIGKILL once a few of its cells were staged: the rerun keeps them (a line says
    how many of how many), decodes only the rest, and ends with the rows and checks of an uninterrupted evaluation,
    timings aside. Before, a killed evaluation started again from its first prompt, so one longer than its Slurm
    job's time limit was requeued again and again and never ended."""
    import json

    import torch

    artifacts, _ = reference
    uninterrupted = run(small_cfg(artifacts["count"].path.parents[1], *FAST, *EVALUATE), ["evaluate"])["evaluate"]
    workdir = tmp_path / "killed"
    cfg = small_cfg(workdir, *FAST, *EVALUATE)
    staging = workdir / "staging" / plan(cfg, ["evaluate"])["evaluate"].id
    # the same torch threads as this process, so the cells decoded there are the ones decoded here
    (tmp_path / "empty.yaml").write_text("")  # the defaults small_cfg starts from, not the CLI's embedded default
    proc = subprocess.Popen(_cli(workdir, "evaluate", "--config", str(tmp_path / "empty.yaml"), *EVALUATE), cwd=ROOT,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    deadline = time.monotonic() + 300
    while (not staging.is_dir() or _pieces(staging, cells=True) < 3) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the evaluation ended before the kill: the test would prove nothing"
    first = json.loads((uninterrupted.path / "report.json").read_text())
    cells = len(first["rows"]) - 2  # the rows but each task's autoregressive one
    staged = _pieces(staging)
    assert 3 <= _pieces(staging, cells=True) < cells  # killed midway

    # one staged cell as a build whose rows had another field would have left it (sound checksum, other record):
    # decoded again, where EvalRow(**row) raised TypeError before
    other = sorted(f for f in staging.glob("*-g*.json") if not f.name.endswith(".sha256.json"))[0]
    piece = json.loads(other.read_text())
    write_staged_json(other, {**piece, "row": {**piece["row"], "retired_field": 1}}, about=staged_about(other))
    capfd.readouterr()
    resumed = run(cfg, ["evaluate"])["evaluate"]
    said = capfd.readouterr().err
    keys = 2 + cells + 2 * (cells // 4)  # per task its autoregressive runs; the cells; per configuration (2 tasks ×
    # 2 γ cells each) its first-token and its every-position check
    assert f"{other.name}: staged with records of another shape: decoding it again" in said
    assert f"resuming an interrupted evaluation: {staged - 1} of {keys} pieces kept" in said
    assert resumed.id == uninterrupted.id
    assert _decoded(json.loads((resumed.path / "report.json").read_text())) == _decoded(first)
    assert not staging.exists()  # the staged pieces go once the evaluation is published


def test_full_disk_fails_clearly_and_publishes_nothing(tmp_path: Path, tiny_kit) -> None:
    """The workdir on a 16 KiB tmpfs: generate fails with a DrafterError that says the disk is full and what to
    do, the store holds no artifact and no temporary directory, and the same run on a larger disk succeeds."""
    skip_unless(os.geteuid() == 0, "not root: mounting a tmpfs needs root", "DRAFTER_REQUIRE_ROOT",
                "run the tests as root, as .ci/run does")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], check=True)
    try:
        cfg = small_cfg(small, *FAST, "mlflow.tracking_uri=" + (tmp_path / "mlruns").as_uri())
        with pytest.raises(DrafterError, match="No space left on the device while stage generate") as err:
            run(cfg, ["generate"])
        assert "what to do" in str(err.value) and "no partial artifact" in str(err.value)
        store = small / "artifacts"
        assert not store.exists() or not list(store.iterdir())
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert run(small_cfg(tmp_path / "large", *FAST), ["generate"])["generate"].path.is_dir()


def test_a_system_prompt_longer_than_the_budget_leaves_the_template_intact(tiny_kit) -> None:
    """When a system turn and the template's overhead fill evaluate.max_prompt_tokens, the user turn was cut to one
    token and the prompt then cut from the left: it lost BOS and the system header, a prompt the served target never
    sees. The system turn is dropped instead: the prompt is the user's turn (cut) under the whole template."""
    from pipeline.data.calibration import encode_prompt
    from pipeline.models.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny:test/target")
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    user = {"role": "user", "content": "Write a function that adds two numbers. " * 10}
    ids = encode_prompt(tokenizer, [system, user], 64)
    assert len(ids) <= 64
    assert ids == encode_prompt(tokenizer, [user], 64)
    full = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True)
    full = full["input_ids"] if isinstance(full, dict) or hasattr(full, "input_ids") else full
    assert ids[0] == full[0]  # the template's opening (BOS) is there


def test_long_empty_and_non_utf8_prompts(tmp_path: Path, tiny_kit) -> None:
    """A prompt far longer than the context is cut to generate.max_prompt_tokens (left kept), empty turns are
    dropped and counted, and a file that is not UTF-8 is refused naming the byte offset and the fix."""
    long_text = "word " * 5000
    rows = [
        '{"conversations": [{"from": "human", "value": "' + long_text + '"}]}',
        '{"conversations": [{"from": "human", "value": ""}]}',
        '{"conversations": [{"from": "human", "value": "A short question?"}]}',
    ]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(rows) + "\n")
    convs, report = load_conversations(str(source))
    assert len(convs) == 2 and report.records_dropped == 1
    art = run(small_cfg(tmp_path, *FAST, f"generate.source={source}", "generate.heldout_fraction=0.01"),
              ["generate"])["generate"]
    lengths = [sum(1 for m in row["loss_mask"] if m == 0) for row in iter_rows(art.path / "data")]
    assert max(lengths) <= 48 + 8  # generate.max_prompt_tokens=48 in SMALL, plus the template's tokens
    bad = tmp_path / "latin1.jsonl"
    data = '{"conversations": [{"from": "human", "value": "café"}]}\n'.encode("latin-1")
    bad.write_bytes(data)
    with pytest.raises(DrafterError, match="not valid UTF-8") as err:
        load_conversations(str(bad))
    assert f"byte {data.index(bytes([0xE9]))}" in str(err.value) and "iconv" in str(err.value)


@pytest.mark.slow
def test_sigterm_stops_generate_between_shards_and_the_rerun_resumes(tmp_path: Path, tiny_kit) -> None:
    """SIGTERM (what preemption, ``scancel`` and ``scontrol requeue`` send first) once the first shard has
    landed: generate stops before its next shard with an error that says so (exit 2), publishes nothing, and
    the rerun resumes from the kept shards. Lightning's predict loop alone would ignore the signal."""
    workdir = tmp_path / "work"
    slower = ["generate.shard_size=1", "generate.batch_size=1", "generate.max_new_tokens=32"]
    proc = subprocess.Popen([*_cli(workdir, "generate"), *slower], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while not list(workdir.glob("staging/*/shard-*.arrow")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, f"expected the SIGTERM error (exit 2), got {proc.returncode}: {stderr[-2000:]}"
    assert "received SIGTERM" in stderr and "finished shards are kept" in stderr
    landed = len(list(workdir.glob("staging/*/shard-*.arrow")))
    cfg = small_cfg(workdir, *FAST, *slower)
    step = plan(cfg, ["generate"])["generate"]
    assert not step.cached and landed >= 1
    metrics = run(cfg, ["generate"])["generate"].metrics
    assert metrics["resumed_shards"] == landed < metrics["shards"], (landed, metrics)


@pytest.mark.slow
def test_two_runs_on_one_workdir_build_each_artifact_once(tmp_path: Path, reference) -> None:
    """Two `drafter run --stages count` started together on one workdir: both succeed, each artifact is built
    once (the other run waits on its lock, then reuses it: a cache hit), and the ids and payload bytes are the
    uninterrupted reference's."""
    artifacts, _ = reference
    workdir = tmp_path / "shared"
    procs = [subprocess.Popen(_cli(workdir, "run", "--stages", "count"), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
             for _ in range(2)]
    logs = [proc.communicate(timeout=900)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [log[-2000:] for log in logs]
    for stage in ("generate", "count"):
        built = [log for log in logs if f"{stage}: wrote " in log]
        assert len(built) == 1, (stage, [log[-2000:] for log in logs])
        step = plan(small_cfg(workdir, *FAST), [stage])[stage]
        assert step.id == artifacts[stage].id and _payloads(step.path) == _payloads(artifacts[stage].path)
    # they overlapped: one of them waited on the other's generate lock (else the test would prove nothing)
    assert any("generate: waiting for pid" in log for log in logs), [log[-2000:] for log in logs]
    assert not list((workdir / "artifacts").glob(".tmp-*"))


def test_registering_an_evaluation_waits_for_a_run_already_registering_it(tmp_path: Path, tiny_kit) -> None:
    """Two `drafter evaluate` of one built evaluation at once on one workdir (two CI jobs, a rerun while a run
    registers): registration ran outside any lock, both could look the bundle up before either created a version, and
    the registry got two versions of one bundle. Registration now holds `<evaluation id>.registration`: with it held
    here (another run registering), `drafter evaluate` waits, registers nothing until it is released, then makes the
    one version; a second run reuses it."""
    from mlflow.tracking import MlflowClient

    from pipeline.orchestration.lock import Launch, artifact_lock

    workdir = tmp_path / "shared"
    (tmp_path / "built-in.yaml").write_text("{}\n")  # the built-in defaults, not configs/tiny.yaml
    keys = ["--config", str(tmp_path / "built-in.yaml"), "evaluate.methods=[full,shortlist]",
            "evaluate.shortlists=[top_k_16]", "evaluate.prompts_per_task=2", "evaluate.tasks=[chat]",
            "evaluate.max_new_tokens=8", "evaluate.gammas=[2]", "evaluate.sampling_check_samples=50",
            "evaluate.gate_tau_min=1.0", "evaluate.gate_speed_min=0.01"]
    built = subprocess.run(_cli(workdir, "evaluate", *keys, "evaluate.register=false"), cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-2000:]
    (evaluation,) = [p for p in (workdir / "artifacts").glob("evaluate-*") if p.is_dir()]
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    stderr = tmp_path / "waiting.log"
    with artifact_lock(workdir, f"{evaluation.name}.registration", "evaluate", lambda _: None, Launch.from_environ({})):
        with stderr.open("w") as sink:
            proc = subprocess.Popen(_cli(workdir, "evaluate", *keys), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=sink,
                                    text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        while "waiting for pid" not in stderr.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "waiting for pid" in stderr.read_text(), stderr.read_text()[-2000:]
        assert client.search_registered_models() == []  # nothing registered while the other run holds it
    assert proc.wait(timeout=600) == 0, stderr.read_text()[-2000:]
    (model,) = client.search_registered_models()
    again = subprocess.run(_cli(workdir, "evaluate", *keys), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(client.search_model_versions(f"name = '{model.name}'")) == 1


def test_a_held_lock_stops_a_multi_rank_launch_naming_the_holder(tmp_path: Path, monkeypatch) -> None:
    """Ranks started by srun/torchrun cannot wait with their rank 0, so a held lock stops rank 0 at once with
    the holder's pid; a run's later ranks never take the lock."""
    from pipeline.orchestration.lock import Launch, artifact_lock

    messages: list[str] = []
    # what Lightning sets in a process that launched 2 ranks itself (the CLI's Launch was read before): not external
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "2")
    monkeypatch.setitem(os.environ, "LOCAL_RANK", "0")
    launched = Launch.from_environ({})
    assert launched.first_rank and not launched.external_peers
    assert Launch.from_environ().external_peers  # read now, the same process would look like an srun rank
    with artifact_lock(tmp_path, "count-abc", "count", messages.append, launched):
        srun = Launch.from_environ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"})  # started by srun with a peer
        with pytest.raises(DrafterError, match=f"being built in this workdir by pid {os.getpid()}") as err:
            with artifact_lock(tmp_path, "count-abc", "count", messages.append, srun):
                pass
        assert "another workdir" in str(err.value)
        later = Launch.from_environ({"SLURM_NTASKS": "2", "SLURM_PROCID": "1"})  # works inside its rank 0's lock
        with artifact_lock(tmp_path, "count-abc", "count", messages.append, later):
            pass
    with artifact_lock(tmp_path, "count-abc", "count", messages.append, srun):  # released: taken without waiting
        pass
    assert messages == []


def test_max_prompt_tokens_at_the_template_overhead_is_refused(tmp_path: Path, tiny_kit) -> None:
    """generate.max_prompt_tokens at or below the chat template's own tokens around a user turn (12 for the kit's
    ChatML) gave prompts cut from the left to the template's tail, with no user text ("assistant\\n" at 4). Refused,
    naming the key, the overhead and the minimum; one token more keeps the whole template and the text's start."""
    from pipeline.data.calibration import encode_prompt
    from pipeline.models.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny:test/target")
    user = [{"role": "user", "content": "Write a function that adds two numbers. " * 10}]
    for limit in (4, 12):
        with pytest.raises(DrafterError, match=f"generate.max_prompt_tokens={limit} leaves no room for the user's "
                                               "text under the chat template") as err:
            encode_prompt(tokenizer, user, limit, "generate.max_prompt_tokens")
        assert "of at least 13" in err.value.expected and "overhead of 12 tokens" in err.value.found
    full = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True)
    full = full["input_ids"] if isinstance(full, dict) or hasattr(full, "input_ids") else full
    ids = encode_prompt(tokenizer, user, 13)
    assert len(ids) == 13 and ids[0] == full[0] and ids[-4:] == full[-4:] and "W" in tokenizer.decode(ids)
    with pytest.raises(DrafterError, match="generate.max_prompt_tokens=8 leaves no room"):
        run(small_cfg(tmp_path, *FAST, "generate.max_prompt_tokens=8"), ["generate"])


def test_a_prompt_file_edited_between_plan_and_load_is_refused(tmp_path: Path, tiny_kit,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A local source edited after the plan hashed it into generate's id was loaded as it was then, and its rows were
    published under the id of the old bytes (a later run with the old file reused them). The bytes parsed must hash
    to the plan's fingerprint (each rank checks the bytes it parsed): refused, nothing published."""
    from jobs import generate

    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                              {"from": "gpt", "value": f"answer {i}."}]} for i in range(12)]
    source = tmp_path / "window.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in recs[:4]))
    cfg = small_cfg(tmp_path, "generate.kind=raw", f"generate.source={source}", "generate.heldout_fraction=0.0")
    before = plan(cfg, ["generate"])["generate"]
    load = generate.select_conversations

    def edited(*args: object) -> object:  # the edit lands after main planned, before the stage reads the file
        source.write_text("".join(json.dumps(r) + "\n" for r in recs[4:]))
        return load(*args)

    monkeypatch.setattr(generate, "select_conversations", edited)
    with pytest.raises(DrafterError, match="prompt file .*window.jsonl changed after the run was planned") as err:
        generate.main(cfg)
    assert "Rerun" in err.value.fix and not before.path.exists()
    monkeypatch.undo()
    art = generate.main(cfg)  # the rerun plans the file as it is
    assert art.path != before.path
    assert {r["prompt_id"] for r in iter_rows(art.path / "data")} == {f"r{i}" for i in range(4, 12)}


def test_a_prompt_file_edited_before_evaluate_reads_its_prompts_is_refused(tmp_path: Path, tiny_kit,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """evaluate's chat prompts come from ``generate.source``, whose sha256 is in evaluate's id too: an edit after
    the plan was decoded and published under the id of the old bytes."""
    from jobs import evaluate
    from pipeline.evaluation import matrix

    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}?"},
                                              {"from": "gpt", "value": f"answer {i}."}]} for i in range(24)]
    source = tmp_path / "window.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in recs[:12]))
    cfg = small_cfg(tmp_path, "generate.kind=raw", f"generate.source={source}", "generate.heldout_fraction=0.5",
                    "evaluate.methods=[shortlist]", "evaluate.shortlists=[top_k_64]", "evaluate.tasks=[chat]",
                    "evaluate.register=false")
    run(cfg, ["count"])
    seen = matrix.prompts_seen

    def edited(*args: object) -> object:  # the edit lands after evaluate planned, before it reads the prompts
        source.write_text("".join(json.dumps(r) + "\n" for r in recs[12:]))
        return seen(*args)

    monkeypatch.setattr(matrix, "prompts_seen", edited)
    with pytest.raises(DrafterError, match="prompt file .*window.jsonl changed after the run was planned"):
        evaluate.main(cfg)
    assert not list((cfg.workdir_path / "artifacts").glob("evaluate-*"))
