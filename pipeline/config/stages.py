"""One configuration section per stage (``generate``, ``count``, ``train_drafter``, ``cluster``, ``train_router``,
``estimate_rdk``, ``evaluate``; ``train_dflash``'s is in :mod:`pipeline.config.dflash`), each field documented below
it; :class:`~pipeline.config.sections.PipelineConfig` holds them beside the shared sections. Checks live in each
section's ``__post_init__`` so a bad value fails when the config is read, not an hour into a job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.config.method_names import DEFAULT_METHOD_NAMES, METHOD_NAMES
from pipeline.config.schema import check_devices, check_seed, check_value, input_override, run_setting
from pipeline.config.training import TrainConfig

MAX_GAMMA = 64
"""Longest draft length a config accepts. Position ``i`` of a draft is accepted with probability about
``alpha^i``: even at ``alpha = 0.9`` the 64th draft survives 0.1 % of rounds and γ = 64 already yields 99.9 %
of an unbounded draft's expected tokens (Leviathan et al. 2023, Eq. 1), while every round pays γ drafter
forwards. Longer drafts only cost; the context checks at plan time bound γ further."""


@dataclass
class GenerateConfig:
    kind: str = "target"
    """Calibration kind (VocabTrim): ``target`` (the target answers the prompts), ``raw`` (the dataset's
    own assistant turns, no generation) or ``drafter`` (the drafter named in ``drafter`` answers)."""
    source: str = "sharegpt"
    """Prompts: ``sharegpt`` / ``humaneval`` (packaged), a ShareGPT-format .json/.jsonl file, a
    ``datasets.save_to_disk`` directory, or a hub dataset id."""
    source_revision: str | None = None
    """Hub dataset sources only: the revision to load (a commit sha pins the data; null = main). It enters the
    id; a local file's sha256 and a saved dataset's ``datasets`` fingerprint enter it the same way, so changed
    data reruns generate and everything after it."""
    limit: int | None = 256
    """Use at most this many conversations (after the held-out split); null for all."""
    heldout_fraction: float = 0.05
    """Fraction of conversations (by id hash) kept out of calibration for the evaluate stage."""
    drafter: str | None = None
    """Model that answers when kind is ``drafter`` (hub id, path or tiny ref)."""
    max_prompt_tokens: int = 128
    """Prompts are cut to their first user turn and at most this many tokens: an overlong user turn keeps its start
    under the whole chat template (a system prompt that leaves no room is dropped). A value that leaves no room for
    the user's text under the template (its overhead, 12 tokens for the tiny kit's ChatML) is refused."""
    max_new_tokens: int = 96
    """Tokens generated per prompt (kind raw: a row keeps at most max_prompt_tokens + max_new_tokens tokens of the
    dataset's turns). max_prompt_tokens + max_new_tokens must fit the target's context (and the answering drafter's),
    checked at plan time, so no row is longer than it."""
    temperature: float = 0.8
    """Sampling temperature (0 for greedy). The answers' law is this temperature then ``top_p`` and nothing else
    (no top-k, no processor from the model's generation_config.json), the law ``evaluate`` decodes with."""
    top_p: float = 0.95
    """Nucleus sampling mass."""
    batch_size: int = 16
    """Prompts per generate() call (left padded, KV cache). Part of the artifact id: padding and the
    order in which a batch draws its random numbers change the sampled answers."""
    shard_size: int = 64
    """Prompts per shard. A shard is the unit of resume: each is written atomically when complete."""
    seed: int = 0
    """Base seed; shard i samples with seed + i, so results do not depend on the number of ranks."""
    accelerator: str = run_setting("auto")
    """Lightning accelerator (auto, cpu, gpu). A run setting: not part of the artifact id."""
    devices: int | str = run_setting("auto")
    """Lightning devices per node: auto, a count, or a list like "0,1". A run setting: shards are dealt
    to ranks round-robin and seeded per shard, so the rows do not depend on it."""
    num_nodes: int = run_setting(1)
    """Nodes in the job (Slurm: $SLURM_JOB_NUM_NODES); ranks = num_nodes x devices. A run setting."""
    collective_timeout: int = run_setting(1800)
    """Seconds a rank waits for its peers in one collective (the start-up rendezvous, the barrier after its
    shards) before it fails, ending the job instead of leaving it waiting on a dead or hung node. It must cover
    the imbalance of one shard between ranks. A run setting."""

    def __post_init__(self) -> None:
        check_value(self.kind in ("target", "raw", "drafter"), "generate.kind", "target, raw or drafter", self.kind)
        check_seed(self.seed, "generate.seed")
        check_devices(self.accelerator, self.devices, "generate")
        check_value(self.kind != "drafter" or bool(self.drafter), "generate.drafter",
               "a model when generate.kind is drafter", self.drafter)
        check_value(0 <= self.heldout_fraction < 1, "generate.heldout_fraction", "a number in [0, 1)",
               self.heldout_fraction)
        check_value(self.limit is None or self.limit > 0, "generate.limit", "a positive integer or null", self.limit)
        for key in ("max_prompt_tokens", "max_new_tokens", "batch_size", "shard_size"):
            check_value(getattr(self, key) > 0, f"generate.{key}", "a positive integer", getattr(self, key))
        check_value(self.num_nodes >= 1, "generate.num_nodes", "an integer >= 1", self.num_nodes)
        check_value(self.collective_timeout >= 1, "generate.collective_timeout", "seconds, an integer >= 1",
                    self.collective_timeout)
        check_value(math.isfinite(self.temperature) and self.temperature >= 0, "generate.temperature",
                    "a finite number >= 0", self.temperature)
        check_value(0 < self.top_p <= 1, "generate.top_p", "a number in (0, 1]", self.top_p)


@dataclass
class CountConfig:
    calibration: str | None = input_override()
    """Count this calibration artifact directory instead of the one ``generate`` builds for this config
    (its artifact id, not this path, enters the count id)."""
    top_k: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    """Shortlists of the k most frequent tokens (FR-Spec), one per k."""
    top_p: list[float] = field(default_factory=lambda: [0.9, 0.95, 0.99])
    """Shortlists of the fewest tokens covering this share of the counted mass (VocabTrim)."""
    min_count: list[int] = field(default_factory=lambda: [2])
    """Shortlists of every token seen at least this often."""
    draft_vocab_size: int = 1024
    """Size of the EAGLE-3 draft vocabulary written as d2t/t2d and as the SGLang token map."""
    always_include_special: bool = True
    """Add the tokenizer's special tokens (EOS above all) and every id an answer ends at (the generation config's
    end-of-turn ids too) to every shortlist: a drafter that can never propose EOS never lets a sequence end early."""
    workers: int = run_setting(2)
    """Processes for the map step over shards (1 = in-process). A run setting: counts are exact."""

    def __post_init__(self) -> None:
        check_value(all(k > 0 for k in self.top_k), "count.top_k", "positive integers", self.top_k)
        check_value(all(0 < p <= 1 for p in self.top_p), "count.top_p", "numbers in (0, 1]", self.top_p)
        check_value(all(c > 0 for c in self.min_count), "count.min_count", "positive integers", self.min_count)
        check_value(self.draft_vocab_size > 0, "count.draft_vocab_size", "a positive integer", self.draft_vocab_size)
        check_value(self.workers >= 1, "count.workers", "an integer >= 1", self.workers)

    def shortlist_names(self) -> list[str]:
        """The names of the shortlists these rules build (``top_k_<k>``, ``top_p_<p>``, ``min_count_<c>``), as
        ``evaluate.shortlists`` and ``evaluate.dynaspec_match`` name them."""
        return ([f"top_k_{k}" for k in self.top_k] + [top_p_name(p) for p in self.top_p]
                + [f"min_count_{c}" for c in self.min_count])


def top_p_name(p: float) -> str:
    """``top_p_<p>``: ``p`` in 6 significant digits (``top_p_0.95``), or in full where those would name another
    mass (``top_p_0.9999991`` and ``top_p_0.9999992`` were one shortlist, the second overwriting the first)."""
    short = f"{p:g}"
    return f"top_p_{short if float(short) == p else repr(float(p))}"


def _drafter_training() -> TrainConfig:
    # EAGLE-3's recipe (AdamW 0.9/0.95, grad clip 0.5, ZeRO-2) with a learning rate for a freshly
    # initialised head; checkpoint choice by simulated tau every 100 steps.
    return TrainConfig(lr=3e-4, warmup_steps=50, global_batch_size=16, micro_batch_size=4, eval_every=100,
                       checkpoint_every=100)


@dataclass
class TrainDrafterConfig:
    calibration: str | None = input_override()
    """Train on this calibration artifact directory instead of the one ``generate`` builds for this config
    (its artifact id, not this path, enters the train_drafter id)."""
    counts: str | None = input_override()
    """Take the draft vocabulary (d2t/t2d) from this count artifact directory instead of the one ``count``
    builds for this config."""
    aux_layer_ids: list[int] | None = None
    """Target feature layers (low, mid, high) as indices into HF output_hidden_states (0 = embeddings,
    i = input of layer i). null: EAGLE-3's (2, L//2, L-3) for L >= 7 layers, spread over 0..L-1 for shallower
    targets. SGLang's eagle_aux_hidden_state_layer_ids in the export are these minus one."""
    ttt_steps: int = 7
    """Unrolled steps of the training-time test (EAGLE-3: 7)."""
    ttt_decay: float = 0.8
    """Weight decay^s of unrolled step s in the loss."""
    max_length: int = 256
    """Tokens kept per calibration row (prompt first, then the answer). At most the target's context (checked at
    plan time): the target computes the features of every kept position. 256 is the default tiny target's."""
    eval_fraction: float = 0.05
    """Share of calibration conversations (by id hash) held out to score checkpoints by simulated tau."""
    eval_max_rows: int = 64
    """Most held-out rows scored per evaluation."""
    init_seed: int = 0
    """Seed of the drafter's initial weights."""
    head_init: str = "random"
    """How the head's ``lm_head`` and final ``norm`` start: ``random``, or ``target`` — the target's own output rows
    for the draft vocabulary and its final norm, so a step whose output resembles the target's last hidden state
    already scores like the target (Medusa and HASS start their heads this way); it learns far faster from few rows."""
    features: str = "online"
    """Where the target's features come from: ``online`` (the frozen target runs inside each training step,
    no disk) or ``cached`` (computed once into the staging directory; costs 4 x hidden x dtype bytes per
    token, printed before anything is written)."""
    features_disk_limit_gb: float = run_setting(200.0)
    """features=cached refuses to start when the cache would need more than this many GB (or more than the
    disk has free)."""
    train: TrainConfig = field(default_factory=_drafter_training)
    """Optimiser, schedule, batch, strategy (DeepSpeed ZeRO on GPUs, DDP or one process on CPU), checkpoints."""

    def __post_init__(self) -> None:
        check_value(self.ttt_steps >= 1, "train_drafter.ttt_steps", "an integer >= 1", self.ttt_steps)
        check_seed(self.init_seed, "train_drafter.init_seed")
        check_value(0 < self.ttt_decay <= 1, "train_drafter.ttt_decay", "a number in (0, 1]", self.ttt_decay)
        check_value(self.max_length >= self.ttt_steps + 2, "train_drafter.max_length",
                    f"at least ttt_steps + 2 = {self.ttt_steps + 2}", self.max_length)
        check_value(0 < self.eval_fraction < 1, "train_drafter.eval_fraction", "a number in (0, 1)",
                    self.eval_fraction)
        check_value(self.eval_max_rows >= 1, "train_drafter.eval_max_rows", "an integer >= 1", self.eval_max_rows)
        check_value(self.head_init in ("random", "target"), "train_drafter.head_init", "random or target",
                    self.head_init)
        check_value(self.features in ("online", "cached"), "train_drafter.features", "online or cached",
                    self.features)
        check_value(self.features_disk_limit_gb > 0, "train_drafter.features_disk_limit_gb", "a positive number",
                    self.features_disk_limit_gb)
        check_value(self.aux_layer_ids is None or len(self.aux_layer_ids) == 3, "train_drafter.aux_layer_ids",
                    "three layer indices or null", self.aux_layer_ids)


@dataclass
class ClusterConfig:
    drafter: str = "tiny:default/drafter"
    """The drafter whose LM head is clustered (DynaSpec routes over this head; evaluate.drafter must be it)."""
    clusters: int = 64
    """M, the number of token clusters (spherical k-means; sizes left unbalanced, DynaSpec §4.2)."""
    niter: int = 25
    """Lloyd iterations per k-means run."""
    redo: int = 3
    """Independent k-means runs; the one with the best objective is kept."""
    seed: int = 0
    """FAISS k-means seed (the clustering is a function of the head, M, niter, redo and this)."""
    max_points_per_centroid: int | None = None
    """Rows FAISS samples per centroid for training (null: every row; the final assignment always covers
    every token)."""
    device: str = run_setting("auto")
    """auto (FAISS-GPU when it sees a GPU), cpu or cuda. A run setting: the same k-means either way, though not bit
    for bit (the backends' floating point differs; tested: mean cosine to centroid within 1 %). The backend is in
    clusters.json; a router trained on one clustering refuses another (content hash), so a cluster artifact rebuilt
    on the other backend is never routed with silently."""

    def __post_init__(self) -> None:
        check_value(self.clusters >= 2, "cluster.clusters", "an integer >= 2", self.clusters)
        check_seed(self.seed, "cluster.seed")
        check_value(self.niter >= 1 and self.redo >= 1, "cluster.niter/redo", "integers >= 1", (self.niter, self.redo))
        check_value(self.device in ("auto", "cpu", "cuda"), "cluster.device", "auto, cpu or cuda", self.device)
        check_value(self.max_points_per_centroid is None or self.max_points_per_centroid >= 1,
                    "cluster.max_points_per_centroid", "a positive integer or null", self.max_points_per_centroid)


def _router_training() -> TrainConfig:
    return TrainConfig(lr=1e-3, warmup_steps=20, global_batch_size=16, micro_batch_size=16, epochs=4,
                       eval_every=50, checkpoint_every=50, schedule="cosine", min_lr_ratio=0.1)


@dataclass
class TrainRouterConfig:
    calibration: str | None = input_override()
    """Train on this calibration artifact directory instead of the one ``generate`` builds for this config."""
    counts: str | None = input_override()
    """Compare with the frequency shortlists of this count artifact instead of the one ``count`` builds."""
    clusters: str | None = input_override()
    """Route over this cluster artifact instead of the one ``cluster`` builds for this config."""
    top_l: int = 8
    """L: a cluster is a positive label at a position when it holds one of the full-vocabulary drafter's
    top-L tokens there (DynaSpec §4.2, training the router)."""
    hidden_size: int = 256
    """Width of the router's hidden layer (a 2-layer ReLU MLP on [E(x_t), h_(t-1)])."""
    max_length: int = 512
    """Tokens kept per calibration row."""
    eval_fraction: float = 0.05
    """Share of calibration conversations (by id hash) held out to score checkpoints and measure recall."""
    eval_max_rows: int = 64
    """Most held-out rows scored."""
    init_seed: int = 0
    """Seed of the router's initial weights."""
    train: TrainConfig = field(default_factory=_router_training)
    """Optimiser, schedule, batch, strategy and checkpoints (the shared harness; DeepSpeed on GPUs)."""

    def __post_init__(self) -> None:
        check_value(self.top_l >= 1, "train_router.top_l", "an integer >= 1", self.top_l)
        check_seed(self.init_seed, "train_router.init_seed")
        check_value(self.hidden_size >= 1, "train_router.hidden_size", "an integer >= 1", self.hidden_size)
        check_value(self.max_length >= 2, "train_router.max_length", "an integer >= 2", self.max_length)
        check_value(0 < self.eval_fraction < 1, "train_router.eval_fraction", "a number in (0, 1)",
                    self.eval_fraction)
        check_value(self.eval_max_rows >= 1, "train_router.eval_max_rows", "an integer >= 1", self.eval_max_rows)


def rdk_level_name(fraction: float) -> str:
    """``keep_0.025`` for 2.5 % of the vocabulary: the name of an estimate_rdk pruning level (its key in the artifact
    and the evaluated rows); :func:`pipeline.rdk.prior.level_name`."""
    return f"keep_{fraction:g}"


@dataclass
class EstimateRdkConfig:
    calibration: str | None = input_override()
    """Estimate on this calibration artifact directory instead of the one ``generate`` builds for this config."""
    counts: str | None = input_override()
    """Take the frequency ranking (pruning levels) from this count artifact instead of the one ``count`` builds."""
    top_k: int = 64
    """Entries of each target distribution kept for the sparse second moment S (the mass they cover is reported)."""
    max_length: int = 512
    """Tokens kept per calibration row."""
    batch_size: int = 8
    """Rows per target forward."""
    shard_rows: int = 64
    """Rows per saved partial sum: the unit a killed job resumes from and ranks split."""
    heldout_fraction: float = 0.05
    """Share of calibration conversations (by id hash) held out for the τ grid and the α table, never estimated on."""
    heldout_max_positions: int = 1024
    """Most held-out answer positions analysed, evenly spread over the held-out rows (τ and the prior weight chosen
    on the even-numbered chats' positions, α reported on the odd-numbered chats')."""
    code_problems: int = 16
    """HumanEval problems, taken from the end of the set (evaluate decodes the first ``evaluate.prompts_per_task``),
    whose canonical solutions as the assistant's answers give the code half of the α table: every kept set's
    chat-fitted τ and prior weights scored on code positions (at most ``heldout_max_positions``), nothing refitted
    (0: chat only)."""
    keep_fractions: list[float] = field(default_factory=lambda: [0.25, 0.1, 0.025, 0.0025])
    """FR pruning levels of the same-tokenizer drafter (evaluate.drafter): shares of the vocabulary kept (EOS and the
    other specials always added)."""
    taus: list[float] = field(default_factory=lambda: [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5])
    """The τ grid of RDK's affinity (Eq. 2); each kept set takes the τ with the best held-out α."""
    accelerator: str = run_setting("auto")
    """Lightning accelerator for the estimation pass (auto, cpu, gpu)."""
    devices: int | str = run_setting(1)
    """Lightning devices; ranks estimate disjoint shards and rank 0 adds their sums."""
    num_nodes: int = run_setting(1)
    """Nodes (Slurm)."""
    collective_timeout: int = run_setting(1800)
    """Seconds a rank waits for its peers in one collective before it fails (as ``generate.collective_timeout``)."""

    def __post_init__(self) -> None:
        check_value(self.top_k >= 1, "estimate_rdk.top_k", "an integer >= 1", self.top_k)
        check_devices(self.accelerator, self.devices, "estimate_rdk")
        check_value(self.max_length >= 2 and self.batch_size >= 1 and self.shard_rows >= 1,
                    "estimate_rdk.max_length/batch_size/shard_rows", "max_length >= 2, the others >= 1",
                    (self.max_length, self.batch_size, self.shard_rows))
        check_value(0 < self.heldout_fraction < 1, "estimate_rdk.heldout_fraction", "a number in (0, 1)",
                    self.heldout_fraction)
        check_value(self.heldout_max_positions >= 2, "estimate_rdk.heldout_max_positions", "an integer >= 2",
                    self.heldout_max_positions)
        check_value(self.code_problems >= 0, "estimate_rdk.code_problems", "an integer >= 0", self.code_problems)
        check_value(self.num_nodes >= 1, "estimate_rdk.num_nodes", "an integer >= 1", self.num_nodes)
        check_value(self.collective_timeout >= 1, "estimate_rdk.collective_timeout", "seconds, an integer >= 1",
                    self.collective_timeout)
        check_value(bool(self.keep_fractions) and all(0 < f <= 1 for f in self.keep_fractions),
                    "estimate_rdk.keep_fractions", "shares of the vocabulary in (0, 1]", self.keep_fractions)
        names = [rdk_level_name(f) for f in self.keep_fractions]
        clash = sorted({f for f in self.keep_fractions if names.count(rdk_level_name(f)) > 1})
        check_value(not clash, "estimate_rdk.keep_fractions", "distinct levels: fractions that differ in their first "
                    "6 significant digits (each level is named keep_<fraction>; these would be one level)", clash)
        check_value(bool(self.taus) and all(t > 0 for t in self.taus), "estimate_rdk.taus",
                    "positive temperatures (RDK Eq. 2 needs tau > 0)", self.taus)


EVAL_METHODS = METHOD_NAMES  # the registry (pipeline.engine.methods) checks itself against this list


@dataclass
class EvaluateConfig:
    tasks: list[str] = field(default_factory=lambda: ["chat", "code"])
    """Eval tasks: ``chat`` (held-out ShareGPT conversations, never used for calibration) and ``code``
    (HumanEval prompts)."""
    prompts_per_task: int = 8
    """Prompts decoded per task and method."""
    max_prompt_tokens: int = 128
    """Prompts are cut to this many tokens (template kept)."""
    max_new_tokens: int = 64
    """Tokens decoded per prompt. max_prompt_tokens + max_new_tokens + max(gammas) + 1 must fit the target's and
    the drafters' contexts (the byte drafter's in bytes), checked at plan time."""
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHOD_NAMES))
    """Speculative methods besides the autoregressive baseline: full (same-tokenizer drafter, full head),
    shortlist (its head cut to each shortlist below), pa_fr (position-aware frequency shortlist), dynaspec /
    dynaspec_pa (router-chosen clusters, fixed / Eq. 3 budget; need cluster and train_router), eagle3 (needs
    train_drafter), tli, union, slem (different-tokenizer drafter); pruned / rdk / rdk_taylor / rdk_prior (the
    same-tokenizer drafter pruned to each estimate_rdk level, without and with RDK redistribution) and tli_rdk /
    tli_rdk_taylor / tli_rdk_prior (the different-tokenizer drafter, TLI then RDK; all need estimate_rdk); slrs
    (string-level rejection sampling, Alg. 3) and slem_bytes (its exact-match baseline) with the byte-level
    drafter; dflash (the DFlash block drafter of train_dflash) is opt-in: not in the default list, evaluated (and
    train_dflash run) only when named here."""
    gammas: list[int] = field(default_factory=lambda: [4])
    """Draft lengths to try (each a row of the matrix): 1 to 64, and with method eagle3 at most the drafter's
    train_drafter.ttt_steps, with dflash at most train_dflash.block_size - 1 (checked at plan time)."""
    drafter: str = "tiny:default/drafter"
    """Drafter sharing the target's tokenizer (full head and shortlists)."""
    drafter_other: str | None = "tiny:default/drafter_other"
    """Drafter with a different tokenizer (TLI, Union, SLEM); null to skip those methods."""
    drafter_bytes: str | None = "tiny:default/drafter_bytes"
    """Byte-level drafter (a vocabulary of the 256 single bytes plus specials) for slrs and slem_bytes; null
    to skip those methods."""
    slrs_byte_top_k: int = 4
    """SLRS drafting law: bytes kept per draw (the string trie's branching factor; Alg. 3 with exact psi)."""
    slrs_lookahead: int = 4
    """SLRS bytes per drafted string (the trie's depth, §3.4); slem_bytes drafts as many bytes per target token.
    byte_top_k ** lookahead strings are enumerated per drafted token (at most 65,536)."""
    shortlists: list[str] = field(default_factory=lambda: ["top_k_128", "top_k_256", "top_k_512", "top_k_1024"])
    """Shortlists from the ``count`` artifact to evaluate, by name (``top_k_<k>``, ``top_p_<p>``, ...)."""
    counts: str | None = input_override()
    """Use this count artifact directory instead of the one ``count`` builds for this config (its
    artifact id, not this path, enters the evaluate id)."""
    eagle3: str | None = input_override()
    """Use this train_drafter artifact directory (an EAGLE-3 drafter) for method ``eagle3`` instead of the one
    ``train_drafter`` builds for this config (its artifact id, not this path, enters the evaluate id)."""
    dflash: str | None = input_override()
    """Use this train_dflash artifact directory (a DFlash drafter) for method ``dflash`` instead of the one
    ``train_dflash`` builds for this config."""
    rdk_levels: list[str] | None = None
    """estimate_rdk kept sets the same-tokenizer RDK rows (pruned, rdk, rdk_taylor, rdk_prior) decode with, by name
    (``keep_<fraction>``); null for every pruning level. The held-out α table covers every level either way."""
    rdk: str | None = input_override()
    """Use this estimate_rdk artifact directory for the RDK methods instead of the one ``estimate_rdk`` builds."""
    clusters: str | None = input_override()
    """Use this cluster artifact directory for the DynaSpec methods instead of the one ``cluster`` builds."""
    router: str | None = input_override()
    """Use this train_router artifact directory for the DynaSpec methods instead of the one ``train_router``
    builds (it must have been trained for the clustering used)."""
    dynaspec_match: str = "top_k_512"
    """The FR-Spec shortlist whose size the DynaSpec-F, DynaSpec-PA and PA-FR rows match on average over each
    γ's draft positions (budgets chosen from the router's held-out size curve; sizes measured and reported)."""
    dynaspec_k_min: int = 1
    """Floor of the position-aware budgets (Eq. 3 and PA-FR reach 0 at late positions otherwise)."""
    temperature: float = 0.0
    """Decoding temperature for the metrics (0 = greedy). Greedy equality with autoregressive decoding
    is checked on every prompt whatever this is."""
    top_p: float = 1.0
    """Nucleus mass for sampled decoding (applied to both p and q)."""
    sampling_check_samples: int = 400
    """Draws of the first emitted token per method, under the law the rows decode with (temperature and top_p; at
    temperature 1 when they decode greedily), compared with the target's p by a chi-square test (0 disables; too few
    draws for two bins fail the check)."""
    law_check_generations: int = 8
    """Sampled generations per method (the tasks' prompts in turn, ``max_new_tokens`` each, at the largest γ) whose
    every emitted position is tested against the target's law there, under the first-token check's law: per offset in
    the round and in the order of the method's q over p (pipeline/evaluation/position_law.py; 0 disables)."""
    sampling_check_alpha: float = 1e-4
    """The sampling checks fail when a chi-square p-value falls below this, and the every-position check when any of
    its statistics does below this share of it (family-wise)."""
    tie_tolerance: float = 1e-4
    """A greedy mismatch counts as a floating-point tie (not a losslessness failure) only when the target's
    two candidate logits at the divergence differ by at most this, relative to the largest logit. Batched
    verification and one-token decoding round differently; 0 demands bit-exact agreement."""
    device: str = "auto"
    """Where to decode: auto (CUDA when present), cpu or cuda. Unlike generate's devices this is part of
    the evaluate id: timings, and with gate_speed_metric=auto the gate itself, depend on the device."""
    decode_path: str = "auto"
    """How decoding runs: eager (a growing KV cache, shapes as fed), static (preallocated KV caches, fixed-shape
    forwards, at most one device-to-host read per round), graphs (static, each forward a CUDA graph; CUDA only), or
    auto (graphs on CUDA, eager on a CPU). Greedy outputs are the same on every path; it is part of the evaluate
    id because timings, and on CUDA the speed gate, depend on it."""
    first_token: str = "round"
    """Where each speculative generation's first new token comes from: round (the first drafting round drafts it
    after a prefill of the prompt but its last token) or prefill (the target's prefill emits it, and the first round
    drafts after it: the order of vLLM, SGLang and EAGLE's reference code). τ counts only the rounds' tokens, so with
    prefill it is measured as those engines report it. Both are lossless; it is part of the evaluate id."""
    seed: int = 0
    """Seed for sampled decoding and the sampling check."""
    gate_tau_min: float = 1.3
    """Gate: the registered configuration's mean accepted length tau must reach this."""
    gate_speed_metric: str = "auto"
    """Gate metric: speedup (measured wall-clock, meaningful on GPU), mbsu (memory-bound speedup, the
    CPU proxy), or auto (speedup on CUDA, mbsu on CPU)."""
    gate_speed_min: float = 1.0
    """Gate: the speed metric of the registered configuration must reach this."""
    primary_metric: str = "auto"
    """Metric that decides whether a new version beats the champion (higher wins); auto = the gate's
    speed metric."""
    register: bool = run_setting(True)
    """Register a bundle that passes its gates in the MLflow Model Registry (what to do with the
    result, not part of it: a run setting)."""
    promote: bool = run_setting(False)
    """Move alias ``champion`` to the new version even if it does not beat the current champion (a
    run setting)."""

    def __post_init__(self) -> None:
        check_seed(self.seed, "evaluate.seed")
        # τ >= 1 and the speed metrics >= 0 by construction: a threshold below either is a typo, not a gate
        check_value(math.isfinite(self.gate_tau_min) and self.gate_tau_min >= 1, "evaluate.gate_tau_min",
                    "a number >= 1 (a mean accepted length is at least 1)", self.gate_tau_min)
        check_value(math.isfinite(self.gate_speed_min) and self.gate_speed_min >= 0, "evaluate.gate_speed_min",
                    "a number >= 0", self.gate_speed_min)
        check_value(set(self.tasks) <= {"chat", "code"} and bool(self.tasks), "evaluate.tasks",
               "a non-empty subset of [chat, code]", self.tasks)
        check_value(set(self.methods) <= set(EVAL_METHODS), "evaluate.methods", f"a subset of {list(EVAL_METHODS)}",
               self.methods)
        check_value(bool(self.gammas) and all(1 <= g <= MAX_GAMMA for g in self.gammas), "evaluate.gammas",
               f"draft lengths from 1 (gamma = 0 drafts nothing) to {MAX_GAMMA} (see pipeline.config.stages.MAX_GAMMA)",
               self.gammas)
        for key in ("prompts_per_task", "max_prompt_tokens", "max_new_tokens"):
            check_value(getattr(self, key) > 0, f"evaluate.{key}", "a positive integer", getattr(self, key))
        check_value(self.sampling_check_samples >= 0, "evaluate.sampling_check_samples", "an integer >= 0",
               self.sampling_check_samples)
        check_value(self.law_check_generations >= 0, "evaluate.law_check_generations", "an integer >= 0",
                    self.law_check_generations)
        check_value(math.isfinite(self.temperature) and self.temperature >= 0, "evaluate.temperature",
                    "a finite number >= 0", self.temperature)
        check_value(0 < self.top_p <= 1, "evaluate.top_p", "a number in (0, 1]", self.top_p)
        # either out of range makes a losslessness gate that cannot fail
        check_value(0 < self.sampling_check_alpha < 0.5, "evaluate.sampling_check_alpha",
                    "a p-value threshold in (0, 0.5) (at 0 or below no chi-square test fails)", self.sampling_check_alpha)
        check_value(0 <= self.tie_tolerance <= 1e-2, "evaluate.tie_tolerance",
                    "a relative logit gap in [0, 0.01] (floating-point rounding; a larger one calls real greedy "
                    "mismatches ties)", self.tie_tolerance)
        check_value(self.device in ("auto", "cpu", "cuda"), "evaluate.device", "auto, cpu or cuda", self.device)
        check_value(self.decode_path in ("auto", "eager", "static", "graphs"), "evaluate.decode_path",
                    "auto, eager, static or graphs", self.decode_path)
        check_value(not (self.decode_path == "graphs" and self.device == "cpu"), "evaluate.decode_path",
                    "graphs only with a CUDA device (evaluate.device auto or cuda)", "graphs with evaluate.device=cpu")
        check_value(self.first_token in ("round", "prefill"), "evaluate.first_token", "round or prefill",
                    self.first_token)
        check_value(self.gate_speed_metric in ("auto", "speedup", "mbsu"), "evaluate.gate_speed_metric",
               "auto, speedup or mbsu", self.gate_speed_metric)
        check_value(self.primary_metric in ("auto", "tau", "speedup", "mbsu"), "evaluate.primary_metric",
               "auto, tau, speedup or mbsu", self.primary_metric)
        check_value(self.dynaspec_k_min >= 1, "evaluate.dynaspec_k_min", "an integer >= 1", self.dynaspec_k_min)
        for key in ("slrs_byte_top_k", "slrs_lookahead"):
            check_value(getattr(self, key) >= 1, f"evaluate.{key}", "an integer >= 1", getattr(self, key))
        check_value(self.slrs_byte_top_k**self.slrs_lookahead <= 1 << 16, "evaluate.slrs_byte_top_k",
                    "byte_top_k ** lookahead <= 65536 (the SLRS trie is enumerated per drafted token)",
                    f"{self.slrs_byte_top_k} ** {self.slrs_lookahead}")
