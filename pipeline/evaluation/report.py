"""The evaluation report: the ``evaluate`` stage's results dict rendered as Markdown, HTML and JSON.

:func:`markdown_table` gives one GitHub-markdown row per result row (for the README and the CLI);
:func:`render_html` writes one self-contained page (inline CSS and SVG, no external CSS, JS or fonts:
matplotlib draws text as paths) with the target, device, gate verdict (values to their thresholds'
precision), the table, the four plots of :mod:`pipeline.evaluation.plots` and the losslessness checks;
:func:`write_report` writes all three. Results come from a run that may have failed part-way, so every
field may be missing, ``None`` or non-finite: it is shown as "—" and a plot with nothing to draw is
replaced by a one-line note. Every string taken from the results is escaped."""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from pipeline.engine.methods import DRAFT_VOCAB
from pipeline.evaluation.cells import (  # noqa: F401 - re-exported for callers of this module
    METHOD_ORDER,
    MISSING,
    Row,
    _fmt,
    _num,
    _rank,
    _rows,
    _shortlist_label,
    _text,
    _tick,
    _verdict,
    bundle_verdicts,
)
from pipeline.evaluation.plots import PLOTS, figures, svg
from pipeline.evaluation.results import EvaluationResults
from pipeline.evaluation.sections import (
    BLOCK_HEADERS,
    BLOCK_NOTE,
    DEVICE_HEADERS,
    DEVICE_NOTE,
    EAGLE3_HEADERS,
    RDK_ANALYSIS_HEADERS,
    RDK_DECODE_HEADERS,
    SHORTLIST_HEADERS,
    SLRS_HEADERS,
    SLRS_NOTE,
    block_markdown,
    block_rows,
    device_markdown,
    device_rows,
    dynaspec_markdown,
    eagle3_markdown,
    eagle3_rows,
    rdk_analysis_rows,
    rdk_decode_rows,
    rdk_markdown,
    shortlist_rows,
    slrs_markdown,
    slrs_rows,
)

# (header, cell) for the table; the same columns in Markdown and HTML.
COLUMNS: list[tuple[str, Callable[[Row], str]]] = [
    ("task", lambda r: _text(r.get("task"))),
    ("method", lambda r: _text(r.get("method"))),
    ("drafter", lambda r: _text(r.get("drafter"))),
    ("γ", lambda r: _fmt(r.get("gamma"), ".0f")),
    ("shortlist (size)", _shortlist_label),
    ("τ", lambda r: _fmt(r.get("tau"))),
    ("α", lambda r: _fmt(r.get("acceptance_rate"))),
    ("tokens/s", lambda r: _fmt(r.get("tokens_per_s"), ".1f")),
    ("speedup", lambda r: _fmt(r.get("speedup"), ".2f", "×")),
    ("predicted", lambda r: _fmt(r.get("predicted_speedup"), ".2f", "×")),
    ("MBSU", lambda r: _fmt(r.get("mbsu"), ".2f", "×")),
    ("lossless", lambda r: _lossless(r)),
]


def _lossless(row: Row) -> str:
    """✓ greedy output equal to autoregressive decoding on every prompt; ✓ (n ties) where the only differences were
    floating-point ties (the lossless check passes); ✗ otherwise."""
    ties, equal = row.get("greedy_ties"), row.get("greedy_equal")
    if equal is False and isinstance(ties, int) and not isinstance(ties, bool) and ties > 0:
        return f"✓ ({ties} tie{'s' if ties > 1 else ''})"
    return _tick(equal)


def markdown_table(results: dict, task: str | None = None) -> str:
    """A GitHub-markdown table with one line per result row.

    Args:
        results: the ``evaluate`` results dict.
        task: keep only the rows of this task (``"chat"``, ``"code"``); all rows when None.

    Returns:
        Header, separator and one line per row, joined by newlines (no trailing newline).
    """

    def cell(text: str) -> str:
        # A pipe would start a new column and a newline a new row.
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in _rows(results, task):
        lines.append("| " + " | ".join(cell(fn(row)) for _, fn in COLUMNS) + " |")
    return "\n".join(lines)


