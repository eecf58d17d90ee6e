"""Tests for the evaluation report: Markdown table, self-contained HTML page, and the three-file writer."""

from __future__ import annotations

import copy
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pipeline.engine.methods import GATE_SETS
from pipeline.evaluation.report import COLUMNS, markdown_table, render_html, write_report
from pipeline.evaluation.results import EvalRow, EvaluationResults, LosslessCheck, decide_gates
from pipeline.evaluation.sections import BLOCK_HEADERS, block_rows
from tests.helpers import SHORTLISTS, report_row, skip_unless, synthetic_results, typed_results


class _Checker(HTMLParser):
    """Counts tags and checks that every opened non-void element is closed in order."""

    VOID = {"meta", "br", "img", "hr", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.counts: dict[str, int] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.counts[tag] = self.counts.get(tag, 0) + 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        self.counts[tag] = self.counts.get(tag, 0) + 1

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(path: Path) -> _Checker:
    checker = _Checker()
    checker.feed(path.read_text(encoding="utf-8"))
    checker.close()
    assert checker.stack == [], f"unclosed: {checker.stack}"
    return checker


def test_markdown_table_has_one_line_per_row_and_every_column() -> None:
    results = synthetic_results()
    lines = markdown_table(results).splitlines()
    assert len(lines) == 2 + len(results["rows"])
    for line in lines:
        # Unescaped pipes delimit columns: n columns need n + 1 of them.
        assert line.replace("\\|", "").count("|") == len(COLUMNS) + 1
    assert "top-p 0.95 (2048)" in markdown_table(results)
    chat = markdown_table(results, task="chat").splitlines()
    assert len(chat) == 2 + 8 and all("| code |" not in line for line in chat)


def test_markdown_table_escapes_pipes_and_shows_missing_values() -> None:
    results = synthetic_results()
    results["rows"][1]["drafter"] = "a|b"
    results["rows"][1]["tau"] = None
    results["rows"][1]["speedup"] = float("nan")
    line = next(line for line in markdown_table(results).splitlines() if "a\\|b" in line)
    assert line.replace("\\|", "").count("|") == len(COLUMNS) + 1
    cells = [c.strip() for c in line.replace("\\|", "¦").strip("|").split("|")]
    assert cells[5] == "—" and cells[8] == "—"


def test_lossless_column_shows_tolerated_ties_as_lossless() -> None:
    """A row whose greedy output differed from autoregressive decoding only at floating-point ties passes the lossless
    check and the gates; the table showed ✗ beside "gates: PASSED". It shows ✓ with the number of tied prompts;
    a row with a real mismatch stays ✗."""
    results = synthetic_results()
    results["rows"][1].update(greedy_equal=False, greedy_ties=2)
    results["rows"][2].update(greedy_equal=False, greedy_ties=None)
    lines = markdown_table(results).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[1][-1] == "✓ (2 ties)" and cells[2][-1] == "✗" and cells[0][-1] in ("✓", "—")


def test_render_html_is_well_formed_self_contained_and_complete(tmp_path: Path) -> None:
    path = render_html(synthetic_results(), tmp_path)
    assert path == tmp_path / "report.html"
    page = path.read_text(encoding="utf-8")
    checker = _parse(path)
    assert checker.counts.get("svg", 0) >= 4
    for method in ("ar", "full", "shortlist", "tli", "union", "slem"):
        assert f"<td>{method}</td>" in page
    assert "PASSED" in page and "FAILED" not in page
    assert "tau_full_chat" in page and "greedy equals AR" in page
    # Self-contained: no script, no stylesheet or font link, every href/src a same-document fragment.
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert re.findall(r"url\((?!#)", page) == []
    assert re.findall(r'(?:href|src)="([^#][^"]*)"', page) == []


def test_render_html_shows_failures_in_red(tmp_path: Path) -> None:
    results = synthetic_results()
    results["gates"]["passed"] = False
    results["gates"]["checks"]["tau_full_chat"]["passed"] = False
    results["rows"][2]["greedy_equal"] = False
    page = render_html(results, tmp_path).read_text(encoding="utf-8")
    assert (
        '<span class="fail">FAILED</span>' in page
        and '<span class="pass">' not in page.split("<h2>Results")[0]
    )
    # One failed gate check and one row whose greedy output differs from AR.
    assert page.count('<td class="fail">✗</td>') == 2


def test_render_html_escapes_strings_from_results(tmp_path: Path) -> None:
    results = synthetic_results()
    evil = "<script>alert('x')</script>$\\frac$"
    for row in results["rows"]:
        if row["drafter"]:
            row["drafter"] = evil
    results["target"]["model"] = "<b>m</b>"
    results["gates"]["checks"]["<img src=x>"] = {"passed": True, "value": 1, "threshold": 0, "detail": "<i>"}
    results["registration"] = {"name": "<script>x</script>"}
    path = render_html(results, tmp_path)
    page = path.read_text(encoding="utf-8")
    assert "<script" not in page and "<b>m</b>" not in page and "<img" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(" in page
    _parse(path)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda r: r.clear(),
        lambda r: r.update(rows=[]),
        lambda r: r.update(rows=None, gates=None, lossless=None, target=None),
        lambda r: [row.update({k: None for k in row if k not in ("task", "method")}) for row in r["rows"]],
        lambda r: [row.clear() for row in r["rows"]],
        lambda r: r["rows"].append("not a row"),
        # Wrong types where numbers are expected, and a single point at zero speedup.
        lambda r: r["rows"][1].update(
            tau="2.4", gamma="three", per_position_acceptance=5, shortlist_size=[1]
        ),
        lambda r: r.update(rows=[dict(r["rows"][1], speedup=0.0, predicted_speedup=0.0)]),
    ],
)
def test_render_html_survives_empty_and_missing_fields(tmp_path: Path, mutate) -> None:
    results = copy.deepcopy(synthetic_results())
    mutate(results)
    path = render_html(results, tmp_path)
    checker = _parse(path)
    page = path.read_text(encoding="utf-8")
    assert checker.counts.get("svg", 0) + page.count("Plot omitted") == 4
    assert (
        markdown_table(results).count("\n")
        == len([r for r in results.get("rows") or [] if isinstance(r, dict)]) + 1
    )


