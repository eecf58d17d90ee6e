"""Multi-node: the launch path, then every rank-parallel stage on a real two-node Slurm.

The launch path on the real two-node cluster (``nodeA`` at 127.0.0.2, ``nodeB`` at 127.0.0.3): the job script
exports the first node's ``NodeAddr`` as ``MASTER_ADDR`` and a ``MASTER_PORT`` from the job id to every rank
(whatever the submitting shell had) and the configured network interface; the script ``drafter submit`` writes for
a 2-node x 8-GPU train_drafter of ``configs/llama3-8b.yaml``, submitted with sbatch options that fit it to the test
nodes, starts each rank with its arguments and environment. Without Slurm: the DeepSpeed strategy on those 16 ranks
handed Lightning's Slurm environment (checked where the harness builds its trainer: there is no GPU here to run
it); the collective timeout reaching the strategies.

With the ``two_node_slurm`` fixture (``nodeA`` and ``nodeB``, one CPU each, names that resolve nowhere): the tiny
DAG submitted with generate, train_drafter, train_router and estimate_rdk on two nodes (one task per node, CPU,
gloo) and count, cluster and evaluate on one, ending in registered bundles, its train_drafter job requeued once
mid-run (``scontrol requeue``). Each two-node stage records both nodes and ranks and is published once, by global
rank 0; every artifact id equals the in-process one-rank run's, generate's rows are the same, the trained weights
and per-step losses agree with one rank accumulating two micro-batches, estimate_rdk's moment sums agree; the
requeued train_drafter resumed from its last checkpoint and ends with the bytes of an uninterrupted one-node x
two-rank run. Faults across nodes: killing one node's task, or stopping it so that it hangs, ends the whole job
(``srun --kill-on-bad-exit``, the collective timeout) and publishes nothing; the rerun completes to the
uninterrupted model.

The module shares one two-node cluster and one DAG, and runs eleven Slurm job runs of the stages (eight on two
nodes) of 20-40 s each here, most of it two processes importing Lightning on the machine's two cores, and three
short two-node jobs of the launch tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from jobs import run
from pipeline.config.sections import PipelineConfig, load_config
from pipeline.config.training import TrainConfig
from pipeline.data.calibration import iter_rows
from pipeline.errors import DrafterError
from pipeline.orchestration import slurm
from pipeline.orchestration.dag import plan
from pipeline.training import checkpoints as ckpt
from pipeline.training.harness import fit, shard_trainer
from pipeline.training.strategy import trainer_arguments
from tests.helpers import ROUTER, SMALL, TRAIN
from tests.mlflow_server import MlflowServer
from tests.slurm_cluster import TWO_NODE_CLUSTER, TWO_NODES, SlurmCluster

ROOT = Path(__file__).resolve().parents[1]
PARALLEL = ("generate", "train_drafter", "train_router", "estimate_rdk")
ON_TWO = "slurm.stages={" + ", ".join(f"{stage}: {{nodes: 2}}" for stage in PARALLEL) + "}"
RDK = ["estimate_rdk.top_k=16", "estimate_rdk.shard_rows=2", "estimate_rdk.batch_size=2",
       "estimate_rdk.heldout_fraction=0.2", "estimate_rdk.heldout_max_positions=32", "estimate_rdk.code_problems=2",
       "estimate_rdk.keep_fractions=[0.05,0.01]", "estimate_rdk.taus=[1e-2,1e-3]", "estimate_rdk.accelerator=cpu"]
EVAL = ["evaluate.methods=[eagle3,dynaspec,rdk]", "evaluate.rdk_levels=[keep_0.01]", "evaluate.dynaspec_match=top_k_64",
        "evaluate.tasks=[code]", "evaluate.prompts_per_task=2", "evaluate.max_new_tokens=8", "evaluate.gammas=[2]",
        "evaluate.sampling_check_samples=0",
        "evaluate.law_check_generations=0", "evaluate.gate_tau_min=1.0", "evaluate.gate_speed_min=0.0"]
DAG = [*SMALL, *TRAIN, *ROUTER, *RDK, *EVAL, "mlflow.experiment=two-nodes", "slurm.cpus_per_task=1",
       "slurm.socket_ifname=lo", ON_TWO]
LOSS_RTOL = 1e-5  # tests/training/test_harness.py::test_two_process_cpu_ddp_trains_on_disjoint_shards
WEIGHT_TOL = {"rtol": 1e-5, "atol": 1e-5}
MOMENT_TOL = {"rtol": 1e-5, "atol": 1e-7}


# --- the launch path --------------------------------------------------------------------------------


def _run_script(cluster: SlurmCluster, tmp_path: Path, script: str, *args: str, fit: tuple[str, ...] = (),
                **environ: str) -> tuple[str, list[dict[str, str]], list[list[str]]]:
    """Submit a rendered job script to the real two-node cluster from a shell that has ``environ``, one task on each
    node (sbatch run from ``tmp_path``, where a relative ``--output`` lands), its stage command replaced by a recorder of the arguments and environment each rank starts with. ``fit``:
    sbatch options that override the script's header where the test nodes lack what it asks for (GPUs, cores).
    Returns the job id and, by rank, the environment and arguments each task saw."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    recorder = tmp_path / "record.sh"
    recorder.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/args.$SLURM_PROCID\n'
                        f'env > {tmp_path}/env.$SLURM_PROCID\n')
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "job.sbatch").write_text(script)
    env = {**cluster.env, "DRAFTER_CMD": str(recorder), **environ}
    done = subprocess.run(["sbatch", "--parsable", "--wait", "--nodes=2", "--ntasks-per-node=1", *fit,
                           str(tmp_path / "job.sbatch"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    job_id = done.stdout.strip().split(";")[0]
    assert done.returncode == 0, (done.stderr, *(p.read_text() for p in tmp_path.glob("*.out")))
    seen = [dict(line.split("=", 1) for line in (tmp_path / f"env.{rank}").read_text().splitlines() if "=" in line)
            for rank in range(2)]
    return job_id, seen, [(tmp_path / f"args.{rank}").read_text().splitlines() for rank in range(2)]


@pytest.mark.slurm
def test_job_script_meets_at_the_first_nodes_address_on_a_port_from_the_job_id(tmp_path: Path,
                                                                              two_node_slurm: SlurmCluster) -> None:
    """On a real two-node allocation, whose node names resolve nowhere: both ranks meet at the first node's
    NodeAddr (nodeA's 127.0.0.2, not nodeB's or the controller's), on a port from the job id, whatever the submitting
    shell had; each task computes with its own cores, not a login shell's thread count; the interface variables
    appear only when set (here: passed through from the shell)."""
    text = slurm.TEMPLATE.read_text()
    nodes = two_node_slurm.addresses
    job_id, seen, args = _run_script(two_node_slurm, tmp_path / "plain", text, "generate", "cfg.yaml",
                                     fit=("--cpus-per-task=1",))
    for rank, (env, node) in enumerate(zip(seen, TWO_NODES, strict=True)):
        assert (env["SLURM_PROCID"], env["SLURMD_NODENAME"]) == (str(rank), node)
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (nodes["nodeA"], str(15000 + int(job_id) % 10000))
        assert env["OMP_NUM_THREADS"] == "1"  # the task's own cores (--cpus-per-task), not every core of the node
        assert "GLOO_SOCKET_IFNAME" not in env and "NCCL_SOCKET_IFNAME" not in env
    assert args == [["generate", "--config", "cfg.yaml"]] * 2
    log = (tmp_path / "plain" / f"drafter-stage-{job_id}.out").read_text()  # the template's --output=%x-%j.out
    assert f"generate on 2 node(s) x 1 task(s), job {job_id}, restart 0, rendezvous {nodes['nodeA']}:" in log
    job_id, seen, _ = _run_script(two_node_slurm, tmp_path / "shell", text, "generate", "cfg.yaml",
                                  fit=("--cpus-per-task=1",), MASTER_ADDR="10.9.9.9", MASTER_PORT="1",
                                  NCCL_SOCKET_IFNAME="lo", OMP_NUM_THREADS="7")
    for env in seen:
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (nodes["nodeA"], str(15000 + int(job_id) % 10000))
        assert env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["OMP_NUM_THREADS"] == "1"  # a login shell's module-set value would leave the task's cores idle


@pytest.mark.slurm
def test_llama3_8b_train_drafter_on_2_nodes_x_8_gpus_script_and_environment(tmp_path: Path,
                                                                             two_node_slurm: SlurmCluster) -> None:
    """What `drafter submit` writes for the production config's EAGLE-3 training on 2 nodes x 8 GPUs: one srun task
    per GPU over both nodes, the run settings of that allocation, the interface exports. Then that very script on
    the real two-node cluster, with its GPUs, tasks, cores and memory overridden on sbatch's command line to what
    the test nodes have (planning the hub model needs the network, and running it GPUs): the arguments and
    environment each rank starts with."""
    cfg = load_config(ROOT / "configs" / "llama3-8b.yaml", [
        f"workdir={tmp_path}", "slurm.socket_ifname=lo",
        "slurm.stages={train_drafter: {nodes: 2, ntasks_per_node: 8, gpus_per_node: 8, cpus_per_task: 12, "
        "mem: 900G, time: '24:00:00'}}"])
    script = slurm.render(cfg, "train_drafter", tmp_path / "logs")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=12", "--mem=900G",
                 "--time=24:00:00", "--requeue", f"--output={tmp_path / 'logs' / 'train_drafter-%j.out'}"):
        assert f"#SBATCH {line}\n" in script, line
    assert slurm.job_environment(cfg) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    header_end = max(i for i, line in enumerate(script.splitlines()) if line.startswith("#SBATCH"))
    exports = script.splitlines()[header_end + 1 : header_end + 3]
    assert exports == ["export GLOO_SOCKET_IFNAME=lo", "export NCCL_SOCKET_IFNAME=lo"]  # after the header
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    settings = slurm.run_settings("train_drafter", slurm.Resources.of(cfg, "train_drafter"))
    assert settings == ["train_drafter.train.accelerator=gpu", "train_drafter.train.devices=8",
                        "train_drafter.train.num_nodes=2"]
    (tmp_path / "logs").mkdir()  # drafter submit makes it; Slurm does not
    job_id, seen, args = _run_script(two_node_slurm, tmp_path / "job", script, "train_drafter", "resolved.yaml",
                                     *settings, fit=("--partition=test", "--gpus-per-node=0",
                                                               "--cpus-per-task=1", "--mem=0"))
    assert args == [["train_drafter", "--config", "resolved.yaml", *settings]] * 2
    for rank, env in enumerate(seen):
        assert {k: env[k] for k in ("SLURM_PROCID", "SLURM_NNODES", "MASTER_ADDR", "MASTER_PORT",
                                    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} == {
            "SLURM_PROCID": str(rank), "SLURM_NNODES": "2", "MASTER_ADDR": two_node_slurm.addresses["nodeA"],
            "MASTER_PORT": str(15000 + int(job_id) % 10000), "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert (tmp_path / "logs" / f"train_drafter-{job_id}.out").is_file()  # the header's --output, not sbatch's default
    train = load_config(ROOT / "configs" / "llama3-8b.yaml", settings).train_drafter.train
    assert (train.strategy, train.zero_stage, train.devices, train.num_nodes) == ("deepspeed", 2, 8, 2)
    assert train.batch_layout(16) == (1, 4)  # global batch 64 on 16 ranks: micro 1 x accumulation 4


class _Built(Exception):
    """Raised by the stand-in Trainer once it has recorded what the harness handed it."""


def test_deepspeed_on_two_nodes_goes_through_srun_and_slurm_environment(tmp_path: Path, monkeypatch) -> None:
    """Rank 9 of the 16 above (node 1, local rank 1), in the environment the job script gives it: the harness hands
    Lightning the Slurm environment (ranks and the rendezvous from srun and the script, requeue ours) and the
    DeepSpeed ZeRO-2 strategy for 2 nodes x 8 devices with the collective timeout. The Trainer is replaced by a
    recorder: building the real one needs the GPUs."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    for key, value in {"SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                       "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "drafter-train_drafter",
                       "SLURM_NODELIST": "gpu[07-08]", "MASTER_ADDR": "10.1.0.7", "MASTER_PORT": "19242"}.items():
        monkeypatch.setenv(key, value)
    train = load_config(ROOT / "configs" / "llama3-8b.yaml", [
        "train_drafter.train.devices=8", "train_drafter.train.num_nodes=2",
        "train_drafter.train.collective_timeout=900"]).train_drafter.train
    seen: dict = {}

    def recorder(**kwargs):  # noqa: ANN003, ANN202
        seen.update(kwargs)
        raise _Built("the Trainer was built")

    monkeypatch.setattr(L, "Trainer", recorder)
    module = torch.nn.Linear(2, 1)
    with pytest.raises(_Built, match="the Trainer was built"):
        fit(module, [torch.zeros(2)] * 64, train, tmp_path / "staging")
    (environment,) = seen["plugins"]
    assert isinstance(environment, SLURMEnvironment) and not environment.auto_requeue
    assert (environment.world_size(), environment.global_rank(), environment.node_rank(),
            environment.local_rank()) == (16, 9, 1, 1)
    assert (environment.main_address, environment.main_port) == ("10.1.0.7", 19242)
    strategy = seen["strategy"]
    assert isinstance(strategy, DeepSpeedStrategy) and strategy._timeout == timedelta(seconds=900)
    assert strategy.config["zero_optimization"]["stage"] == 2 and strategy.config["train_micro_batch_size_per_gpu"] == 1
    assert (seen["accelerator"], seen["devices"], seen["num_nodes"], seen["accumulate_grad_batches"]) == ("gpu", 8, 2, 4)


def test_the_collective_timeout_reaches_ddp_and_the_shard_trainer() -> None:
    arguments = trainer_arguments(TrainConfig(accelerator="cpu", num_nodes=2, devices=1, collective_timeout=42), "ddp", 2)
    assert isinstance(arguments["strategy"], DDPStrategy) and arguments["strategy"]._timeout == timedelta(seconds=42)
    trainer = shard_trainer("generate", "cpu", 2, 1, collective_timeout=42)
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.strategy._timeout == timedelta(seconds=42)
    assert not isinstance(shard_trainer("generate", "cpu", 1, 1).strategy, DDPStrategy)  # one rank: no group
    with pytest.raises(DrafterError, match="collective_timeout"):
        load_config(None, ["train_drafter.train.collective_timeout=0"])
    with pytest.raises(DrafterError, match="slurm.socket_ifname"):
        load_config(None, ["slurm.socket_ifname=ib0; rm -rf /"])


# --- on a real two-node Slurm ----------------------------------------------------------------------


def _cfg(workdir: Path, uri: str, *extra: str) -> PipelineConfig:
    return load_config(None, [f"workdir={workdir}", *DAG, f"mlflow.tracking_uri={uri}", *extra])


def _log(cfg: PipelineConfig, stage: str, job_id: str) -> str:
    return (cfg.workdir_path / "slurm" / "logs" / f"{stage}-{job_id}.out").read_text()


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _losses(uri: str, artifact_path: Path) -> dict[int, float]:
    """Training loss per step (averaged over ranks and micro-batches) from the MLflow run the stage names; a step
    logged again after a requeue counts once (its last value)."""
    run_id = json.loads((artifact_path / "training.json").read_text())["mlflow_run_id"]
    history = MlflowClient(tracking_uri=uri).get_metric_history(run_id, "loss")
    return {m.step: m.value for m in sorted(history, key=lambda m: (m.step, m.timestamp))}


def _named_inputs(cfg: PipelineConfig, stage: str) -> list[str]:
    """Overrides that name ``cfg``'s upstream artifacts of ``stage``, so another workdir plans only ``stage``."""
    upstream = {"train_drafter": ("generate:calibration", "count:counts"),
                "train_router": ("generate:calibration", "count:counts", "cluster:clusters")}[stage]
    the_plan = plan(cfg, [stage])
    return [f"{stage}.{key}={the_plan[up].path}" for up, key in (pair.split(":") for pair in upstream)]


def _wait_for_checkpoint(staging: Path, job_id: str, after: int = 0, timeout: float = 600) -> int:
    """Until job ``job_id`` has landed a checkpoint of a step beyond ``after``; that step. Fails if the job ends first
    (the fault would come too late to test anything)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [int(p.name[len(ckpt.PREFIX):]) for p in ckpt.checkpoints(staging)] if staging.is_dir() else []
        if steps and max(steps) > after:
            return max(steps)
        state = slurm.job_state(job_id).state
        assert state in slurm.ACTIVE, f"job {job_id} ended ({state}) before a checkpoint beyond step {after} landed"
        time.sleep(0.05)
    raise TimeoutError(f"no checkpoint beyond step {after} under {staging} after {timeout:.0f} s")


def _rank_process(job_id: str, rank: int) -> int:
    """The pid of the stage process of ``rank`` in job ``job_id`` (its srun task: SLURM_PROCID in its environment)."""
    want = {f"SLURM_CLUSTER_NAME={TWO_NODE_CLUSTER}", f"SLURM_JOB_ID={job_id}", f"SLURM_PROCID={rank}"}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = set((proc / "environ").read_bytes().decode(errors="replace").split("\0"))
        except OSError:
            continue
        if b"jobs.cli" in cmdline and want <= environ:
            return int(proc.name)
    raise LookupError(f"no rank {rank} process of job {job_id}")


@pytest.fixture(scope="module")
def dag(tmp_path_factory: pytest.TempPathFactory, tiny_kit, slurm_two_nodes: SlurmCluster,
        mlflow_server: MlflowServer):
    """The whole tiny DAG submitted (four stages on two nodes); once train_drafter's job has landed a checkpoint
    (one every step: a run setting) it is requeued, both nodes' tasks stop and the job (restart 1) resumes. It is
    submitted from a process whose environment holds another launch's rank variables. Then the
    same four stages run in-process on one rank. Returns the config, the submitted rows by stage, the one-rank
    artifacts and the step of the checkpoint that had landed before the requeue."""
    cfg = _cfg(tmp_path_factory.mktemp("two-nodes"), mlflow_server.uri, "train_drafter.train.checkpoint_every=1")
    with slurm_two_nodes.active(), pytest.MonkeyPatch.context() as patch:
        # submitted from a process that is itself rank 1 of some launch: none of it may reach the jobs (rank 0 of
        # a job that inherited RANK=1 would not publish, and MASTER_ADDR=nodeA does not resolve)
        for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "nodeA",
                           "MASTER_PORT": "1"}.items():
            patch.setenv(key, value)
        rows = {row.stage: row for row in slurm.submit(cfg, ["evaluate"], [])}
        train = rows["train_drafter"]
        landed = _wait_for_checkpoint(cfg.workdir_path / "staging" / train.artifact_id / "train", train.job_id)
        slurm_two_nodes.requeue(train.job_id)  # both tasks stop, the job starts again without Slurm's back-off
    slurm_two_nodes.wait([row.job_id for row in rows.values() if row.job_id], timeout=1800)
    local = run(_cfg(tmp_path_factory.mktemp("one-rank"), mlflow_server.uri, "mlflow.experiment=one-rank"),
                list(PARALLEL))
    return cfg, rows, local, landed


@pytest.fixture(scope="module")
def one_node_two_ranks(dag, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train_drafter on the DAG's inputs as one node running two Lightning ranks (DDP over gloo, a real second
    process), uninterrupted, one thread per rank as the job script gives each task; its artifact's path."""
    cfg, _, _, _ = dag
    workdir = tmp_path_factory.mktemp("one-node-two-ranks")
    config = next((cfg.workdir_path / "slurm" / "configs").glob("*.yaml"))
    cmd = [sys.executable, "-m", "jobs.cli", "train_drafter", "--config", str(config), f"workdir={workdir}",
           *_named_inputs(cfg, "train_drafter"), "mlflow.experiment=one-node-two-ranks",
           "train_drafter.train.accelerator=cpu", "train_drafter.train.devices=2", "train_drafter.train.num_nodes=1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 24 steps on 2 rank(s) (ddp)" in done.stderr
    (artifact,) = (workdir / "artifacts").glob("train_drafter-*/")
    return artifact


@pytest.mark.slurm
@pytest.mark.slow
def test_dag_with_four_stages_on_two_nodes_ends_in_registered_bundles(dag, two_node_slurm: SlurmCluster,
                                                                      mlflow_server: MlflowServer) -> None:
    cfg, rows, _, _ = dag
    assert set(rows) == {"generate", "count", "train_drafter", "cluster", "train_router", "estimate_rdk", "evaluate"}
    status = {row.stage: row for row in slurm.status(cfg, ["evaluate"])}
    for stage, row in rows.items():
        assert row.status == "submitted" and status[stage].state == "COMPLETED" and status[stage].artifact, status[stage]
        nodes = 2 if stage in PARALLEL else 1
        log = _log(cfg, stage, row.job_id)
        assert f"drafter: {stage} on {nodes} node(s) x 1 task(s)" in log
        first = two_node_slurm.first_node(row.job_id)
        assert first == "nodeA" or nodes == 1, (stage, first)
        port = 15000 + int(row.job_id) % 10000  # the first node's NodeAddr, not its name
        assert f"rendezvous {two_node_slurm.addresses[first]}:{port}" in log, (stage, first)
    assert "generate: 2 rank(s) on 2 node(s) answer" in _log(cfg, "generate", rows["generate"].job_id)
    assert "trained 24 steps on 2 rank(s) (ddp)" in _log(cfg, "train_drafter", rows["train_drafter"].job_id)
    the_plan = plan(cfg, ["evaluate"])
    evaluated = the_plan["evaluate"].path
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    for family, stage in (("eagle3", "train_drafter"), ("dynaspec", "train_router"), ("rdk", "estimate_rdk")):
        record = json.loads((evaluated.parent / f"{evaluated.name}.registration-{family}.json").read_text())
        version = client.get_model_version(record["name"], record["version"])
        assert "candidate" in record["aliases"] and the_plan[stage].id in version.tags["drafter.components"], family


@pytest.mark.slurm
@pytest.mark.slow
def test_each_two_node_stage_records_both_nodes_and_is_published_once(dag, mlflow_server: MlflowServer) -> None:
    """generate and estimate_rdk in their artifact's metrics, the trainers in training.json: nodeA (node rank 0,
    global rank 0) and nodeB (node rank 1, global rank 1). Global rank 0 alone publishes: one "wrote" line in the
    job's log (both ranks write to it; the requeued train_drafter's first run published nothing) and one MLflow
    stage run per artifact."""
    cfg, rows, _, _ = dag
    the_plan = plan(cfg, ["evaluate"])
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name("two-nodes")
    expected = [{"rank": 0, "node_rank": 0, "local_rank": 0, "host": "nodeA"},
                {"rank": 1, "node_rank": 1, "local_rank": 0, "host": "nodeB"}]
    for stage in PARALLEL:
        step = the_plan[stage]
        if stage in ("train_drafter", "train_router"):
            record = json.loads((step.path / "training.json").read_text())
            assert record["world_size"] == 2 and record["strategy"] == "ddp"
        else:
            record = json.loads((step.path / "manifest.json").read_text())["metrics"]
        assert record["nodes"] == list(TWO_NODES) and record["ranks"] == expected, (stage, record)
        log = _log(cfg, stage, rows[stage].job_id)
        assert log.count(f"wrote {step.id} ->") == 1, log[-3000:]
        runs = client.search_runs([experiment.experiment_id], f"tags.`drafter.artifact_id` = '{step.id}'")
        assert len(runs) == 1, (stage, [r.info.run_id for r in runs])


@pytest.mark.slurm
@pytest.mark.slow
def test_two_node_artifacts_are_the_one_rank_artifacts(dag, mlflow_server: MlflowServer) -> None:
    """Same ids (run settings never enter them); generate: the same rows; the trainers (two nodes x one rank
    against one rank accumulating two micro-batches): every per-step loss within 1e-5 relative (the bound of the
    harness's DDP test) and every weight within 1e-5; estimate_rdk: every moment sum within 1e-5 relative
    (1e-7 absolute) — each shard is summed by one rank either way, in float64, and rank 0 adds the shards in order
    (measured here: equal to the last bit)."""
    cfg, _, local, _ = dag
    the_plan = plan(cfg, ["evaluate"])
    for stage in PARALLEL:
        assert the_plan[stage].id == local[stage].id, stage
    assert list(iter_rows(the_plan["generate"].path / "data")) == list(iter_rows(local["generate"].path / "data"))
    for stage, weights in (("train_drafter", "model.safetensors"), ("train_router", "router.safetensors")):
        two, one = _losses(mlflow_server.uri, the_plan[stage].path), _losses(mlflow_server.uri, local[stage].path)
        assert sorted(two) == sorted(one) and len(one) >= 2, (stage, sorted(two), sorted(one))
        assert [two[s] for s in sorted(two)] == pytest.approx([one[s] for s in sorted(one)], rel=LOSS_RTOL), stage
        mine, theirs = _weights(the_plan[stage].path / weights), _weights(local[stage].path / weights)
        assert set(mine) == set(theirs)
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], **WEIGHT_TOL, msg=f"{stage} {key}")
    mine = _weights(the_plan["estimate_rdk"].path / "moments.safetensors")
    theirs = _weights(local["estimate_rdk"].path / "moments.safetensors")
    assert set(mine) == set(theirs)
    for key in mine:
        torch.testing.assert_close(mine[key], theirs[key], **MOMENT_TOL, msg=key)


@pytest.mark.slurm
@pytest.mark.slow
def test_requeued_two_node_training_ends_with_the_uninterrupted_one_node_two_rank_model(
        dag, one_node_two_ranks: Path, mlflow_server: MlflowServer) -> None:
    """The DAG's train_drafter job was requeued once mid-run: its log shows both runs (restart 1), the second
    resumed from the last checkpoint (at or after the one seen before the requeue, before the end), and the
    published weights are byte for byte those of an uninterrupted one-node x two-rank run (two ranks are two ranks,
    whichever nodes they are on; gloo adds two gradients the same either way), with the same per-step losses."""
    cfg, rows, _, landed = dag
    log = _log(cfg, "train_drafter", rows["train_drafter"].job_id)
    assert "restart 0" in log and "restart 1" in log and "DUE TO JOB REQUEUE" in log, log[-3000:]
    two_nodes = plan(cfg, ["train_drafter"])["train_drafter"].path
    record = json.loads((two_nodes / "training.json").read_text())
    assert landed <= record["resumed_from"] < record["steps"] == 24, record
    assert one_node_two_ranks.name == two_nodes.name  # the same id
    one_node = json.loads((one_node_two_ranks / "training.json").read_text())
    assert one_node["nodes"] == [os.uname().nodename] and [r["rank"] for r in one_node["ranks"]] == [0, 1]
    assert one_node["resumed_from"] == 0
    assert (two_nodes / "model.safetensors").read_bytes() == (one_node_two_ranks / "model.safetensors").read_bytes()
    two, one = _losses(mlflow_server.uri, two_nodes), _losses(mlflow_server.uri, one_node_two_ranks)
    assert sorted(two) == sorted(one) and [two[s] for s in two] == pytest.approx([one[s] for s in two], rel=LOSS_RTOL)


# --- faults across nodes -----------------------------------------------------------------------------


@pytest.mark.slurm
@pytest.mark.slow
def test_a_killed_or_hung_node_ends_the_job_and_the_rerun_completes(dag, tmp_path: Path, two_node_slurm: SlurmCluster,
                                                                    mlflow_server: MlflowServer) -> None:
    """train_router on two nodes, a checkpoint every step and a 15 s collective timeout (run settings, same id).

    1. SIGKILL to the task on nodeB (global rank 1) once a checkpoint has landed: srun's ``--kill-on-bad-exit`` ends
       the task on nodeA too, so the job fails instead of rank 0 waiting in its next all-reduce.
    2. The rerun resumes; SIGSTOP to its nodeB task once a newer checkpoint has landed: that node hangs with its
       process alive, so srun sees no exit. Rank 0's next collective gives up after 15 s with our error, srun then
       ends the stopped task, and the job fails; ``drafter status`` quotes the error.
    3. The second rerun resumes from the last checkpoint and ends with the bytes of the uninterrupted two-node run.

    Nothing is published by the failed jobs. The waits are 5-minute guards against a hang, not speed bounds."""
    cfg, _, _, _ = dag
    mine = _cfg(tmp_path, mlflow_server.uri, *_named_inputs(cfg, "train_router"),
                "train_router.train.checkpoint_every=1", "train_router.train.collective_timeout=15",
                "mlflow.experiment=faults")
    staging = tmp_path / "staging" / plan(mine, ["train_router"])["train_router"].id / "train"

    def nothing_published() -> None:
        assert not plan(mine, ["train_router"])["train_router"].cached
        assert not [*(tmp_path / "artifacts").glob("train_router-*"), *(tmp_path / "artifacts").glob(".*")]

    (killed,) = slurm.submit(mine, ["train_router"], [])
    _wait_for_checkpoint(staging, killed.job_id)
    os.kill(_rank_process(killed.job_id, 1), signal.SIGKILL)
    two_node_slurm.wait([killed.job_id], timeout=300)
    assert slurm.job_state(killed.job_id).state == "FAILED"
    assert "srun: error: nodeB: task 1: Killed" in _log(mine, "train_router", killed.job_id)
    nothing_published()

    landed = max(int(p.name[len(ckpt.PREFIX):]) for p in ckpt.checkpoints(staging))
    (hung,) = slurm.submit(mine, ["train_router"], [])
    assert hung.status == "submitted" and hung.job_id != killed.job_id
    _wait_for_checkpoint(staging, hung.job_id, after=landed)
    os.kill(_rank_process(hung.job_id, 1), signal.SIGSTOP)
    two_node_slurm.wait([hung.job_id], timeout=300)
    assert slurm.job_state(hung.job_id).state == "FAILED"
    log = _log(mine, "train_router", hung.job_id)
    assert re.search(r"^error: train_router: rank 0 of 2 lost its peers in a collective: another rank died, or did "
                     r"not answer for 15 s\.$", log, re.M), log[-3000:]
    assert "srun: error: nodeA: task 0: Exited with exit code 2" in log
    nothing_published()
    (status,) = [row for row in slurm.status(mine, ["train_router"]) if row.stage == "train_router"]
    assert status.state == "FAILED" and "lost its peers in a collective" in status.why, status

    landed = max(int(p.name[len(ckpt.PREFIX):]) for p in ckpt.checkpoints(staging))
    (again,) = slurm.submit(mine, ["train_router"], [])
    two_node_slurm.wait([again.job_id])
    rerun = plan(mine, ["train_router"])["train_router"]
    assert rerun.cached and slurm.job_state(again.job_id).state == "COMPLETED"
    record = json.loads((rerun.path / "training.json").read_text())
    assert record["resumed_from"] == landed and record["nodes"] == list(TWO_NODES), record
    uninterrupted = plan(cfg, ["train_router"])["train_router"]
    assert rerun.id == uninterrupted.id
    assert (rerun.path / "router.safetensors").read_bytes() == (uninterrupted.path / "router.safetensors").read_bytes()
