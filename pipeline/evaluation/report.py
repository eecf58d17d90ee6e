"""The evaluation report: the ``evaluate`` stage's results dict rendered as Markdown, HTML and JSON.

:func:`markdown_table` gives one GitHub-markdown row per result row (for the README and the CLI);
:func:`render_html` writes one self-contained page (inline CSS and SVG, no external CSS, JS or fonts:
matplotlib draws text as paths) with the target, device, gate verdict, the table, four plots and the
losslessness checks; :func:`write_report` writes all three. Results come from a run that may have
failed part-way, so every field may be missing, ``None`` or non-finite: it is shown as "—" and a plot
with nothing to draw is replaced by a one-line note. Every string taken from the results is escaped.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

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
)
from pipeline.evaluation.results import EvaluationResults
from pipeline.evaluation.sections import (
    EAGLE3_HEADERS,
    RDK_ANALYSIS_HEADERS,
    RDK_DECODE_HEADERS,
    SHORTLIST_HEADERS,
    SLRS_HEADERS,
    SLRS_NOTE,
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
    ("lossless", lambda r: _tick(r.get("greedy_equal"))),
]


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


def _label(*parts: Any) -> str:
    """A plot label from result strings: '$' is escaped so matplotlib never parses it as mathtext."""
    text = " / ".join(str(p) for p in parts if p is not None and p != "")
    text = text if len(text) <= 48 else text[:47] + "…"
    return text.replace("$", r"\$")


def _color(method: Any) -> str:
    """One colour per method, the same in every plot (unknown methods are grey)."""
    return f"C{_rank(method)}" if method in METHOD_ORDER else "C7"


def _figure(width: float = 7.5, height: float = 3.6) -> Any:
    # A bare Figure (not pyplot) touches no global backend state and is never shown on screen.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _finish(ax: Any, title: str, xlabel: str, ylabel: str, fontsize: float = 8, **legend: Any) -> None:
    """Title, axis labels, light grid, and the legend outside the axes on the right."""
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(**legend, fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1))


def _plot_tau(rows: list[Row]) -> Any:
    """Grouped bars: τ per task (groups) and method (bars), the best configuration of each method."""
    best: dict[tuple[str, str], float] = {}
    for r in rows:
        tau, key = _num(r.get("tau")), (_text(r.get("task")), _text(r.get("method")))
        if tau is not None:
            best[key] = max(tau, best.get(key, tau))
    if not best:
        return None
    tasks = sorted({t for t, _ in best})
    methods = sorted({m for _, m in best}, key=lambda m: (_rank(m), m))
    fig = _figure()
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs = [t + (i - (len(methods) - 1) / 2) * width for t in range(len(tasks))]
        heights = [best.get((task, method), 0.0) for task in tasks]
        bars = ax.bar(xs, heights, width, label=_label(method), color=_color(method))
        texts = [f"{h:.2f}" if (task, method) in best else "" for task, h in zip(tasks, heights)]
        ax.bar_label(bars, texts, fontsize=7, padding=1)
    ax.set_xticks(range(len(tasks)), [_label(t) for t in tasks])
    ax.margins(y=0.12)
    _finish(ax, "Mean accepted length τ (best configuration per method)", "", "τ (tokens per target forward)")
    ax.grid(False)
    return fig


def _plot_positions(rows: list[Row]) -> Any:
    """Per-position acceptance, one panel per task and one line per method/drafter/γ/shortlist."""
    lines: dict[str, dict[str, list[tuple[int, float]]]] = {}
    order: dict[str, tuple] = {}  # label -> (method rank, shortlist size, label, method): legend order
    for r in rows:
        values = r.get("per_position_acceptance")
        values = values if isinstance(values, list) else []
        points = [(i + 1, v) for i, v in enumerate(values) if _num(v) is not None]
        if points and r.get("method") != "ar":
            gamma = _num(r.get("gamma"))
            gamma_text = None if gamma is None else f"γ={int(gamma)}"
            label = _label(r.get("method"), r.get("drafter"), gamma_text, r.get("shortlist"))
            lines.setdefault(_text(r.get("task")), {})[label] = points
            method = r.get("method")
            order[label] = (_rank(method), _num(r.get("shortlist_size")) or 0.0, label, str(method))
    if not lines:
        return None
    labels = sorted(order, key=order.__getitem__)
    # Colour says the method (as in every plot); dash and marker tell its variants apart.
    style, seen = {}, {}
    for label in labels:
        method = order[label][3]
        k = seen[method] = seen.get(method, -1) + 1
        style[label] = (_color(method), ("-", "--", ":", "-.")[k % 4], "osD^v*"[k % 6])
    fig = _figure(4.0 + 3.2 * len(lines), 3.6)
    axes = fig.subplots(1, len(lines), sharey=True, squeeze=False)[0]
    for ax, task in zip(axes, sorted(lines)):
        for label, points in sorted(lines[task].items()):
            color, dash, marker = style[label]
            ax.plot(*zip(*points), marker=marker, markersize=4, color=color, linestyle=dash, label=label)
        ax.set_title(f"task: {_label(task)}")
        ax.set_xlabel("draft position")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance probability")
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}
    fig.legend([handles[k] for k in labels], labels, loc="outside right upper", fontsize=7)
    fig.suptitle("Per-position acceptance")
    return fig


def _plot_shortlist(rows: list[Row]) -> Any:
    """Shortlist size vs τ, one line per task (and drafter/γ when several), full-head τ dashed."""
    curves: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        size, tau = _num(r.get("shortlist_size")), _num(r.get("tau"))
        if r.get("method") == "shortlist" and size is not None and size > 0 and tau is not None:
            curves.setdefault((r.get("task"), r.get("drafter"), r.get("gamma")), []).append((size, tau))
    if not curves:
        return None
    several = len({key[1:] for key in curves}) > 1
    fig = _figure()
    ax = fig.add_subplot()
    for i, ((task, drafter, gamma), points) in enumerate(sorted(curves.items(), key=str)):
        label = _label(task, drafter, f"γ={gamma}") if several else _label(task)
        ax.plot(*zip(*sorted(points)), marker="o", color=f"C{i % 10}", label=label)
        same = [r for r in rows if r.get("method") == "full" and r.get("task") == task]
        if several:
            same = [r for r in same if (r.get("drafter"), r.get("gamma")) == (drafter, gamma)]
        full = [t for t in (_num(r.get("tau")) for r in same) if t is not None]
        if full:
            ax.axhline(max(full), color=f"C{i % 10}", linestyle="--", lw=1, label=f"{label}: full head")
    sizes = sorted({s for points in curves.values() for s, _ in points})
    if sizes[-1] >= 10 * sizes[0]:
        ax.set_xscale("log")
    if len(sizes) <= 8:
        # Ticks at the sizes evaluated, as plain integers (a log axis would print 6×10^2).
        ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
        ax.minorticks_off()
    ax.margins(y=0.1)
    _finish(ax, "Shortlist size vs mean accepted length τ", "shortlist size (tokens)", "τ")
    return fig


def _plot_speedup(rows: list[Row], device: str) -> Any:
    """Measured vs Leviathan-predicted speedup, colour by method, marker by task, with y = x."""
    points = [(r, _num(r.get("predicted_speedup")), _num(r.get("speedup"))) for r in rows]
    points = [(r, x, y) for r, x, y in points if x is not None and y is not None]
    if not points:
        return None
    tasks = sorted({_text(r.get("task")) for r, _, _ in points})
    fig = _figure(6.5, 4.2)
    ax = fig.add_subplot()
    for r, x, y in points:
        method, task = _text(r.get("method")), _text(r.get("task"))
        marker = "osD^v*"[tasks.index(task) % 6]
        ax.scatter(x, y, c=_color(method), marker=marker, label=_label(method, task), edgecolors="k", lw=0.5)
    low = min(min(x, y) for _, x, y in points) * 0.9
    high = max(max(max(x, y) for _, x, y in points) * 1.1, low + 0.1)  # never an empty range
    ax.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1, label="y = x")
    ax.set(xlim=(low, high), ylim=(low, high))
    unique = {h.get_label(): h for h in ax.collections + ax.lines}  # one legend entry per method/task
    title, legend = f"Measured vs predicted speedup\n{_label(device)}", {"handles": list(unique.values())}
    _finish(ax, title, "predicted speedup (Leviathan)", "measured speedup vs AR", 7, **legend)
    return fig


def _svg(fig: Any) -> str:
    """The figure as an inline ``<svg>`` element (the XML prolog and DOCTYPE dropped)."""
    import matplotlib

    buffer = io.StringIO()
    # A fixed salt makes the ids (and so the page) reproducible; equal ids across figures only ever
    # name identical glyph/marker definitions.
    with matplotlib.rc_context({"svg.hashsalt": "drafter-report", "svg.fonttype": "path"}):
        # No metadata: the Dublin Core block only adds bytes and links to matplotlib.org.
        fig.savefig(buffer, format="svg", metadata=dict.fromkeys(("Date", "Creator", "Format", "Type")))
    text = buffer.getvalue()
    return text[text.index("<svg") :]


PLOTS: list[tuple[str, str, str]] = [
    ("tau", "Mean accepted length τ", "no row has a τ"),
    ("positions", "Per-position acceptance", "no drafting row has per-position acceptance"),
    ("shortlist", "Shortlist size vs τ", "no shortlist row has a size and a τ"),
    ("speedup", "Measured vs predicted speedup", "no row has both a measured and a predicted speedup"),
]


def _figures(results: dict) -> dict[str, Any]:
    """Each plot's figure by name, or None where there is nothing to draw."""
    rows, device = _rows(results), _text(results.get("device"))
    plots = {"tau": _plot_tau, "positions": _plot_positions, "shortlist": _plot_shortlist}
    return {name: plot(rows) for name, plot in plots.items()} | {"speedup": _plot_speedup(rows, device)}


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


