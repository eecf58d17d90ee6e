"""The stage DAG as data, and the plan: every stage's artifact id and cache status, computed without
running anything.

:data:`STAGES` is the one table of stages: name, the job module that builds it (a recipe in ``jobs/``,
named by module path so the library never imports recipes), the artifact kind, the upstream stages, and
the config it reads. A stage's artifact id hashes exactly what changes its result: the fields it reads
minus run settings (where and how a job runs: accelerator, devices, nodes, workers — see
:func:`pipeline.config.schema.run_setting`), the ids of its inputs, the target fingerprint, and the
fingerprints of any other model it uses. :func:`plan` computes all of that up front, so ``drafter run``,
``drafter plan``, a Slurm submission and CI share one answer to "what is cached, what must run", and a
stage gets its inputs from its :class:`StagePlan` instead of calling another stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    MANIFEST,
    Artifact,
    artifact_id,
    check_fingerprint,
    content_digest,
    load_artifact,
    read_manifest,
    stale_inputs,
    stored_manifest,
    upstream_manifests,
)
from pipeline.config.schema import identity, to_dict
from pipeline.config.sections import PipelineConfig
from pipeline.config.stage_names import STAGE_NAMES
from pipeline.data.sources import holds_humaneval, source_fingerprint
from pipeline.engine.inputs import DRAFTER_MODELS
from pipeline.engine.methods import models_read, stages_read
from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint
from pipeline.models.target import Target
from pipeline.orchestration.limits import check_settings
from pipeline.tiny import kit_status, parse_tiny_ref


def _generate_models(cfg: PipelineConfig) -> dict:

    gen = cfg.generate
    return {"generator": fingerprint(gen.drafter)} if gen.kind == "drafter" and gen.drafter else {}


def _evaluate_models(cfg: PipelineConfig) -> dict:

    ev = cfg.evaluate
    used = models_read(ev.methods)
    return {key: fingerprint(getattr(ev, key)) for key in DRAFTER_MODELS if key in used and getattr(ev, key)}


def _prompt_data(cfg: PipelineConfig) -> dict:

    return {"source": source_fingerprint(cfg.generate.source, cfg.generate.source_revision)}


def _evaluate_data(cfg: PipelineConfig) -> dict:

    data = _prompt_data(cfg)
    if "code" in cfg.evaluate.tasks:
        data["code"] = source_fingerprint("humaneval")
        if holds_humaneval(cfg.generate.source):
            data["code_prompts"] = "heldout"  # the code task keeps to the problems generate held out
    return data


def _rdk_data(cfg: PipelineConfig) -> dict:

    return {"code": source_fingerprint("humaneval")} if cfg.estimate_rdk.code_problems else {}


def _cluster_models(cfg: PipelineConfig) -> dict:

    return {"drafter": fingerprint(cfg.cluster.drafter)}


def _rdk_models(cfg: PipelineConfig) -> dict:

    ev = cfg.evaluate
    models = {"drafter": fingerprint(ev.drafter)}
    if ev.drafter_other:
        models["drafter_other"] = fingerprint(ev.drafter_other)
    return models


def _read_by_methods(stage: str) -> Callable[[PipelineConfig], bool]:
    """``evaluate``'s ``when`` for ``stage``: whether an evaluated method reads its artifact (the method registry
    says which do)."""
    return lambda cfg: stage in stages_read(cfg.evaluate.methods)


@dataclass(frozen=True)
class StageSpec:
    """One row of the DAG table.

    Attributes:
        name: Stage name (also its CLI subcommand and its artifact id prefix).
        job: Module path of the recipe whose ``main(cfg)`` builds the artifact.
        kind: Artifact kind it writes.
        upstream: Stages whose artifacts it reads, in order.
        reads: Config paths (sections or single fields) whose result-changing fields enter the id.
        overrides: Upstream stage → config key that may name an artifact directory to use instead.
        models: Fingerprints of models other than the target that the result depends on.
        data: Fingerprint of the data behind a config value (a prompt file's sha256, a hub revision), so
            changed content changes the id even where the config text did not change.
        when: Upstream stage → predicate on the config; the stage reads that input only when it holds
            (``evaluate`` reads an upstream artifact only when an evaluated method's registry entry needs it).
        opt_in: For a stage outside the default run: a predicate on the config saying when the default run
            (``drafter run``, ``drafter plan``, ``drafter submit`` without ``--stages``) includes it anyway
            (``train_dflash``: when an evaluated method reads it). None: always in the default run.
        one_process: The stage runs as one process (``count``, ``cluster``, ``evaluate``): launched as several ranks,
            only the first runs it (the others return at once), and ``drafter submit`` gives its job one task.
        version: The version of the stage's code. A change that makes the stage write other bytes from the same
            inputs (a bug fixed, a metric computed another way) raises it; above 1 it enters the id, so what the
            older code built is not found cached, and neither is anything downstream. Ids do not hash the code
            itself: every commit would rerun every stage.
    """

    name: str
    job: str
    kind: str
    upstream: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    overrides: dict[str, str] = field(default_factory=dict)
    models: Callable[[PipelineConfig], dict] | None = None
    data: Callable[[PipelineConfig], dict] | None = None
    when: dict[str, Callable[[PipelineConfig], bool]] = field(default_factory=dict)
    opt_in: Callable[[PipelineConfig], bool] | None = None
    one_process: bool = False
    version: int = 1

    def upstream_of(self, cfg: PipelineConfig) -> tuple[str, ...]:
        """The upstream stages this stage reads under ``cfg``."""
        return tuple(up for up in self.upstream if up not in self.when or self.when[up](cfg))


TARGET_IDENTITY = ("target.model", "target.revision", "target.tokenizer")
EVALUATE_UPSTREAM = ("count", "train_drafter", "cluster", "train_router", "estimate_rdk", "train_dflash")

STAGES: tuple[StageSpec, ...] = (
    # 2: the parts of a chat share a side of the split for every source, not only the packaged one; a record without
    # an id is named by its content, not its position; answers stop at the generation config's end-of-turn ids too.
    # 3: sampled answers follow temperature and top_p alone (not transformers' top-k 50 or the model's generation
    # config); rows carry their chat's split group. 4: a raw row's turns are learnt up to their end-of-turn id
    StageSpec("generate", "jobs.generate", "calibration",
              reads=(*TARGET_IDENTITY, "target.dtype", "generate"), models=_generate_models, data=_prompt_data,
              version=6),  # 5: its prompts' digests (prompt_digests.json). 6: OpenAI content-part turns read
    # 2: shortlists and the draft vocabulary keep generation-config end-of-turn ids. 3: a top-p name per mass
    StageSpec("count", "jobs.count", "token_counts", upstream=("generate",),
              reads=(*TARGET_IDENTITY, "count"), overrides={"generate": "count.calibration"}, one_process=True,
              version=3),
    # evaluate's prompts come from generate.source / heldout_fraction: in its id even where evaluate.counts names count
    # The EAGLE-3 drafter learns from the calibration set with the draft vocabulary of count; the target
    # runs in float32 (CPU, DDP) or as DeepSpeed casts it, so target.dtype does not enter its id.
    # 2: the last step's training figures (final.acc_*, final.train_simulated_tau) pool its micro-batches' rows
    # 3 (and train_dflash's 5): the serving exports in the dtype the target's checkpoint declares
    StageSpec("train_drafter", "jobs.train_drafter", "eagle3_drafter", upstream=("generate", "count"),
              reads=(*TARGET_IDENTITY, "train_drafter"),
              overrides={"generate": "train_drafter.calibration", "count": "train_drafter.counts"}, version=3),
    # DFlash learns from the calibration set (and, with its own draft-vocabulary head, count's draft vocabulary).
    # Outside the default run unless evaluate decodes it: its training would lengthen the embedded default's `make run`.
    StageSpec("train_dflash", "jobs.train_dflash", "dflash_drafter", upstream=("generate", "count"),
              reads=(*TARGET_IDENTITY, "train_dflash"),
              overrides={"generate": "train_dflash.calibration", "count": "train_dflash.counts"},
              when={"count": lambda cfg: cfg.train_dflash.head == "draft"},
              opt_in=_read_by_methods("train_dflash"),
              version=5),  # 2: each row's anchors seeded by its own index, not by its micro-batch (a run setting)
              # 3: a draft-vocabulary head's reference export is exports/dflash-vllm (SGLang drops its head); 4: the
              # last step's training figures pool its micro-batches' blocks
    # DynaSpec: the drafter's head is clustered (no upstream: it reads only a model), the router learns from
    # the calibration set with the clustering, and compares itself with count's frequency shortlists.
    # 2: the clustering also records its head's digest rounded to float16 (a float16 load is compared with it)
    StageSpec("cluster", "jobs.cluster", "token_clusters", reads=(*TARGET_IDENTITY, "cluster"),
              models=_cluster_models, one_process=True, version=3),  # 3: zero rows out of k-means, dealt round
    # 2: the checkpoint chosen on half of the held-out chats, the routing curves measured on the others; shortlists
    # keep every id a decode stops at. 3: the last step's positive_clusters pools its micro-batches' positions
    StageSpec("train_router", "jobs.train_router", "cluster_router", upstream=("generate", "count", "cluster"),
              reads=(*TARGET_IDENTITY, "train_router"), models=_cluster_models,
              overrides={"generate": "train_router.calibration", "count": "train_router.counts",
                         "cluster": "train_router.clusters"}, version=3),
    # RDK: the target's moments on the calibration set, pruning levels from count's ranking; the held-out
    # analysis that picks tau runs evaluate's drafters, so they (and nothing else of evaluate) enter its id.
    StageSpec("estimate_rdk", "jobs.estimate_rdk", "rdk_affinity", upstream=("generate", "count"),
              # the α table's code prompts are cut as evaluate cuts its prompts
              reads=(*TARGET_IDENTITY, "target.dtype", "estimate_rdk", "evaluate.drafter", "evaluate.drafter_other",
                     "evaluate.max_prompt_tokens"),
              overrides={"generate": "estimate_rdk.calibration", "count": "estimate_rdk.counts"}, models=_rdk_models,
              data=_rdk_data, version=3),  # 2: τ and the prior weight chosen on some held-out chats, α on the others
              # 3: the vocabulary map takes the added token a tokenizer emits over a regular one with its bytes
    StageSpec("evaluate", "jobs.evaluate", "evaluation",
              upstream=EVALUATE_UPSTREAM,
              reads=(*TARGET_IDENTITY, "target.dtype", "generate.source", "generate.source_revision",
                     "generate.heldout_fraction", "evaluate"),
              overrides={"count": "evaluate.counts", "train_drafter": "evaluate.eagle3", "cluster": "evaluate.clusters",
                         "train_router": "evaluate.router", "estimate_rdk": "evaluate.rdk",
                         "train_dflash": "evaluate.dflash"},
              models=_evaluate_models, data=_evaluate_data,
              # count always (its shortlists, the draft-vocabulary bundle); the others only for the methods that read them
              when={stage: _read_by_methods(stage) for stage in EVALUATE_UPSTREAM if stage != "count"},
              # 2: the split as generate 2 draws it, no chat prompt also on the calibration side, the generation
              # config's end-of-turn ids end a decode, drafts after an accepted end of sequence not counted. 3:
              # DynaSpec/PA-FR shortlists keep every id a decode stops at; the eager path's warm-up. 4: a figure no row
              # measured is missing, not 0.0; the bundle records where it was timed; 5: an RDK row's MBSU charges its
              # redistribution; 6: verdicts on top; 7: every position's law checked, 8: also in id order; 9: a fixed
              one_process=True, version=10),  # budget: no k_min, PA evaluate.dynaspec_k_min. 10: *_ms_per_round
)
if tuple(s.name for s in STAGES) != STAGE_NAMES:  # the leaf list the config layer validates against
    raise RuntimeError(f"the DAG table's stages {[s.name for s in STAGES]} differ from {list(STAGE_NAMES)}")


def default_stages(cfg: PipelineConfig) -> tuple[str, ...]:
    """The stages a run without ``--stages`` covers: every stage but the opt-in ones ``cfg`` does not ask for."""
    return tuple(row.name for row in STAGES if row.opt_in is None or row.opt_in(cfg))


def spec(name: str) -> StageSpec:
    """The table row of stage ``name``."""
    for row in STAGES:
        if row.name == name:
            return row
    raise DrafterError(f"Unknown stage {name!r}.", expected=f"one of {list(STAGE_NAMES)}", found=name)


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for key in dotted.split("."):
        node = getattr(node, key)
    return node


def stage_identity(cfg: PipelineConfig, row: StageSpec) -> dict:
    """The config part of ``row``'s id: each path it reads, run settings left out."""
    return {path: identity(_get(cfg, path)) for path in row.reads}


@dataclass
class StagePlan:
    """What running one stage under a config means, known before it runs.

    Attributes:
        spec: The stage's table row.
        id: Its artifact id.
        config: The identity the id hashes (config fields that change the result, other models).
        fingerprint: The target fingerprint stamped on the artifact.
        inputs: Upstream stage → (artifact id, artifact directory).
        explicit: Upstream stages whose artifact the config names directly (not built by this plan).
        path: Where the artifact lives (or will).
    """

    spec: StageSpec
    id: str
    config: dict
    fingerprint: dict
    inputs: dict[str, tuple[str, Path]]
    explicit: frozenset[str]
    path: Path

    @property
    def cached(self) -> bool:
        """Whether the store holds this artifact under a sound manifest (a damaged one is rebuilt; payloads are
        re-hashed when the artifact is loaded), built from its inputs as they are now (one built from other contents
        of an input, rebuilt under its id since, is rebuilt too)."""
        try:
            manifest = stored_manifest(self.path, self.id)
        except DrafterError:
            return False
        now = {}
        for aid, path in self.inputs.values():
            try:
                now[aid] = content_digest(stored_manifest(path, aid))
            except DrafterError:
                continue  # not built yet (or damaged): built first, and the run compares again
        return not stale_inputs(manifest, now)

    def input(self, stage: str) -> Artifact:
        """The verified upstream artifact of ``stage`` (hashes and target fingerprint checked)."""
        aid, path = self.inputs[stage]
        if not (path / MANIFEST).is_file():
            raise DrafterError(
                f"Stage {self.spec.name} needs the {stage} artifact {aid}, which has not been built.",
                expected=f"{path}", found="no such artifact",
                fix=f"Run `drafter {self.spec.name}` (it builds missing upstream stages first) or "
                    f"`drafter run`.")
        artifact = load_artifact(path, kind=spec(stage).kind)
        if artifact.id != aid:
            raise DrafterError(f"{path} holds another {stage} artifact than the one planned.",
                               expected=f"id {aid}", found=f"id {artifact.id}",
                               fix=f"Delete {path} and rerun `drafter {self.spec.name}`.")
        check_fingerprint(artifact, self.fingerprint, f"The {stage} artifact")
        return artifact


@dataclass(frozen=True)
class KitPlan:
    """A tiny-model kit the config names: known from its recipe before it is built.

    Attributes:
        profile: Kit profile (``tiny:<profile>/<role>``).
        kit_hash: Content hash of its recipe.
        path: Where it is (or will be) cached.
        built: Whether it is in the cache already.
    """

    profile: str
    kit_hash: str
    path: Path
    built: bool

    def row(self) -> dict:
        """The ``drafter plan`` row: the kit is built before the first stage that loads a model."""
        return {"stage": "tiny kit", "artifact_id": f"{self.profile}-{self.kit_hash}",
                "status": "cached" if self.built else "to build", "inputs": {}, "path": str(self.path)}


def _kit_profiles(node: Any) -> set[str]:
    """Profiles of every ``tiny:<profile>/<role>`` reference anywhere in a (nested) config dict."""

    if isinstance(node, dict):
        return set().union(set(), *(_kit_profiles(v) for v in node.values()))
    if isinstance(node, list | tuple):
        return set().union(set(), *(_kit_profiles(v) for v in node))
    if isinstance(node, str) and node.startswith("tiny:"):
        return {parse_tiny_ref(node)[0]}
    return set()


def kits(cfg: PipelineConfig) -> list[KitPlan]:
    """The tiny kits ``cfg`` names, with their recipe hash and cache status (nothing is built)."""

    return [KitPlan(profile, digest, root, built)
            for profile in sorted(_kit_profiles(to_dict(cfg)))
            for root, digest, built in [kit_status(profile)]]


@dataclass
class Plan:
    """Every planned stage, in DAG order, and the tiny kits the config names."""

    stages: dict[str, StagePlan]
    kits: list[KitPlan] = field(default_factory=list)

    def __getitem__(self, name: str) -> StagePlan:
        return self.stages[name]

    @property
    def provisional(self) -> bool:
        """Whether a kit the config names is not built yet: a kit model's id then holds its recipe alone, and the
        ids change once the kit is built and its files name its weights (:func:`~pipeline.tiny.kit_weights`)."""
        return any(not kit.built for kit in self.kits)

    def needed(self, wanted: Iterable[str]) -> list[str]:
        """``wanted`` plus the upstream stages it must build (not cached, not named explicitly), in order."""
        need: set[str] = set()

        def visit(name: str) -> None:
            if name in need:
                return
            need.add(name)
            step = self.stages[name]
            for up in step.inputs:
                if up not in step.explicit and not self.stages[up].cached:
                    visit(up)

        for name in wanted:
            visit(name)
        return [name for name in self.stages if name in need]

    def table(self) -> list[dict]:
        """One row per stage for ``drafter plan``: id, cached or to run, inputs."""
        return [{"stage": name, "artifact_id": s.id, "status": "cached" if s.cached else "to run",
                 "inputs": {up: aid for up, (aid, _) in s.inputs.items()}, "path": str(s.path)}
                for name, s in self.stages.items()]


def plan(cfg: PipelineConfig, stages: Iterable[str] | None = None) -> Plan:
    """Compute the artifact id and cache status of ``stages`` (default: :func:`default_stages`) and their upstreams.

    Nothing runs and nothing is built: a tiny-kit model's fingerprint comes from its recipe, another
    model's tokenizer is loaded for its vocabulary hash, and manifests of explicitly named input artifacts
    are read. The settings of every planned stage are checked against the models they run on (context
    windows, EAGLE-3's trained draft steps: :mod:`pipeline.orchestration.limits`), so a length no model can
    hold is refused here, before any stage does work.

    Raises:
        DrafterError: An unknown stage, or a setting the models cannot hold (the message names the key).
    """

    wanted = list(stages) if stages is not None else list(default_stages(cfg))
    for name in wanted:
        spec(name)
    fingerprint = Target(cfg.target).fingerprint
    store = cfg.workdir_path / "artifacts"
    planned: dict[str, StagePlan] = {}

    def visit(name: str) -> StagePlan:
        if name in planned:
            return planned[name]
        row = spec(name)
        inputs: dict[str, tuple[str, Path]] = {}
        explicit = set()
        for up in row.upstream_of(cfg):
            named = _get(cfg, row.overrides[up]) if up in row.overrides else None
            if named:
                path = Path(named).expanduser().resolve()
                manifest = read_manifest(path, kind=spec(up).kind)
                inputs[up] = (manifest["id"], path)
                explicit.add(up)
            else:
                upstream = visit(up)
                inputs[up] = (upstream.id, upstream.path)
        config = stage_identity(cfg, row)
        if row.version > 1:  # version 1 leaves the id as it was before stages had versions
            config["stage_version"] = row.version
        if row.models is not None and (models := row.models(cfg)):
            config["models"] = models
        if row.data is not None:
            config["data"] = row.data(cfg)
        aid = artifact_id(name, config, [aid for aid, _ in inputs.values()], fingerprint)
        planned[name] = StagePlan(row, aid, config, fingerprint, inputs, frozenset(explicit), store / aid)
        return planned[name]

    for name in wanted:
        visit(name)
    check_settings(cfg, planned, fingerprint)
    if "evaluate" in planned:
        check_heldout(cfg, planned["evaluate"], planned, store)
    return Plan({name: planned[name] for name in STAGE_NAMES if name in planned}, kits(cfg))


def check_heldout(cfg: PipelineConfig, step: StagePlan, planned: dict[str, StagePlan], store: Path) -> None:
    """Refuse an evaluation whose prompts include conversations an artifact it reads by path was built from.

    A planned stage's calibration set is drawn by this config's ``generate`` section, so it leaves out exactly the
    conversations the evaluation decodes. An artifact named by path (``evaluate.eagle3=…``, ``count.calibration=…``)
    may come from another split: trained on everything outside a held-out fraction of 0.05, it would be scored on
    the prompts of a fraction of 0.2, three quarters of them seen in training, and the τ they inflate would be gated
    and registered. Held-out shares are nested (:func:`~pipeline.data.sources.split_heldout`), so an evaluation's
    fraction at most the calibration set's is sound. The calibration sets behind named artifacts are found through
    their manifests' inputs, beside the named artifact, in the ``lineage/`` of the bundle it was pulled in, or in this
    workdir's store; one found nowhere (a bundle registered before bundles carried their lineage) cannot be checked.

    Raises:
        DrafterError: An evaluated task's prompts overlap what a calibration set behind a named artifact kept.
    """
    gen, data = cfg.generate, step.config.get("data") or {}  # the contents, as the evaluation's id holds them
    tasks = {}  # task -> (its prompts' source as named, its content, the held-out fraction it keeps to or None: all)
    if "chat" in cfg.evaluate.tasks:
        tasks["chat"] = (gen.source, data.get("source"), gen.heldout_fraction)
    if "code" in cfg.evaluate.tasks:  # every HumanEval problem, or only the held-out ones where generate drew on them
        tasks["code"] = ("humaneval", data.get("code"), gen.heldout_fraction if holds_humaneval(gen.source) else None)
    for named, calibration in _named_calibrations(step, planned, store):
        drew = calibration["config"].get("generate") or {}
        kept_out = drew.get("heldout_fraction")
        then = (calibration["config"].get("data") or {}).get("source")
        if kept_out is None:
            continue
        for task, (source, now, fraction) in tasks.items():
            # the split hashes conversation ids, so a source named alike overlaps even if rows were added since
            if (drew.get("source") != source and (then is None or then != now)) or (
                    fraction is not None and fraction <= kept_out):
                continue
            raise DrafterError(
                f"The evaluation's {task} prompts include conversations {named} was built from.",
                expected=f"prompts from the share its calibration set {calibration['id']} held out: the same source "
                         f"with generate.heldout_fraction <= {kept_out}",
                found=(f"generate.heldout_fraction={fraction}" if fraction is not None
                       else f"every HumanEval problem, while {calibration['id']} was drawn from them "
                            f"(generate.source={drew.get('source')})"),
                fix=(f"Evaluate with generate.heldout_fraction={kept_out} (or less), or name artifacts built from the "
                     f"split you evaluate on." if fraction is not None else
                     f"Leave the code task out (evaluate.tasks=[chat]), or evaluate with generate.source=humaneval and "
                     f"generate.heldout_fraction <= {kept_out} so the code task keeps to the held-out problems."))


def _named_calibrations(step: StagePlan, planned: dict[str, StagePlan], store: Path) -> Iterator[tuple[Path, dict]]:
    """(named artifact, the manifest of a calibration set it was built from) for every artifact ``step`` reads by
    path, directly or through a planned upstream stage."""
    for up, (_, path) in step.inputs.items():
        if up in step.explicit:
            yield from ((path, calibration) for calibration in _calibrations_behind(path, store))
        elif up in planned:
            yield from _named_calibrations(planned[up], planned, store)


def _calibrations_behind(path: Path, store: Path) -> Iterator[dict]:
    """The manifests of the calibration sets artifact ``path`` was built from (itself, if it is one), found through
    its manifest's inputs (:func:`~pipeline.artifacts.upstream_manifests`: beside it, in the lineage of the bundle it
    came in, or in ``store``); one found nowhere is passed over (it cannot be checked)."""
    manifest = read_manifest(path)
    if manifest.get("stage") == "generate":
        yield manifest
        return
    yield from (found for _, found in upstream_manifests(path, store) if found.get("stage") == "generate")
