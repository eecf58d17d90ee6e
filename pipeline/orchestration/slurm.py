"""``drafter submit`` and ``drafter status``: the stage DAG as a chain of Slurm jobs.

:func:`submit` plans the config like ``drafter run`` does, skips every stage whose artifact exists (or whose
job for the same artifact id is still queued or running), and submits one job per remaining stage from the
single template ``slurm/stage.sbatch``: its ``#SBATCH`` header is filled from the config's ``slurm`` section
(partition, account, QoS, nodes, tasks, GPUs, CPUs, memory, time; per stage under ``slurm.stages``), the job
depends on its upstream stages' jobs with ``--dependency=afterok:...`` and ``--kill-on-invalid-dep=yes``, and
is submitted ``--requeue`` with a SIGUSR1 before its time limit on which the script requeues itself.

Jobs read the *resolved* config, written once per submission under ``<workdir>/slurm/`` (so editing the
YAML later cannot change what a queued job computes), plus the stage's run settings derived from its
allocation (accelerator, devices per node, nodes; none of them enters an artifact id). On several nodes every
stage runs one ``srun`` task per rank and Lightning's Slurm environment gives each its ranks; the template
points them at the first node's address (``MASTER_ADDR`` from its ``NodeAddr``, ``MASTER_PORT`` from the job
id) and the config may name the network interface (:func:`job_environment`). ``generate`` and
``estimate_rdk`` spread their shards over the job's ranks and global rank 0 publishes once: one job per stage
keeps the dependency chain one edge per stage and the publish step inside the job that produced the shards,
where an array job would need a separate publish job and a barrier on shared disk. Every submission is
recorded in ``<workdir>/slurm/jobs.json`` (artifact id → job), which :func:`status` reads back with ``squeue`` /
``sacct`` / ``scontrol``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import load_artifact, write_json_atomic
from pipeline.checksums import write_text_atomic
from pipeline.config.schema import to_dict
from pipeline.config.sections import SLURM_RESOURCES, PipelineConfig
from pipeline.config.stage_names import STAGE_NAMES
from pipeline.config.training import TrainConfig
from pipeline.errors import DrafterError, scrub
from pipeline.orchestration.dag import plan, spec
from pipeline.orchestration.lock import held
from pipeline.orchestration.slurm_jobs import ACTIVE, ENDED_BADLY, job_state, need, recorded_state
from pipeline.progress import stamped
from pipeline.tracking import log_stage_run, logged_run, tracking_uri

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "stage.sbatch"
"""The one job template (``slurm/stage.sbatch`` of the repository); ``slurm.template`` names another."""
RECORDS = "jobs.json"
SUBMIT_LOCK = "submit.lock"
"""Held while a submission reads and writes the job records (two submissions from one workdir take turns)."""
LAUNCH_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                              "MASTER_ADDR", "MASTER_PORT"})
"""Variables of a torch.distributed launch that ``submit`` keeps out of its jobs' environment: a job's ranks and
rendezvous come from its own allocation (Slurm and the template), never from the shell that submitted it."""


@dataclass(frozen=True)
class Resources:
    """One stage's allocation: ``slurm`` section defaults overridden by ``slurm.stages.<stage>``."""

    nodes: int
    ntasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int
    mem: str | None
    time: str

    @classmethod
    def of(cls, cfg: PipelineConfig, stage: str) -> Resources:
        """A stage that runs as one process (``count``, ``cluster``, ``evaluate``) takes one node, one task and at
        most one GPU from the section's defaults, which are sized for the distributed stages; asking it for more
        in ``slurm.stages.<stage>`` is refused."""
        base = {key: getattr(cfg.slurm, key) for key in SLURM_RESOURCES}
        own = cfg.slurm.stages.get(stage, {})
        if spec(stage).one_process:
            if wider := {k: v for k, v in own.items() if k in ("nodes", "ntasks_per_node", "gpus_per_node") and v > 1}:
                raise DrafterError(f"Stage {stage} runs as one process, but slurm.stages.{stage} asks for more.",
                                   expected="nodes: 1, ntasks_per_node: 1 and gpus_per_node: 0 or 1 (or none set): "
                                            "one process uses one GPU",
                                   found=", ".join(f"{k}: {v}" for k, v in wider.items()),
                                   fix=f"Remove them from slurm.stages.{stage}; only generate, estimate_rdk and the "
                                       "trainers run on several ranks.")
            base.update(nodes=1, ntasks_per_node=1, gpus_per_node=min(base["gpus_per_node"], 1))
        return cls(**{**base, **own})


