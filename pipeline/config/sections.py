"""The root of the pipeline's configuration and its shared sections, each field documented below it.

``PipelineConfig`` is the root a YAML file under ``configs/`` fills. The shared sections (``target``, ``mlflow``,
``slurm``) live here; the one section per stage (``generate``, ``count``, ...) in :mod:`pipeline.config.stages`.
Checks live in each section's ``__post_init__`` so a bad value fails when the config is read, not an hour into
a job. :func:`load_config` reads a YAML file and ``key=value`` overrides into a validated ``PipelineConfig``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config.dflash import TrainDFlashConfig
from pipeline.config.schema import (
    apply_overrides,
    check_value,
    from_dict,
    load_yaml,
    run_setting,
)
from pipeline.config.stage_names import STAGE_NAMES
from pipeline.config.stages import (
    ClusterConfig,
    CountConfig,
    EstimateRdkConfig,
    EvaluateConfig,
    GenerateConfig,
    TrainDrafterConfig,
    TrainRouterConfig,
)
from pipeline.errors import refuse_secrets_in_uri


@dataclass
class TargetConfig:
    model: str = "tiny:default/target"
    """The target LLM: a hub id, a local directory, or a tiny-kit ref ``tiny:<profile>/<role>``."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) pinned into every artifact's fingerprint."""
    tokenizer: str | None = None
    """Tokenizer to use when it lives apart from the model; null means the model's own."""
    dtype: str = "float32"
    """Weights dtype for inference: float32, bfloat16, float16, or float64 (exactness checks)."""
    trust_remote_code: bool = run_setting(False)
    """Allow the target checkpoint's own Python code to run (the target's only: a drafter never runs its own code).
    Off by default: only enable for code you have read. A run setting
    (the config's hash ignores it), but with it on the target's fingerprint says so, and every id that reads the
    target changes: a checkpoint with both a known ``model_type`` and an ``auto_map`` runs its own code with it on
    and transformers' class with it off."""

    def __post_init__(self) -> None:
        check_value(self.dtype in ("float32", "bfloat16", "float16", "float64"), "target.dtype",
               "one of float32, bfloat16, float16, float64", self.dtype)
        check_value(bool(self.model), "target.model", "a hub id, local path or tiny:<profile>/<role>", self.model)


@dataclass
class MlflowConfig:
    tracking_uri: str | None = None
    """Tracking store. null: $MLFLOW_TRACKING_URI if set, else sqlite:///<workdir>/mlflow.db."""
    experiment: str = "drafter-pipeline"
    """MLflow experiment the stage runs are logged under."""
    log_artifacts: bool = True
    """Upload each stage's artifact directory to the run (turn off for very large calibration sets)."""
    retries: int = 3
    """Attempts to reach a tracking server before giving up with a clear error."""
    timeout_s: float = 5.0
    """Seconds per attempt to reach a tracking server."""

    def __post_init__(self) -> None:
        if self.tracking_uri:  # the config is printed (drafter config) and copied beside every submitted job
            refuse_secrets_in_uri(self.tracking_uri, "mlflow.tracking_uri",
                                  "A config file is printed by `drafter config` and copied beside every submitted job")
        check_value(self.retries >= 1, "mlflow.retries", "an integer >= 1", self.retries)
        check_value(self.timeout_s > 0, "mlflow.timeout_s", "a positive number", self.timeout_s)


SLURM_RESOURCES = ("nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task", "mem", "time")
"""Resource keys a stage may set for itself under ``slurm.stages.<stage>``."""


