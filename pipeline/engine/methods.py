"""The method registry: one :class:`MethodSpec` per draft method, and the only module that names one.

A spec pairs what a method *is* (family, the typed inputs of :mod:`pipeline.engine.inputs` it is built from — which
say the drafter model it loads and the upstream stages it reads —, its report sections and place, the bundle it is
gated in) with how it is *built* (its proposer factory). Everything that used to keep a list of method names reads it
instead: the DAG (which upstream stages and models ``evaluate`` needs), the config (which names ``evaluate.methods``
accepts), the evaluator (how each configuration is prepared), the report (row order, sections), the gates and their
bundles (:data:`GATE_SETS`), the CLI summary and the plan-time checks. Adding a method is its proposer module, one
entry in :data:`METHODS` and its name in :mod:`pipeline.config.method_names` (README, "Adding a method").

Importing this module is light (no torch): the config layer keeps its own torch-free :data:`METHOD_NAMES`, which this
module checks its registry against at import, and each factory imports the engine only when it builds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from pipeline.config.method_names import METHOD_NAMES, OPT_IN_METHOD_NAMES
from pipeline.engine.inputs import (
    BlockFeatureInputs,
    ByteInputs,
    CrossRDKInputs,
    CrossVocabInputs,
    FeatureInputs,
    FrequencyInputs,
    OtherTokenizerInputs,
    RDKInputs,
    RoutedInputs,
    SameTokenizerInputs,
    ShortlistInputs,
)
from pipeline.errors import DrafterError

if TYPE_CHECKING:
    from pipeline.engine.proposers import Proposer

BASELINE = "ar"
"""The autoregressive baseline's name in result rows (not a draft method: no spec, first in every table)."""

FAMILIES: tuple[str, ...] = (
    "same-tokenizer: full / shortlist",
    "same-tokenizer: routed (DynaSpec)",
    "features (EAGLE-3)",
    "cross-vocabulary",
    "RDK",
    "byte-level",
    "block features (DFlash)",
)
"""Method families, in report order: what a method drafts with and how its head is cut (plots colour by family)."""

SECTIONS: dict[str, str] = {
    "features": "EAGLE-3: train_drafter's simulated τ beside the measured τ",
    "matched_shortlists": "shortlists at matched size (DynaSpec, PA-FR, FR-Spec) against the full head",
    "out_of_vocabulary": "out-of-vocabulary drafting (RDK) beside its TLI baselines",
    "string_level": "string-level rejection sampling (SLRS) beside SLEM on the same byte drafter",
    "block_drafting": "DFlash (a block per drafter forward) beside EAGLE-3 (a forward per draft) at equal γ",
}
"""Report sections beyond the main table (every method is in that), by key: what each one shows."""

HEADLINE_METRICS: tuple[str, ...] = ("tau", "mbsu", "speedup")
"""Figures of a bundle's chosen configuration that ``drafter run`` prints in its summary."""

CONFIGURATIONS: tuple[str, ...] = ("named_shortlist", "per_gamma", "per_method")
"""What a bundle's candidate configurations can be (:attr:`GateSet.configurations`)."""


@dataclass(frozen=True)
class GateSet:
    """One bundle the evaluate stage gates and registers; its candidates are the methods whose spec names it.

    Attributes:
        name: The bundle kind (the registered model is ``drafter-<target>-<name>``).
        results_field: The :class:`~pipeline.evaluation.results.EvaluationResults` field holding its verdict.
        metric_prefix: MLflow metrics of its chosen configuration are ``<prefix>.<figure>``.
        passed_metric: The MLflow metric that records its verdict (1 passed, 0 failed).
        registration: The record written beside the evaluation artifact when it is registered.
        artifacts: Upstream stages whose artifacts the bundle holds (with the evaluation); it is decided only
            when evaluate read all of them.
        configurations: What a candidate configuration is: ``named_shortlist`` (a named shortlist × γ of its
            method; rows without a shortlist are not candidates), ``per_gamma`` (γ of one method: the last of
            its methods in registry order that was evaluated, else its first) or ``per_method`` (method ×
            kept set × γ over all its methods, named ``<method>:<kept set>``).
    """

    name: str
    results_field: str
    metric_prefix: str
    passed_metric: str
    registration: str
    artifacts: tuple[str, ...]
    configurations: str

    def __post_init__(self) -> None:
        if self.configurations not in CONFIGURATIONS:
            raise ValueError(f"bundle {self.name!r}: configurations {self.configurations!r} is not one of "
                             f"{CONFIGURATIONS}")

    def summary_metrics(self) -> tuple[str, ...]:
        """Its verdict and the headline figures of its chosen configuration, as MLflow metric names."""
        return (self.passed_metric, *(f"{self.metric_prefix}.{figure}" for figure in HEADLINE_METRICS))


