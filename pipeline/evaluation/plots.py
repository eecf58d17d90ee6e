"""The evaluation report's four plots, drawn with matplotlib and inlined in the page as SVG.

Colour says a method's family and marker which method of its family it is, both read from the method
registry (:data:`pipeline.engine.methods.METHODS`), so every plot of every report styles a method the same
way and no method is named here; a method outside the registry (the autoregressive baseline) is grey.
Legends sit below the axes, their entries grouped under the family names and laid out in as many columns
as the figure is wide, and the figure grows to hold them, so nothing is cut off. No figure is wider than
:data:`MAX_WIDTH_IN`, so none is scaled down (its text shrunk) in the page's 1200 px column. A plot with
nothing to draw is None.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

from pipeline.engine.inputs import SameTokenizerInputs, ShortlistInputs
from pipeline.engine.methods import BASELINE, FAMILIES, METHODS, methods_with
from pipeline.evaluation.cells import Row, _num, _rank, _rows, _text

MAX_WIDTH_IN = 11.5
"""Widest figure in inches: 828 pt in the SVG (72 pt per inch) is 1104 CSS px, inside the page's 1200 px."""
FONT = 7
"""Point size of legend entries and bar labels."""
ROW_IN = 0.17
"""Height of one legend row at :data:`FONT` (text plus the spacing between rows), in inches."""
MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h")
"""A family's methods in registry order take these markers in turn."""
FAMILY_COLORS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")
"""One colour per family, in :data:`~pipeline.engine.methods.FAMILIES` order (C7, grey, is left out)."""
OTHER_COLOR = "C7"
"""The autoregressive baseline and any method outside the registry."""
OTHER_FAMILY = "baseline / other"
DASHES = ("-", "--", ":", "-.")
PLOTS: list[tuple[str, str, str]] = [
    ("tau", "Mean accepted length τ", "no row has a τ"),
    ("positions", "Per-position acceptance", "no drafting row has per-position acceptance"),
    ("shortlist", "Shortlist size vs τ", "no shortlist row has a size and a τ"),
    ("speedup", "Measured vs predicted speedup", "no row has both a measured and a predicted speedup"),
]


def family(method: Any) -> str:
    """The family the registry gives ``method``; :data:`OTHER_FAMILY` for anything else."""
    spec = METHODS.get(method) if isinstance(method, str) else None
    return spec.family if spec else OTHER_FAMILY


def color_of(fam: str) -> str:
    """The colour of family ``fam``."""
    return FAMILY_COLORS[FAMILIES.index(fam)] if fam in FAMILIES else OTHER_COLOR


def color(method: Any) -> str:
    """The colour of ``method``'s family (the same in every plot)."""
    return color_of(family(method))


def marker(method: Any) -> str:
    """The marker of ``method`` within its family: its place among the family's methods in the registry."""
    fam = family(method)
    members = [name for name, spec in METHODS.items() if spec.family == fam]
    return MARKERS[members.index(method) % len(MARKERS)] if method in members else "o"


def _label(*parts: Any) -> str:
    """A plot label from result strings, at most 48 characters: the middle parts (a drafter's name) are shortened
    first, so the method, γ and shortlist that tell a method's configurations apart stay whole; '$' is escaped so
    matplotlib never parses it as mathtext."""
    items = [str(p) for p in parts if p is not None and p != ""]
    text = " / ".join(items)
    while len(text) > 48 and len(items) > 2:
        i = max(range(1, len(items) - 1), key=lambda k: len(items[k]))
        if len(items[i]) <= 4:
            break
        items[i] = items[i][: max(3, len(items[i]) - (len(text) - 48) - 1)] + "…"
        text = " / ".join(items)
    text = text if len(text) <= 48 else text[:47] + "…"
    return text.replace("$", r"\$")


def _figure(width: float, height: float) -> Any:
    # A bare Figure (not pyplot) touches no global backend state and is never shown on screen.
    from matplotlib.figure import Figure

    return Figure(figsize=(min(width, MAX_WIDTH_IN), height), layout="constrained")


Group = tuple[str | None, list[tuple[Any, str]]]
"""A legend group: its heading (None for none) and its (handle, label) entries."""