@dataclass
class SlurmConfig:
    """How ``drafter submit`` asks Slurm for each stage's job. Every field is a run setting: where a stage runs,
    never what it computes, so none enters an artifact id."""

    partition: str | None = run_setting(None)
    """``--partition`` of every job (null: the cluster's default)."""
    account: str | None = run_setting(None)
    """``--account`` (null: the user's default)."""
    qos: str | None = run_setting(None)
    """``--qos`` (null: none)."""
    nodes: int = run_setting(1)
    """Nodes per job; a stage's ranks are nodes x ntasks_per_node (Lightning reads them from Slurm)."""
    ntasks_per_node: int = run_setting(1)
    """Tasks (ranks) per node: one per GPU for GPU stages."""
    gpus_per_node: int = run_setting(0)
    """GPUs per node (0: a CPU job; the stage then runs with accelerator cpu)."""
    cpus_per_task: int = run_setting(2)
    """CPU cores per task."""
    mem: str | None = run_setting(None)
    """``--mem`` per node, e.g. ``64G`` (null: the partition's default)."""
    time: str = run_setting("04:00:00")
    """Wall-clock limit (``--time``). The job is signalled ``signal_seconds`` before it and requeues itself;
    the stage resumes from its shards or checkpoints."""
    signal_seconds: int = run_setting(90)
    """Seconds before the time limit at which the batch script gets SIGUSR1 and requeues the job."""
    stages: dict[str, dict] = run_setting(default_factory=dict)
    """Per-stage resources overriding the ones above, e.g. ``{train_drafter: {nodes: 2, gpus_per_node: 8,
    ntasks_per_node: 8, time: "24:00:00"}}``; keys from nodes, ntasks_per_node, gpus_per_node, cpus_per_task,
    mem, time."""
    extra: list[str] = run_setting(default_factory=list)
    """Further sbatch options written into every script's header verbatim (e.g. ``--exclusive``)."""
    logs: str | None = run_setting(None)
    """Directory of the job logs (``<stage>-<job id>.out``); null: ``<workdir>/slurm/logs``."""
    socket_ifname: str | None = run_setting(None)
    """Network interface the ranks of a multi-node job talk over (e.g. ``ib0``, ``eth0``): the job script exports
    it as ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``. Null: those variables pass through from the
    submitting shell when set there, else gloo and NCCL pick an interface themselves."""
    template: str | None = run_setting(None)
    """The batch script every stage's job is made from; null: ``slurm/stage.sbatch`` of this checkout. A copy of it
    may add site-specific setup (modules, containers) above the pipeline's command."""

    def __post_init__(self) -> None:
        for key in ("nodes", "ntasks_per_node", "cpus_per_task", "signal_seconds"):
            check_value(getattr(self, key) >= 1, f"slurm.{key}", "an integer >= 1", getattr(self, key))
        check_value(self.gpus_per_node >= 0, "slurm.gpus_per_node", "an integer >= 0", self.gpus_per_node)
        for stage, settings in self.stages.items():
            check_value(stage in STAGE_NAMES, "slurm.stages", f"stage names from {list(STAGE_NAMES)}", stage)
            check_value(isinstance(settings, dict) and set(settings) <= set(SLURM_RESOURCES),
                        f"slurm.stages.{stage}", f"a mapping with keys from {list(SLURM_RESOURCES)}", settings)
            for key, value in settings.items():  # typed as the top-level field of the same name
                text = key in ("mem", "time")
                ok = isinstance(value, str) if text else isinstance(value, int) and not isinstance(value, bool)
                check_value(ok or (key == "mem" and value is None), f"slurm.stages.{stage}.{key}",
                            'a string, e.g. "24:00:00"' if text else "an integer", value)
        check_value(self.socket_ifname is None or (isinstance(self.socket_ifname, str)
                                                   and re.fullmatch(r"[A-Za-z0-9_.:@,^=-]+", self.socket_ifname)),
                    "slurm.socket_ifname", "an interface name such as ib0, or a list NCCL and gloo accept (ib0,ib1)",
                    self.socket_ifname)
        check_value(all(isinstance(x, str) and x.startswith("--") for x in self.extra), "slurm.extra",
                    "sbatch options starting with --", self.extra)
        # each is written into an #SBATCH line of the job script: a line break would start a shell command there
        texts = {"slurm.partition": self.partition, "slurm.account": self.account, "slurm.qos": self.qos,
                 "slurm.mem": self.mem, "slurm.time": self.time, "slurm.logs": self.logs, "slurm.template": self.template,
                 **{f"slurm.extra[{i}]": x for i, x in enumerate(self.extra)},
                 **{f"slurm.stages.{stage}.{key}": v for stage, settings in self.stages.items()
                    for key, v in settings.items() if isinstance(v, str)}}
        for key, text in texts.items():
            check_value(text is None or text.isprintable(), key, "one line of printable text (it goes into the job "
                        "script's #SBATCH header)", text)


@dataclass
class PipelineConfig:
    workdir: str = "runs/tiny"
    """Where artifacts, staging shards and the default MLflow store live (relative to the current dir)."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The target model every artifact is fingerprinted against."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """Experiment tracking."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """Stage ``generate``: the calibration set."""
    count: CountConfig = field(default_factory=CountConfig)
    """Stage ``count``: token frequencies and shortlists."""
    train_drafter: TrainDrafterConfig = field(default_factory=TrainDrafterConfig)
    """Stage ``train_drafter``: the EAGLE-3 drafter (Lightning + DeepSpeed), on the calibration set."""
    train_dflash: TrainDFlashConfig = field(default_factory=TrainDFlashConfig)
    """Stage ``train_dflash``: the DFlash block drafter (same harness), on the calibration set; runs only when
    asked for or when evaluate's methods include dflash."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Stage ``cluster``: spherical k-means (FAISS) of the drafter's LM head (DynaSpec)."""
    train_router: TrainRouterConfig = field(default_factory=TrainRouterConfig)
    """Stage ``train_router``: the DynaSpec cluster router, on the calibration set."""
    estimate_rdk: EstimateRdkConfig = field(default_factory=EstimateRdkConfig)
    """Stage ``estimate_rdk``: the target's token moments and RDK affinities (pruned and foreign drafters)."""
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    """Stage ``evaluate``: speculative decoding vs autoregressive, gates, registration."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """``drafter submit``: partition, account and resources of each stage's Slurm job (run settings only)."""

    def __post_init__(self) -> None:
        # it goes into paths everywhere, and into the #SBATCH --output line of every submitted job
        check_value(isinstance(self.workdir, str) and bool(self.workdir) and self.workdir.isprintable(), "workdir",
                    "a path on one line of printable text", self.workdir)

    @property
    def workdir_path(self) -> Path:
        return Path(self.workdir).expanduser().resolve()


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read ``path`` (YAML; None for the built-in defaults), apply ``key=value`` overrides, validate."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(PipelineConfig, data)
