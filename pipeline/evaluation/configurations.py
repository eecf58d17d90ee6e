"""The evaluate matrix's configurations: each evaluated method's typed inputs prepared, its proposer built.

This is where the method registry (:mod:`pipeline.engine.methods`) meets models and artifacts. For each
evaluated method, :class:`Configurations` runs the preparer of its inputs family (:mod:`pipeline.engine.inputs`),
which loads what that family's dataclass holds — each drafter once (the same-tokenizer drafter, train_drafter's
EAGLE-3 head, the other-tokenizer and byte-level drafters), the count artifact's shortlists, the RDK prior,
the clusters and router, the shortlist budgets matched to an FR-Spec shortlist — and yields one
:class:`Configuration` per proposer: one per shortlist or kept set where a method has several, each with the
cost ``c`` its MBSU charges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.dynaspec.budget import ShortlistPolicy, match_budgets, match_pa_fr
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
from pipeline.engine.methods import METHODS, MethodSpec, build_proposer, specs_of
from pipeline.engine.metrics import parameter_ratio
from pipeline.engine.proposers import ShortlistProposer
from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint, load_model, load_tokenizer
from pipeline.rdk.affinity import held_bytes
from pipeline.rdk.prior import PRUNED
from pipeline.vocab.counting import load_shortlists
from pipeline.vocab.tokens import stop_ids, vocab_hash


def shortlist_param_ratio(drafter: torch.nn.Module, target: torch.nn.Module, k: int) -> float:
    """Drafter/target parameter ratio when the drafter's LM head is cut to ``k`` rows (its cost ``c``)."""
    head = drafter.get_output_embeddings().weight
    drafter_params = sum(p.numel() for p in drafter.parameters()) - head.shape[0] * head.shape[1] + k * head.shape[1]
    return drafter_params / sum(p.numel() for p in target.parameters())


def redistribution_cost(proposer: Any, target: torch.nn.Module) -> float:
    """What a proposer's redistribution (RDK's ``transform``) adds to ``c`` per draft step: the bytes one row's
    redistribution reads and writes over the bytes of the target's weights (0 for a proposer without one)."""
    transform = getattr(proposer, "transform", None)
    if transform is None:
        return 0.0
    return transform.step_bytes() / held_bytes(*target.parameters())


@dataclass(frozen=True)
class Configuration:
    """One configuration of the matrix, decoded at every γ.

    Attributes:
        method: The registered method.
        drafter: What drafts (a model name, or ``<method>:<artifact id>`` for a drafter artifact).
        shortlist: The shortlist or kept set it drafts over, where the method has several.
        size: That shortlist's size.
        proposer: The proposer.
        cost: ``c``, the drafter/target parameter ratio (its head cut to the shortlist where it has one), plus
            what a redistribution reads and writes per step over the target's weight bytes
            (:func:`redistribution_cost`).
    """

    method: str
    drafter: str | None
    shortlist: str | None
    size: int | None
    proposer: Any
    cost: float