def test_empty_results_omit_every_plot_with_a_note(tmp_path: Path) -> None:
    page = render_html({}, tmp_path).read_text(encoding="utf-8")
    assert "<svg" not in page and page.count("Plot omitted") == 4 and "NOT EVALUATED" in page


def test_shortlist_plot_needs_shortlist_rows(tmp_path: Path) -> None:
    results = synthetic_results()
    results["rows"] = [r for r in results["rows"] if r["method"] != "shortlist"]
    page = render_html(results, tmp_path).read_text(encoding="utf-8")
    assert page.count("<svg") == 3 and "no shortlist row" in page


def test_write_report_writes_json_html_and_markdown(tmp_path: Path) -> None:
    typed = typed_results()
    results = typed.to_dict()
    paths = write_report(typed, tmp_path / "out")
    assert [p.name for p in paths] == ["report.json", "report.html", "report.md"]
    text = paths[0].read_text(encoding="utf-8")
    assert json.loads(text) == results
    assert text == json.dumps(results, sort_keys=True, indent=2) + "\n"
    assert markdown_table(results) in paths[2].read_text(encoding="utf-8")
    assert "<svg" in paths[1].read_text(encoding="utf-8")


@pytest.mark.parametrize(("tau_min", "eagle3_verdict"), [(1.5, "PASSED"), (9.0, "FAILED")])
def test_the_headline_gives_each_bundle_and_an_undecoded_one_is_not_evaluated(
        tmp_path: Path, tau_min: float, eagle3_verdict: str) -> None:
    """A run that decodes only EAGLE-3 and DFlash (configs/tiny-dflash.yaml) used to head its report "gates: FAILED":
    the draft-vocabulary bundle, judged with no shortlist row, fails its ``shortlist_evaluated`` check. The headline
    now gives every judged bundle's verdict, that one NOT EVALUATED, and a real failure still reads FAILED."""
    rows = [EvalRow(**report_row(task, method, tau, 0.8)) for task in ("chat", "code")
            for method, tau in (("ar", 1.0), ("eagle3", 3.2), ("dflash", 3.0))]
    checks = [LosslessCheck("greedy_equal[chat/eagle3/γ=3]", True, "8/8 prompts")]
    judged = {gate: decide_gates(rows, checks, speed_metric="mbsu", tau_min=tau_min if gate == "eagle3" else 1.5,
                                 speed_min=1.0, gate=GATE_SETS[gate], evaluated=["eagle3", "dflash"])
              for gate in ("draft-vocab", "eagle3", "dflash")}
    assert not judged["draft-vocab"].passed and "shortlist_evaluated" in judged["draft-vocab"].checks
    assert judged["draft-vocab"].unevaluated() == "no shortlist configuration was evaluated: nothing to register"
    assert judged["eagle3"].unevaluated() is None and judged["dflash"].passed
    results = EvaluationResults(rows=rows, checks=checks, gates=judged["draft-vocab"], device="cpu (2 threads)",
                                target={"model": "tiny-target"}, inputs={"counts": "count-0123"},
                                eagle3_gates=judged["eagle3"], dflash_gates=judged["dflash"])
    _, page_path, md_path = write_report(results, tmp_path)
    headline = f"gates: draft-vocab **NOT EVALUATED** · eagle3 **{eagle3_verdict}** · dflash **PASSED**\n"
    assert headline in md_path.read_text(encoding="utf-8")
    page = page_path.read_text(encoding="utf-8")
    heading = re.search(r"<h2>Gates: (.*?)</h2>", page).group(1)
    assert re.sub(r"<[^>]+>", "", heading) == f"draft-vocab NOT EVALUATED · eagle3 {eagle3_verdict} · dflash PASSED"
    assert '<h3>Draft-vocabulary bundle: <span class="none">NOT EVALUATED</span></h3>' in page

