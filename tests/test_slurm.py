"""``drafter submit`` / ``drafter status`` and the one job template, ending on a real one-node Slurm.

Without Slurm: the template is valid bash with a sane header; a submit plan's scripts carry the config's
resources and per-stage overrides; the run settings a job adds for its allocation change no artifact id.
With the ``slurm_cluster`` fixture (real ``slurmctld`` + ``slurmd``; ``.ci/run`` installs them): the tiny DAG
submitted as jobs ends with the same artifact ids and bytes as ``drafter run`` in-process, a second submit
submits nothing, a job requeued mid-``generate`` resumes and ends identically, and a failing stage cancels
its dependants while ``drafter status`` says which and why.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from jobs import run
from jobs.cli import main as cli_main
from pipeline.artifacts import load_artifact
from pipeline.config.sections import load_config
from pipeline.errors import DrafterError
from pipeline.orchestration import slurm
from pipeline.orchestration.dag import STAGE_NAMES, plan
from tests.helpers import SMALL, small_cfg
from tests.mlflow_server import MlflowServer
from tests.slurm_cluster import SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
GPU_ALLOCATION = slurm.Resources(nodes=2, ntasks_per_node=8, gpus_per_node=8, cpus_per_task=16, mem="500G",
                                 time="12:00:00")
# generate → count → evaluate (shortlists only, one task): three chained jobs, a minute or two on 2 cores
CHAIN = ["generate", "count", "evaluate"]
SUBMIT = [*SMALL, "evaluate.methods=[shortlist]", "evaluate.tasks=[code]", "evaluate.prompts_per_task=2",
          "evaluate.max_new_tokens=8", "evaluate.gammas=[2]", "evaluate.sampling_check_samples=0",
          "evaluate.law_check_generations=0",
          "evaluate.shortlists=[top_k_64]", "evaluate.gate_tau_min=1.0", "evaluate.gate_speed_min=0.0",
          "slurm.cpus_per_task=1", "mlflow.experiment=slurm"]


def test_template_is_valid_bash_with_a_slurm_header() -> None:
    text = slurm.TEMPLATE.read_text()
    subprocess.run(["bash", "-n", str(slurm.TEMPLATE)], check=True)
    assert text.startswith("#!/bin/bash") and "set -euo pipefail" in text
    for option in ("--job-name=", "--time=", "--requeue", "--signal=B:USR1@", "--open-mode=append"):
        assert re.search(rf"^#SBATCH {re.escape(option)}", text, re.M), option
    assert re.search(r'^srun --kill-on-bad-exit=1 "\$\{DRAFTER\[@\]\}" "\$\{STAGE\}" --config "\$\{CONFIG\}" "\$@" &$', text, re.M)
    assert "trap requeue USR1" in text and 'scontrol requeue "${SLURM_JOB_ID}"' in text


def test_every_stage_run_settings_keep_every_id(tmp_path: Path, tiny_kit) -> None:
    """A job's overrides for an 8-GPU x 2-node allocation (and for a CPU one) plan every stage's id
    unchanged: the next stage of the chain, on another node, finds the artifact."""
    plain = plan(small_cfg(tmp_path), STAGE_NAMES)  # every stage, the opt-in train_dflash included
    cpu = slurm.Resources(1, 1, 0, 2, None, "1:00:00")
    for stage in STAGE_NAMES:
        for res in (GPU_ALLOCATION, cpu):
            settings = slurm.run_settings(stage, res)
            assert plan(small_cfg(tmp_path, *settings), [stage])[stage].id == plain[stage].id, (stage, settings)
    assert slurm.run_settings("generate", GPU_ALLOCATION) == [
        "generate.accelerator=gpu", "generate.devices=8", "generate.num_nodes=2"]
    assert slurm.run_settings("train_drafter", GPU_ALLOCATION)[1] == "train_drafter.train.devices=8"
    # every trainer's ranks are the allocation's tasks: train_dflash got none, so a 2-node job of 16 tasks built
    # trainers for 1 node and failed after waiting for its inputs
    for trainer in ("train_drafter", "train_dflash", "train_router"):
        assert slurm.run_settings(trainer, GPU_ALLOCATION) == [
            f"{trainer}.train.accelerator=gpu", f"{trainer}.train.devices=8", f"{trainer}.train.num_nodes=2"]
    assert slurm.run_settings("evaluate", GPU_ALLOCATION) == []  # evaluate.device is part of its id


def test_the_stages_that_run_as_one_process_get_one_task_whatever_the_sections_defaults(tmp_path: Path) -> None:
    """The README's multi-node section sets ``ntasks_per_node: 8`` and ``gpus_per_node: 8`` at the top level and
    sizes generate and train_drafter. count, cluster and evaluate inherited the 8 tasks, so srun started 8 copies of
    ``drafter evaluate`` decoding on one GPU (the published speedups timed under that contention) and registering
    beside each other. They now take one node, one task and at most one GPU; asking one of them for more is
    refused."""
    readme = ["slurm.ntasks_per_node=8", "slurm.gpus_per_node=8",
              "slurm.stages={generate: {nodes: 4}, train_drafter: {nodes: 2}}"]
    cfg = small_cfg(tmp_path, *readme)
    for stage in ("count", "cluster", "evaluate"):
        res = slurm.Resources.of(cfg, stage)
        assert (res.nodes, res.ntasks_per_node, res.gpus_per_node) == (1, 1, 1), stage
    assert (slurm.Resources.of(cfg, "generate").nodes, slurm.Resources.of(cfg, "generate").ntasks_per_node) == (4, 8)
    assert slurm.Resources.of(cfg, "train_drafter").ntasks_per_node == 8
    wider = small_cfg(tmp_path, "slurm.stages={evaluate: {ntasks_per_node: 2}}")
    with pytest.raises(DrafterError, match=r"evaluate runs as one process(.|\n)*ntasks_per_node: 2"):
        slurm.Resources.of(wider, "evaluate")
    # its own gpus_per_node was let through: 8 GPUs held for one process
    gpus = small_cfg(tmp_path, "slurm.stages={evaluate: {gpus_per_node: 8}, count: {gpus_per_node: 0}}")
    with pytest.raises(DrafterError, match=r"evaluate runs as one process(.|\n)*gpus_per_node: 8"):
        slurm.Resources.of(gpus, "evaluate")
    assert slurm.Resources.of(gpus, "count").gpus_per_node == 0


def test_dry_run_prints_each_script_with_its_resources(tmp_path: Path, tiny_kit, capsys) -> None:
    overrides = [f"workdir={tmp_path}", *SMALL, "slurm.partition=gpu", "slurm.account=ml", "slurm.qos=high",
                 "slurm.time=02:00:00", "slurm.stages={generate: {gpus_per_node: 8, ntasks_per_node: 8, "
                 "nodes: 2, mem: 400G}}", "slurm.extra=[--exclusive]"]
    assert cli_main(["submit", "--dry-run", "--stages", "count", *overrides]) == 0
    out = capsys.readouterr().out
    scripts = dict(re.findall(r"^# ---- (\w+) \(\S+\) ----\n(.*?^# sbatch [^\n]*\n)", out, re.M | re.S))
    assert set(scripts) == {"generate", "count"}
    generate, count = scripts["generate"], scripts["count"]
    for line in ("--partition=gpu", "--account=ml", "--qos=high", "--exclusive", "--requeue"):
        assert f"#SBATCH {line}\n" in generate and f"#SBATCH {line}\n" in count
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--mem=400G", "--time=02:00:00"):
        assert f"#SBATCH {line}\n" in generate
    assert "#SBATCH --nodes=1\n" in count and "--gpus-per-node" not in count
    assert "generate.accelerator=gpu generate.devices=8 generate.num_nodes=2" in generate
    planned = plan(small_cfg(tmp_path), ["count"])
    for stage, text in scripts.items():  # each job runs only if its config still plans the submitted id
        assert f" --expect-id {planned[stage].id} " in text.splitlines()[-1], text.splitlines()[-1]
    assert re.search(r"^count\s+—\s+<generate>\s+count-", out, re.M)  # the dependency, by stage
    assert "0 job(s) submitted" in out
    assert not (tmp_path / "slurm").exists()  # a dry run writes nothing
    for text in scripts.values():
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_a_job_whose_id_moved_since_submit_or_whose_inputs_are_gone_refuses_to_run(tmp_path: Path, tiny_kit,
                                                                                      capsys) -> None:
    """A job plans again when it starts. If the id moved (the YAML, a hub branch's commit, the prompt file changed
    after `drafter submit`), the job refuses instead of building the new ids' upstream stages inside its own
    allocation (a GPU generate in a count job's CPU allocation) under ids `jobs.json` never heard of; so does a job
    whose input is missing from the store. Nothing is built either way; with the submitted id and its inputs built,
    the job runs."""
    overrides = [f"workdir={tmp_path}", *SMALL]
    submitted = plan(small_cfg(tmp_path), ["count"])["count"].id
    assert cli_main(["count", "--expect-id", submitted, *overrides]) == 2
    assert "inputs are not in the store: generate generate-" in capsys.readouterr().err
    assert not list((tmp_path / "artifacts").glob("*-*"))
    assert cli_main(["generate", *overrides]) == 0
    # an input named by path is not planned: a moved id said KeyError: 'generate' instead of the message
    built = tmp_path / "artifacts" / plan(small_cfg(tmp_path), ["generate"])["generate"].id
    named = small_cfg(tmp_path, f"count.calibration={built}")
    with pytest.raises(DrafterError, match=r"submitted for count-0000000000000000, but its config now plans count-"):
        slurm.check_submitted(named, "count", "count-0000000000000000")
    assert cli_main(["count", "--expect-id", submitted, *overrides, "count.top_k=[8]"]) == 2
    err = capsys.readouterr().err
    assert f"submitted for {submitted}, but its config now plans count-" in err and "drafter submit" in err
    assert not list((tmp_path / "artifacts").glob("count-*"))
    assert cli_main(["count", "--expect-id", submitted, *overrides]) == 0
    assert (tmp_path / "artifacts" / submitted).is_dir()


def test_status_wait_exits_nonzero_until_every_artifact_exists(tmp_path: Path, tiny_kit, capsys) -> None:
    """CI's wait: `drafter status --wait S` returns once no job is queued or running, and its exit code is whether
    every planned stage's artifact exists. The workflow's own loop listed five active states and grepped five failed
    ones: a preempted, suspended or forgotten job (Slurm drops a failed job after MinJobAge) ended it green."""
    overrides = [f"workdir={tmp_path}", *SMALL, "--stages", "generate"]
    assert cli_main(["status", "--wait", "0.01", *overrides]) == 1  # nothing submitted, nothing built: not done
    assert "not done: generate" in capsys.readouterr().out
    assert cli_main(["generate", f"workdir={tmp_path}", *SMALL]) == 0
    capsys.readouterr()
    assert cli_main(["status", "--wait", "0.01", *overrides]) == 0
    assert cli_main(["status", *overrides]) == 0  # without --wait, status only reports


def test_a_built_evaluation_whose_registration_failed_is_submitted_again_to_register(tmp_path: Path, tiny_kit,
                                                                                     capsys) -> None:
    """evaluate published its artifact, then registering failed (the server dropped, the job hit its time limit):
    `drafter submit` saw evaluate cached and submitted nothing, so the bundle was never registered and CI's wait
    went green. Now submit sends an evaluate job (a cache hit that registers), status names what is not registered
    and `status --wait` fails until it is; a registration recorded for another store does not count."""
    keys = [f"workdir={tmp_path}", *SMALL, "evaluate.methods=[full,shortlist]", "evaluate.prompts_per_task=2",
            "evaluate.max_new_tokens=8", "evaluate.gammas=[2]", "evaluate.sampling_check_samples=50",
            "evaluate.gate_tau_min=1.0", "evaluate.gate_speed_min=0.01", "evaluate.shortlists=[top_k_16,top_k_64]"]
    (tmp_path / "built-in.yaml").write_text("{}\n")  # the built-in defaults, not configs/tiny.yaml
    stage_args = ["--config", str(tmp_path / "built-in.yaml"), *keys]
    overrides = [*stage_args, "--stages", "evaluate"]
    assert cli_main(["evaluate", *stage_args]) == 0
    evaluation = plan(load_config(None, keys), ["evaluate"])["evaluate"]
    record = evaluation.path.parent / f"{evaluation.id}.registration.json"
    assert json.loads(record.read_text())["store"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    capsys.readouterr()
    assert cli_main(["submit", "--dry-run", *overrides]) == 0
    assert "0 job(s)" in capsys.readouterr().out and cli_main(["status", "--wait", "0.01", *overrides]) == 0
    for lost in (None, {**json.loads(record.read_text()), "store": "http://127.0.0.1:1"}):
        record.unlink() if lost is None else record.write_text(json.dumps(lost))
        capsys.readouterr()
        assert cli_main(["submit", "--dry-run", *overrides]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"^evaluate\s+—\s+—\s+{evaluation.id}\s+dry run: to register draft-vocab", out, re.M), out
        assert f"# sbatch {evaluation.id}.sbatch evaluate " in out and f"--expect-id {evaluation.id}" in out
        assert cli_main(["status", "--wait", "0.01", *overrides]) == 1
        assert "not registered in this store: draft-vocab" in capsys.readouterr().out
    assert cli_main(["evaluate", "--expect-id", evaluation.id, *stage_args]) == 0  # what that job runs
    assert json.loads(record.read_text())["store"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert cli_main(["status", "--wait", "0.01", *overrides]) == 0


def test_status_quotes_why_the_last_restart_of_a_requeued_job_failed(tmp_path: Path) -> None:
    """A requeued job appends each restart to one log (--open-mode=append). The first restart stopped on SIGTERM with
    our error; the last died of a CUDA out-of-memory traceback. `status` quoted the first restart's error as the
    reason; it quotes the last restart's."""
    log = tmp_path / "generate-7.out"
    log.write_text("drafter: generate on 1 node(s) x 1 task(s), job 7, restart 0, rendezvous a:1\n"
                   "error: Stage generate received SIGTERM before finishing.\n  found:    signal 15\n"
                   "drafter: generate on 1 node(s) x 1 task(s), job 7, restart 1, rendezvous a:1\n"
                   "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                   "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    why = slurm._log_tail(log)
    assert "OutOfMemoryError" in why and "SIGTERM" not in why, why
    log.write_text(log.read_text().split("drafter: generate on 1 node(s) x 1 task(s), job 7, restart 1")[0])
    assert slurm._log_tail(log).startswith("error: Stage generate received SIGTERM")
    # another tool's traceback quoting a URL with its credentials (MLflow's own message): `status` shows none of them
    log.write_text("Traceback (most recent call last):\nmlflow.exceptions.MlflowException: API request to "
                   "https://alice:s3cr3t@Pa55@mlflow.example.com/api/2.0/mlflow/runs/log-batch failed\n")
    assert slurm._log_tail(log).endswith("mlflow.exceptions.MlflowException: API request to "
                                         "https://***@mlflow.example.com/api/2.0/mlflow/runs/log-batch failed")


def test_submit_without_slurm_or_with_a_bad_stage_is_refused(tmp_path: Path, tiny_kit, monkeypatch) -> None:
    with pytest.raises(DrafterError, match="slurm.stages"):
        load_config(None, ["slurm.stages={generat: {nodes: 2}}"])
    with pytest.raises(DrafterError, match="slurm.stages.generate"):
        load_config(None, ["slurm.stages={generate: {gpus: 2}}"])
    # a value written into the #SBATCH header may not break its line: the rest would run as a shell command
    for override, key in (('slurm.extra=["--exclusive\\nrm -rf $HOME"]', r"slurm.extra\[0\]"),
                          ('slurm.partition="gpu\\ntouch /tmp/x"', "slurm.partition"),
                          ('slurm.stages={generate: {time: "1:00:00\\r"}}', "slurm.stages.generate.time")):
        with pytest.raises(DrafterError, match=rf"Invalid value for {key}\.\n  expected: one line of printable"):
            load_config(None, [override])
    template = tmp_path / "site.sbatch"
    for text, problem in (("#!/bin/bash\nsrun drafter\n", "has no #SBATCH block"),
                          ("#!/bin/bash\n#SBATCH -N 1\n\xe9\n", "is not UTF-8 text")):
        template.write_bytes(text.encode("latin-1"))
        with pytest.raises(DrafterError, match=problem):
            slurm.render(small_cfg(tmp_path, f"slurm.template={template}"), "generate", tmp_path / "logs")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    cfg = small_cfg(tmp_path)
    with pytest.raises(DrafterError, match="sbatch.*is not on PATH"):
        slurm.submit(cfg, ["generate"], [])


# --- on a real one-node Slurm ----------------------------------------------------------------------


def _cfg(workdir: Path, uri: str, *extra: str):
    return load_config(None, [f"workdir={workdir}", *SUBMIT, f"mlflow.tracking_uri={uri}", *extra])


def _files(path: Path) -> dict[str, str]:
    """Payload name → sha256, from the artifact's own manifest (verified on load)."""
    artifact = load_artifact(path)
    return {name: entry["sha256"] for name, entry in artifact.manifest["files"].items()}


@pytest.fixture(scope="module")
def submitted(tmp_path_factory: pytest.TempPathFactory, tiny_kit, slurm_one_node: SlurmCluster,
              mlflow_server: MlflowServer):
    """The chain submitted as jobs and waited for, and the same chain run in-process elsewhere."""
    workdir = tmp_path_factory.mktemp("submitted")
    cfg = _cfg(workdir, mlflow_server.uri)
    with slurm_one_node.active():
        rows = slurm.submit(cfg, CHAIN, [])
    jobs = [row.job_id for row in rows if row.status == "submitted"]
    slurm_one_node.wait(jobs)
    local = run(_cfg(tmp_path_factory.mktemp("local"), mlflow_server.uri), CHAIN)
    return cfg, rows, local


@pytest.mark.slurm
@pytest.mark.slow
def test_submitted_chain_ends_like_the_in_process_run(submitted, slurm_cluster: SlurmCluster) -> None:
    cfg, rows, local = submitted
    assert [(r.stage, r.status) for r in rows] == [(s, "submitted") for s in CHAIN]
    by_stage = {r.stage: r for r in rows}
    assert by_stage["generate"].depends_on == []
    assert by_stage["count"].depends_on == [by_stage["generate"].job_id]
    assert by_stage["evaluate"].depends_on == [by_stage["count"].job_id]
    status = {row.stage: row for row in slurm.status(cfg, CHAIN)}
    for stage in CHAIN:
        assert status[stage].state == "COMPLETED" and status[stage].artifact, status[stage]
        step = plan(cfg, [stage])[stage]
        assert step.id == local[stage].id  # the same artifact ids
        if stage != "evaluate":  # evaluate's report holds wall-clock timings; its id and rows are compared
            assert _files(step.path) == _files(local[stage].path), stage
    mine = json.loads((plan(cfg, ["evaluate"])["evaluate"].path / "report.json").read_text())
    theirs = json.loads(local["evaluate"].file("report.json").read_text())
    assert [(r["method"], r["tau"], r["new_tokens"]) for r in mine["rows"]] == [
        (r["method"], r["tau"], r["new_tokens"]) for r in theirs["rows"]]
    log = (cfg.workdir_path / "slurm" / "logs" / f"generate-{by_stage['generate'].job_id}.out").read_text()
    assert "generate on 1 node(s) x 1 task(s)" in log


@pytest.mark.slurm
@pytest.mark.slow
def test_second_submit_submits_nothing(submitted, slurm_cluster: SlurmCluster) -> None:
    cfg, _, _ = submitted
    records = (cfg.workdir_path / "slurm" / "jobs.json").read_text()
    again = slurm.submit(cfg, CHAIN, [])
    assert [r.status for r in again] == ["cached"] * len(CHAIN) and all(r.job_id is None for r in again)
    assert (cfg.workdir_path / "slurm" / "jobs.json").read_text() == records


@pytest.mark.slurm
@pytest.mark.slow
def test_a_built_stage_whose_run_this_store_lacks_is_logged_by_submit(submitted, slurm_cluster: SlurmCluster,
                                                                     tmp_path: Path) -> None:
    """A job whose MLflow logging failed after it published (the server down) leaves a built artifact and no run; no
    job runs that stage again, so submit logs it, as `drafter run`'s cache hit does. The chain was logged to the
    module's server: a store that lacks its runs stands for the failed logging. An unreachable store is said in the
    row, and nothing is submitted for it."""
    cfg, _, _ = submitted
    store = f"sqlite:///{tmp_path / 'other.db'}"

    def submit(uri: str) -> slurm.Submitted:
        rows = slurm.submit(load_config(None, [f"workdir={cfg.workdir_path}", *SUBMIT, f"mlflow.tracking_uri={uri}",
                                               "mlflow.retries=1", "mlflow.timeout_s=2"]), ["count"], [])
        assert [(r.stage, r.job_id, r.status) for r in rows[:-1]] == [("generate", None, "cached")]  # not asked for
        return rows[-1]

    artifact = plan(cfg, ["count"])["count"].path
    payload = next(p for p in sorted(artifact.rglob("*")) if p.is_file() and p.name != "manifest.json")
    kept = payload.read_bytes()
    mode = payload.stat().st_mode
    payload.chmod(0o644)
    payload.write_bytes(kept + b" ")  # damaged since it was published: nothing of it may reach a store
    try:
        with pytest.raises(DrafterError, match=payload.name):
            submit(f"sqlite:///{tmp_path / 'third.db'}")
    finally:
        payload.write_bytes(kept)
        payload.chmod(mode)
    down = submit("http://127.0.0.1:9")
    assert down.job_id is None and down.status.startswith("cached; its MLflow run is not logged (The MLflow tracking "
                                                          "server at http://127.0.0.1:9 is unreachable")
    logged = submit(store)
    assert (logged.job_id, logged.status) == (None, "cached; its MLflow run logged now (its job's logging had failed)")
    assert submit(store).status == "cached"  # logged once
    runs = MlflowClient(tracking_uri=store).search_runs(
        [MlflowClient(tracking_uri=store).get_experiment_by_name(cfg.mlflow.experiment).experiment_id])
    assert [r.data.tags["drafter.artifact_id"] for r in runs] == [plan(cfg, ["count"])["count"].id]


@pytest.mark.slurm
def test_a_queued_job_is_reused_and_says_when_this_submission_would_run_it_otherwise(
        tmp_path: Path, tiny_kit, slurm_cluster: SlurmCluster, mlflow_server: MlflowServer) -> None:
    """A held generate job is reused by the next submit. A submission whose run settings differ (another MLflow
    experiment, evaluate.register, resources: none in the id) still reuses it, which then runs with the settings it
    was submitted with; the row now says so instead of a plain "queued"."""
    cfg = _cfg(tmp_path, mlflow_server.uri, "slurm.extra=[--hold]")
    (row,) = slurm.submit(cfg, ["generate"], [])
    try:
        (again,) = slurm.submit(cfg, ["generate"], [])
        assert (again.job_id, again.status) == (row.job_id, "queued")
        (other,) = slurm.submit(_cfg(tmp_path, mlflow_server.uri, "slurm.extra=[--hold]", "mlflow.experiment=other"),
                                ["generate"], [])
        assert other.job_id == row.job_id and other.status.startswith("queued with its own settings (scancel it")
    finally:
        slurm_cluster.tool("scancel", row.job_id)


@pytest.mark.slurm
def test_two_submissions_at_once_from_one_workdir_take_turns(tmp_path: Path, tiny_kit, slurm_cluster: SlurmCluster,
                                                             mlflow_server: MlflowServer, capfd) -> None:
    """Two `drafter submit` of one workdir started together: each read jobs.json before the other wrote it, so both
    submitted every stage (and one's records were lost). They take turns now: the first submits, the second waits
    for it (naming it) and finds its jobs queued."""
    cfg = _cfg(tmp_path, mlflow_server.uri, "slurm.extra=[--hold]")
    start, results, errors = threading.Barrier(2), [], []

    def submit() -> None:
        start.wait()
        try:
            results.append(slurm.submit(cfg, ["count"], []))
        except Exception as err:  # noqa: BLE001 - reported below, with the thread's error
            errors.append(err)

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    try:
        assert not errors and len(results) == 2, errors
        statuses = sorted([row.status for row in rows] for rows in results)
        assert statuses == [["queued", "queued"], ["submitted", "submitted"]], statuses
        assert {row.job_id for row in results[0]} == {row.job_id for row in results[1]}
        records = json.loads((cfg.workdir_path / "slurm" / "jobs.json").read_text())
        assert sorted(r["stage"] for r in records.values()) == ["count", "generate"]
        queued = slurm_cluster.tool("squeue", "-h", "-o", "%i %j").stdout.split("\n")
        assert sum("drafter-" in line for line in queued) == 2, queued  # two jobs, not four
        assert "which is submitting jobs from this workdir" in capfd.readouterr().err
        # the resolved config the jobs read, cut short (a crash while it was written): the next submit writes it again
        (config,) = (cfg.workdir_path / "slurm" / "configs").glob("*.yaml")
        whole = config.read_text()
        config.write_text(whole[: len(whole) // 2])
        assert [row.status for row in slurm.submit(cfg, ["count"], [])] == ["queued", "queued"]
        assert config.read_text() == whole
    finally:
        slurm_cluster.tool("scancel", *{row.job_id for rows in results for row in rows if row.job_id})


@pytest.mark.slurm
def test_a_recorded_job_id_that_now_names_another_job_is_not_taken_for_the_stages(
        tmp_path: Path, tiny_kit, slurm_cluster: SlurmCluster, mlflow_server: MlflowServer) -> None:
    """Slurm reuses job ids (they wrap; a controller that lost its state starts again): jobs.json's id for generate
    names someone else's queued job. Submit does not reuse that job (it would chain the stage's dependants after a
    job that builds nothing) but submits the stage; status, before, says the id was reused."""
    cfg = _cfg(tmp_path, mlflow_server.uri, "slurm.extra=[--hold]")
    step = plan(cfg, ["generate"])["generate"]
    foreign = slurm_cluster.tool("sbatch", "--parsable", "--hold", "-J", "someone-else", "--wrap", "sleep 60",
                                 check=True).stdout.strip().split(";")[0]
    jobs: list[str] = [foreign]
    try:
        records = cfg.workdir_path / "slurm" / "jobs.json"
        records.parent.mkdir(parents=True)
        script = cfg.workdir_path / "slurm" / "scripts" / f"{step.id}.sbatch"
        records.write_text(json.dumps({step.id: {"stage": "generate", "job_id": foreign, "script": str(script)}}))
        (row,) = slurm.status(cfg, ["generate"])
        assert row.state is None and row.why.startswith(f"Slurm reused the recorded job id {foreign}: it now names "
                                                        "another job (someone-else, ")
        (submitted,) = slurm.submit(cfg, ["generate"], [])
        jobs.append(submitted.job_id)
        assert submitted.status == "submitted" and submitted.job_id != foreign
        (again,) = slurm.submit(cfg, ["generate"], [])  # the stage's own job, recorded now, is reused
        assert (again.job_id, again.status) == (submitted.job_id, "queued")
    finally:
        slurm_cluster.tool("scancel", *jobs)


@pytest.mark.slurm
@pytest.mark.slow
def test_requeue_mid_generate_resumes_and_ends_identically(tmp_path: Path, tiny_kit, slurm_cluster: SlurmCluster,
                                                          mlflow_server: MlflowServer) -> None:
    """20 shards of 2 prompts; ``scontrol requeue`` once the first shard has landed: the requeued job
    (restart 1) resumes from the landed shards and ends with the bytes of an uninterrupted in-process run."""
    slower = ["generate.shard_size=2", "generate.batch_size=2", "generate.max_new_tokens=24"]
    cfg = _cfg(tmp_path / "slurm", mlflow_server.uri, *slower)
    (row,) = slurm.submit(cfg, ["generate"], [])
    staging = cfg.workdir_path / "staging" / row.artifact_id
    deadline = time.monotonic() + 300
    while not list(staging.glob("shard-*.arrow")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the first shard has landed
    assert list(staging.glob("shard-*.arrow")) and not plan(cfg, ["generate"])["generate"].cached
    slurm_cluster.requeue(row.job_id)  # and skip Slurm's back-off
    slurm_cluster.wait([row.job_id])
    step = plan(cfg, ["generate"])["generate"]
    assert slurm.job_state(row.job_id).state == "COMPLETED" and step.cached
    log = (cfg.workdir_path / "slurm" / "logs" / f"generate-{row.job_id}.out").read_text()
    assert "restart 1" in log and "DUE TO JOB REQUEUE" in log
    resumed = re.findall(r"in 20 shards; (\d+) already done \(resumed\)", log)
    assert len(resumed) == 2 and resumed[0] == "0" and int(resumed[1]) >= 1, resumed
    local = run(_cfg(tmp_path / "local", mlflow_server.uri, *slower), ["generate"])["generate"]
    assert step.id == local.id and _files(step.path) == _files(local.path)


@pytest.mark.slurm
@pytest.mark.slow
def test_failing_stage_cancels_its_dependants_and_status_says_why(tmp_path: Path, tiny_kit,
                                                                  slurm_cluster: SlurmCluster,
                                                                  mlflow_server: MlflowServer, capsys) -> None:
    broken = tmp_path / "prompts.jsonl"
    broken.write_text('{"conversations": [{"from": "human", "value": "hi"}\n')  # not JSON: generate fails
    cfg = _cfg(tmp_path, mlflow_server.uri, f"generate.source={broken}")
    rows = slurm.submit(cfg, CHAIN, [])
    capsys.readouterr()
    # CI's wait: it says what it waits on (the jobs were queued a moment ago), then fails (nothing was built)
    assert cli_main(["status", "--wait", "0.2", f"workdir={tmp_path}", *SUBMIT,
                     f"mlflow.tracking_uri={mlflow_server.uri}", f"generate.source={broken}"]) == 1
    waited = capsys.readouterr().err
    assert re.search(r"status: waiting \(\d+s\): generate (PENDING|RUNNING|CONFIGURING)", waited), waited
    slurm_cluster.wait([r.job_id for r in rows])
    status = {row.stage: row for row in slurm.status(cfg, CHAIN)}
    assert status["generate"].state == "FAILED" and not status["generate"].artifact
    # the CLI exits 2 on a DrafterError; status quotes its message and what was found, not srun's noise
    assert status["generate"].why.startswith("exit 2:0; log ")
    assert f"error: No usable conversation in {broken}. | found:    1 records, all dropped" in status["generate"].why
    for stage in ("count", "evaluate"):
        assert status[stage].state == "CANCELLED" and not status[stage].artifact
    assert status["count"].why == f"cancelled: upstream generate (job {rows[0].job_id}) did not succeed"
    assert cli_main(["status", f"workdir={tmp_path}", *SUBMIT, f"mlflow.tracking_uri={mlflow_server.uri}",
                     f"generate.source={broken}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^generate\s+generate-\S+\s+no\s+\d+\s+FAILED\s+exit 2:0; log \S+: error: No usable", out, re.M)
    assert re.search(r"^count\s+count-\S+\s+no\s+\d+\s+CANCELLED\s+cancelled: upstream generate", out, re.M)