GATE_SETS: dict[str, GateSet] = {
    gate.name: gate
    for gate in (
        GateSet("draft-vocab", "gates", "chosen", "gates_passed", "registration.json", ("count",), "named_shortlist"),
        GateSet("eagle3", "eagle3_gates", "eagle3", "eagle3_gates_passed", "registration-eagle3.json",
                ("train_drafter", "count"), "per_gamma"),
        GateSet("dynaspec", "dynaspec_gates", "dynaspec", "dynaspec_gates_passed", "registration-dynaspec.json",
                ("cluster", "train_router"), "per_gamma"),
        GateSet("rdk", "rdk_gates", "rdk", "rdk_gates_passed", "registration-rdk.json", ("estimate_rdk",),
                "per_method"),
        GateSet("dflash", "dflash_gates", "dflash", "dflash_gates_passed", "registration-dflash.json",
                ("train_dflash",), "per_gamma"),
    )
}
"""Every bundle, in registration and summary order: draft-vocab (count's shortlists) always, others if read."""
DRAFT_VOCAB = GATE_SETS["draft-vocab"]


@dataclass(frozen=True)
class MethodSpec:
    """One draft method.

    Attributes:
        name: The method's name in configs, result rows and reports.
        summary: One line for docs and error messages.
        family: One of :data:`FAMILIES` (the plots' colour).
        inputs: The inputs dataclass of :mod:`pipeline.engine.inputs` it is built from; its ``MODEL`` and
            ``STAGES`` are the drafter model it loads and the upstream stages it reads (see :attr:`model`,
            :attr:`stages`).
        build: Its proposer factory: builds the proposer from an ``inputs`` object.
        order: Its place in every table of the report (ascending; the baseline comes first).
        sections: Keys of :data:`SECTIONS` whose table lists it besides the main one.
        gates: The :data:`GATE_SETS` bundle it is a candidate of, or None.
        budget: For a method whose shortlist budget depends on γ: its label at γ (``kmax700``, ``k12``) from
            the evaluator's record of the matched budgets; None otherwise.
        opt_in: Evaluated only when ``evaluate.methods`` names it (not in the default list): for a method whose
            upstream stage would lengthen the default run (:data:`~pipeline.config.method_names.OPT_IN_METHOD_NAMES`).
    """

    name: str
    summary: str
    family: str
    inputs: type
    build: Callable[[Any], Proposer]
    order: int
    sections: frozenset[str] = frozenset()
    gates: str | None = None
    budget: Callable[[dict, int], str] | None = None
    opt_in: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"method {self.name!r}: family {self.family!r} is not one of {FAMILIES}")
        if not (hasattr(self.inputs, "MODEL") and hasattr(self.inputs, "STAGES")):
            raise ValueError(f"method {self.name!r}: inputs {self.inputs!r} is not an inputs dataclass of "
                             "pipeline.engine.inputs (it needs MODEL and STAGES)")
        if not self.sections <= set(SECTIONS):
            raise ValueError(f"method {self.name!r}: sections {sorted(self.sections - set(SECTIONS))} are not "
                             f"among {list(SECTIONS)}")
        if self.gates is not None and self.gates not in GATE_SETS:
            raise ValueError(f"method {self.name!r}: gate set {self.gates!r} is not one of {list(GATE_SETS)}")

    @property
    def model(self) -> str | None:
        """The ``evaluate`` config key of the drafter model it loads (None: its drafter is an artifact)."""
        return self.inputs.MODEL

    @property
    def stages(self) -> tuple[str, ...]:
        """Upstream stages whose artifacts it reads besides ``count``."""
        return self.inputs.STAGES


# --- proposer factories: each imports the engine when it builds ------------------------------------------


def _label(inputs: Any) -> dict[str, str]:
    return {} if inputs.name is None else {"name": inputs.name}