# --- every registered method at once: the plots' layout, style and the page at 1300 px -----------------


def full_results() -> dict:
    """Every method of the registry and the AR baseline on two tasks at γ = 2 and 4: shortlists for
    ``shortlist``, two kept sets for the RDK family; a gate value with more digits than its threshold."""
    from pipeline.engine.methods import METHODS

    results = synthetic_results()
    rows = []
    for task, scale in (("chat", 1.0), ("code", 1.15)):
        rows.append(report_row(task, "ar", 1.0, None))
        for i, (method, spec) in enumerate(METHODS.items()):
            # top-k 500 sits beside top-k 512 on the size axis: their tick labels would overlap.
            shortlists = {"shortlist": [*SHORTLISTS, ("top-k 500", 500)]}.get(method, [None])
            if spec.family == "RDK":
                shortlists = [("keep_0.50", 1024), ("keep_0.25", 512)]
            for gamma in (2, 4):
                for shortlist in shortlists:
                    tau = (1.5 + 0.07 * i) * scale
                    row = report_row(task, method, tau, 0.3 + 0.02 * i, shortlist=shortlist, predicted=tau * 0.9 + 0.1)
                    alpha = 0.5 + 0.025 * i
                    row.update(gamma=gamma, per_position_acceptance=[alpha ** (k + 1) for k in range(gamma)])
                    rows.append(row)
    results["rows"] = rows
    results["gates"]["checks"]["tau_min"] = {"passed": True, "value": 2.7654321, "threshold": 1.3,
                                             "detail": "mean τ of top-k 512, γ=4 over tasks"}
    results["gates"]["checks"]["mbsu_min"] = {"passed": False, "value": 1.2999604, "threshold": 1.3,
                                              "detail": "mean mbsu of top-k 512, γ=4 over tasks"}
    return results


