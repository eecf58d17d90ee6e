"""The method × drafter × γ matrix itself: decode, check losslessness, measure.

:class:`Evaluator` runs, per task, the autoregressive baseline and every configured speculative method
(same-tokenizer drafter with its full head and with each shortlist; different-tokenizer drafter with
TLI, Union and SLEM; the routed, redistributed and byte-level methods) for each draft length γ, on the same
prompts. It records one row of metrics per configuration (τ, α, per-position acceptance, tokens/s, measured
speedup, Leviathan's predicted speedup, MBSU, TTFT/TPOT) and two losslessness checks per method: greedy output
equal to the autoregressive greedy output on every prompt, and a chi-square test of the first emitted token's
empirical distribution against the target's own p, under the evaluation's temperature and top-p (temperature 1 when
it decodes greedily). The configurations themselves (each
method's inputs prepared, its proposer built) come from :mod:`pipeline.evaluation.configurations`.

A killed or requeued evaluation loses only the piece it was decoding: each finished piece (a task's autoregressive
runs, one configuration × γ's row and greedy check, one first-token check) is staged as it ends, and the rerun keeps
those decoded on the same kind of device (:meth:`Evaluator.run`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.artifacts import Artifact
from pipeline.config.sections import EvaluateConfig, PipelineConfig
from pipeline.engine.loop import GenerationResult, first_rounds, generate_autoregressive, generate_speculative
from pipeline.engine.methods import BASELINE
from pipeline.engine.metrics import summarize
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.static import DecodeOptions, resolve_path
from pipeline.evaluation.configurations import Configuration, Configurations
from pipeline.evaluation.position_law import position_law, sampled_decodes
from pipeline.evaluation.results import EvalRow, LosslessCheck
from pipeline.progress import Progress
from pipeline.staged import staged_about, staged_ok, write_staged_json
from pipeline.timing import device_name
from pipeline.vocab.tokens import stop_ids

GREEDY = SamplingParams(temperature=0.0)

Cells = dict[str, tuple[bool, list[tuple[Configuration, int]]]]
"""Per task, what is left to decode: whether its autoregressive runs are, and which configuration × γ cells."""


def chi_square_first_token(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    """p-value of counts ~ Multinomial(n, p): bins with expected count >= 5, the rest pooled. A token emitted where
    ``p`` is 0 gives 0.0 whatever the rest says: the pooled tail had dropped such a token's bin when the tail expected
    nothing, so a law that emitted an impossible token could score as a fit."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = n * p
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if counts[p <= 0].sum() > 0:
        return 0.0, int(obs.size)
    if obs.size < 2:
        return 1.0, int(obs.size)
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue), int(obs.size)


def decode_options(ev: EvaluateConfig, device: str) -> DecodeOptions:
    """How ``evaluate`` decodes on ``device``: ``evaluate.decode_path`` resolved there, in ``evaluate.first_token``'s
    order (the evaluation and ``drafter bench decode`` alike)."""
    return DecodeOptions(resolve_path(ev.decode_path, device), first_token=ev.first_token)