@dataclass
class _Legend:
    """Legend entries laid out column by column, padded with blanks: (handle, label, is a heading)."""

    entries: list[tuple[Any, str, bool]]
    columns: int

    @property
    def rows(self) -> int:
        return len(self.entries) // self.columns

    @property
    def height(self) -> float:
        """Inches the legend takes below the axes."""
        return ROW_IN * self.rows + 0.1

    def draw(self, fig: Any) -> None:
        legend = fig.legend([h for h, _, _ in self.entries], [label for _, label, _ in self.entries],
                            loc="outside lower center", ncol=self.columns, fontsize=FONT, frameon=False)
        for text, (_, _, heading) in zip(legend.get_texts(), self.entries):
            if heading:
                text.set_fontweight("bold")


def _legend(groups: list[Group], width: float) -> _Legend:
    """Lay ``groups`` out in as many columns as fit ``width`` inches: a group that fits in a column is not
    split across two, and no heading ends a column."""
    from matplotlib.lines import Line2D

    def blank() -> tuple[Any, str, bool]:
        return Line2D([], [], linestyle="none"), "", False

    labels = [heading for heading, _ in groups if heading] + [label for _, members in groups for _, label in members]
    # A character at FONT points is about half an em; the handle and the gap to the next column ~0.6 in.
    column = 0.5 * FONT / 72 * max(len(label) for label in labels) + 0.6
    columns = max(1, min(len(labels), int(min(width, MAX_WIDTH_IN) // column)))
    rows = math.ceil(len(labels) / columns)
    while True:
        entries: list[tuple[Any, str, bool]] = []
        for heading, members in groups:
            size, room = len(members) + bool(heading), rows - len(entries) % rows
            if rows > 1 and size > room and (size <= rows or (heading and room == 1)):
                entries += [blank() for _ in range(room)]
            if heading:
                entries.append((Line2D([], [], linestyle="none"), heading, True))
            entries += [(handle, label, False) for handle, label in members]
        used = math.ceil(len(entries) / rows)
        if used <= columns:
            return _Legend(entries + [blank() for _ in range(used * rows - len(entries))], used)
        rows += 1


def _by_family(entries: list[tuple[Any, Any, str]]) -> list[Group]:
    """Legend groups from (method, handle, label) entries: each family's methods under the family's name."""
    groups: list[Group] = []
    for fam in (*FAMILIES, OTHER_FAMILY):
        members = [(handle, label) for method, handle, label in entries if family(method) == fam]
        if members:
            groups.append((fam, members))
    return groups


def _plot_tau(rows: list[Row]) -> Any:
    """Horizontal bars: τ of each method's best configuration, one panel per task, colour by family."""
    from matplotlib.patches import Patch

    best: dict[tuple[str, str], float] = {}
    for r in rows:
        tau, key = _num(r.get("tau")), (_text(r.get("task")), _text(r.get("method")))
        if tau is not None:
            best[key] = max(tau, best.get(key, tau))
    if not best:
        return None
    tasks = sorted({t for t, _ in best})
    order = (OTHER_FAMILY, *FAMILIES)  # the baseline on top, then the families, each one block of bars
    methods = sorted({m for _, m in best}, key=lambda m: (order.index(family(m)), _rank(m), m))
    families = [f for f in order if any(family(m) == f for m in methods)]
    width = 2.0 + 3.2 * len(tasks)
    legend = _legend([(None, [(Patch(color=color_of(f)), f) for f in families])], width)
    fig = _figure(width, 1.0 + 0.22 * len(methods) + legend.height)
    fig.get_layout_engine().set(wspace=0.08)  # room between one panel's last x label and the next's first
    axes = fig.subplots(1, len(tasks), sharex=True, sharey=True, squeeze=False)[0]
    ys = list(range(len(methods)))
    for ax, task in zip(axes, tasks):
        values = [best.get((task, m)) for m in methods]
        bars = ax.barh(ys, [v or 0.0 for v in values], height=0.7, color=[color(m) for m in methods])
        ax.bar_label(bars, ["" if v is None else f"{v:.2f}" for v in values], fontsize=FONT, padding=2)
        ax.set_title(f"task: {_label(task)}", fontsize=9)
        ax.set_xlabel("τ (tokens per verify round)", fontsize=8)
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys, [_label(m) for m in methods], fontsize=8)
    axes[0].invert_yaxis()  # the first method on top (the axes share y)
    legend.draw(fig)
    fig.suptitle("Mean accepted length τ (best configuration per method)", fontsize=10)
    return fig


def _plot_positions(rows: list[Row]) -> Any:
    """Per-position acceptance, one panel per task and one line per method/drafter/γ/shortlist: colour by
    family, marker by method, dash (and hollow markers) by configuration of the method."""
    from matplotlib.lines import Line2D

    lines: dict[str, dict[str, list[tuple[int, float]]]] = {}
    order: dict[str, tuple] = {}  # label -> (method rank, shortlist size, label, method): legend order
    shown: dict[str, tuple] = {}  # label -> the configuration it names
    for r in rows:
        values = r.get("per_position_acceptance")
        values = values if isinstance(values, list) else []
        points = [(i + 1, v) for i, v in enumerate(values) if _num(v) is not None]
        if points and r.get("method") != BASELINE:
            gamma = _num(r.get("gamma"))
            gamma_text = None if gamma is None else f"γ={int(gamma)}"
            label = _label(r.get("method"), r.get("drafter"), gamma_text, r.get("shortlist"))
            full = (r.get("method"), r.get("drafter"), gamma_text, r.get("shortlist"))
            while shown.setdefault(label, full) != full:  # two configurations, one shortened label: keep both lines
                label += " ′"
            lines.setdefault(_text(r.get("task")), {})[label] = points
            method = r.get("method")
            order[label] = (_rank(method), _num(r.get("shortlist_size")) or 0.0, label, str(method))
    if not lines:
        return None
    labels = sorted(order, key=order.__getitem__)
    style, seen = {}, {}
    for label in labels:
        method = order[label][3]
        k = seen[method] = seen.get(method, -1) + 1
        style[label] = {"color": color(method), "marker": marker(method), "linestyle": DASHES[k % len(DASHES)],
                        "fillstyle": ("full", "none")[k // len(DASHES) % 2], "markersize": 4}
    width = 3.0 + 3.6 * len(lines)
    legend = _legend(_by_family([(order[label][3], Line2D([], [], **style[label]), label) for label in labels]),
                     width)
    fig = _figure(width, 3.3 + legend.height)
    axes = fig.subplots(1, len(lines), sharey=True, squeeze=False)[0]
    for ax, task in zip(axes, sorted(lines)):
        for label, points in sorted(lines[task].items()):
            ax.plot(*zip(*points), label=label, **style[label])
        ax.set_title(f"task: {_label(task)}", fontsize=9)
        ax.set_xlabel("draft position", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance probability", fontsize=8)
    legend.draw(fig)
    fig.suptitle("Per-position acceptance", fontsize=10)
    return fig


def _thin_ticks(sizes: list[float], log: bool, gap: float = 0.05) -> list[str]:
    """Tick labels for ``sizes``, blank where a label would crowd the previous one (closer than ``gap`` of
    the axis)."""
    scale = (lambda s: math.log(s)) if log else (lambda s: s)
    span = (scale(sizes[-1]) - scale(sizes[0])) or 1.0
    labels, last = [], None
    for s in sizes:
        at = (scale(s) - scale(sizes[0])) / span
        keep = last is None or at - last >= gap
        labels.append(f"{s:g}" if keep else "")
        last = at if keep else last
    return labels


def _plot_shortlist(rows: list[Row]) -> Any:
    """Shortlist size vs τ, one line per task (and drafter/γ when several), full-head τ dashed."""
    from matplotlib.lines import Line2D

    static, full_head = methods_with(ShortlistInputs), methods_with(SameTokenizerInputs)
    curves: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        size, tau = _num(r.get("shortlist_size")), _num(r.get("tau"))
        if r.get("method") in static and size is not None and size > 0 and tau is not None:
            curves.setdefault((r.get("task"), r.get("drafter"), r.get("gamma")), []).append((size, tau))
    if not curves:
        return None
    several = len({key[1:] for key in curves}) > 1
    drawn, entries = [], []
    for i, ((task, drafter, gamma), points) in enumerate(sorted(curves.items(), key=str)):
        label = _label(task, drafter, f"γ={gamma}") if several else _label(task)
        same = [r for r in rows if r.get("method") in full_head and r.get("task") == task]
        if several:
            same = [r for r in same if (r.get("drafter"), r.get("gamma")) == (drafter, gamma)]
        full = [t for t in (_num(r.get("tau")) for r in same) if t is not None]
        line = {"color": f"C{i % 10}", "marker": "o"}
        drawn.append((sorted(points), line, max(full) if full else None))
        entries.append((Line2D([], [], **line), label))
        if full:
            entries.append((Line2D([], [], color=line["color"], linestyle="--", lw=1), f"{label}: full head"))
    legend = _legend([(None, entries)], 7.5)
    fig = _figure(7.5, 3.4 + legend.height)
    ax = fig.add_subplot()
    for points, line, full_tau in drawn:
        ax.plot(*zip(*points), **line)
        if full_tau is not None:
            ax.axhline(full_tau, color=line["color"], linestyle="--", lw=1)
    sizes = sorted({s for points in curves.values() for s, _ in points})
    log = sizes[-1] >= 10 * sizes[0]
    if log:
        ax.set_xscale("log")
    if len(sizes) <= 12:
        # Ticks at the sizes evaluated, as plain integers (a log axis would print 6×10^2); slanted when
        # there are many, and unlabelled where two sizes are too close to read apart.
        slant = {"rotation": 45, "ha": "right", "rotation_mode": "anchor"} if len(sizes) > 4 else {}
        ax.set_xticks(sizes, _thin_ticks(sizes, log), **slant)
        ax.minorticks_off()
    ax.margins(y=0.1)
    ax.set(title="Shortlist size vs mean accepted length τ", xlabel="shortlist size (tokens)", ylabel="τ")
    ax.grid(alpha=0.3)
    legend.draw(fig)
    return fig


def _plot_speedup(rows: list[Row], device: str) -> Any:
    """Measured vs Leviathan-predicted speedup with y = x: colour by family, marker by method, filled or
    hollow (or half-filled) by task."""
    from matplotlib.lines import Line2D

    points = [(r, _num(r.get("predicted_speedup")), _num(r.get("speedup"))) for r in rows]
    points = [(r, x, y) for r, x, y in points if x is not None and y is not None]
    if not points:
        return None
    tasks = sorted({_text(r.get("task")) for r, _, _ in points})
    fills = ("full", "none", "left", "bottom", "right", "top")
    methods = sorted({r.get("method") for r, _, _ in points}, key=lambda m: (_rank(m), str(m)))

    def style(method: Any, task: str | None = None) -> dict:
        fill = "full" if task is None else fills[tasks.index(task) % len(fills)]
        return {"color": color(method), "marker": marker(method), "fillstyle": fill, "linestyle": "none",
                "markeredgewidth": 1, "markersize": 6}

    groups = _by_family([(m, Line2D([], [], **style(m)), _label(m)) for m in methods])
    groups.append(("task", [(Line2D([], [], **(style(None, task) | {"color": "0.3", "marker": "o"})), _label(task))
                            for task in tasks] + [(Line2D([], [], color="grey", linestyle="--", lw=1), "y = x")]))
    legend = _legend(groups, 8.0)
    fig = _figure(8.0, 5.2 + legend.height)
    ax = fig.add_subplot()
    for r, x, y in points:
        ax.plot([x], [y], **style(r.get("method"), _text(r.get("task"))))
    low = min(min(x, y) for _, x, y in points) * 0.9
    high = max(max(max(x, y) for _, x, y in points) * 1.1, low + 0.1)  # never an empty range
    ax.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1)
    ax.set(xlim=(low, high), ylim=(low, high), xlabel="predicted speedup (Leviathan)",
           ylabel="measured speedup vs AR")
    ax.set_aspect("equal", adjustable="box")
    ax.grid(alpha=0.3)
    ax.set_title(f"Measured vs predicted speedup\n{_label(device)}", fontsize=10)
    legend.draw(fig)
    return fig


def figures(results: dict) -> dict[str, Any]:
    """Each plot's figure by name (the names of :data:`PLOTS`), or None where there is nothing to draw."""
    rows, device = _rows(results), _text(results.get("device"))
    plots = {"tau": _plot_tau, "positions": _plot_positions, "shortlist": _plot_shortlist}
    return {name: plot(rows) for name, plot in plots.items()} | {"speedup": _plot_speedup(rows, device)}


def svg(fig: Any) -> str:
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