def test_every_method_plots_without_a_matplotlib_warning(tmp_path: Path) -> None:
    """A legend constrained layout cannot fit makes matplotlib warn and squash the axes (issue 20)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        render_html(full_results(), tmp_path)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def _drawn(fig):
    """Draw ``fig``; return the renderer, the texts drawn and the tick labels among them (matplotlib keeps
    label objects for ticks outside the view too: those are not drawn)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ticks, hidden = [], set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if low - 1e-9 <= tick.get_loc() <= high + 1e-9:
                    ticks.append(tick.label1)
                else:
                    hidden.add(tick.label1)
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text() and t not in hidden]
    return canvas.get_renderer(), texts, [t for t in ticks if t.get_visible() and t.get_text()]


def test_figures_fit_the_page_and_no_text_is_clipped_or_overlaps() -> None:
    from pipeline.evaluation.plots import MAX_WIDTH_IN, figures

    drawn = figures(full_results())
    assert all(fig is not None for fig in drawn.values())
    assert MAX_WIDTH_IN * 96 <= 1200  # CSS px at 96 per inch, inside the page's 1200 px column
    for name, fig in drawn.items():
        assert fig.get_figwidth() <= MAX_WIDTH_IN, name
        renderer, texts, tick_labels = _drawn(fig)
        page = fig.bbox.padded(1)
        for text in texts:
            box = text.get_window_extent(renderer)
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, \
                (name, text.get_text())
        boxes = [t.get_window_extent(renderer) for t in tick_labels]
        overlapping = [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]
        assert not overlapping, (name, overlapping[:3])
        for legend in fig.legends:
            box = legend.get_window_extent(renderer)
            assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes), name


def test_colour_is_the_family_and_marker_the_method_within_it() -> None:
    from pipeline.engine.methods import FAMILIES, METHODS
    from pipeline.evaluation.plots import OTHER_COLOR, color, color_of, figures, marker

    colours = [color_of(fam) for fam in FAMILIES]
    assert len(set(colours)) == len(FAMILIES) and OTHER_COLOR not in colours
    assert color("ar") == OTHER_COLOR
    for fam in FAMILIES:
        members = [name for name, spec in METHODS.items() if spec.family == fam]
        assert members, f"family {fam!r} has no method"
        assert {color(m) for m in members} == {color_of(fam)}
        assert len({marker(m) for m in members}) == len(members), fam
    # The drawn speedup plot: one (colour, marker) per method, and each family named in its legend.
    fig = figures(full_results())["speedup"]
    ax = fig.axes[0]
    styles = {(line.get_color(), line.get_marker()) for line in ax.get_lines() if line.get_marker() not in (None, "None")}
    assert len(styles) == len(METHODS)
    legend = {text.get_text() for text in fig.legends[0].get_texts()}
    assert set(FAMILIES) | set(METHODS) <= legend


def test_per_position_plot_keeps_every_configuration_of_a_long_drafter_name() -> None:
    """With the default drafter `tiny:default/drafter`, the shortlist rows' labels ran past 48 characters and were
    cut at the end: top_k_128/256/512/1024 all became `shortlist / tiny:default/drafter / γ=4 / top_k_…`, the plot
    kept one line per task under that label and the other configurations vanished. The drafter's name is shortened
    now, so each configuration keeps its own line and a label that names it."""
    from pipeline.evaluation.plots import figures

    shortlists = [("top_k_128", 128), ("top_k_256", 256), ("top_k_512", 512), ("top_k_1024", 1024)]
    rows = [report_row("chat", "ar", 1.0, None)] + [
        report_row("chat", "shortlist", 2.0, 0.5 + i / 10, drafter="tiny:default/drafter", shortlist=sl)
        for i, sl in enumerate(shortlists)]
    fig = figures({"rows": rows, "device": "cpu"})["positions"]
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert len(labels) == len(set(labels)) == 4
    assert all(len(label) <= 48 for label in labels)
    assert sorted(label.rsplit(" / ", 1)[-1] for label in labels) == sorted(name for name, _ in shortlists)


