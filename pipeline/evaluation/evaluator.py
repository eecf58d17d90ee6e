"""The method × drafter × γ matrix itself: decode, check losslessness, measure.

:class:`Evaluator` runs, per task, the autoregressive baseline and every configured speculative method
(same-tokenizer drafter with its full head and with each shortlist; different-tokenizer drafter with
TLI, Union and SLEM; the routed, redistributed and byte-level methods) for each draft length γ, on the same
prompts. It records one row of metrics per configuration (τ, α, per-position acceptance, tokens/s, measured
speedup, Leviathan's predicted speedup, MBSU, TTFT/TPOT) and two losslessness checks per method: greedy output
equal to the autoregressive greedy output on every prompt, and a chi-square test of the first emitted token's
empirical distribution at temperature 1 against the target's own p.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.engine.loop import first_rounds, generate_autoregressive, generate_speculative
from pipeline.engine.metrics import parameter_ratio, summarize
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.errors import DrafterError
from pipeline.evaluation.results import EvalRow, LosslessCheck
from pipeline.models.loading import load_model, load_tokenizer
from pipeline.progress import Progress
from pipeline.vocab.counting import load_shortlists

GREEDY = SamplingParams(temperature=0.0)


def shortlist_param_ratio(drafter: torch.nn.Module, target: torch.nn.Module, k: int) -> float:
    """Drafter/target parameter ratio when the drafter's LM head is cut to ``k`` rows (its cost ``c``)."""
    head = drafter.get_output_embeddings().weight
    drafter_params = sum(p.numel() for p in drafter.parameters()) - head.shape[0] * head.shape[1] + k * head.shape[1]
    return drafter_params / sum(p.numel() for p in target.parameters())