TRAINERS = tuple(name for name in STAGE_NAMES
                 if isinstance(getattr(getattr(PipelineConfig(), name, None), "train", None), TrainConfig))
"""The stages the training harness runs (their section has a ``train`` block): each rank of a job is one trainer rank."""


def run_settings(stage: str, res: Resources) -> list[str]:
    """Overrides that make ``stage`` use exactly its allocation (run settings: no artifact id changes).

    ``evaluate.device`` is deliberately absent: it is part of the evaluate id (timings depend on it).
    """
    gpu = res.gpus_per_node > 0
    accelerator = "gpu" if gpu else "cpu"
    if stage in ("generate", "estimate_rdk"):
        prefix = stage
    elif stage in TRAINERS:
        prefix = f"{stage}.train"
    elif stage == "cluster":
        return [f"cluster.device={'cuda' if gpu else 'cpu'}"]
    elif stage == "count":
        return [f"count.workers={res.cpus_per_task}"]
    else:
        return []
    return [f"{prefix}.accelerator={accelerator}", f"{prefix}.devices={res.ntasks_per_node}",
            f"{prefix}.num_nodes={res.nodes}"]


def _template(cfg: PipelineConfig) -> str:
    path = Path(cfg.slurm.template).expanduser() if cfg.slurm.template else TEMPLATE
    if not path.is_file():
        raise DrafterError("The Slurm job template is missing.", expected=str(path), found="no such file",
                           fix="Run from a checkout of the repository (slurm/stage.sbatch) or set slurm.template "
                               "to a copy of it.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DrafterError(f"The Slurm job template {path} is not UTF-8 text.", expected="a UTF-8 batch script",
                           found=f"{err.reason} at byte {err.start}", fix="Re-encode it as UTF-8.") from None
    if not any(line.startswith("#SBATCH") for line in text.splitlines()):
        raise DrafterError(f"The Slurm job template {path} has no #SBATCH block.",
                           expected="a batch script whose #SBATCH lines (replaced by each stage's resources) come "
                                    "before its first command, as in slurm/stage.sbatch",
                           found="no line starting with #SBATCH",
                           fix="Start from a copy of slurm/stage.sbatch and keep its #SBATCH lines.")
    return text


def header(cfg: PipelineConfig, stage: str, logs: Path) -> list[str]:
    """The ``#SBATCH`` lines of ``stage``'s job."""
    res, slurm = Resources.of(cfg, stage), cfg.slurm
    lines = [f"--job-name=drafter-{stage}", f"--nodes={res.nodes}", f"--ntasks-per-node={res.ntasks_per_node}",
             f"--cpus-per-task={res.cpus_per_task}", f"--time={res.time}"]
    if res.gpus_per_node:
        lines.append(f"--gpus-per-node={res.gpus_per_node}")
    if res.mem:
        lines.append(f"--mem={res.mem}")
    lines += [f"--{key}={_quoted(value)}" for key in ("partition", "account", "qos") if (value := getattr(slurm, key))]
    lines += ["--requeue", f"--signal=B:USR1@{slurm.signal_seconds}", "--open-mode=append",
              f"--output={_quoted(str(logs / f'{stage}-%j.out'))}", *slurm.extra]
    return [f"#SBATCH {line}" for line in lines]