class Evaluator:
    """Runs the method × drafter × γ matrix on prepared prompts (see the module docstring).

    Args:
        artifacts: Upstream stage → its artifact: ``count`` always, and whichever of ``train_drafter``,
            ``cluster``, ``train_router``, ``estimate_rdk`` the evaluated methods read.
    """

    def __init__(self, cfg: PipelineConfig, target: torch.nn.Module, tokenizer: Any,
                 prompts: dict[str, list[list[int]]], artifacts: dict[str, Artifact], device: str,
                 log: Callable[[str], None], staging: Path | None = None) -> None:
        self.cfg, self.ev = cfg, cfg.evaluate
        self.target, self.tokenizer, self.prompts = target, tokenizer, prompts
        self.device, self.log = device, log
        self.staging, self.device_label = staging, device_name(device)
        self.configurations = Configurations(cfg, target, tokenizer, prompts, artifacts, device, log)
        self.eos = stop_ids(tokenizer, target)  # where generate ended the calibration answers
        self.params = SamplingParams(temperature=self.ev.temperature, top_p=self.ev.top_p)
        self.options = decode_options(self.ev, device)

    def _generator(self, offset: int = 0) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.ev.seed + offset)

    def proposers(self) -> Iterator[Configuration]:
        """Every configuration of the evaluated methods (see :mod:`pipeline.evaluation.configurations`)."""
        return iter(self.configurations)

    @property
    def policy_record(self) -> dict | None:
        """How the DynaSpec and PA-FR budgets were matched, once a method needed them."""
        return self.configurations.policy_record


    def _decode_all(self, items: list[list[int]], proposer: Any, gamma: int, params: SamplingParams,
                    seed: int, progress: Progress | None = None) -> list[Any]:
        """Each prompt of ``items`` decoded (autoregressively without a proposer); ``progress`` counts each generation."""
        gen = self._generator(seed)
        out = []
        for p in items:
            if proposer is None:
                out.append(generate_autoregressive(self.target, p, self.ev.max_new_tokens, params, gen, self.eos,
                                                   self.options))
            else:
                out.append(generate_speculative(self.target, proposer, p, self.ev.max_new_tokens, gamma, params, gen,
                                                self.eos, self.options))
            if progress is not None:
                progress.update(1)
        return out

    def _generations(self, left: Cells) -> int:
        """Generations the timed matrix decodes (and the static warm-up replays) of what is ``left``: per task, its
        autoregressive runs and each configuration × γ cell, greedily and, when sampling, sampled too."""
        passes = 1 if self.params.greedy else 2
        return sum(len(self.prompts[task]) * (ar + len(cells)) * passes for task, (ar, cells) in left.items())

    def _warm_up(self, left: Cells) -> None:
        """Every timed generation of what is ``left`` once, untimed, before anything is timed (the static paths): per
        task, autoregressive decoding and each configuration × γ over all the task's prompts, greedy and (when
        sampling) with the timed pass's seed.

        On path ``graphs`` a CUDA graph is compiled the first time a session or drafter feeds a shape, which takes
        seconds. The shapes a generation feeds depend on what it accepts (a drafter's catch-up after ``a`` accepted
        tokens, a last round with fewer drafts left), so only the timed generations themselves are sure to feed all of
        them: decoding is seeded, so the replay feeds the shapes the timed pass will feed. Two narrower warm-ups
        timed the compiler on an H100: the first prompt only (autoregressive decoding at 92 tokens/s on the kit's chat
        prompts, 1,062 on code), then one prompt per prefill bucket (EAGLE-3's chat row at 0.20×, code at 0.72×: a
        chat generation's last one-token verify compiled inside the timed cell).
        """
        sampled = not self.params.greedy
        passes = [(GREEDY, 0)] + ([(self.params, 1)] if sampled else [])
        with Progress("evaluate: untimed warm-up (every timed generation once: compiles the static paths' shapes)",
                      self._generations(left), "generation") as warm:
            for task, (ar, cells) in left.items():
                items = self.prompts[task]
                for params, seed in passes if ar else ():
                    self._decode_all(items, None, 0, params, seed, warm)
                for config, gamma in cells:
                    warm.note(method=config.method)
                    for params, seed in passes:
                        self._decode_all(items, config.proposer, gamma, params, seed, warm)

    def _warm_up_briefly(self, configs: list[Configuration]) -> None:
        """The eager path's warm-up: a few greedy tokens of the first prompt, autoregressively and with each
        configuration at each γ, untimed. Eager shapes need no replay, but a configuration's first call still pays
        its one-off costs (a Triton kernel's compilation for DynaSpec's routed head on a GPU, cuBLAS and allocator
        set-up), which landed in its first timed cell when only autoregressive decoding was warmed up."""
        first = next(iter(self.prompts.values()))[0]
        generate_autoregressive(self.target, first, 8, GREEDY, self._generator(), self.eos, self.options)
        for config in configs:
            for gamma in self.ev.gammas:
                generate_speculative(self.target, config.proposer, first, 8, gamma, GREEDY, self._generator(),
                                     self.eos, self.options)

    # -- pieces an interrupted run finished ----------------------------------------------------------------

    def _kept(self, key: str, shape: str) -> Any | None:
        """What an interrupted run of this evaluation staged under ``key`` (JSON), if it is sound, was decoded on
        this kind of device and holds the records of ``shape`` (``ar``, ``cell`` or ``check``) as this code writes
        them; else None (a damaged file is deleted with a line naming it, :func:`staged_ok`)."""
        path = None if self.staging is None else self.staging / f"{key}.json"
        if path is None or not staged_ok(path, self.log):
            return None
        if (device := staged_about(path).get("device")) != self.device_label:
            self.log(f"{path.name}: decoded on {device}, not on this {self.device_label}: decoding it again")
            return None
        value = json.loads(path.read_text())
        if not _piece_fits(value, shape):  # staged by code whose records had other fields
            self.log(f"{path.name}: staged with records of another shape: decoding it again")
            return None
        return value

    def _keep(self, key: str, value: Any) -> None:
        if self.staging is not None:
            write_staged_json(self.staging / f"{key}.json", value, about={"device": self.device_label})

    def run(self) -> tuple[list[EvalRow], list[LosslessCheck]]:
        """Decode everything: the matrix rows and the losslessness checks.

        Each finished piece is staged as it ends: a task's autoregressive runs (their timings are every row's
        baseline), a configuration × γ cell's row and greedy check, a configuration's first-token check. A rerun after
        a kill or a Slurm requeue keeps the pieces decoded on the same kind of device and decodes (and on the static
        paths warms up) only the rest, so an evaluation longer than a job's time limit still ends. Pieces do not
        depend on one another: each generation is seeded on its own, and every proposer starts each one afresh.
        """
        configs = list(self.proposers())
        cell_keys = {(task, index, gamma): f"{task}-{index}-{config.method}-g{gamma}" for task in self.prompts
                     for index, config in enumerate(configs) for gamma in self.ev.gammas}
        ar_keys = {task: f"{task}-ar" for task in self.prompts}
        first_token = ({index: f"first-token-{index}-{config.method}" for index, config in enumerate(configs)}
                       if self.ev.sampling_check_samples > 0 else {})
        every_position = ({index: f"position-law-{index}-{config.method}" for index, config in enumerate(configs)}
                          if self.ev.law_check_generations > 0 else {})
        keys = [*ar_keys.values(), *cell_keys.values(), *first_token.values(), *every_position.values()]
        shapes = {**dict.fromkeys(ar_keys.values(), "ar"), **dict.fromkeys(cell_keys.values(), "cell"),
                  **dict.fromkeys([*first_token.values(), *every_position.values()], "check")}
        kept = {key: value for key in keys if (value := self._kept(key, shapes[key])) is not None}
        if kept:
            self.log(f"resuming an interrupted evaluation: {len(kept)} of {len(keys)} pieces kept (decoded on "
                     f"{self.device_label})")
        left: Cells = {task: (ar_keys[task] not in kept,
                              [(config, gamma) for index, config in enumerate(configs) for gamma in self.ev.gammas
                               if cell_keys[task, index, gamma] not in kept]) for task in self.prompts}
        if self.options.static:
            self._warm_up(left)
        else:
            self._warm_up_briefly(configs)
        rows: list[EvalRow] = []
        checks: list[LosslessCheck] = []
        # Counted per generation, not per cell: one cell (a slow method on a slow machine) can take over a minute.
        decoding = Progress("evaluate: decoding", self._generations(left), "generation")
        for task, items in self.prompts.items():
            if (runs := kept.get(ar_keys[task])) is not None:
                ar_greedy, ar = ([GenerationResult(**r) for r in part] for part in runs)
            else:
                ar_greedy = self._decode_all(items, None, 0, GREEDY, 0, decoding)
                ar = self._decode_all(items, None, 0, self.params, 1, decoding) if not self.params.greedy else ar_greedy
                self._keep(ar_keys[task], [[dataclasses.asdict(r) for r in part] for part in (ar_greedy, ar)])
            rows.append(self._row(task, BASELINE, None, 0, None, None, summarize(ar, ar, None), True))
            self.log(f"{task}: autoregressive {rows[-1].tokens_per_s:.1f} tokens/s")
            for index, config in enumerate(configs):
                for gamma in self.ev.gammas:
                    key = cell_keys[task, index, gamma]
                    if (cell := kept.get(key)) is not None:
                        row, check = EvalRow(**cell["row"]), LosslessCheck(**cell["check"])
                    else:
                        row, check = self._cell(task, items, config, gamma, ar_greedy, ar, decoding)
                        self._keep(key, {"row": dataclasses.asdict(row), "check": dataclasses.asdict(check)})
                    rows.append(row)
                    checks.append(check)
        decoding.close()
        checks += self._law_checks(configs, kept, first_token, "first-token law", self.ev.sampling_check_samples,
                                   "draw", self.sampling_check)
        checks += self._law_checks(configs, kept, every_position, "every position's law",
                                   self.ev.law_check_generations, "generation", self.position_check)
        return rows, checks

    def _law_checks(self, configs: list[Configuration], kept: dict[str, Any], keys: dict[int, str], what: str,
                    per_config: int, unit: str, check: Callable[..., LosslessCheck]) -> list[LosslessCheck]:
        """One sampling-law check per configuration (``keys``: its staged piece), the pieces kept by an interrupted
        run read back, the others run and staged as each ends."""
        if not keys:
            return []
        checks = []
        left = sum(keys[index] not in kept for index in keys)
        with Progress(f"evaluate: losslessness ({what})", left * per_config, unit) as progress:
            for index, config in enumerate(configs):
                if (kept_check := kept.get(keys[index])) is not None:
                    checks.append(LosslessCheck(**kept_check))
                    continue
                checks.append(check(config.method, config.shortlist, config.proposer, progress))
                self._keep(keys[index], dataclasses.asdict(checks[-1]))
        return checks

    def _cell(self, task: str, items: list[list[int]], config: Configuration, gamma: int,
              ar_greedy: list[GenerationResult], ar: list[GenerationResult],
              decoding: Progress) -> tuple[EvalRow, LosslessCheck]:
        """One configuration at one γ on a task's prompts: its row and its greedy-equality check."""
        method, shortlist, proposer = config.method, config.shortlist, config.proposer
        sampled = not self.params.greedy
        stats = getattr(proposer, "head_stats", None)
        if stats is not None:
            stats.reset()
        before = _drafter_counts(proposer)
        greedy_runs = self._decode_all(items, proposer, gamma, GREEDY, 0, decoding)
        mismatched = [(p, a.tokens, r.tokens) for p, r, a in zip(items, greedy_runs, ar_greedy)
                      if r.tokens != a.tokens]
        ties = sum(self._is_tie(*m) for m in mismatched)
        equal = not mismatched
        if sampled and stats is not None:
            stats.reset()
        if sampled:
            before = _drafter_counts(proposer)
        runs = self._decode_all(items, proposer, gamma, self.params, 1, decoding) if sampled else greedy_runs
        counts = _drafter_counts(proposer)
        budget = self.configurations.budget_label(method, gamma)
        cost = config.cost
        if counts is not None:
            calls, psi_rows = (after - first for after, first in zip(counts, before, strict=True))
            rounds = sum(len(r.drafted_per_round) for r in runs)
            # c per measured drafter call: MBSU = τ / (1 + c · calls per round)
            cost = config.cost * calls / (rounds * gamma) if rounds else config.cost
        row = self._row(task, method, config.drafter, gamma, shortlist or budget, config.size,
                        summarize(runs, ar, cost), equal)
        row.greedy_ties = ties if mismatched and ties == len(mismatched) else None
        if counts is not None:
            row.drafter_calls_per_token = row.per_kept_token(calls)
            row.psi_rows_per_token = row.per_kept_token(psi_rows) if psi_rows else None
        if stats is not None and stats.steps:
            row.budget, row.draft_vocab_mean = budget, stats.mean_size()
            row.draft_vocab_per_position = stats.per_position()
            row.head_ms_per_step = stats.ms_per_step()
            if budget is not None:
                row.shortlist_size = int(round(stats.mean_size()))
        decoding.note(last=f"{task}/{method} τ={row.tau:.2f}")
        self.log(f"{task}: {method}{':' + row.shortlist if row.shortlist else ''} γ={gamma} "
                 f"τ={row.tau:.2f} speedup={row.speedup:.2f} greedy_equal={equal}"
                 + (f" head rows/step={row.draft_vocab_mean:.0f}" if row.draft_vocab_mean else ""))
        check = LosslessCheck(
            name=f"greedy_equal[{task}/{method}{'/' + shortlist if shortlist else ''}/γ={gamma}]",
            passed=ties == len(mismatched),
            detail=f"{len(items) - len(mismatched)}/{len(items)} prompts token-for-token equal "
                   f"({self.ev.max_new_tokens} tokens each); {ties} of {len(mismatched)} "
                   f"mismatches are floating-point ties (tolerance {self.ev.tie_tolerance})")
        return row, check

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
        # relative to the largest logit, the one greedy decoding picked: the largest *absolute* logit is a masked
        # row's (-1e4, -inf) in a target that masks padded vocabulary rows, and made every divergence a "tie"
        return gap <= self.ev.tie_tolerance * max(1.0, abs(float(logits.max())))

    def sampling_check(self, method: str, shortlist: str | None, proposer: Any,
                       progress: Progress | None = None) -> LosslessCheck:
        """First emitted token over n draws vs the target's p (chi-square, pooled tail), under the law the rows decode
        with (``evaluate.temperature`` and ``top_p``), or at temperature 1 when they decode greedily."""
        # The first emitted token is the first draft (accepted) or a residual sample of p_0 and q_0 (rejected):
        # its law involves only the first draft, so one draft per round tests exactly that law, at a fraction of
        # the drafting (SLRS enumerates a byte trie per draft). position_check covers every draft position.
        n, gamma = self.ev.sampling_check_samples, 1
        params = self._check_params()
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
        rounds = first_rounds(self.target, proposer, context, gamma, params, self._generator(7), n, draw, self.options)
        drafted = sum(step.drafted for step in rounds)
        first_accepted = sum(step.accepted > 0 for step in rounds)
        impossible = int(counts[p == 0].sum())
        pvalue, bins = chi_square_first_token(counts, p)
        # One bin tests nothing (its p-value is 1 whatever was drawn), unless the law has a single token: then "no
        # zero-probability token emitted" is the whole law.
        testable = bins >= 2 or int((p > 0).sum()) == 1
        passed = impossible == 0 and pvalue >= self.ev.sampling_check_alpha and drafted > 0 and testable
        name = f"first_token_distribution[{method}{'/' + shortlist if shortlist else ''}]"
        vacuous = "" if testable else ("; one bin tests nothing: raise evaluate.sampling_check_samples until two bins "
                                       "expect 5 draws each")
        detail = (f"n={n}, γ={gamma}, temperature {params.temperature:g}, top-p {params.top_p:g}, chi-square "
                  f"p={pvalue:.3g} over {bins} bins (fails below {self.ev.sampling_check_alpha}{vacuous}); "
                  f"zero-probability tokens emitted: {impossible}; first-round drafts verified: {drafted} (a check "
                  f"with none would be vacuous), first draft accepted in {first_accepted}/{n} draws")
        return LosslessCheck(name=name, passed=passed, detail=detail)

    def _check_params(self) -> SamplingParams:
        """The law the sampling checks test: a sampled evaluation's own (its τ is measured under its temperature and
        nucleus), temperature 1 when the rows decode greedily."""
        return self.params if self.params.temperature > 0 else SamplingParams(temperature=1.0)

    def position_check(self, method: str, shortlist: str | None, proposer: Any,
                       progress: Progress | None = None) -> LosslessCheck:
        """Every emitted position of ``evaluate.law_check_generations`` sampled generations (the tasks' prompts in
        turn, ``max_new_tokens`` each, at the largest γ) against the target's law there (:mod:`position_law`): the
        first-token check tests one position with one draft; this one every draft position, correction and bonus."""
        n, gamma, alpha = self.ev.law_check_generations, max(self.ev.gammas), self.ev.sampling_check_alpha
        params = self._check_params()
        turns = [prompt for group in zip_longest(*self.prompts.values()) for prompt in group if prompt is not None]
        prompts = [turns[i % len(turns)] for i in range(n)]

        def done(_result: GenerationResult) -> None:
            if progress is not None:
                progress.update(1, method=method)

        decodes = sampled_decodes(self.target, proposer, prompts, self.ev.max_new_tokens, gamma, params,
                                  self._generator(11), self.eos, self.options, done)
        law = position_law(self.target, decodes, params, seed=self.ev.seed)
        failures = law.failures(alpha)
        passed = not failures and law.positions > 0 and law.drafted > 0
        name = f"position_law[{method}{'/' + shortlist if shortlist else ''}]"
        detail = (f"{n} generations of up to {self.ev.max_new_tokens} tokens at γ={gamma}, temperature "
                  f"{params.temperature:g}, top-p {params.top_p:g}; {law.detail(alpha)}; drafts verified: {law.drafted} "
                  f"(a check with none would be vacuous)" + (f"; FAILED: {'; '.join(failures)}" if failures else ""))
        return LosslessCheck(name=name, passed=passed, detail=detail)

    def _row(self, task: str, method: str, drafter: str | None, gamma: int, shortlist: str | None,
             size: int | None, m: Any, equal: bool) -> EvalRow:
        return EvalRow(task=task, method=method, drafter=drafter, gamma=gamma, shortlist=shortlist,
                       shortlist_size=size, prompts=m.prompts, new_tokens=m.new_tokens,
                       target_forwards=m.target_forwards, tau=m.mean_accepted_length,
                       acceptance_rate=m.acceptance_rate if method != BASELINE else None,
                       per_position_acceptance=m.per_position_acceptance, tokens_per_s=m.tokens_per_second,
                       speedup=m.speedup_vs_autoregressive, predicted_speedup=m.leviathan_expected_speedup,
                       mbsu=m.mbsu, ttft_ms=m.ttft_ms, tpot_ms=m.tpot_ms,
                       drafter_ms_per_round=m.drafter_ms_per_round, target_ms_per_round=m.target_ms_per_forward,
                       greedy_equal=equal, tau_standard_error=m.tau_standard_error,
                       kept_per_prompt=m.kept_per_prompt, rounds_per_prompt=m.rounds_per_prompt)


def _drafter_counts(proposer: Any) -> tuple[int, int] | None:
    """(drafter calls, psi rows) a proposer has counted so far; None if it does not count them."""
    if proposer is None or not hasattr(proposer, "drafter_calls"):
        return None
    return proposer.drafter_calls, getattr(proposer, "drafter_rows", 0)


def _fields_fit(record: Any, cls: type) -> bool:
    return isinstance(record, dict) and set(record) == {f.name for f in dataclasses.fields(cls)}


def _piece_fits(value: Any, shape: str) -> bool:
    """Whether a staged evaluation piece holds the records :meth:`Evaluator.run` reads: a task's autoregressive runs
    (``ar``: two lists of generation results), a cell (``cell``: a row and its greedy check), a first-token check."""
    if shape == "ar":
        return (isinstance(value, list) and len(value) == 2
                and all(isinstance(part, list) and all(_fields_fit(r, GenerationResult) for r in part)
                        for part in value))
    if shape == "cell":
        return (isinstance(value, dict) and set(value) == {"row", "check"} and _fields_fit(value["row"], EvalRow)
                and _fields_fit(value["check"], LosslessCheck))
    return _fields_fit(value, LosslessCheck)