def _checks_html(checks: Any) -> str:
    """Gate checks (a name → check mapping) or losslessness checks (a list) as a table."""
    if isinstance(checks, dict):
        items = list(checks.items())
    else:
        items = [(c.get("name"), c) for c in checks or [] if isinstance(c, dict)]
    fields = ("value", "threshold", "detail")
    rows = [
        [_text(name), _tick(c.get("passed")), *(_text(c.get(f)) for f in fields)]
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
    gates, lossless = results.get("gates") or {}, results.get("lossless") or {}
    esc, rows, title = html.escape, _rows(results), f"Drafter evaluation: {_text(target.get('model'))}"
    header = [_text(target.get(k)) for k in ("model", "revision", "vocab_hash")]
    header += [_text(results.get("device")), _text(results.get("created"))]
    parts = [
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{esc(title)}</title>",
        f"<style>{CSS}</style></head><body>\n<h1>{esc(title)}</h1>",
        _html_table(["target", "revision", "vocab hash", "device", "created"], [header]),
        f"<h2>Gates: {_verdict_html(gates.get('passed'))}</h2>",
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
    if slrs_table := slrs_rows(results):
        parts += ["<h2>String-level rejection sampling (SLRS)</h2>", f"<p class='note'>{esc(SLRS_NOTE)}</p>",
                  _html_table(SLRS_HEADERS, slrs_table, {1, 3, 4, 5, 6, 7})]
    parts.append("<h2>Results</h2>")
    table = [[fn(r) for _, fn in COLUMNS] for r in rows]
    numeric = {3, *range(5, len(COLUMNS) - 1)}  # γ and τ … MBSU are right-aligned
    headers = [h for h, _ in COLUMNS]
    parts.append(_html_table(headers, table, numeric) if rows else '<p class="note">No result rows.</p>')
    parts.append("<h2>Plots</h2>")
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
    figures = _figures(results)
    for name, heading, empty in PLOTS:
        parts.append(f"<h3>{esc(heading)}</h3>")
        fig = figures[name]
        if fig is None:
            parts.append(f'<p class="note">Plot omitted: {esc(empty)}.</p>')
            continue
        parts.append(_svg(fig))
        if png_dir is not None:
            fig.savefig(png_dir / f"{name}.png", dpi=110)
    parts.append(f"<h2>Losslessness: {_verdict_html(lossless.get('passed'))}</h2>")
    parts.append(_checks_html(lossless.get("checks")))
    parts.append("</body></html>\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_report(results: EvaluationResults | dict, out_dir: Path) -> list[Path]:
    """Write ``report.json`` (sorted keys, indent 2), ``report.html`` and ``report.md`` into ``out_dir``.

    The JSON is written first so the numbers survive even if rendering fails.

    Returns:
        The three paths, in that order.
    """
    if isinstance(results, EvaluationResults):
        results = results.to_dict()
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    json_path.write_text(json.dumps(results, sort_keys=True, indent=2, default=str) + "\n", encoding="utf-8")
    html_path = render_html(results, out_dir)
    model, device = _text((results.get("target") or {}).get("model")), _text(results.get("device"))
    verdict = _verdict((results.get("gates") or {}).get("passed"))
    md_path = out_dir / "report.md"
    md = f"# Drafter evaluation: {model}\n\nDevice: {device} · gates: **{verdict}**\n\n{markdown_table(results)}\n"
    for extra in (eagle3_markdown(results), dynaspec_markdown(results), rdk_markdown(results),
                  slrs_markdown(results)):
        if extra:
            md += "\n" + extra
    md_path.write_text(md, encoding="utf-8")
    return [json_path, html_path, md_path]