def _quoted(value: str) -> str:
    """A value for an ``#SBATCH`` line as sbatch reads it back: in double quotes, ``\\`` and ``"`` escaped, where it
    holds a character sbatch's reader gives a meaning (white space ends a word: "Invalid directive"; ``#`` outside
    quotes starts a comment, so a log path was cut short there; ``'`` opens a quote: "Unmatched `'`")."""
    if not any(c.isspace() or c in "#'\"\\" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def job_environment(cfg: PipelineConfig) -> dict[str, str]:
    """Variables the job script exports for every rank, from the config: the network interface of gloo and NCCL
    (``slurm.socket_ifname``). The rendezvous (``MASTER_ADDR``/``MASTER_PORT``) is the template's own, from the
    allocation; anything else in the submitting shell passes through (sbatch's default ``--export=ALL``)."""
    if not cfg.slurm.socket_ifname:
        return {}
    return {"GLOO_SOCKET_IFNAME": cfg.slurm.socket_ifname, "NCCL_SOCKET_IFNAME": cfg.slurm.socket_ifname}


def render(cfg: PipelineConfig, stage: str, logs: Path) -> str:
    """The template with its ``#SBATCH`` block replaced by ``stage``'s header, followed by the exports of
    :func:`job_environment` (``#SBATCH`` lines must come before the first command)."""
    lines = _template(cfg).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    rest = [line for line in lines[first:] if not line.startswith("#SBATCH")]
    exports = [f"export {key}={shlex.quote(value)}" for key, value in job_environment(cfg).items()]
    return "\n".join([*lines[:first], *header(cfg, stage, logs), *exports, *rest]) + "\n"


def _slurm_dir(cfg: PipelineConfig) -> Path:
    return cfg.workdir_path / "slurm"


def _logs(cfg: PipelineConfig) -> Path:
    return Path(cfg.slurm.logs).expanduser().resolve() if cfg.slurm.logs else _slurm_dir(cfg) / "logs"


def _records(cfg: PipelineConfig) -> dict[str, dict]:
    path = _slurm_dir(cfg) / RECORDS
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise DrafterError(f"The job records {path} are not valid JSON ({err}).",
                           fix="Delete the file: queued jobs keep running; status then knows only artifacts.") from err


def _sbatch(script: Path, args: list[str], dependencies: list[str], env: dict[str, str]) -> str:
    cmd = [need("sbatch"), "--parsable"]
    if dependencies:
        cmd += [f"--dependency=afterok:{':'.join(dependencies)}", "--kill-on-invalid-dep=yes"]
    out = subprocess.run([*cmd, str(script), *args], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise DrafterError(f"sbatch refused {script.name}: {out.stderr.strip()}",
                           fix="Check the slurm section of the config (partition, account, qos, resources).")
    return out.stdout.strip().split(";")[0]


@dataclass
class Submitted:
    """One row of the submit table."""

    stage: str
    artifact_id: str
    job_id: str | None
    depends_on: list[str]
    status: str
    script: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def submit(cfg: PipelineConfig, stages: list[str], overrides: list[str], *, dry_run: bool = False,
           python: str | None = None) -> list[Submitted]:
    """Submit a job per stage of ``stages`` (and uncached upstreams) whose artifact does not exist yet.

    Args:
        cfg: The resolved config (what every job will compute).
        stages: Stages wanted, as for ``drafter run --stages``.
        overrides: Not used to plan (``cfg`` is already resolved); kept in the record for the reader.
        dry_run: Render the scripts and print nothing to Slurm.
        python: Interpreter the jobs run ``-m jobs.cli`` with (default: this one).

    Returns:
        One row per planned stage, in DAG order: ``cached``, ``queued`` (a live job for the same artifact
        id is reused), ``submitted`` or ``dry run``.

    Two submissions from one workdir take turns (``<workdir>/slurm/submit.lock``): each reads the job records the
    other wrote, so a stage is never submitted twice and no record is lost.
    """
    if dry_run:
        return _submit(cfg, stages, overrides, dry_run=True, python=python)
    with held(_slurm_dir(cfg) / SUBMIT_LOCK, "this workdir's submissions", "submitting jobs from this workdir",
              "submit", stamped(sys.stderr)):
        return _submit(cfg, stages, overrides, dry_run=False, python=python)


def _submit(cfg: PipelineConfig, stages: list[str], overrides: list[str], *, dry_run: bool,
            python: str | None) -> list[Submitted]:
    import yaml


    the_plan = plan(cfg, stages)
    if the_plan.provisional and not dry_run:
        missing = [kit.profile for kit in the_plan.kits if not kit.built]
        raise DrafterError("The tiny kit this config names is not built, so the artifact ids the jobs will publish "
                           "are not known yet (a kit model's id names the files it is built into).",
                           expected="the kit built on this machine's cache before submitting",
                           found=f"not built: {', '.join(missing)}",
                           fix=f"Run `drafter tiny --profile {missing[0]}` (minutes), then submit again.")
    needed = set(the_plan.needed(stages))
    root = _slurm_dir(cfg)
    logs = _logs(cfg)
    records = _records(cfg) if not dry_run else {}
    resolved = yaml.safe_dump(to_dict(cfg), sort_keys=True)
    config_path = root / "configs" / f"{hashlib.sha256(resolved.encode()).hexdigest()[:16]}.yaml"
    if not dry_run:
        need("sbatch")
        logs.mkdir(parents=True, exist_ok=True)
        config_path.parent.mkdir(parents=True, exist_ok=True)
        if not config_path.is_file() or config_path.read_text(errors="replace") != resolved:  # absent, or cut
            write_text_atomic(config_path, resolved)
    # the launch variables of this process (an srun/torchrun or Lightning launch it runs in) say nothing of the jobs'
    env = {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES},
           "DRAFTER_CMD": f"{shlex.quote(python or sys.executable)} -m jobs.cli"}
    jobs: dict[str, str] = {}
    rows: list[Submitted] = []
    for name, step in the_plan.stages.items():
        pending = unregistered(cfg, step) if name in stages else []
        if not pending and (name not in needed or step.cached):
            if not step.cached:
                done = "not needed"
            else:
                done = "cached" if dry_run or name not in stages else _log_if_unlogged(cfg, step)
            rows.append(Submitted(name, step.id, None, [], done))
            continue
        upstream = [jobs[up] for up in step.inputs if up in jobs]
        record = records.get(step.id)
        if record is not None and recorded_state(record).state in ACTIVE:
            jobs[name] = record["job_id"]
            # it runs with the config it was submitted with: run settings (evaluate.register, mlflow, resources)
            # of this submission that differ are not in the id, and would be dropped without a word
            same = record.get("args", [None, None])[1] == str(config_path)
            rows.append(Submitted(name, step.id, record["job_id"], record.get("depends_on", []),
                                  "queued" if same else "queued with its own settings (scancel it and submit again "
                                  "to use this submission's)", record.get("script")))
            continue
        text = render(cfg, name, logs)
        args = [name, str(config_path), "--expect-id", step.id, *run_settings(name, Resources.of(cfg, name))]
        script = root / "scripts" / f"{step.id}.sbatch"
        if dry_run:
            rows.append(Submitted(name, step.id, None, [f"<{up}>" for up in step.inputs if up in needed
                                                        and not the_plan[up].cached],
                                  f"dry run: to register {', '.join(pending)}" if pending else "dry run",
                                  text + f"# sbatch {script.name} {shlex.join(args)}\n"))
            jobs[name] = f"<{name}>"
            continue
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(text)
        job_id = _sbatch(script, args, upstream, env)
        jobs[name] = job_id
        records[step.id] = {"stage": name, "job_id": job_id, "depends_on": upstream, "script": str(script),
                            "args": args, "overrides": overrides, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}
        write_json_atomic(root / RECORDS, records)
        rows.append(Submitted(name, step.id, job_id, upstream,
                              f"submitted to register {', '.join(pending)}" if pending else "submitted", str(script)))
    return rows


def _log_if_unlogged(cfg: PipelineConfig, step: Any) -> str:
    """A built artifact of a stage asked for: logged here as its MLflow run if its job's logging failed after it
    published (the server was down); its submit row. ``drafter run`` logs it on its cache hit; under Slurm no job
    runs the stage again, so without this the run would never appear."""
    artifact = load_artifact(step.path, verify=False)
    if logged_run(artifact, tracking_uri(cfg.mlflow, cfg.workdir_path)) is not None:
        return "cached"
    artifact = load_artifact(step.path)  # what goes to the store is hashed first: a damaged payload is refused
    try:
        log_stage_run(artifact, cfg.mlflow, cfg.workdir_path, params=step.config, metrics=artifact.metrics)
    except DrafterError as err:
        return f"cached; its MLflow run is not logged ({err.problem}): submit again once the store is reachable"
    return "cached; its MLflow run logged now (its job's logging had failed)"


@dataclass
class StageStatus:
    """One row of ``drafter status``."""

    stage: str
    artifact_id: str
    artifact: bool
    job_id: str | None
    state: str | None
    why: str | None
    unregistered: list[str] = field(default_factory=list)
    """evaluate: the bundles whose gates passed that this store holds no registration of."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _log_tail(path: Path, lines: int = 3) -> str | None:
    """Why a job failed, from its log's last restart: the pipeline's own ``error:`` block (message and what was
    found), else the last lines naming an error (a traceback's exception), else the last lines."""
    if not path.is_file():
        return None
    text = [line.rstrip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    # a requeued job appends each restart to one log: only the last restart says why the job ended
    starts = [i for i, line in enumerate(text) if line.startswith("drafter: ") and ", restart " in line]
    text = text[starts[-1]:] if starts else text
    ours = [i for i, line in enumerate(text) if line.startswith("error: ")]
    if ours:
        block = text[ours[-1]: ours[-1] + 4]
        picked = [block[0], *(line for line in block[1:] if line.lstrip().startswith("found:"))]
    else:
        picked = [line for line in text if "Error" in line or "error" in line][-lines:] or text[-lines:]
    # another tool's traceback may quote a URL with its credentials (MLflow's "API request to <url> failed")
    return scrub(" | ".join(line.strip() for line in picked)) or None


def check_submitted(cfg: PipelineConfig, stage: str, submitted: str) -> None:
    """A Slurm job plans again when it starts: refuse to run if the id moved since `drafter submit` (the YAML, a hub
    branch's commit, the prompt file or the pipeline's code changed), or if an input is missing from the store
    (the job would build it inside an allocation sized for its own stage)."""
    the_plan = plan(cfg, [stage])
    planned = the_plan[stage].id
    if planned != submitted:
        step = the_plan[stage]  # an input named by path (count.calibration=...) is not planned: it is not ours to build
        changed = [up for up in step.inputs if up not in step.explicit and not the_plan[up].cached]
        raise DrafterError(
            f"This {stage} job was submitted for {submitted}, but its config now plans {planned}: something the id "
            f"reads changed since `drafter submit`.",
            expected=f"the config plans {submitted}",
            found=f"{planned}" + (f" (inputs not built under the new ids: {', '.join(changed)})" if changed else ""),
            fix="Check what changed (the config file, a hub revision that moved to a new commit, the prompt file, a "
                "`git pull` of the pipeline), then `drafter submit` again: it plans the new ids and chains their jobs.")
    missing = [up for up in the_plan.needed([stage]) if up != stage]
    if missing:
        raise DrafterError(
            f"This {stage} job's inputs are not in the store: {', '.join(f'{up} {the_plan[up].id}' for up in missing)}.",
            expected="every input published by the jobs this one waited for",
            found="missing (deleted, or moved aside as damaged, after its job ended)",
            fix="`drafter submit` again: it submits jobs for what is missing and chains this stage after them.")


def unregistered(cfg: PipelineConfig, step: Any) -> list[str]:
    """A built evaluation's passing bundles that this config's store has no registration of (none for another
    stage, or one not built): its registration failed after it was published, or it was registered elsewhere.
    ``drafter submit`` submits an evaluate job for them (a cache hit that only registers)."""
    if step.spec.name != "evaluate" or not step.cached:
        return []
    from pipeline.evaluation.publish import pending_registrations  # deferred: pulls in numpy

    return pending_registrations(cfg, load_artifact(step.path, verify=False))


def status(cfg: PipelineConfig, stages: list[str]) -> list[StageStatus]:
    """Each planned stage: whether its artifact exists, its latest job's state, and why it failed or waits."""

    the_plan = plan(cfg, stages)
    records = _records(cfg)
    by_job = {record["job_id"]: record["stage"] for record in records.values()}
    rows = []
    for name, step in the_plan.stages.items():
        record = records.get(step.id)
        state = recorded_state(record) if record is not None else None
        pending = unregistered(cfg, step)
        if pending and (state is None or state.state not in ACTIVE):
            rows.append(StageStatus(name, step.id, True, record and record["job_id"], None,
                                    f"built; not registered in this store: {', '.join(pending)} (drafter submit "
                                    "registers it)", pending))
            continue
        if record is None:
            unbuilt = "; provisional id until the tiny kit is built (drafter tiny)" if the_plan.provisional else ""
            rows.append(StageStatus(name, step.id, step.cached, None, None,
                                    None if step.cached else f"not submitted (drafter submit){unbuilt}"))
            continue
        why = state.reason
        if state.state in ENDED_BADLY or (state.state or "").startswith("NODE_FAIL"):
            log = _logs(cfg) / f"{name}-{record['job_id']}.out"
            why = f"exit {state.exit_code}; log {log}: {_log_tail(log) or 'empty'}"
        elif state.state == "CANCELLED" and state.reason == "DependencyNeverSatisfied":
            failed = [f"{by_job.get(j, '?')} (job {j})" for j in record.get("depends_on", [])
                      if job_state(j).state not in (None, "COMPLETED")]
            why = f"cancelled: upstream {', '.join(failed) or 'job'} did not succeed"
        elif state.state is None:
            why = (f"{state.reason}; " if state.reason else "Slurm no longer knows this job; ") + (
                f"see its log in {_logs(cfg)}; `drafter submit` submits the stage again")
        rows.append(StageStatus(name, step.id, step.cached, record["job_id"], state.state, why))
    return rows