PREFILL_NOTE = ("First token from the target's prefill (evaluate.first_token=prefill): each generation's first new "
                "token is the target's own, and the first drafting round starts after it, as in vLLM, SGLang and "
                "EAGLE's reference code; τ counts only the rounds' tokens, as they report it.")

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}th,td{border:1px solid #ccc;padding:3px 7px}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#11772d;font-weight:bold}.fail{color:#b3261e;font-weight:bold}.none{color:#777}
.note{color:#777;font-style:italic}svg{max-width:100%;height:auto}"""


def _verdict_html(passed: Any) -> str:
    css = {True: "pass", False: "fail"}.get(passed, "none")
    return f'<span class="{css}">{_verdict(passed)}</span>'


def _html_table(headers: list[str], rows: list[list[str]], numeric: Collection[int] = ()) -> str:
    def td(i: int, text: str) -> str:
        css = {"✓": "pass", "✗": "fail"}.get(text, "n" if i in numeric else "")
        return f'<td class="{css}">{html.escape(text)}</td>' if css else f"<td>{html.escape(text)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(td(i, c) for i, c in enumerate(cells)) + "</tr>\n" for cells in rows)
    return f"<table><tr>{head}</tr>\n{body}</table>"


def _decimals(number: float) -> int:
    return len(f"{number:.10f}".rstrip("0").partition(".")[2])


def _gate_value(value: Any, threshold: Any) -> str:
    """A gate's value to its threshold's decimals (at least two), with more where rounding would put it on
    the threshold or on the other side of it (1.2996 against 1.3 is 1.2996, not 1.30)."""
    number, limit = _num(value), _num(threshold)
    if number is None:
        return _text(value)
    places = max(2, _decimals(limit) if limit is not None else 0)
    while limit is not None and places < 10:
        shown = float(f"{number:.{places}f}")
        if (shown >= limit) == (number >= limit) and (shown == limit) == (number == limit):
            break
        places += 1
    return f"{number:.{places}f}"


def _checks_html(checks: Any) -> str:
    """Gate checks (a name → check mapping) or losslessness checks (a list) as a table."""
    if isinstance(checks, dict):
        items = list(checks.items())
    else:
        items = [(c.get("name"), c) for c in checks or [] if isinstance(c, dict)]
    rows = [
        [_text(name), _tick(c.get("passed")), _gate_value(c.get("value"), c.get("threshold")),
         _text(c.get("threshold")), _text(c.get("detail"))]
        for name, c in items
        if isinstance(c, dict)
    ]
    if not rows:
        return '<p class="note">No checks recorded.</p>'
    return _html_table(["check", "passed", "value", "threshold", "detail"], rows)


def render_html(results: dict, out_dir: Path, *, png_dir: Path | None = None) -> Path:
    """Write ``out_dir/report.html``: one self-contained page (inline CSS and SVG, nothing external).

    Args:
        results: the ``evaluate`` results dict; any field may be missing or None.
        out_dir: directory to write into (created if needed).
        png_dir: if given, each plot is also saved there as ``<name>.png`` (for a README or a look).

    Returns:
        The path of the written page.
    """
    target = results.get("target") or {}
    gates, lossless, verdicts = results.get("gates") or {}, results.get("lossless") or {}, bundle_verdicts(results)
    esc, rows, title = html.escape, _rows(results), f"Drafter evaluation: {_text(target.get('model'))}"
    header = [_text(target.get(k)) for k in ("model", "revision", "vocab_hash")]
    header += [_text(results.get("device")), _text(results.get("created"))]
    parts = [
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{esc(title)}</title>",
        f"<style>{CSS}</style></head><body>\n<h1>{esc(title)}</h1>",
        _html_table(["target", "revision", "vocab hash", "device", "created"], [header]),
        *([f"<p class='note'>{esc(PREFILL_NOTE)}</p>"] if results.get("first_token") == "prefill" else []),
        "<h2>Gates: " + (" · ".join(f"{esc(name)} {_verdict_html(passed)}" for name, passed in verdicts)
                         or _verdict_html(None)) + "</h2>",
        f"<h3>Draft-vocabulary bundle: {_verdict_html(dict(verdicts).get(DRAFT_VOCAB.name))}</h3>",
        _checks_html(gates.get("checks")),
    ]
    if results.get("eagle3_gates") is not None:
        training = results.get("eagle3_training") or {}
        parts += [f"<h2>EAGLE-3 drafter {esc(_text(training.get('artifact')))}: "
                  f"{_verdict_html(results['eagle3_gates'].get('passed'))}</h2>",
                  _checks_html(results["eagle3_gates"].get("checks")),
                  f"<p class='note'>Checkpoint kept at step {esc(_text(training.get('step')))} by held-out "
                  "simulated τ; measured τ is the engine's.</p>",
                  _html_table(EAGLE3_HEADERS, eagle3_rows(results), {1, 2, 3, 4})]
    if (policy := results.get("dynaspec_policy")) is not None:
        ds_gates = results.get("dynaspec_gates")
        parts += ["<h2>Shortlists at matched size (DynaSpec, PA-FR, FR-Spec)"
                  + (f": {_verdict_html(ds_gates.get('passed'))}" if ds_gates is not None else "") + "</h2>",
                  f"<p class='note'>Budgets matched per γ to FR-Spec shortlist {esc(_text(policy.get('match')))} "
                  f"({esc(_text(policy.get('match_size')))} tokens).</p>"]
        if ds_gates is not None:
            parts.append(_checks_html(ds_gates.get("checks")))
        parts.append(_html_table(SHORTLIST_HEADERS, shortlist_rows(results, policy.get("match")), {1, 4, 6, 7, 8, 9}))
    if results.get("rdk_analysis") is not None:
        rdk_gates = results.get("rdk_gates")
        parts += ["<h2>Out-of-vocabulary drafting (RDK)"
                  + (f": {_verdict_html(rdk_gates.get('passed'))}" if rdk_gates is not None else "") + "</h2>",
                  "<p class='note'>α at temperature 1: held-out chat (τ and prior weight chosen on half the "
                  "positions) and code (HumanEval solutions, the chat choices unchanged).</p>",
                  _html_table(RDK_ANALYSIS_HEADERS, rdk_analysis_rows(results), {1, 3, 4, 5, 6, 7, 8, 9}),
                  _html_table(RDK_DECODE_HEADERS, rdk_decode_rows(results), {1, 4, 5})]
        if rdk_gates is not None:
            parts.append(_checks_html(rdk_gates.get("checks")))
    if block_table := block_rows(results):
        block_gates = results.get("dflash_gates")
        parts += ["<h2>Block drafting (DFlash) beside EAGLE-3"
                  + (f": {_verdict_html(block_gates.get('passed'))}" if block_gates is not None else "") + "</h2>",
                  f"<p class='note'>{html.escape(BLOCK_NOTE)}</p>"]
        if block_gates is not None:
            parts.append(_checks_html(block_gates.get("checks")))
        parts.append(_html_table(BLOCK_HEADERS, block_table, {1, 3, 4, 6, 7, 8, 9, 10, 11}))
    if slrs_table := slrs_rows(results):
        parts += ["<h2>String-level rejection sampling (SLRS)</h2>", f"<p class='note'>{esc(SLRS_NOTE)}</p>",
                  _html_table(SLRS_HEADERS, slrs_table, {1, 3, 4, 5, 6, 7})]
    if device_table := device_rows(results):
        parts += ["<h2>Wall-clock on each device</h2>", f"<p class='note'>{esc(DEVICE_NOTE)} This device: "
                  f"{esc(_text(results.get('device')))} ({esc(_text(results.get('decode_path')))}).</p>",
                  _html_table(DEVICE_HEADERS, device_table, {2, 4, 5, 7, 8})]
    parts.append("<h2>Results</h2>")
    table = [[fn(r) for _, fn in COLUMNS] for r in rows]
    numeric = {3, *range(5, len(COLUMNS) - 1)}  # γ and τ … MBSU are right-aligned
    headers = [h for h, _ in COLUMNS]
    parts.append(_html_table(headers, table, numeric) if rows else '<p class="note">No result rows.</p>')
    parts.append("<h2>Plots</h2>")
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
    drawn = figures(results)
    for name, heading, empty in PLOTS:
        parts.append(f"<h3>{esc(heading)}</h3>")
        fig = drawn[name]
        if fig is None:
            parts.append(f'<p class="note">Plot omitted: {esc(empty)}.</p>')
            continue
        parts.append(svg(fig))
        if png_dir is not None:
            fig.savefig(png_dir / f"{name}.png", dpi=110)
    parts.append(f"<h2>Losslessness: {_verdict_html(lossless.get('passed'))}</h2>")
    parts.append(_checks_html(lossless.get("checks")))
    parts.append("</body></html>\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_report(evaluation: EvaluationResults, out_dir: Path, *, provenance: dict | None = None) -> list[Path]:
    """Write ``report.json`` (sorted keys, indent 2), ``report.html`` and ``report.md`` into ``out_dir``.

    The stage hands over its typed results; the page and the table are rendered from the JSON written first (plus
    ``provenance``, e.g. the command and host of a bench run), so the numbers survive even if rendering fails and a
    page rendered again from ``report.json`` is the same page.

    Returns:
        The three paths, in that order.
    """
    results = {**evaluation.to_dict(), **(provenance or {})}
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(results, sort_keys=True, indent=2, default=str) + "\n", encoding="utf-8")
    html_path = render_html(results, out_dir)
    model, device = _text((results.get("target") or {}).get("model")), _text(results.get("device"))
    verdicts = bundle_verdicts(results)
    verdict = " · ".join(f"{name} **{_verdict(passed)}**" for name, passed in verdicts) or f"**{_verdict(None)}**"
    md_path = out_dir / "report.md"
    note = f"\n\n{PREFILL_NOTE}" if results.get("first_token") == "prefill" else ""
    md = (f"# Drafter evaluation: {model}\n\nDevice: {device} · gates: {verdict}{note}\n\n"
          f"{markdown_table(results)}\n")
    for extra in (eagle3_markdown(results), dynaspec_markdown(results), rdk_markdown(results),
                  block_markdown(results), slrs_markdown(results), device_markdown(results)):
        if extra:
            md += "\n" + extra
    md_path.write_text(md, encoding="utf-8")
    return [json_path, html_path, md_path]