def _full(inputs: SameTokenizerInputs) -> Proposer:
    from pipeline.engine.proposers import FullHeadProposer  # deferred: pulls in torch

    return FullHeadProposer(inputs.drafter, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _shortlist(inputs: ShortlistInputs) -> Proposer:
    from pipeline.engine.proposers import ShortlistProposer  # deferred: pulls in torch

    return ShortlistProposer(inputs.drafter, inputs.shortlist, target_vocab_size=inputs.target_vocab_size,
                             **_label(inputs))


def _tli(inputs: CrossVocabInputs) -> Proposer:
    from pipeline.engine.hetero import TLIProposer  # deferred: pulls in torch

    return TLIProposer(inputs.drafter_other, inputs.drafter_other_tokenizer, inputs.target_tokenizer,
                       inputs.vocab_map, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _union(inputs: CrossVocabInputs) -> Proposer:
    from pipeline.engine.hetero import UnionProposer  # deferred: pulls in torch

    return UnionProposer(inputs.drafter_other, inputs.drafter_other_tokenizer, inputs.target_tokenizer,
                         inputs.vocab_map, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _slem(inputs: OtherTokenizerInputs) -> Proposer:
    from pipeline.engine.slem import SLEMProposer  # deferred: pulls in torch

    return SLEMProposer(inputs.drafter_other, inputs.drafter_other_tokenizer, inputs.target_tokenizer,
                        **_label(inputs))


def _slrs(inputs: ByteInputs) -> Proposer:
    from pipeline.engine.slrs import SLRSProposer  # deferred: pulls in torch

    return SLRSProposer(inputs.drafter_bytes, inputs.drafter_bytes_tokenizer, inputs.target_tokenizer,
                        byte_top_k=inputs.byte_top_k, lookahead=inputs.lookahead,
                        target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _slem_bytes(inputs: ByteInputs) -> Proposer:
    from pipeline.engine.slrs import ByteBudgetSLEMProposer  # deferred: pulls in torch

    return ByteBudgetSLEMProposer(inputs.drafter_bytes, inputs.drafter_bytes_tokenizer, inputs.target_tokenizer,
                                  bytes_per_token=inputs.lookahead, keep_specials=True, **_label(inputs))


def _eagle3(inputs: FeatureInputs) -> Proposer:
    from pipeline.engine.eagle3 import Eagle3Proposer  # deferred: pulls in torch

    return Eagle3Proposer(inputs.eagle3, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _dflash(inputs: BlockFeatureInputs) -> Proposer:
    from pipeline.engine.dflash import DFlashProposer  # deferred: pulls in torch

    return DFlashProposer(inputs.dflash, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _routed(budget: str) -> Callable[[RoutedInputs], Proposer]:
    """DynaSpec with the policy's ``fixed`` (DynaSpec-F) or ``pa`` (Eq. 3) cluster budget."""

    def build(inputs: RoutedInputs) -> Proposer:
        from pipeline.engine.dynaspec import RoutedShortlistProposer  # deferred: pulls in torch

        chosen = getattr(inputs.policy, budget)
        if chosen is None:
            raise DrafterError(f"The shortlist policy has no {budget} cluster budget.", expected="a ClusterBudget",
                               found="None", fix="Build the policy with match_budgets (evaluate does).")
        return RoutedShortlistProposer(inputs.drafter, inputs.clustering, inputs.router, chosen,
                                       keep_ids=inputs.policy.keep_ids, target_vocab_size=inputs.target_vocab_size,
                                       **_label(inputs))

    return build


def _pa_fr(inputs: FrequencyInputs) -> Proposer:
    from pipeline.engine.dynaspec import PositionAwareFrequencyProposer  # deferred: pulls in torch

    policy = inputs.policy
    if policy.ranking is None or policy.pa_fr_kmax is None:
        raise DrafterError("The shortlist policy has no frequency ranking or PA-FR budget.",
                           expected="ranking and pa_fr_kmax set", found="None",
                           fix="Take the ranking from the count artifact (evaluate does).")
    return PositionAwareFrequencyProposer(inputs.drafter, policy.ranking, policy.pa_fr_kmax, keep_ids=policy.keep_ids,
                                          k_min=policy.k_min, target_vocab_size=inputs.target_vocab_size,
                                          **_label(inputs))


def _pruned(inputs: RDKInputs) -> Proposer:
    from pipeline.engine.proposers import ShortlistProposer  # deferred: pulls in torch

    kept = inputs.prior.level(inputs.level).kept
    return ShortlistProposer(inputs.drafter, kept, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _redistributed(kind: str) -> Callable[[RDKInputs], Proposer]:
    """The pruned same-tokenizer drafter's drafts redistributed by the prior's ``kind`` (see RDKPrior.transform)."""

    def build(inputs: RDKInputs) -> Proposer:
        from pipeline.engine.rdk import RedistributedShortlistProposer  # deferred: pulls in torch

        return RedistributedShortlistProposer(inputs.drafter, inputs.prior.transform(kind, inputs.level),
                                              target_vocab_size=inputs.target_vocab_size, **_label(inputs))

    return build


def _redistributed_tli(kind: str) -> Callable[[CrossRDKInputs], Proposer]:
    """TLI onto ``T ∩ D``, then the prior's ``kind`` redistribution over its ``intersection`` kept set."""

    def build(inputs: CrossRDKInputs) -> Proposer:
        from pipeline.engine.rdk import RedistributedTLIProposer  # deferred: pulls in torch
        from pipeline.rdk.prior import INTERSECTION  # deferred: pulls in torch

        transform = inputs.prior.transform(kind, INTERSECTION)
        return RedistributedTLIProposer(inputs.drafter_other, inputs.drafter_other_tokenizer,
                                        inputs.target_tokenizer, inputs.vocab_map, transform,
                                        target_vocab_size=inputs.target_vocab_size, **_label(inputs))

    return build


# --- budget labels of the γ-dependent shortlists (from Evaluator.policy_record) --------------------------


def _pa_fr_budget(record: dict, gamma: int) -> str:
    return f"kmax{record['pa_fr_kmax'][str(gamma)]}"


def _fixed_budget(record: dict, gamma: int) -> str:
    return f"k{record['fixed'][str(gamma)]['k1']}"


def _pa_budget(record: dict, gamma: int) -> str:
    budget = record["pa"][str(gamma)]
    return f"k0_{budget['k0']}-k1_{budget['k1']}"


# --- the registry ----------------------------------------------------------------------------------------

_SAME, _ROUTED, _FEATURES, _CROSS, _RDK, _BYTE, _BLOCK = FAMILIES
_SHORTLISTS = frozenset({"matched_shortlists"})
_OOV = frozenset({"out_of_vocabulary"})
_RDK_EXACT = "exact sparse affinity M^T q' (RDK Alg. 1, Eq. 2)"
_RDK_TAYLOR = "first-order Taylor form with the calibration prior (RDK Eq. 3)"
_RDK_PRIOR = "rank-one affinity limit: q' mixed with the prior on out-of-vocabulary tokens"

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("full", "same-tokenizer drafter, full LM head", _SAME, SameTokenizerInputs, _full, 10,
                   _SHORTLISTS),
        MethodSpec("shortlist", "same-tokenizer drafter, LM head cut to a static shortlist (FR-Spec / VocabTrim)",
                   _SAME, ShortlistInputs, _shortlist, 20, _SHORTLISTS, gates="draft-vocab"),
        MethodSpec("dynaspec",
                   "same-tokenizer drafter, head on router-chosen clusters, fixed budget (DynaSpec-F, §4.2)",
                   _ROUTED, RoutedInputs, _routed("fixed"), 40, _SHORTLISTS, gates="dynaspec", budget=_fixed_budget),
        MethodSpec("dynaspec_pa",
                   "same-tokenizer drafter, head on router-chosen clusters, position-aware budget (DynaSpec Eq. 3)",
                   _ROUTED, RoutedInputs, _routed("pa"), 50, _SHORTLISTS, gates="dynaspec", budget=_pa_budget),
        MethodSpec("pa_fr", "same-tokenizer drafter, position-aware frequency shortlist (DynaSpec App. A.3)",
                   _SAME, FrequencyInputs, _pa_fr, 30, _SHORTLISTS, budget=_pa_fr_budget),
        MethodSpec("tli", "other-tokenizer drafter, token-level intersection (Timor et al. 2025, Alg. 4)",
                   _CROSS, CrossVocabInputs, _tli, 110, _OOV),
        MethodSpec("union", "other-tokenizer drafter, union-vocabulary baseline (Timor et al. 2025, Alg. 1)",
                   _CROSS, CrossVocabInputs, _union, 120),
        MethodSpec("slem", "other-tokenizer drafter, string-level exact match (Timor et al. 2025, Alg. 2)",
                   _CROSS, OtherTokenizerInputs, _slem, 130),
        MethodSpec("pruned",
                   "same-tokenizer drafter pruned to an RDK level's frequent tokens, TLI only (RDK's baseline)",
                   _RDK, RDKInputs, _pruned, 70, _OOV),
        MethodSpec("rdk", f"same-tokenizer drafter pruned to an RDK level, then {_RDK_EXACT}",
                   _RDK, RDKInputs, _redistributed("exact"), 80, _OOV, gates="rdk"),
        MethodSpec("rdk_taylor", f"same-tokenizer drafter pruned to an RDK level, then {_RDK_TAYLOR}",
                   _RDK, RDKInputs, _redistributed("taylor"), 90, _OOV, gates="rdk"),
        MethodSpec("rdk_prior", f"same-tokenizer drafter pruned to an RDK level, then {_RDK_PRIOR}",
                   _RDK, RDKInputs, _redistributed("prior_mix"), 100, _OOV, gates="rdk"),
        MethodSpec("tli_rdk", f"other-tokenizer drafter, TLI onto T∩D, then {_RDK_EXACT}",
                   _RDK, CrossRDKInputs, _redistributed_tli("exact"), 140, _OOV, gates="rdk"),
        MethodSpec("tli_rdk_taylor", f"other-tokenizer drafter, TLI onto T∩D, then {_RDK_TAYLOR}",
                   _RDK, CrossRDKInputs, _redistributed_tli("taylor"), 150, _OOV, gates="rdk"),
        MethodSpec("tli_rdk_prior", f"other-tokenizer drafter, TLI onto T∩D, then {_RDK_PRIOR}",
                   _RDK, CrossRDKInputs, _redistributed_tli("prior_mix"), 160, _OOV, gates="rdk"),
        MethodSpec("slrs",
                   "byte-level drafter, string-level rejection sampling with exact trie psi (Timor et al. 2025, Alg. 3)",
                   _BYTE, ByteInputs, _slrs, 180, frozenset({"string_level"})),
        MethodSpec("slem_bytes",
                   "byte-level drafter, string-level exact match with SLRS's byte budget (SLRS's baseline)",
                   _BYTE, ByteInputs, _slem_bytes, 170, frozenset({"string_level"})),
        MethodSpec("eagle3", "EAGLE-3 head on the target's low/mid/high features (Li et al. 2025)",
                   _FEATURES, FeatureInputs, _eagle3, 60, frozenset({"features", "block_drafting"}), gates="eagle3"),
        MethodSpec("dflash", "DFlash block drafter on the target's features: B - 1 drafts per forward (block diffusion)",
                   _BLOCK, BlockFeatureInputs, _dflash, 65, frozenset({"block_drafting"}), gates="dflash", opt_in=True),
    )
}
"""Every draft method. The order is the default ``evaluate.methods`` (so it enters the evaluate id: append,
do not reorder); the report orders by :attr:`MethodSpec.order`."""
if tuple(METHODS) != METHOD_NAMES:  # the leaf list the config layer validates evaluate.methods against
    raise RuntimeError(f"the method registry {list(METHODS)} differs from pipeline.config.method_names "
                       f"{list(METHOD_NAMES)}: add the new method's name there too")
if tuple(name for name, spec in METHODS.items() if spec.opt_in) != OPT_IN_METHOD_NAMES:
    raise RuntimeError(f"the registry's opt-in methods differ from pipeline.config.method_names.OPT_IN_METHOD_NAMES "
                       f"{list(OPT_IN_METHOD_NAMES)}: keep the two in step")
DECODE_BENCH: tuple[str, ...] = ("full", "dynaspec", "eagle3", "dflash")
"""What ``drafter bench decode`` times: one method per drafter family whose drafts stay on the device (a small
same-tokenizer drafter, a routed head, EAGLE-3, DFlash)."""
REPORT_ORDER: tuple[str, ...] = (BASELINE, *sorted(METHODS, key=lambda name: METHODS[name].order))
"""Row order of every report table: the baseline, then the methods by :attr:`MethodSpec.order`."""


def method_spec(method: str) -> MethodSpec:
    """The spec registered under ``method``.

    Raises:
        DrafterError: If no method has that name.
    """
    spec = METHODS.get(method)
    if spec is None:
        raise DrafterError(
            f"unknown draft method {method!r}",
            expected=f"one of {list(METHOD_NAMES)}",
            found=repr(method),
            fix="use a registered method name (pipeline.engine.methods.METHODS)",
        )
    return spec


def specs_of(methods: Iterable[str]) -> list[MethodSpec]:
    """The specs of ``methods`` (e.g. ``evaluate.methods``), in registry order.

    Raises:
        DrafterError: If a name is not registered.
    """
    wanted = {method_spec(name).name for name in methods}
    return [spec for name, spec in METHODS.items() if name in wanted]


def models_read(methods: Iterable[str]) -> frozenset[str]:
    """The ``evaluate`` drafter keys (``drafter``, ``drafter_other``, ``drafter_bytes``) ``methods`` load."""
    return frozenset(spec.model for spec in specs_of(methods) if spec.model is not None)


def stages_read(methods: Iterable[str]) -> frozenset[str]:
    """The upstream stages besides ``count`` whose artifacts ``methods`` read."""
    return frozenset(stage for spec in specs_of(methods) for stage in spec.stages)


def methods_reading(methods: Iterable[str], need: str) -> list[str]:
    """Those of ``methods`` that load drafter ``need`` or read upstream stage ``need``, in the given order (for
    messages)."""
    return [name for name in methods if need == method_spec(name).model or need in method_spec(name).stages]


def methods_with(inputs: type) -> tuple[str, ...]:
    """The methods built from ``inputs`` (an inputs dataclass), in report order."""
    return tuple(name for name in REPORT_ORDER if name in METHODS and METHODS[name].inputs is inputs)


def in_section(section: str) -> tuple[str, ...]:
    """The methods report section ``section`` lists, in report order."""
    if section not in SECTIONS:
        raise ValueError(f"unknown report section {section!r}: not one of {list(SECTIONS)}")
    return tuple(name for name in REPORT_ORDER if name in METHODS and section in METHODS[name].sections)


def gate_candidates(gate: GateSet, evaluated: Collection[str] | None = None) -> str | tuple[str, ...]:
    """What bundle ``gate`` chooses among: one method's name, or a tuple of them (``per_method``).

    Args:
        gate: The bundle.
        evaluated: The evaluated methods (``evaluate.methods``); None counts every method as evaluated.
    """
    members = tuple(name for name, spec in METHODS.items() if spec.gates == gate.name)
    if gate.configurations == "per_method":
        return members
    chosen = [name for name in members if evaluated is None or name in evaluated]
    return chosen[-1] if chosen else members[0]


def build_proposer(method: str, inputs: Any) -> Proposer:
    """Build the proposer for ``method`` from ``inputs``.

    Args:
        method: A name in :data:`METHODS`.
        inputs: An instance of the method's :attr:`MethodSpec.inputs` with every field set that has no default.

    Returns:
        The proposer, named ``inputs.name`` or else the method's name (its label in metrics).

    Raises:
        DrafterError: If the method is unknown, or ``inputs`` is of another family or leaves a field unset.
    """
    spec = method_spec(method)
    if not isinstance(inputs, spec.inputs):
        raise DrafterError(
            f"draft method {method!r} is built from {spec.inputs.__name__}, not {type(inputs).__name__}",
            expected=f"a {spec.inputs.__name__} ({', '.join(f.name for f in fields(spec.inputs))})",
            found=type(inputs).__name__,
            fix=f"build the inputs of its family ({spec.summary})",
        )
    missing = [f.name for f in fields(inputs)
               if f.default is MISSING and f.default_factory is MISSING and getattr(inputs, f.name) is None]
    if missing:
        raise DrafterError(
            f"draft method {method!r} is missing inputs",
            expected=f"{missing} set",
            found=f"{missing} unset",
            fix=f"load them before building it ({spec.summary})",
        )
    if inputs.name is None:
        inputs = replace(inputs, name=spec.name)  # every proposer the registry builds is labelled by its method
    return spec.build(inputs)
