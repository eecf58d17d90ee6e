"""Typed evaluation results: the gates are a pure function of the rows and checks, the JSON form round-
trips, and the report shows what the results hold (no field read that nothing sets)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.evaluation.report import render_html, write_report
from pipeline.evaluation.results import EvalRow, EvaluationResults, LosslessCheck, decide_gates
from tests.helpers import typed_results


def test_gates_choose_the_best_shortlist_by_the_speed_metric() -> None:
    results = typed_results()
    chosen = results.gates.chosen
    # synthetic_results: τ grows with the shortlist index and mbsu = τ/1.3, so the largest one wins.
    assert (chosen.shortlist, chosen.gamma, chosen.shortlist_size) == ("top-k 8192", 3, 8192)
    taus = [r.tau for r in results.rows if r.shortlist == "top-k 8192"]
    assert chosen.tau == pytest.approx(sum(taus) / len(taus)) and chosen.mbsu == pytest.approx(chosen.tau / 1.3)
    assert results.gates.passed and set(results.gates.checks) == {"lossless", "tau_min", "mbsu_min"}


def test_gates_are_a_pure_function_of_rows_checks_and_thresholds() -> None:
    results = typed_results()
    rows, checks = copy.deepcopy(results.rows), copy.deepcopy(results.checks)
    again = decide_gates(rows, checks, speed_metric="mbsu", tau_min=1.5, speed_min=1.0)
    assert rows == results.rows and checks == results.checks  # its inputs untouched
    assert again == results.gates  # and the same gates as the helper's call on equal inputs
    strict = decide_gates(results.rows, results.checks, speed_metric="mbsu", tau_min=99.0, speed_min=1.0)
    assert not strict.passed and strict.failures() == [f"tau_min ({strict.chosen.tau} vs 99.0)"]
    lossy = typed_results(lossless=False)
    assert not lossy.gates.passed and not lossy.gates.checks["lossless"].passed
    no_shortlist = [r for r in results.rows if r.method != "shortlist"]
    none = decide_gates(no_shortlist, results.checks, speed_metric="speedup", tau_min=1.0, speed_min=1.0)
    assert not none.passed and none.chosen is None and "shortlist_evaluated" in none.checks
    with pytest.raises(ValueError, match="speed_metric must be one of"):
        decide_gates(results.rows, results.checks, speed_metric="tau", tau_min=1.0, speed_min=1.0)


def test_results_round_trip_through_report_json(tmp_path: Path) -> None:
    results = typed_results()
    write_report(results, tmp_path)
    back = EvaluationResults.from_dict(json.loads((tmp_path / "report.json").read_text()))
    assert back == results
    assert dataclasses.asdict(back.gates) == dataclasses.asdict(results.gates)
    # a report written before evaluate version 10 named a round's milliseconds *_ms_per_step: read back the same
    old = json.loads((tmp_path / "report.json").read_text())
    for row in old["rows"]:
        row["drafter_ms_per_step"], row["target_ms_per_step"] = row.pop("drafter_ms_per_round"), row.pop(
            "target_ms_per_round")
    assert EvaluationResults.from_dict(old) == results


def test_report_header_shows_when_the_results_were_created(tmp_path: Path) -> None:
    """The report used to read ``created`` (and ``registration``), which the evaluate stage never set:
    the header showed "—". The typed results carry ``created``; registration is an event about the
    immutable artifact and lives beside it, not in the report."""
    results = typed_results()
    assert results.created[:2] == "20" and results.created.endswith("Z")
    page = render_html(results.to_dict(), tmp_path).read_text()
    assert f"<td>{results.created}</td>" in page
    assert "Registration" not in page


def test_a_budgeted_shortlists_chosen_size_is_the_mean_over_tasks() -> None:
    """DynaSpec's and PA-FR's rows carry each task's measured mean head size; the chosen configuration's size (the
    `dynaspec.shortlist_size` metric, the bundle, report.json) was the first task's alone while τ and the speed
    figures were means over tasks."""
    from pipeline.engine.methods import GATE_SETS
    from tests.helpers import report_row

    rows = [EvalRow(**report_row(task, "dynaspec_pa", 2.0, 0.5, shortlist=("k0_30-k1_12", size)))
            for task, size in (("chat", 120), ("code", 181))]
    checks = [LosslessCheck("greedy_equal[chat/dynaspec_pa/γ=3]", True, "8/8 prompts")]
    gates = decide_gates(rows, checks, gate=GATE_SETS["dynaspec"], evaluated=["dynaspec_pa"], speed_metric="mbsu",
                         tau_min=1.0, speed_min=0.0)
    assert gates.chosen.shortlist_size == 150  # round(150.5): banker's rounding of the mean


def test_each_bundle_chooses_among_its_own_methods() -> None:
    """The bundles of the method registry's GATE_SETS: DynaSpec gates PA (F only when PA is not evaluated),
    RDK every redistributed method by method × kept set (not its pruned baseline), EAGLE-3 its γ."""
    from pipeline.engine.methods import GATE_SETS
    from tests.helpers import report_row

    def row(method: str, tau: float, shortlist: str | None = None) -> EvalRow:
        return EvalRow(**report_row("chat", method, tau, 0.5, shortlist=(shortlist, 100) if shortlist else None))

    rows = [row("dynaspec", 2.5, "k12"), row("dynaspec_pa", 2.0, "k0_30-k1_12"), row("pruned", 3.0, "keep_0.1"),
            row("rdk", 2.2, "keep_0.1"), row("tli_rdk", 2.6), row("eagle3", 2.8), row("shortlist", 1.8, "top_k_8")]
    checks = [LosslessCheck("greedy_equal[chat/rdk/γ=3]", True, "8/8 prompts")]
    thresholds = {"speed_metric": "mbsu", "tau_min": 1.0, "speed_min": 0.0}
    dynaspec = GATE_SETS["dynaspec"]
    both = decide_gates(rows, checks, gate=dynaspec, evaluated=["dynaspec", "dynaspec_pa"], **thresholds)
    assert both.chosen.shortlist == "k0_30-k1_12" and both.chosen.tau == 2.0  # PA, though F's τ is higher
    fixed = decide_gates(rows, checks, gate=dynaspec, evaluated=["dynaspec"], **thresholds)
    assert fixed.chosen.shortlist == "k12"
    rdk = decide_gates(rows, checks, gate=GATE_SETS["rdk"], **thresholds)
    assert (rdk.chosen.shortlist, rdk.chosen.tau) == ("tli_rdk:None", 2.6)  # pruned (τ 3.0) is no candidate
    none = decide_gates([r for r in rows if r.method in ("pruned", "eagle3")], checks, gate=GATE_SETS["rdk"],
                        **thresholds)
    assert not none.passed and "rdk/rdk_taylor/rdk_prior/tli_rdk/tli_rdk_taylor/tli_rdk_prior_evaluated" in none.checks
    eagle3 = decide_gates(rows, checks, gate=GATE_SETS["eagle3"], **thresholds)
    assert (eagle3.chosen.shortlist, eagle3.chosen.tau) == (None, 2.8)
    draft_vocab = decide_gates(rows, checks, **thresholds)  # the default bundle: the count artifact's shortlists
    assert (draft_vocab.chosen.shortlist, draft_vocab.chosen.tau) == ("top_k_8", 1.8)


def test_a_figure_no_row_measured_is_missing_from_the_chosen_metrics_not_zero() -> None:
    """``_mean`` over rows that all lack a figure returned 0.0: an EAGLE-3 bundle (no predicted speedup: its drafter
    has no per-token cost model) was registered with ``predicted_speedup = 0.0``, and a configuration whose speed
    metric was never measured failed its speed gate as "0.0 < 1.0" instead of saying it was not measured."""
    from pipeline.engine.methods import GATE_SETS
    from tests.helpers import report_row

    rows = [EvalRow(**report_row(task, "eagle3", 2.8, 0.6)) for task in ("chat", "code")]
    checks = [LosslessCheck("greedy_equal[chat/eagle3/γ=3]", True, "8/8 prompts")]
    gates = decide_gates(rows, checks, gate=GATE_SETS["eagle3"], speed_metric="mbsu", tau_min=1.0, speed_min=1.0)
    assert gates.passed and gates.chosen.predicted_speedup is None
    assert set(gates.chosen.metrics()) == {"gamma", "tau", "speedup", "mbsu", "acceptance_rate"}
    for row in rows:
        row.mbsu = None
    unmeasured = decide_gates(rows, checks, gate=GATE_SETS["eagle3"], speed_metric="mbsu", tau_min=1.0,
                              speed_min=1.0)
    check = unmeasured.checks["mbsu_min"]
    assert not unmeasured.passed and (check.passed, check.value) == (False, None)
    assert check.detail == "no finite mbsu was measured for task(s) chat, code of eagle3, γ=3 over tasks"


def test_a_gate_over_tasks_needs_every_tasks_figure_finite_and_at_least_one_check() -> None:
    """A task whose speed figure was missing dropped out of the "mean over tasks" and the gate passed on the other; a
    NaN ranked by where it stood in the rows (chosen over a measured candidate); an infinite figure passed; and no
    lossless check at all read as lossless."""
    from tests.helpers import report_row

    ok = [LosslessCheck("greedy_equal[chat/shortlist/A/γ=3]", True, "8/8")]

    def rows(name: str, tau: float) -> list[EvalRow]:
        return [EvalRow(**report_row(t, "shortlist", tau, 0.6, shortlist=(name, 8))) for t in ("chat", "code")]

    one = rows("A", 2.0)
    one[0].speedup, one[1].speedup = 1.6, None
    gates = decide_gates(one, ok, speed_metric="speedup", tau_min=1.3, speed_min=1.5)
    assert not gates.passed and "no finite speedup was measured for task(s) code" in gates.checks["speedup_min"].detail
    a, b = rows("A", 2.0), rows("B", 2.5)
    a[0].speedup = float("nan")
    for order in (a + b, b + a):
        gates = decide_gates(order, ok, speed_metric="speedup", tau_min=1.3, speed_min=1.0)
        assert gates.chosen.shortlist == "B" and gates.passed
    b[0].speedup = float("inf")
    assert not decide_gates(b, ok, speed_metric="speedup", tau_min=1.3, speed_min=1.0).passed
    none = decide_gates(rows("B", 2.5), [], speed_metric="speedup", tau_min=1.3, speed_min=1.0)
    assert not none.passed and not none.checks["lossless"].passed


def test_a_configuration_exactly_at_its_floors_passes_its_gates() -> None:
    """The gates are minimums: a chosen configuration whose mean τ equals gate_tau_min, and whose speed metric equals
    gate_speed_min, passes both (a strict comparison failed it); a hair above either floor fails."""
    from tests.helpers import report_row

    ok = [LosslessCheck("greedy_equal[chat/shortlist/A/γ=3]", True, "8/8")]
    rows = [EvalRow(**report_row(t, "shortlist", 2.0, 0.6, shortlist=("A", 8))) for t in ("chat", "code")]
    assert {(r.tau, r.speedup) for r in rows} == {(2.0, 1.6)}  # report_row's speedup is 0.8 τ
    gates = decide_gates(rows, ok, speed_metric="speedup", tau_min=2.0, speed_min=1.6)
    assert (gates.chosen.tau, gates.chosen.speedup) == (2.0, 1.6)
    assert gates.passed and gates.checks["tau_min"].passed and gates.checks["speedup_min"].passed
    assert not decide_gates(rows, ok, speed_metric="speedup", tau_min=2.0 + 1e-9, speed_min=1.6).passed
    assert not decide_gates(rows, ok, speed_metric="speedup", tau_min=2.0, speed_min=1.6 + 1e-9).passed


def test_the_speed_metric_ranks_candidates_before_tau() -> None:
    """The chosen configuration is the one with the highest mean speed metric; τ only breaks a tie. Here the
    configuration with the higher τ has the lower speedup (a larger shortlist: more accepted, slower drafts), so
    the other is chosen; with equal speedups the higher τ wins."""
    from tests.helpers import report_row

    ok = [LosslessCheck("greedy_equal[chat/shortlist/A/γ=3]", True, "8/8")]

    def rows(name: str, tau: float, speedup: float) -> list[EvalRow]:
        made = [EvalRow(**report_row(t, "shortlist", tau, 0.6, shortlist=(name, 8))) for t in ("chat", "code")]
        for row in made:
            row.speedup = speedup
        return made

    for order in (rows("slow", 2.6, 1.2) + rows("fast", 2.0, 1.5), rows("fast", 2.0, 1.5) + rows("slow", 2.6, 1.2)):
        chosen = decide_gates(order, ok, speed_metric="speedup", tau_min=1.0, speed_min=1.0).chosen
        assert (chosen.shortlist, chosen.tau, chosen.speedup) == ("fast", 2.0, 1.5)
    tied = decide_gates(rows("slow", 2.6, 1.5) + rows("fast", 2.0, 1.5), ok, speed_metric="speedup", tau_min=1.0,
                        speed_min=1.0).chosen
    assert tied.shortlist == "slow"


def test_drafter_calls_are_counted_per_token_the_rounds_kept() -> None:
    """With ``evaluate.first_token=prefill`` each generation's first token comes from the target's prefill, in no
    round. Calls per token divided by every new token, so calls per token × τ (the report's drafter forwards per
    round) came out below the calls per round: 16 prompts of 64 tokens, one drafter call in each of 252 rounds that
    kept 63 tokens a prompt gave 0.98 forwards a round, not 1."""
    from tests.helpers import report_row

    row = EvalRow(**{**report_row("chat", "dflash", 4.0, 0.7), "prompts": 16, "new_tokens": 1024,
                     "kept_per_prompt": [63] * 16, "rounds_per_prompt": [252 // 16 + (i < 252 % 16) for i in range(16)]})
    row.tau = sum(row.kept_per_prompt) / sum(row.rounds_per_prompt)
    calls = 252  # one forward a round
    assert row.per_kept_token(calls) * row.tau == pytest.approx(1.0, rel=1e-12)
    assert calls / row.new_tokens * row.tau < 0.99  # what was reported
    assert EvalRow(**{**report_row("chat", "dflash", 4.0, 0.7), "kept_per_prompt": [0, 0]}).per_kept_token(3) is None