def test_gate_values_are_rounded_to_their_thresholds(tmp_path: Path) -> None:
    page = render_html(full_results(), tmp_path).read_text(encoding="utf-8")
    assert "<td>2.77</td>" in page and "2.7654321" not in page
    # 1.30 would read as reaching the threshold it failed: enough decimals to show it is below.
    assert "<td>1.29996</td>" in page and "1.2999604" not in page
    assert "<td>2.40</td><td>1.5</td>" in page


def test_page_at_1300_px_shows_every_figure_at_full_size(tmp_path: Path) -> None:
    """Headless Chromium lays the page out at 1300 px: no figure is scaled down, none scrolls sideways."""
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    skip_unless(chromium is not None, "no chromium, chromium-browser or google-chrome on PATH to lay the page out",
                "DRAFTER_REQUIRE_CHROMIUM", "apt-get install chromium; the layout itself is tested without it by "
                "test_figures_fit_the_page_and_no_text_is_clipped_or_overlaps")
    page = render_html(full_results(), tmp_path).read_text(encoding="utf-8")
    probe = ("<script>document.title = JSON.stringify({svgs: [...document.querySelectorAll('svg')].map(s => "
             "[s.getBoundingClientRect().width, s.width.baseVal.value]), scroll: document.documentElement.scrollWidth, "
             "client: document.documentElement.clientWidth});</script>")
    path = tmp_path / "probe.html"
    path.write_text(page.replace("</body>", probe + "</body>"), encoding="utf-8")
    out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1300,1000", "--dump-dom", path.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    layout = json.loads(html.unescape(re.search("<title>(.*?)</title>", out).group(1)))  # type: ignore[union-attr]
    assert len(layout["svgs"]) == 4
    for shown, own in layout["svgs"]:
        assert shown == pytest.approx(own, abs=1), "a figure was scaled down to fit the page"
    assert layout["scroll"] <= layout["client"]


def test_block_section_gives_the_paired_tau_difference_against_the_chain() -> None:
    """The DFlash row's "τ − chain's" cell is the paired difference on the same prompts ± 1.96 standard errors
    (the hand-computed case of tests/engine/test_metrics.py, the other way round: 4 − 5 ± 1.96 · 0.7217); the chain's own row, a row
    without per-prompt counts (a report written before they were kept) and prompts that do not pair show '—'."""
    chain = {**report_row("chat", "eagle3", 5.0, 0.8), "kept_per_prompt": [10, 20, 30], "rounds_per_prompt": [2, 5, 5]}
    block = {**report_row("chat", "dflash", 4.0, 0.7), "drafter_calls_per_token": 0.25,
             "kept_per_prompt": [8, 20, 24], "rounds_per_prompt": [2, 5, 6]}
    column = BLOCK_HEADERS.index("τ − chain's (95 %)")
    table = {row[2]: row for row in block_rows({"rows": [chain, block]})}
    assert table["dflash"][column] == f"-1.00 ± {1.96 * (3.125 / 6) ** 0.5:.2f}" == "-1.00 ± 1.41"
    assert table["eagle3"][column] == "—"
    unpaired = {**block, "kept_per_prompt": [8, 20]}
    assert {row[2]: row for row in block_rows({"rows": [chain, unpaired]})}["dflash"][column] == "—"
    old = {k: v for k, v in block.items() if k not in ("kept_per_prompt", "rounds_per_prompt")}
    assert {row[2]: row for row in block_rows({"rows": [chain, old]})}["dflash"][column] == "—"
