"""Formatting shared by the report and its sections: numbers that may be missing, and the row order (the
method registry's)."""

from __future__ import annotations

import math
from typing import Any

from pipeline.engine.methods import GATE_SETS, REPORT_ORDER
from pipeline.evaluation.results import not_evaluated

METHOD_ORDER = REPORT_ORDER  # the baseline, then each method by its registry entry's order
MISSING = "—"

Row = dict[str, Any]


def _num(value: Any) -> float | None:
    """``value`` as a finite float, else None (bools, strings, NaN and inf are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    number = _num(value)
    return MISSING if number is None else f"{number:{spec}}{suffix}"


def _text(value: Any) -> str:
    return MISSING if value is None or value == "" else str(value)


def _shortlist_label(row: Row) -> str:
    name, size = row.get("shortlist"), _num(row.get("shortlist_size"))
    if name is None and size is None:
        return MISSING
    return f"{_text(name)} ({int(size)})" if size is not None else _text(name)


def _tick(passed: Any) -> str:
    return {True: "✓", False: "✗"}.get(passed, MISSING)


def _rank(method: Any) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def _rows(results: dict, task: str | None = None) -> list[Row]:
    """The result rows that are dicts, of ``task`` if given, ordered by task then method (stable)."""
    rows = [r for r in results.get("rows") or [] if isinstance(r, dict)]
    if task is not None:
        rows = [r for r in rows if r.get("task") == task]
    return sorted(rows, key=lambda r: (str(r.get("task")), _rank(r.get("method"))))


def _verdict(passed: Any) -> str:
    return {True: "PASSED", False: "FAILED"}.get(passed, "NOT EVALUATED")


def bundle_verdicts(results: dict) -> list[tuple[str, bool | None]]:
    """Each bundle the evaluation judged, in registration order, with its verdict: passed, failed, or None where none
    of its methods was decoded (``evaluate.methods`` named none: e.g. the draft-vocabulary bundle of a run that decodes
    only EAGLE-3 and DFlash), so that a run's headline is not a failure it never asked for (``_verdict``: NOT
    EVALUATED). Such a bundle is still not registered."""
    verdicts = []
    for gate in GATE_SETS.values():
        judged = results.get(gate.results_field)
        if not isinstance(judged, dict):
            continue
        checks = judged.get("checks") if isinstance(judged.get("checks"), dict) else {}
        unevaluated = any(isinstance(check, dict) and not_evaluated(name, check.get("passed"))
                          for name, check in checks.items())
        verdicts.append((gate.name, None if unevaluated else judged.get("passed")))
    return verdicts
