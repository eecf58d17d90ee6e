"""The proposer registry: one table from a draft method's name to what it needs and how it is built.

Evaluation, benchmarks, configs and tests all choose a draft method by name; this module is the one
place that turns the name into a :class:`~pipeline.engine.proposers.Proposer`. Each
:class:`MethodSpec` names the inputs its builder reads (fields of :class:`ProposerInputs`), so a caller
loads only what the methods it runs need, and a missing input is refused with a message that names it.
Each spec also names its family (:data:`FAMILIES`), which the report's plots colour by.
Importing this module is light (no torch): the config layer reads :data:`METHOD_NAMES` from it, and
builders import the engine when they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from pipeline.errors import DrafterError

if TYPE_CHECKING:
    from pipeline.engine.proposers import Proposer


@dataclass(frozen=True)
class ProposerInputs:
    """Everything a builder may read; each method uses only the fields its :attr:`MethodSpec.needs` names.

    Attributes:
        drafter: A causal LM sharing the target's tokenizer (``full``, ``shortlist``).
        shortlist: 1-D tensor of target ids the shortlisted head keeps (``shortlist``).
        drafter_other: A causal LM with a tokenizer of its own (``tli``, ``union``, ``slem``).
        drafter_other_tokenizer: That drafter's tokenizer.
        drafter_bytes: A causal LM whose vocabulary is the 256 single bytes plus specials (``slrs``,
            ``slem_bytes``).
        drafter_bytes_tokenizer: Its tokenizer.
        byte_top_k: SLRS's bytes kept per draw (the string trie's branching factor).
        lookahead: SLRS's bytes per drafted string; ``slem_bytes`` drafts as many bytes per target token.
        target_tokenizer: The target's tokenizer.
        vocab_map: ``VocabMap.build(target_tokenizer, drafter_other_tokenizer)`` (``tli``, ``union``).
        eagle3: A :class:`~pipeline.drafters.eagle3.Eagle3Drafter` trained for this target, on the target's
            device (it holds the target's embedding by reference) (``eagle3``).
        clustering: The :class:`~pipeline.dynaspec.clusters.Clustering` of ``drafter``'s LM head (``dynaspec``,
            ``dynaspec_pa``).
        router: A :class:`~pipeline.dynaspec.router.Router` trained for that clustering (``dynaspec``,
            ``dynaspec_pa``).
        policy: A :class:`~pipeline.dynaspec.budget.ShortlistPolicy`: budgets, kept tokens, frequency ranking
            (``dynaspec``, ``dynaspec_pa``, ``pa_fr``).
        rdk: An :class:`~pipeline.rdk.prior.RDKPrior` (an ``estimate_rdk`` artifact) for this target (``pruned``,
            ``rdk*``, ``tli_rdk*``).
        rdk_level: Its kept set a same-tokenizer method drafts over (``keep_<fraction>``; ``pruned``, ``rdk*``).
        target_vocab_size: The target's logit width (``q``'s width); ``None`` lets each proposer infer it.
        name: Label for metrics and reports; ``None`` keeps the proposer's default.
    """

    drafter: Any = None
    shortlist: Any = None
    drafter_other: Any = None
    drafter_other_tokenizer: Any = None
    drafter_bytes: Any = None
    drafter_bytes_tokenizer: Any = None
    byte_top_k: int = 4
    lookahead: int = 4
    target_tokenizer: Any = None
    vocab_map: Any = None
    eagle3: Any = None
    clustering: Any = None
    router: Any = None
    policy: Any = None
    rdk: Any = None
    rdk_level: str | None = None
    target_vocab_size: int | None = None
    name: str | None = None


FAMILIES: tuple[str, ...] = (
    "same-tokenizer: full / shortlist",
    "same-tokenizer: routed (DynaSpec)",
    "features (EAGLE-3)",
    "cross-vocabulary",
    "RDK",
    "byte-level",
)
"""Method families, in report order: what a method drafts with and how its head is cut. Plots colour by
family and tell a family's methods (its variants) apart by marker."""


@dataclass(frozen=True)
class MethodSpec:
    """One draft method.

    Attributes:
        name: The method's name in configs and reports.
        needs: Fields of :class:`ProposerInputs` the builder reads (each must be set).
        build: Builds the proposer from the inputs.
        summary: One line for docs and error messages.
        family: One of :data:`FAMILIES`.
    """

    name: str
    needs: frozenset[str]
    build: Callable[[ProposerInputs], Proposer]
    summary: str
    family: str

    def __post_init__(self) -> None:
        unknown = self.needs - {f.name for f in fields(ProposerInputs)}
        if unknown:
            raise ValueError(f"method {self.name!r} needs unknown inputs {sorted(unknown)}")
        if self.family not in FAMILIES:
            raise ValueError(f"method {self.name!r}: family {self.family!r} is not one of {FAMILIES}")

    @property
    def same_tokenizer(self) -> bool:
        """Whether the method drafts with the drafter that shares the target's tokenizer."""
        return "drafter" in self.needs


