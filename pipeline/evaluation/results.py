"""Typed evaluation results: rows, losslessness checks, gates and the verdict.

The evaluate stage's figures travel from the matrix (:mod:`pipeline.evaluation.evaluator`) through the
report and into the registry as these dataclasses, not as dicts re-read from JSON. :func:`decide_gates`
is a pure function of the rows and checks (plus the thresholds): the same results always give the same
verdict, and a test can exercise the gates without decoding anything. ``report.json`` is
:meth:`EvaluationResults.to_dict`; :meth:`EvaluationResults.from_dict` reads it back for a cache hit.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.engine.methods import DRAFT_VOCAB, GateSet, gate_candidates

SPEED_METRICS = ("speedup", "mbsu")


OLD_ROW_NAMES = {"drafter_ms_per_step": "drafter_ms_per_round", "target_ms_per_step": "target_ms_per_round"}
"""Row fields renamed in evaluate version 10 (they always held a round's milliseconds), for reports written before."""


def _renamed(row: dict) -> dict:
    return {OLD_ROW_NAMES.get(key, key): value for key, value in row.items()}


@dataclass
class EvalRow:
    """One configuration (task × method × drafter × γ × shortlist) of the matrix. ``ar`` rows are the
    autoregressive baseline (γ = 0, no drafter)."""

    task: str
    method: str
    drafter: str | None
    gamma: int
    shortlist: str | None
    shortlist_size: int | None
    prompts: int
    new_tokens: int
    target_forwards: int
    tau: float
    acceptance_rate: float | None
    per_position_acceptance: list[float]
    tokens_per_s: float
    speedup: float | None
    predicted_speedup: float | None
    mbsu: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    drafter_ms_per_round: float | None
    """Drafting milliseconds a round (all its drafts; ``head_ms_per_step`` is a draft step's head alone)."""
    target_ms_per_round: float | None
    """Milliseconds of a round's one verify forward."""
    greedy_equal: bool
    greedy_ties: int | None = None
    """Where ``greedy_equal`` is False and every difference from autoregressive decoding was a floating-point tie
    (the two tokens' logits within ``evaluate.tie_tolerance``: the lossless check passes), the prompts that differed;
    None otherwise."""
    budget: str | None = None
    """Shortlist budget of a context-dependent method at this γ (DynaSpec ``k12`` / ``k0_30-k1_12``, PA-FR
    ``kmax700``)."""
    draft_vocab_mean: float | None = None
    """Mean number of head rows evaluated per draft step (the shortlist size; the vocabulary for full)."""
    draft_vocab_per_position: list[float] | None = None
    """Mean head rows at each draft position t = 0..γ-1."""
    head_ms_per_step: float | None = None
    """Milliseconds per draft step spent in the LM head alone (selection + gather + matmul)."""
    drafter_calls_per_token: float | None = None
    """Drafter forward calls per token the rounds kept (τ's numerator: a first token the target's prefill emitted is
    in no round), for proposers that count them (other-tokenizer and byte drafters; SLRS: one per trie depth, batched
    over its nodes; DFlash: one per round). Times τ it is the calls per round. MBSU then charges ``c`` per measured
    call instead of assuming γ calls per round."""
    psi_rows_per_token: float | None = None
    """SLRS only: next-byte distributions computed per token the rounds kept to get psi exactly (the trie's nodes)."""
    tau_standard_error: float | None = None
    """Standard error of ``tau`` over the prompts (:func:`pipeline.engine.metrics.tau_standard_error`)."""
    kept_per_prompt: list[int] | None = None
    """Tokens the rounds kept, per prompt in decoding order (τ's numerator): with ``rounds_per_prompt`` it pairs two
    rows decoded on the same prompts (:func:`pipeline.engine.metrics.paired_tau_difference`)."""
    rounds_per_prompt: list[int] | None = None
    """Drafting-verification rounds per prompt (τ's denominator)."""

    def per_kept_token(self, count: float) -> float | None:
        """``count`` (drafter calls, ψ rows) per token the rounds kept; None where they kept none."""
        kept = sum(self.kept_per_prompt) if self.kept_per_prompt is not None else self.new_tokens
        return count / kept if kept else None

    @property
    def tag(self) -> str:
        """A metric-name prefix: ``chat.shortlist.top_k_256.g4``."""
        return f"{self.task}.{self.method}" + (f".{self.shortlist}" if self.shortlist else "") + f".g{self.gamma}"


@dataclass
class LosslessCheck:
    """One losslessness check (greedy equality, first-token distribution) and its verdict."""

    name: str
    passed: bool
    detail: str


@dataclass
class GateCheck:
    """One gate: the value found, the threshold, and whether it passed."""

    passed: bool
    value: Any
    threshold: Any
    detail: str


@dataclass
class Chosen:
    """The configuration a bundle would be registered for: the best shortlist (None for an EAGLE-3 head)
    and γ, averaged over tasks."""

    shortlist: str | None
    gamma: int
    shortlist_size: int | None
    tau: float
    speedup: float | None
    mbsu: float | None
    acceptance_rate: float | None
    predicted_speedup: float | None
    """Each None where no row of the configuration has the figure (it is then not registered as a metric)."""

    def metrics(self) -> dict[str, float]:
        """The numeric figures (for the registry's version tags and the primary metric)."""
        return {k: float(v) for k, v in dataclasses.asdict(self).items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}


@dataclass
class Gates:
    """The verdict: every gate check, the chosen configuration, and the speed metric gated on."""

    passed: bool
    checks: dict[str, GateCheck]
    chosen: Chosen | None
    speed_metric: str

    def failures(self) -> list[str]:
        """``name (value vs threshold)`` of each failed gate."""
        return [f"{name} ({c.value} vs {c.threshold})" for name, c in self.checks.items() if not c.passed]

    def unevaluated(self) -> str | None:
        """Why none of the bundle's configurations was decoded (its ``<methods>_evaluated`` check), else None."""
        return next((c.detail for name, c in self.checks.items() if not_evaluated(name, c.passed)), None)


EVALUATED_CHECK = "_evaluated"
"""The suffix of the check a bundle fails when none of its methods was decoded (``decide_gates``)."""


def not_evaluated(check: str, passed: Any) -> bool:
    """Whether gate check ``check`` with verdict ``passed`` says its bundle was not evaluated at all."""
    return check.endswith(EVALUATED_CHECK) and passed is False


@dataclass
class EvaluationResults:
    """Everything the evaluate stage found."""

    rows: list[EvalRow]
    checks: list[LosslessCheck]
    gates: Gates
    device: str
    target: dict
    inputs: dict[str, str]
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    eagle3_gates: Gates | None = None
    """The EAGLE-3 bundle's verdict (its best γ), when method ``eagle3`` was evaluated."""
    dynaspec_gates: Gates | None = None
    """The DynaSpec bundle's verdict (DynaSpec-PA's best γ, or DynaSpec-F's when PA is not evaluated)."""
    dynaspec_policy: dict | None = None
    """How the DynaSpec and PA-FR budgets were matched: the FR-Spec shortlist, its size, budgets per γ."""
    rdk_gates: Gates | None = None
    """The RDK bundle's verdict (the best redistributed configuration: method × kept set × γ)."""
    rdk_analysis: dict | None = None
    """estimate_rdk's held-out analysis per kept set: τ, prior weight, α of TLI / RDK / Taylor / prior mix / oracle."""
    eagle3_training: dict | None = None
    """What train_drafter predicted for the evaluated EAGLE-3 drafter: the checkpoint's step and its
    held-out simulated τ and per-step accuracies, shown beside the τ measured here."""
    dflash_gates: Gates | None = None
    """The DFlash bundle's verdict (its best γ), when method ``dflash`` was evaluated."""
    dflash_training: dict | None = None
    """What train_dflash predicted for the evaluated DFlash drafter (its kept checkpoint's held-out simulated τ)."""
    decode_path: str | None = None
    """The decode path the rows were measured on (eager, static, graphs)."""
    first_token: str | None = None
    """``prefill`` when the target's prefill emitted each generation's first token (``evaluate.first_token``), which
    τ then leaves out; None for the engine's original order (the first round drafts it)."""
    other_devices: list[dict] | None = None
    """The same config's evaluations on other devices found in the store: ``{"device", "decode_path", "evaluation",
    "rows"}`` with their result rows (the report's device table)."""

    @property
    def lossless(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        """The JSON form written as ``report.json`` and rendered by :mod:`pipeline.evaluation.report`."""
        return {"rows": [dataclasses.asdict(r) for r in self.rows],
                "lossless": {"passed": self.lossless, "checks": [dataclasses.asdict(c) for c in self.checks]},
                "gates": dataclasses.asdict(self.gates), "device": self.device, "target": self.target,
                "inputs": self.inputs, "created": self.created,
                "eagle3_gates": dataclasses.asdict(self.eagle3_gates) if self.eagle3_gates else None,
                "eagle3_training": self.eagle3_training,
                "dynaspec_gates": dataclasses.asdict(self.dynaspec_gates) if self.dynaspec_gates else None,
                "dynaspec_policy": self.dynaspec_policy,
                "rdk_gates": dataclasses.asdict(self.rdk_gates) if self.rdk_gates else None,
                "rdk_analysis": self.rdk_analysis,
                # only when DFlash was evaluated (an opt-in method): other reports keep their keys
                **({"dflash_gates": dataclasses.asdict(self.dflash_gates) if self.dflash_gates else None,
                    "dflash_training": self.dflash_training}
                   if self.dflash_gates or self.dflash_training else {}),
                **({"decode_path": self.decode_path} if self.decode_path else {}),
                **({"first_token": self.first_token} if self.first_token else {}),
                **({"other_devices": self.other_devices} if self.other_devices else {})}

    @classmethod
    def from_dict(cls, data: dict) -> EvaluationResults:
        """Read back :meth:`to_dict` (a cached evaluation's ``report.json``)."""
        def gates(raw: dict | None) -> Gates | None:
            if raw is None:
                return None
            chosen = raw.get("chosen")
            return Gates(passed=raw["passed"], checks={k: GateCheck(**v) for k, v in raw["checks"].items()},
                         chosen=Chosen(**chosen) if chosen else None, speed_metric=raw["speed_metric"])

        return cls(
            rows=[EvalRow(**_renamed(r)) for r in data["rows"]],
            checks=[LosslessCheck(**c) for c in data["lossless"]["checks"]],
            gates=gates(data["gates"]), device=data["device"], target=data["target"], inputs=data["inputs"],
            created=data["created"], eagle3_gates=gates(data.get("eagle3_gates")),
            eagle3_training=data.get("eagle3_training"), dynaspec_gates=gates(data.get("dynaspec_gates")),
            dynaspec_policy=data.get("dynaspec_policy"), rdk_gates=gates(data.get("rdk_gates")),
            rdk_analysis=data.get("rdk_analysis"), dflash_gates=gates(data.get("dflash_gates")),
            dflash_training=data.get("dflash_training"), decode_path=data.get("decode_path"),
            first_token=data.get("first_token"), other_devices=data.get("other_devices"))


def _mean(rows: list[EvalRow], key: str) -> float | None:
    """The mean of a figure over ``rows`` (tasks), None where no row has it: a figure nobody measured is missing,
    not 0."""
    values = [getattr(r, key) for r in rows if getattr(r, key) is not None]
    return float(np.mean(values)) if values else None


def _ranked(value: float | None) -> float:
    """A figure as a ranking key: a missing or non-finite one ranks last (NaN would make ``max`` depend on order)."""
    return value if value is not None and math.isfinite(value) else -math.inf


def _unmeasured(rows: list[EvalRow], key: str) -> list[str]:
    """The tasks of ``rows`` whose ``key`` is missing or not finite: a gate "over tasks" cannot pass on the others."""
    return [r.task for r in rows if getattr(r, key) is None or not math.isfinite(getattr(r, key))]


def decide_gates(rows: list[EvalRow], checks: list[LosslessCheck], *, speed_metric: str, tau_min: float,
                 speed_min: float, gate: GateSet = DRAFT_VOCAB, evaluated: Collection[str] | None = None) -> Gates:
    """The verdict of bundle ``gate``, a pure function of the results: lossless, and the best of its candidate
    configurations (highest mean speed metric over tasks, then τ) reaches the τ and speed minimums.

    Losslessness is judged over every check, not only the bundle's methods': a failure anywhere means the
    engine cannot be trusted, so nothing is registered.

    Args:
        rows: The matrix rows.
        checks: The losslessness checks.
        speed_metric: ``speedup`` (measured; meaningful on CUDA) or ``mbsu`` (the CPU proxy).
        tau_min: Minimum mean accepted length τ of the chosen configuration.
        speed_min: Minimum of its speed metric.
        gate: The bundle (:data:`~pipeline.engine.methods.GATE_SETS`): its methods are the registered methods
            that name it, and its ``configurations`` say what a candidate is — a named shortlist × γ (the
            draft-vocabulary bundle), γ of one method (EAGLE-3; DynaSpec: PA, or F when PA is not evaluated)
            or method × kept set × γ, named ``<method>:<kept set>`` (RDK).
        evaluated: The evaluated methods (``evaluate.methods``), which pick a ``per_gamma`` bundle's method;
            None counts every method as evaluated.
    """
    if speed_metric not in SPEED_METRICS:
        raise ValueError(f"speed_metric must be one of {SPEED_METRICS}, not {speed_metric!r}")
    method = gate_candidates(gate, evaluated)
    lossless = bool(checks) and all(c.passed for c in checks)  # no check at all shows nothing
    gate_checks = {"lossless": GateCheck(lossless, lossless, True, f"{len(checks)} checks")}
    candidates: dict[tuple[str, int], list[EvalRow]] = {}
    several = not isinstance(method, str)
    label = "/".join(method) if several else method
    named_only = gate.configurations == "named_shortlist"
    for row in rows:
        if (row.method in method if several else row.method == method) and (not named_only or row.shortlist is not None):
            name = f"{row.method}:{row.shortlist}" if several else row.shortlist
            candidates.setdefault((name, row.gamma), []).append(row)
    chosen = None
    if candidates:
        (name, gamma), best = max(candidates.items(),
                                  key=lambda kv: (_ranked(_mean(kv[1], speed_metric)), _ranked(_mean(kv[1], "tau"))))
        sizes = [r.shortlist_size for r in best if r.shortlist_size is not None]
        # a budgeted shortlist's size is measured per task (its mean head rows): the mean over tasks, as every figure
        chosen = Chosen(shortlist=name, gamma=gamma, shortlist_size=round(float(np.mean(sizes))) if sizes else None,
                        **{k: _mean(best, k) for k in ("tau", "speedup", "mbsu", "acceptance_rate",
                                                       "predicted_speedup")})
        where = f"{name or method}, γ={gamma} over tasks"
        for key, figure, floor in (("tau_min", "tau", tau_min), (f"{speed_metric}_min", speed_metric, speed_min)):
            value, missing = getattr(chosen, figure), _unmeasured(best, figure)
            shown = "τ" if figure == "tau" else figure
            gate_checks[key] = GateCheck(
                not missing and value >= floor, value, floor,
                f"mean {shown} of {where}" if not missing else
                f"no finite {shown} was measured for task(s) {', '.join(missing)} of {where}")
    else:
        gate_checks[f"{label}{EVALUATED_CHECK}"] = GateCheck(
            False, False, True, f"no {label} configuration was evaluated: nothing to register")
    return Gates(passed=all(c.passed for c in gate_checks.values()), checks=gate_checks, chosen=chosen,
                 speed_metric=speed_metric)