class Configurations:
    """The configurations of ``cfg.evaluate.methods`` (iterate it), and how the shortlist budgets were matched.

    Args:
        cfg: The pipeline config (``evaluate`` names the methods, drafters, shortlists, kept sets).
        target: The target model (its LM head's width is ``q``'s; parameter ratios are against it).
        tokenizer: The target's tokenizer.
        prompts: Task → token ids of its prompts (a static shortlist must hold every prompt token).
        artifacts: Upstream stage → its artifact: ``count`` always, and whichever of ``train_drafter``,
            ``cluster``, ``train_router``, ``estimate_rdk`` the evaluated methods read.
        device: Where the drafters go.
        log: One line per event worth a log line.

    Attributes:
        policy_record: How the DynaSpec and PA-FR budgets were matched (None until a method needed them).
    """

    def __init__(self, cfg: PipelineConfig, target: torch.nn.Module, tokenizer: Any,
                 prompts: dict[str, list[list[int]]], artifacts: dict[str, Artifact], device: str,
                 log: Callable[[str], None]) -> None:
        self.cfg, self.ev = cfg, cfg.evaluate
        self.target, self.tokenizer, self.prompts = target, tokenizer, prompts
        self.artifacts, self.counts = artifacts, artifacts["count"]
        self.device, self.log = device, log
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self._drafters: dict[str, tuple[Any, Any]] = {}
        self._rdk_prior: Any = None
        self._vocab_map: Any = None
        self._shortlist_policy: tuple[Any, dict] | None = None
        self.policy_record: dict | None = None

    def preparers(self) -> dict[type, Callable[[MethodSpec], Iterator[Configuration]]]:
        """Inputs family (:mod:`pipeline.engine.inputs`) → how a method of it is prepared: load what the family's
        dataclass holds, yield the method's configurations. In run order: the same-tokenizer
        drafter's families, EAGLE-3's, DFlash's, the other tokenizer's, the byte drafter's (each drafter loaded once)."""
        return {
            SameTokenizerInputs: self._full_head, ShortlistInputs: self._static_shortlists,
            RoutedInputs: self._routed, FrequencyInputs: self._frequency, RDKInputs: self._pruned,
            FeatureInputs: self._features, BlockFeatureInputs: self._block_features, CrossVocabInputs: self._cross_vocab,
            OtherTokenizerInputs: self._other_tokenizer, CrossRDKInputs: self._cross_rdk, ByteInputs: self._bytes,
        }

    def __iter__(self) -> Iterator[Configuration]:
        """Every configuration of the evaluated methods: families in :meth:`preparers` order, a family's methods
        in registry order.

        Raises:
            DrafterError: If an evaluated method's inputs family has no preparer here.
        """
        prepare = self.preparers()
        specs = specs_of(self.ev.methods)
        unprepared = sorted(spec.name for spec in specs if spec.inputs not in prepare)
        if unprepared:
            raise DrafterError(f"The evaluator cannot prepare the inputs of methods {unprepared}.",
                               expected=f"inputs among {sorted(t.__name__ for t in prepare)}",
                               found=", ".join(f"{name}: {METHODS[name].inputs.__name__}" for name in unprepared),
                               fix="Add a preparer for the new inputs family to Configurations.preparers.")
        for family, prepare_one in prepare.items():
            for spec in specs:
                # an evaluate.drafter_other / drafter_bytes of null skips the methods that draft with it
                if spec.inputs is family and (spec.model is None or getattr(self.ev, spec.model)):
                    yield from prepare_one(spec)

    def _drafter(self, key: str) -> tuple[Any, Any]:
        """The model ``evaluate.<key>`` names and its tokenizer (None for the same-tokenizer drafter), loaded once."""
        if key not in self._drafters:
            name = getattr(self.ev, key)
            model = load_model(name, dtype=self.cfg.target.dtype, device=self.device)
            self._drafters[key] = (model, None if key == SameTokenizerInputs.MODEL else load_tokenizer(name))
        return self._drafters[key]

    def _full_head(self, spec: MethodSpec) -> Iterator[Configuration]:
        drafter = self._drafter(spec.model)[0]
        proposer = build_proposer(spec.name, SameTokenizerInputs(drafter, target_vocab_size=self.vocab))
        yield Configuration(spec.name, self.ev.drafter, None, None, proposer, parameter_ratio(drafter, self.target))

    def _static_shortlists(self, spec: MethodSpec) -> Iterator[Configuration]:
        """One configuration per shortlist of ``evaluate.shortlists`` (from the count artifact)."""
        drafter = self._drafter(spec.model)[0]
        lists = load_shortlists(self.counts)
        for name in self.ev.shortlists:
            if name not in lists:
                raise DrafterError(f"Shortlist {name!r} is not in count artifact {self.counts.id}.",
                                   expected=f"one of {sorted(lists)}",
                                   fix="Fix evaluate.shortlists or add the size to count.top_k/top_p.")
            ids = torch.from_numpy(lists[name])
            all_prompts = [p for items in self.prompts.values() for p in items]
            ShortlistProposer.check(ids, self.tokenizer, all_prompts, stop_ids(self.tokenizer, self.target))
            inputs = ShortlistInputs(drafter, ids, target_vocab_size=self.vocab, name=f"{spec.name}:{name}")
            yield Configuration(spec.name, self.ev.drafter, name, int(ids.numel()), build_proposer(spec.name, inputs),
                                shortlist_param_ratio(drafter, self.target, int(ids.numel())))

    def _matched_cost(self, drafter: torch.nn.Module) -> float:
        """The cost ratio of a head cut to the matched shortlist's size (the budgets are matched to it)."""
        self._policy_once(drafter)
        return shortlist_param_ratio(drafter, self.target, int(self.policy_record["match_size"]))

    def _routed(self, spec: MethodSpec) -> Iterator[Configuration]:
        drafter = self._drafter(spec.model)[0]
        policy, routed = self._policy_once(drafter)
        inputs = RoutedInputs(drafter, routed["clustering"], routed["router"], policy, target_vocab_size=self.vocab)
        yield Configuration(spec.name, self.ev.drafter, None, None, build_proposer(spec.name, inputs),
                            self._matched_cost(drafter))

    def _frequency(self, spec: MethodSpec) -> Iterator[Configuration]:
        drafter = self._drafter(spec.model)[0]
        policy, _ = self._policy_once(drafter)
        inputs = FrequencyInputs(drafter, policy, target_vocab_size=self.vocab)
        yield Configuration(spec.name, self.ev.drafter, None, None, build_proposer(spec.name, inputs),
                            self._matched_cost(drafter))

    def _pruned(self, spec: MethodSpec) -> Iterator[Configuration]:
        """One configuration per RDK pruning level (``evaluate.rdk_levels``, else every one)."""
        drafter = self._drafter(spec.model)[0]
        prior = self._prior()
        for level in self.ev.rdk_levels or prior.names(PRUNED):
            size = int(prior.level(level).kept.numel())
            inputs = RDKInputs(drafter, prior, level, target_vocab_size=self.vocab, name=f"{spec.name}:{level}")
            proposer = build_proposer(spec.name, inputs)
            yield Configuration(spec.name, self.ev.drafter, level, size, proposer,
                                shortlist_param_ratio(drafter, self.target, size)
                                + redistribution_cost(proposer, self.target))

    def _features(self, spec: MethodSpec) -> Iterator[Configuration]:
        from pipeline.drafters.store import load_drafter  # deferred: pulls in torch

        (stage,) = spec.stages
        if stage not in self.artifacts:
            raise DrafterError(f"Method {spec.name} is evaluated but no {stage} artifact was given.",
                               fix="Run `drafter evaluate` (it trains the drafter first) or set evaluate.eagle3.")
        artifact = self.artifacts[stage]
        if stage not in self._drafters:
            self._drafters[stage] = (load_drafter(artifact.path, self.target), None)
        head = self._drafters[stage][0]
        proposer = build_proposer(spec.name, FeatureInputs(head, target_vocab_size=self.vocab))
        yield Configuration(spec.name, f"{spec.name}:{artifact.id}", None, None, proposer,
                            parameter_ratio(head, self.target))

    def _block_features(self, spec: MethodSpec) -> Iterator[Configuration]:
        from pipeline.drafters.dflash_export import load_dflash  # deferred: pulls in torch

        (stage,) = spec.stages
        if stage not in self.artifacts:
            raise DrafterError(f"Method {spec.name} is evaluated but no {stage} artifact was given.",
                               fix="Run `drafter evaluate` (it trains the drafter first) or set evaluate.dflash.")
        artifact = self.artifacts[stage]
        if stage not in self._drafters:
            self._drafters[stage] = (load_dflash(artifact.path, self.target), None)
        drafter = self._drafters[stage][0]
        proposer = build_proposer(spec.name, BlockFeatureInputs(drafter, target_vocab_size=self.vocab))
        # c: its layers plus the target's LM head, which it applies to its B - 1 rows every forward (a draft-vocabulary
        # head, like EAGLE-3's, is among its own parameters); charged once per measured forward, not γ times.
        head = self.target.get_output_embeddings().weight.numel() if drafter.config.draft_vocab_size is None else 0
        total = sum(p.numel() for p in self.target.parameters())
        yield Configuration(spec.name, f"{spec.name}:{artifact.id}", None, None, proposer,
                            parameter_ratio(drafter, self.target) + head / total)

    def _map(self) -> Any:
        """``VocabMap.build(target tokenizer, other drafter's tokenizer)``, built once."""
        if self._vocab_map is None:
            from pipeline.vocab.maps import VocabMap  # deferred: pulls in torch

            self._vocab_map = VocabMap.build(self.tokenizer, self._drafter(CrossVocabInputs.MODEL)[1])
            self.log(f"vocabulary intersection with {self.ev.drafter_other}: "
                     f"{self._vocab_map.intersection_size} tokens")
        return self._vocab_map

    def _cross_vocab(self, spec: MethodSpec) -> Iterator[Configuration]:
        model, tokenizer = self._drafter(spec.model)
        inputs = CrossVocabInputs(model, tokenizer, self.tokenizer, self._map(), target_vocab_size=self.vocab)
        yield Configuration(spec.name, self.ev.drafter_other, None, None, build_proposer(spec.name, inputs),
                            parameter_ratio(model, self.target))

    def _other_tokenizer(self, spec: MethodSpec) -> Iterator[Configuration]:
        model, tokenizer = self._drafter(spec.model)
        inputs = OtherTokenizerInputs(model, tokenizer, self.tokenizer)
        yield Configuration(spec.name, self.ev.drafter_other, None, None, build_proposer(spec.name, inputs),
                            parameter_ratio(model, self.target))

    def _cross_rdk(self, spec: MethodSpec) -> Iterator[Configuration]:
        model, tokenizer = self._drafter(spec.model)
        inputs = CrossRDKInputs(model, tokenizer, self.tokenizer, self._map(), self._prior(),
                                target_vocab_size=self.vocab)
        proposer = build_proposer(spec.name, inputs)
        yield Configuration(spec.name, self.ev.drafter_other, None, None, proposer,
                            parameter_ratio(model, self.target) + redistribution_cost(proposer, self.target))

    def _bytes(self, spec: MethodSpec) -> Iterator[Configuration]:
        model, tokenizer = self._drafter(spec.model)
        inputs = ByteInputs(model, tokenizer, self.tokenizer, byte_top_k=self.ev.slrs_byte_top_k,
                            lookahead=self.ev.slrs_lookahead, target_vocab_size=self.vocab)
        yield Configuration(spec.name, self.ev.drafter_bytes, None, None, build_proposer(spec.name, inputs),
                            parameter_ratio(model, self.target))

    def _prior(self) -> Any:
        """The estimate_rdk artifact as an :class:`~pipeline.rdk.prior.RDKPrior`, checked against this target."""
        if self._rdk_prior is None:
            from pipeline.rdk.prior import RDKPrior  # deferred: pulls in torch

            if "estimate_rdk" not in self.artifacts:
                raise DrafterError("RDK methods are evaluated but no estimate_rdk artifact was given.",
                                   fix="Run `drafter evaluate` (it builds estimate_rdk first) or set evaluate.rdk.")
            self._rdk_prior = RDKPrior.load(self.artifacts["estimate_rdk"].path)
            self._rdk_prior.check_target(vocab_hash(self.tokenizer), self.vocab)
        return self._rdk_prior

    def _policy_once(self, drafter: torch.nn.Module) -> tuple[Any, dict]:
        """:meth:`_policy` for the evaluated methods, computed once (with cluster budgets when one is routed)."""
        if self._shortlist_policy is None:
            routed = [spec.name for spec in specs_of(self.ev.methods) if spec.inputs is RoutedInputs]
            self._shortlist_policy = self._policy(drafter, routed)
        return self._shortlist_policy

    def _policy(self, drafter: torch.nn.Module, routed_methods: list[str]) -> tuple[Any, dict]:
        """Budgets of DynaSpec-F/PA and PA-FR matched, per γ, to the FR-Spec shortlist ``dynaspec_match``:
        cluster budgets from the router's held-out size curve, PA-FR's kmax from its exact sizes."""
        import json

        from pipeline.vocab.counting import frequency_ranking  # deferred: pulls in pyarrow

        ev = self.ev
        lists = load_shortlists(self.counts)
        if ev.dynaspec_match not in lists:
            raise DrafterError(f"evaluate.dynaspec_match names shortlist {ev.dynaspec_match!r}, which count "
                               f"artifact {self.counts.id} does not have.", expected=f"one of {sorted(lists)}",
                               found=ev.dynaspec_match, fix="Set evaluate.dynaspec_match to one of them.")
        size = float(lists[ev.dynaspec_match].size)
        keep = tuple(stop_ids(self.tokenizer, self.target))  # every id a turn ends at, as the decodes stop
        ranking = frequency_ranking(self.counts)
        fields: dict[str, Any] = {"pa_fr_kmax": {g: match_pa_fr(ranking.size, size, g, ev.dynaspec_k_min)
                                                 for g in ev.gammas}}
        routed: dict[str, Any] = {}
        record: dict[str, Any] = {"match": ev.dynaspec_match, "match_size": int(size), "keep_ids": list(keep),
                                  "pa_fr_kmax": {str(g): k for g, k in fields["pa_fr_kmax"].items()}}
        if routed_methods:
            from pipeline.dynaspec.clusters import Clustering  # deferred: pulls in numpy
            from pipeline.dynaspec.router import load_router  # deferred: pulls in torch

            if not set(RoutedInputs.STAGES) <= set(self.artifacts):
                raise DrafterError(f"Methods {routed_methods} are evaluated but no cluster/router artifacts were given.",
                                   fix="Run `drafter evaluate` (it builds cluster and train_router first) or set "
                                       "evaluate.clusters and evaluate.router.")
            clusters, router_art = (self.artifacts[stage] for stage in RoutedInputs.STAGES)
            clustering = Clustering.load(clusters.path)
            head = drafter.get_output_embeddings().weight
            clustering.check_head(head, f"evaluate.drafter {ev.drafter!r}")
            router, meta = load_router(router_art.path, clustering, head,
                                       fingerprint(ev.drafter).get("weights"))
            curve = json.loads(router_art.file("routing.json").read_text())["size"]
            budgets = {g: match_budgets(curve, size, g, ev.dynaspec_k_min) for g in ev.gammas}
            fields["fixed"] = {g: b[0] for g, b in budgets.items()}
            fields["pa"] = {g: b[1] for g, b in budgets.items()}
            routed = {"clustering": clustering, "router": router.to(self.device)}
            record.update({"clusters": clusters.id, "router": router_art.id, "num_clusters": clustering.num_clusters,
                           "fixed": {str(g): b[0].to_dict() for g, b in budgets.items()},
                           "pa": {str(g): b[1].to_dict() for g, b in budgets.items()},
                           "predicted_size": {str(g): {"fixed": curve[b[0].k1 - 1],
                                                       "pa": sum(curve[b[1].at(t) - 1] for t in range(g)) / g}
                                              for g, b in budgets.items()}})
        self.policy_record = record
        self.log(f"shortlist budgets matched to {ev.dynaspec_match} ({int(size)} tokens): {record}")
        return ShortlistPolicy(keep_ids=keep, ranking=ranking, k_min=ev.dynaspec_k_min,
                               match=f"{ev.dynaspec_match}: {int(size)} tokens", **fields), routed

    def budget_label(self, method: str, gamma: int) -> str | None:
        """The γ-dependent shortlist budget of ``method`` (its spec's label), None for a method without one."""
        budget = METHODS[method].budget
        return None if budget is None else budget(self.policy_record or {}, gamma)