def _label(inputs: ProposerInputs) -> dict[str, str]:
    return {} if inputs.name is None else {"name": inputs.name}


def _full(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.proposers import FullHeadProposer

    return FullHeadProposer(inputs.drafter, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _shortlist(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.proposers import ShortlistProposer

    return ShortlistProposer(
        inputs.drafter, inputs.shortlist, target_vocab_size=inputs.target_vocab_size, **_label(inputs)
    )


def _mapped(kind: str) -> Callable[[ProposerInputs], Proposer]:
    def build(inputs: ProposerInputs) -> Proposer:
        from pipeline.engine import hetero

        cls = hetero.TLIProposer if kind == "tli" else hetero.UnionProposer
        return cls(
            inputs.drafter_other,
            inputs.drafter_other_tokenizer,
            inputs.target_tokenizer,
            inputs.vocab_map,
            target_vocab_size=inputs.target_vocab_size,
            **_label(inputs),
        )

    return build


def _slem(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.slem import SLEMProposer

    return SLEMProposer(
        inputs.drafter_other, inputs.drafter_other_tokenizer, inputs.target_tokenizer, **_label(inputs)
    )


def _slrs(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.slrs import SLRSProposer

    return SLRSProposer(inputs.drafter_bytes, inputs.drafter_bytes_tokenizer, inputs.target_tokenizer,
                        byte_top_k=inputs.byte_top_k, lookahead=inputs.lookahead,
                        target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _slem_bytes(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.slrs import ByteBudgetSLEMProposer

    return ByteBudgetSLEMProposer(inputs.drafter_bytes, inputs.drafter_bytes_tokenizer, inputs.target_tokenizer,
                                  bytes_per_token=inputs.lookahead, keep_specials=True, **_label(inputs))


def _eagle3(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.eagle3 import Eagle3Proposer

    return Eagle3Proposer(inputs.eagle3, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _routed(kind: str) -> Callable[[ProposerInputs], Proposer]:
    def build(inputs: ProposerInputs) -> Proposer:
        from pipeline.engine.dynaspec import RoutedShortlistProposer

        policy = inputs.policy
        budget = policy.fixed if kind == "fixed" else policy.pa
        if budget is None:
            raise DrafterError(f"The shortlist policy has no {kind} cluster budget.", expected="a ClusterBudget",
                               found="None", fix="Build the policy with match_budgets (evaluate does).")
        return RoutedShortlistProposer(inputs.drafter, inputs.clustering, inputs.router, budget,
                                       keep_ids=policy.keep_ids, target_vocab_size=inputs.target_vocab_size,
                                       **_label(inputs))

    return build


def _pa_fr(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.dynaspec import PositionAwareFrequencyProposer

    policy = inputs.policy
    if policy.ranking is None or policy.pa_fr_kmax is None:
        raise DrafterError("The shortlist policy has no frequency ranking or PA-FR budget.",
                           expected="ranking and pa_fr_kmax set", found="None",
                           fix="Take the ranking from the count artifact (evaluate does).")
    return PositionAwareFrequencyProposer(inputs.drafter, policy.ranking, policy.pa_fr_kmax, keep_ids=policy.keep_ids,
                                          k_min=policy.k_min, target_vocab_size=inputs.target_vocab_size,
                                          **_label(inputs))


def _pruned(inputs: ProposerInputs) -> Proposer:
    from pipeline.engine.proposers import ShortlistProposer

    kept = inputs.rdk.level(inputs.rdk_level).kept
    return ShortlistProposer(inputs.drafter, kept, target_vocab_size=inputs.target_vocab_size, **_label(inputs))


def _redistributed(kind: str, other: bool) -> Callable[[ProposerInputs], Proposer]:
    def build(inputs: ProposerInputs) -> Proposer:
        from pipeline.engine import rdk
        from pipeline.rdk.prior import INTERSECTION

        if other:
            return rdk.RedistributedTLIProposer(
                inputs.drafter_other, inputs.drafter_other_tokenizer, inputs.target_tokenizer, inputs.vocab_map,
                inputs.rdk.transform(kind, INTERSECTION), target_vocab_size=inputs.target_vocab_size,
                **_label(inputs))
        return rdk.RedistributedShortlistProposer(inputs.drafter, inputs.rdk.transform(kind, inputs.rdk_level),
                                                  target_vocab_size=inputs.target_vocab_size, **_label(inputs))

    return build


_RDK_SUMMARY = {"rdk": "exact sparse affinity M^T q' (RDK Alg. 1, Eq. 2)",
                "rdk_taylor": "first-order Taylor form with the calibration prior (RDK Eq. 3)",
                "rdk_prior": "rank-one affinity limit: q' mixed with the prior on out-of-vocabulary tokens"}
_PRUNED = frozenset({"drafter", "rdk", "rdk_level"})
_ROUTED = frozenset({"drafter", "clustering", "router", "policy"})
_OTHER = frozenset({"drafter_other", "drafter_other_tokenizer", "target_tokenizer"})
_BYTES = frozenset({"drafter_bytes", "drafter_bytes_tokenizer", "target_tokenizer"})

_SAME, _ROUTED_FAMILY, _FEATURES, _CROSS, _RDK, _BYTE = FAMILIES

METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec("full", frozenset({"drafter"}), _full, "same-tokenizer drafter, full LM head", _SAME),
        MethodSpec(
            "shortlist",
            frozenset({"drafter", "shortlist"}),
            _shortlist,
            "same-tokenizer drafter, LM head cut to a static shortlist (FR-Spec / VocabTrim)",
            _SAME,
        ),
        MethodSpec("dynaspec", _ROUTED, _routed("fixed"),
                   "same-tokenizer drafter, head on router-chosen clusters, fixed budget (DynaSpec-F, §4.2)",
                   _ROUTED_FAMILY),
        MethodSpec("dynaspec_pa", _ROUTED, _routed("pa"),
                   "same-tokenizer drafter, head on router-chosen clusters, position-aware budget (DynaSpec Eq. 3)",
                   _ROUTED_FAMILY),
        MethodSpec("pa_fr", frozenset({"drafter", "policy"}), _pa_fr,
                   "same-tokenizer drafter, position-aware frequency shortlist (DynaSpec App. A.3)", _SAME),
        MethodSpec(
            "tli",
            _OTHER | {"vocab_map"},
            _mapped("tli"),
            "other-tokenizer drafter, token-level intersection (Timor et al. 2025, Alg. 4)",
            _CROSS,
        ),
        MethodSpec(
            "union",
            _OTHER | {"vocab_map"},
            _mapped("union"),
            "other-tokenizer drafter, union-vocabulary baseline (Timor et al. 2025, Alg. 1)",
            _CROSS,
        ),
        MethodSpec(
            "slem",
            _OTHER,
            _slem,
            "other-tokenizer drafter, string-level exact match (Timor et al. 2025, Alg. 2)",
            _CROSS,
        ),
        MethodSpec("pruned", _PRUNED, _pruned,
                   "same-tokenizer drafter pruned to an RDK level's frequent tokens, TLI only (RDK's baseline)", _RDK),
        *(MethodSpec(kind, _PRUNED, _redistributed(kind, False),
                     f"same-tokenizer drafter pruned to an RDK level, then {_RDK_SUMMARY[kind]}", _RDK)
          for kind in _RDK_SUMMARY),
        *(MethodSpec(f"tli_{kind}", _OTHER | {"vocab_map", "rdk"}, _redistributed(kind, True),
                     f"other-tokenizer drafter, TLI onto T∩D, then {_RDK_SUMMARY[kind]}", _RDK)
          for kind in _RDK_SUMMARY),
        MethodSpec("slrs", _BYTES, _slrs,
                   "byte-level drafter, string-level rejection sampling with exact trie psi (Timor et al. 2025, Alg. 3)",
                   _BYTE),
        MethodSpec("slem_bytes", _BYTES, _slem_bytes,
                   "byte-level drafter, string-level exact match with SLRS's byte budget (SLRS's baseline)", _BYTE),
        MethodSpec(
            "eagle3",
            frozenset({"eagle3"}),
            _eagle3,
            "EAGLE-3 head on the target's low/mid/high features (Li et al. 2025)",
            _FEATURES,
        ),
    )
}
METHOD_NAMES: tuple[str, ...] = tuple(METHODS)


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


def build_proposer(method: str, inputs: ProposerInputs) -> Proposer:
    """Build the proposer for ``method`` from ``inputs``.

    Args:
        method: A name in :data:`METHODS`.
        inputs: At least the fields the method's spec ``needs``.

    Returns:
        The proposer.

    Raises:
        DrafterError: If the method is unknown or an input it needs is missing.
    """
    spec = method_spec(method)
    missing = sorted(need for need in spec.needs if getattr(inputs, need) is None)
    if missing:
        raise DrafterError(
            f"draft method {method!r} is missing inputs",
            expected=f"{sorted(spec.needs)} set",
            found=f"{missing} unset",
            fix=f"load them before building it ({spec.summary})",
        )
    return spec.build(inputs)