def chi_square_first_token(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """p-value of counts ~ Multinomial(n, p): bins with expected count >= 5, the rest pooled."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = n * p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if obs.size < 2:
        return 1.0, int(obs.size)
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue), int(obs.size)


class Evaluator:
    """Runs the method × drafter × γ matrix on prepared prompts (see the module docstring)."""

    def __init__(self, cfg: PipelineConfig, target: torch.nn.Module, tokenizer: Any,
                 prompts: dict[str, list[list[int]]], counts: Artifact, device: str,
                 log: Callable[[str], None], eagle3: Artifact | None = None,
                 routing: tuple[Artifact, Artifact] | None = None, rdk: Artifact | None = None) -> None:
        self.cfg, self.ev = cfg, cfg.evaluate
        self.target, self.tokenizer, self.prompts = target, tokenizer, prompts
        self.counts, self.device, self.log, self.eagle3, self.routing = counts, device, log, eagle3, routing
        self.rdk = rdk
        self._rdk_prior: Any = None
        self.policy_record: dict | None = None
        self.eos = tokenizer.eos_token_id
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.params = SamplingParams(temperature=self.ev.temperature, top_p=self.ev.top_p)

    def _generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.ev.seed + offset)

    def proposers(self) -> Iterator[tuple[str, str, str | None, int | None, Any, float]]:
        """(method, drafter name, shortlist name, shortlist size, proposer, cost ratio c) per configuration."""
        from pipeline.engine.methods import METHODS, ProposerInputs, build_proposer
        from pipeline.engine.proposers import ShortlistProposer

        ev = self.ev
        specs = [spec for name, spec in METHODS.items() if name in ev.methods]
        same = [spec for spec in specs if spec.same_tokenizer]
        heads = [spec for spec in specs if "eagle3" in spec.needs]
        other = [spec for spec in specs if "drafter_other" in spec.needs]
        byte_level = [spec for spec in specs if "drafter_bytes" in spec.needs]
        if same:
            drafter = load_model(ev.drafter, dtype=self.cfg.target.dtype, device=self.device)
            base = ProposerInputs(drafter=drafter, target_vocab_size=self.vocab)
            policy = routed = None
            if any("policy" in spec.needs for spec in same):
                policy, routed = self._policy(drafter, [spec.name for spec in same if "router" in spec.needs])
            for spec in same:
                if "rdk" in spec.needs:
                    prior = self._prior()
                    for level in ev.rdk_levels or prior.names("pruned"):
                        size = int(prior.level(level).kept.numel())
                        inputs = dataclasses.replace(base, rdk=prior, rdk_level=level, name=f"{spec.name}:{level}")
                        yield (spec.name, ev.drafter, level, size, build_proposer(spec.name, inputs),
                               shortlist_param_ratio(drafter, self.target, size))
                    continue
                if "policy" in spec.needs:
                    inputs = dataclasses.replace(base, policy=policy, **routed if "router" in spec.needs else {})
                    proposer = build_proposer(spec.name, inputs)
                    yield (spec.name, ev.drafter, None, None, proposer,
                           shortlist_param_ratio(drafter, self.target, int(round(self._match_size))))
                    continue
                if "shortlist" not in spec.needs:
                    yield (spec.name, ev.drafter, None, None, build_proposer(spec.name, base),
                           parameter_ratio(drafter, self.target))
                    continue
                lists = load_shortlists(self.counts)
                for name in ev.shortlists:
                    if name not in lists:
                        raise DrafterError(f"Shortlist {name!r} is not in count artifact {self.counts.id}.",
                                           expected=f"one of {sorted(lists)}",
                                           fix="Fix evaluate.shortlists or add the size to count.top_k/top_p.")
                    ids = torch.from_numpy(lists[name])
                    all_prompts = [p for items in self.prompts.values() for p in items]
                    ShortlistProposer.check(ids, self.tokenizer, all_prompts)
                    inputs = dataclasses.replace(base, shortlist=ids, name=f"{spec.name}:{name}")
                    yield (spec.name, ev.drafter, name, int(ids.numel()), build_proposer(spec.name, inputs),
                           shortlist_param_ratio(drafter, self.target, int(ids.numel())))
        if heads:
            from pipeline.drafters.store import load_drafter

            if self.eagle3 is None:
                raise DrafterError("Method eagle3 is evaluated but no train_drafter artifact was given.",
                                   fix="Run `drafter evaluate` (it trains the drafter first) or set evaluate.eagle3.")
            head = load_drafter(self.eagle3.path, self.target)
            ratio = parameter_ratio(head, self.target)
            for spec in heads:
                proposer = build_proposer(spec.name, ProposerInputs(eagle3=head, target_vocab_size=self.vocab))
                yield spec.name, f"eagle3:{self.eagle3.id}", None, None, proposer, ratio
        if other and ev.drafter_other:
            other_model = load_model(ev.drafter_other, dtype=self.cfg.target.dtype, device=self.device)
            other_tok = load_tokenizer(ev.drafter_other)
            ratio = parameter_ratio(other_model, self.target)
            vocab_map = None
            if any("vocab_map" in spec.needs for spec in other):
                from pipeline.vocab.maps import VocabMap

                vocab_map = VocabMap.build(self.tokenizer, other_tok)
                self.log(f"vocabulary intersection with {ev.drafter_other}: {vocab_map.intersection_size} tokens")
            inputs = ProposerInputs(drafter_other=other_model, drafter_other_tokenizer=other_tok,
                                    target_tokenizer=self.tokenizer, vocab_map=vocab_map,
                                    target_vocab_size=self.vocab,
                                    rdk=self._prior() if any("rdk" in spec.needs for spec in other) else None)
            for spec in other:
                yield spec.name, ev.drafter_other, None, None, build_proposer(spec.name, inputs), ratio
        if byte_level and ev.drafter_bytes:
            byte_model = load_model(ev.drafter_bytes, dtype=self.cfg.target.dtype, device=self.device)
            inputs = ProposerInputs(drafter_bytes=byte_model, drafter_bytes_tokenizer=load_tokenizer(ev.drafter_bytes),
                                    target_tokenizer=self.tokenizer, byte_top_k=ev.slrs_byte_top_k,
                                    lookahead=ev.slrs_lookahead, target_vocab_size=self.vocab)
            ratio = parameter_ratio(byte_model, self.target)
            for spec in byte_level:
                yield spec.name, ev.drafter_bytes, None, None, build_proposer(spec.name, inputs), ratio

    def _prior(self) -> Any:
        """The estimate_rdk artifact as an :class:`~pipeline.rdk.prior.RDKPrior`, checked against this target."""
        if self._rdk_prior is None:
            from pipeline.rdk.prior import RDKPrior
            from pipeline.vocab.tokens import vocab_hash

            if self.rdk is None:
                raise DrafterError("RDK methods are evaluated but no estimate_rdk artifact was given.",
                                   fix="Run `drafter evaluate` (it builds estimate_rdk first) or set evaluate.rdk.")
            self._rdk_prior = RDKPrior.load(self.rdk.path)
            self._rdk_prior.check_target(vocab_hash(self.tokenizer), self.vocab)
        return self._rdk_prior

    def _policy(self, drafter: torch.nn.Module, routed_methods: list[str]) -> tuple[Any, dict]:
        """Budgets of DynaSpec-F/PA and PA-FR matched, per γ, to the FR-Spec shortlist ``dynaspec_match``:
        cluster budgets from the router's held-out size curve, PA-FR's kmax from its exact sizes."""
        import json

        from pipeline.dynaspec.budget import ShortlistPolicy, match_budgets, match_pa_fr
        from pipeline.vocab.counting import frequency_ranking
        from pipeline.vocab.tokens import eos_ids

        ev = self.ev
        lists = load_shortlists(self.counts)
        if ev.dynaspec_match not in lists:
            raise DrafterError(f"evaluate.dynaspec_match names shortlist {ev.dynaspec_match!r}, which count "
                               f"artifact {self.counts.id} does not have.", expected=f"one of {sorted(lists)}",
                               found=ev.dynaspec_match, fix="Set evaluate.dynaspec_match to one of them.")
        size = float(lists[ev.dynaspec_match].size)
        self._match_size = size
        keep = tuple(eos_ids(self.tokenizer))
        ranking = frequency_ranking(self.counts)
        fields: dict[str, Any] = {"pa_fr_kmax": {g: match_pa_fr(ranking.size, size, g, ev.dynaspec_k_min)
                                                 for g in ev.gammas}}
        routed: dict[str, Any] = {}
        record: dict[str, Any] = {"match": ev.dynaspec_match, "match_size": int(size), "keep_ids": list(keep),
                                  "pa_fr_kmax": {str(g): k for g, k in fields["pa_fr_kmax"].items()}}
        if routed_methods:
            from pipeline.dynaspec.clusters import Clustering
            from pipeline.dynaspec.router import load_router

            if self.routing is None:
                raise DrafterError(f"Methods {routed_methods} are evaluated but no cluster/router artifacts were given.",
                                   fix="Run `drafter evaluate` (it builds cluster and train_router first) or set "
                                       "evaluate.clusters and evaluate.router.")
            clusters, router_art = self.routing
            clustering = Clustering.load(clusters.path)
            head = drafter.get_output_embeddings().weight
            clustering.check_head(head, f"evaluate.drafter {ev.drafter!r}")
            router, meta = load_router(router_art.path, clustering, head)
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

    def _budget_label(self, method: str, gamma: int) -> str | None:
        record = self.policy_record or {}
        if method == "pa_fr":
            return f"kmax{record['pa_fr_kmax'][str(gamma)]}"
        if method in ("dynaspec", "dynaspec_pa"):
            b = record["fixed" if method == "dynaspec" else "pa"][str(gamma)]
            return f"k{b['k1']}" if method == "dynaspec" else f"k0_{b['k0']}-k1_{b['k1']}"
        return None

    def _decode_all(self, items: list[list[int]], proposer: Any, gamma: int, params: SamplingParams,
                    seed: int) -> list[Any]:
        gen = self._generator(seed)
        if proposer is None:
            return [generate_autoregressive(self.target, p, self.ev.max_new_tokens, params, gen, self.eos) for p in items]
        return [generate_speculative(self.target, proposer, p, self.ev.max_new_tokens, gamma, params, gen, self.eos)
                for p in items]

    def run(self) -> tuple[list[EvalRow], list[LosslessCheck]]:
        """Decode everything: the matrix rows and the losslessness checks."""
        rows: list[EvalRow] = []
        checks: list[LosslessCheck] = []
        configs = list(self.proposers())
        sampled = not self.params.greedy
        # Warm up kernels and allocators so the first timed configuration is not penalised.
        first = next(iter(self.prompts.values()))[0]
        generate_autoregressive(self.target, first, 8, GREEDY, self._generator(), self.eos)
        cells = Progress("evaluate: decoding", len(self.prompts) * (1 + len(configs) * len(self.ev.gammas)), "cell")
        for task, items in self.prompts.items():
            ar_greedy = self._decode_all(items, None, 0, GREEDY, 0)
            ar = self._decode_all(items, None, 0, self.params, 1) if sampled else ar_greedy
            rows.append(self._row(task, "ar", None, 0, None, None, summarize(ar, ar, None), True))
            self.log(f"{task}: autoregressive {rows[-1].tokens_per_s:.1f} tokens/s")
            cells.update(1)
            for method, drafter, shortlist, size, proposer, ratio in configs:
                stats = getattr(proposer, "head_stats", None)
                for gamma in self.ev.gammas:
                    if stats is not None:
                        stats.reset()
                    before = _drafter_counts(proposer)
                    greedy_runs = self._decode_all(items, proposer, gamma, GREEDY, 0)
                    mismatched = [(p, a.tokens, r.tokens) for p, r, a in zip(items, greedy_runs, ar_greedy)
                                  if r.tokens != a.tokens]
                    ties = sum(self._is_tie(*m) for m in mismatched)
                    equal = not mismatched
                    if sampled and stats is not None:
                        stats.reset()
                    if sampled:
                        before = _drafter_counts(proposer)
                    runs = self._decode_all(items, proposer, gamma, self.params, 1) if sampled else greedy_runs
                    counts = _drafter_counts(proposer)
                    budget = self._budget_label(method, gamma)
                    cost = ratio
                    if counts is not None:
                        calls, psi_rows = (after - first for after, first in zip(counts, before, strict=True))
                        rounds = sum(len(r.drafted_per_round) for r in runs)
                        # c per measured drafter call: MBSU = τ / (1 + c · calls per round)
                        cost = ratio * calls / (rounds * gamma) if rounds else ratio
                    row = self._row(task, method, drafter, gamma, shortlist or budget, size,
                                    summarize(runs, ar, cost), equal)
                    if counts is not None and row.new_tokens:
                        row.drafter_calls_per_token = calls / row.new_tokens
                        row.psi_rows_per_token = psi_rows / row.new_tokens if psi_rows else None
                    if stats is not None and stats.steps:
                        row.budget, row.draft_vocab_mean = budget, stats.mean_size()
                        row.draft_vocab_per_position = stats.per_position()
                        row.head_ms_per_step = stats.ms_per_step()
                        if budget is not None:
                            row.shortlist_size = int(round(stats.mean_size()))
                    rows.append(row)
                    cells.update(1, last=f"{task}/{method} τ={row.tau:.2f}")
                    self.log(f"{task}: {method}{':' + row.shortlist if row.shortlist else ''} γ={gamma} "
                             f"τ={row.tau:.2f} speedup={row.speedup:.2f} greedy_equal={equal}"
                             + (f" head rows/step={row.draft_vocab_mean:.0f}" if row.draft_vocab_mean else ""))
                    checks.append(LosslessCheck(
                        name=f"greedy_equal[{task}/{method}{'/' + shortlist if shortlist else ''}/γ={gamma}]",
                        passed=ties == len(mismatched),
                        detail=f"{len(items) - len(mismatched)}/{len(items)} prompts token-for-token equal "
                               f"({self.ev.max_new_tokens} tokens each); {ties} of {len(mismatched)} "
                               f"mismatches are floating-point ties (tolerance {self.ev.tie_tolerance})"))
        cells.close()
        if self.ev.sampling_check_samples > 0:
            with Progress("evaluate: losslessness (first-token law)", len(configs) * self.ev.sampling_check_samples,
                          "draw") as draws:
                checks += [self.sampling_check(method, shortlist, proposer, draws)
                           for method, _, shortlist, _, proposer, _ in configs]
        return rows, checks

    @torch.no_grad()
    def _is_tie(self, prompt: list[int], ar: list[int], spec: list[int]) -> bool:
        """Whether greedy outputs diverge only where the target's top two logits are (numerically) tied."""
        if self.ev.tie_tolerance <= 0:
            return False
        i = next((k for k, (x, y) in enumerate(zip(ar, spec)) if x != y), min(len(ar), len(spec)))
        if i >= len(ar) or i >= len(spec):
            return False  # one stopped where the other went on without a differing token: not a tie
        logits = self.target(torch.tensor([prompt + ar[:i]], device=self.device)).logits[0, -1].double()
        gap = abs(float(logits[ar[i]] - logits[spec[i]]))
        return gap <= self.ev.tie_tolerance * max(1.0, float(logits.abs().max()))

    def sampling_check(self, method: str, shortlist: str | None, proposer: Any,
                       progress: Progress | None = None) -> LosslessCheck:
        """First emitted token at temperature 1 over n draws vs the target's p (chi-square, pooled tail)."""
        # The first emitted token is the first draft (accepted) or a residual sample of p_0 and q_0 (rejected):
        # its law involves only the first draft, so one draft per round tests exactly that law, at a fraction of
        # the drafting (SLRS enumerates a byte trie per draft). The matrix rows cover every draft position.
        n, gamma = self.ev.sampling_check_samples, 1
        params = SamplingParams(temperature=1.0)
        context = next(iter(self.prompts.values()))[0]
        with torch.no_grad():
            logits = self.target(torch.tensor([context], device=self.device)).logits[0, -1]
        p = standardise(logits.float(), params).cpu().numpy()
        counts = np.zeros(p.size, dtype=np.int64)

        def draw(step: Any) -> None:
            counts[step.emitted[0]] += 1
            if progress is not None:
                progress.update(1, method=method)

        # n independent first rounds after one prefill: the same round code the decode loop runs
        rounds = first_rounds(self.target, proposer, context, gamma, params, self._generator(7), n, draw)
        drafted = sum(step.drafted for step in rounds)
        first_accepted = sum(step.accepted > 0 for step in rounds)
        impossible = int(counts[p == 0].sum())
        pvalue, bins = chi_square_first_token(counts, p)
        passed = impossible == 0 and pvalue >= self.ev.sampling_check_alpha and drafted > 0
        name = f"first_token_distribution[{method}{'/' + shortlist if shortlist else ''}]"
        return LosslessCheck(name=name, passed=passed,
                             detail=f"n={n}, γ={gamma}, chi-square p={pvalue:.3g} over {bins} bins "
                          f"(fails below {self.ev.sampling_check_alpha}); zero-probability tokens emitted: {impossible}; "
                          f"first-round drafts verified: {drafted} (a check with none would be vacuous), "
                          f"first draft accepted in {first_accepted}/{n} draws")

    def _row(self, task: str, method: str, drafter: str | None, gamma: int, shortlist: str | None,
             size: int | None, m: Any, equal: bool) -> EvalRow:
        return EvalRow(task=task, method=method, drafter=drafter, gamma=gamma, shortlist=shortlist,
                       shortlist_size=size, prompts=m.prompts, new_tokens=m.new_tokens,
                       target_forwards=m.target_forwards, tau=m.mean_accepted_length,
                       acceptance_rate=m.acceptance_rate if method != "ar" else None,
                       per_position_acceptance=m.per_position_acceptance, tokens_per_s=m.tokens_per_second,
                       speedup=m.speedup_vs_autoregressive, predicted_speedup=m.leviathan_expected_speedup,
                       mbsu=m.mbsu, ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms,
                       drafter_ms_per_step=m.drafter_ms_per_round, target_ms_per_step=m.target_ms_per_forward,
                       greedy_equal=equal)


def _drafter_counts(proposer: Any) -> tuple[int, int] | None:
    """(drafter calls, psi rows) a proposer has counted so far; None if it does not count them."""
    if proposer is None or not hasattr(proposer, "drafter_calls"):
        return None
    return proposer.drafter_calls, getattr(proposer, "drafter_rows", 0)
