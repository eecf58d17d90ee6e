"""Report sections for the drafter families with a bundle of their own: EAGLE-3 (simulated vs measured τ),
context-dependent shortlists at matched size (DynaSpec, PA-FR, FR-Spec) and out-of-vocabulary drafting (RDK),
and for string-level rejection sampling. Which methods each section lists, and in what order, is the method
registry's (:attr:`~pipeline.engine.methods.MethodSpec.sections`)."""

from __future__ import annotations

from pipeline.engine.inputs import SameTokenizerInputs, ShortlistInputs
from pipeline.engine.methods import in_section, methods_with
from pipeline.engine.metrics import paired_tau_difference
from pipeline.evaluation.cells import MISSING, _fmt, _num, _rows, _shortlist_label, _text, _verdict


def simulated_tau_at(training: dict, gamma: int) -> float | None:
    """The simulated τ of a γ-token chain from train_drafter's per-step held-out accuracies
    (``1 + Σ_{k<γ} Π_{i≤k} acc_i``; steps beyond those trained count as misses)."""
    acc, k = [], 0
    while f"acc_{k}" in training and k < gamma:
        acc.append(float(training[f"acc_{k}"]))
        k += 1
    if not acc:
        return None
    total, survive = 1.0, 1.0
    for a in acc:
        survive *= a
        total += survive
    return total


def eagle3_rows(results: dict) -> list[list[str]]:
    """(task, γ, simulated τ, measured τ, measured/simulated) per eagle3 row: how well train_drafter's
    cheap held-out metric predicted the τ the engine measured."""
    training = results.get("eagle3_training") or {}
    listed = in_section("features")
    out = []
    for r in _rows(results):
        if r.get("method") not in listed:
            continue
        sim = simulated_tau_at(training, int(r.get("gamma") or 0))
        tau = _num(r.get("tau"))
        ratio = tau / sim if sim and tau is not None else None
        out.append([_text(r.get("task")), _fmt(r.get("gamma"), ".0f"), _fmt(sim), _fmt(tau), _fmt(ratio)])
    return out


EAGLE3_HEADERS = ["task", "γ", "simulated τ (train_drafter, held-out)", "measured τ (engine)", "measured / simulated"]


def eagle3_markdown(results: dict) -> str:
    """The EAGLE-3 section of report.md ('' when eagle3 was not evaluated)."""
    gates = results.get("eagle3_gates")
    if gates is None:
        return ""
    training = results.get("eagle3_training") or {}
    lines = [f"## EAGLE-3 drafter {_text(training.get('artifact'))}: gates **{_verdict(gates.get('passed'))}**",
             "", f"Checkpoint kept at step {_text(training.get('step'))} (best held-out simulated τ).", "",
             "| " + " | ".join(EAGLE3_HEADERS) + " |", "|" + "---|" * len(EAGLE3_HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in eagle3_rows(results)]
    return "\n".join(lines) + "\n"


SHORTLIST_METHODS = in_section("matched_shortlists")
SHORTLIST_HEADERS = ["task", "γ", "method", "budget", "head rows / step", "rows per draft position", "τ",
                     "τ share of full", "head ms / step", "head ms vs full"]


def shortlist_rows(results: dict, match: str | None = None) -> list[list[str]]:
    """Full head, FR-Spec static (only the shortlist DynaSpec was matched to), PA-FR, DynaSpec-F and -PA per
    task and γ: measured head rows per step and per draft position, τ as a share of the full head's τ, and
    the head's own time against the full head's."""
    rows = _rows(results)
    full_head, static = methods_with(SameTokenizerInputs), methods_with(ShortlistInputs)
    full = {(r.get("task"), r.get("gamma")): r for r in rows if r.get("method") in full_head}
    out = []
    for r in sorted((r for r in rows if r.get("method") in SHORTLIST_METHODS),
                    key=lambda r: (str(r.get("task")), r.get("gamma") or 0, SHORTLIST_METHODS.index(r["method"]))):
        if r["method"] in static and match is not None and r.get("shortlist") != match:
            continue
        base = full.get((r.get("task"), r.get("gamma"))) or {}
        tau, tau_full = _num(r.get("tau")), _num(base.get("tau"))
        ms, ms_full = _num(r.get("head_ms_per_step")), _num(base.get("head_ms_per_step"))
        per_position = r.get("draft_vocab_per_position") or []
        out.append([_text(r.get("task")), _fmt(r.get("gamma"), ".0f"), _text(r.get("method")),
                    _text(r.get("budget") or r.get("shortlist")), _fmt(r.get("draft_vocab_mean"), ".0f"),
                    " / ".join(_fmt(x, ".0f") for x in per_position) or MISSING, _fmt(tau),
                    _fmt(100 * tau / tau_full if tau is not None and tau_full else None, ".1f", "%"),
                    _fmt(ms, ".3f"), _fmt(ms / ms_full if ms is not None and ms_full else None, ".2f", "×")])
    return out


def dynaspec_markdown(results: dict) -> str:
    """The context-dependent shortlist section of report.md ('' when no DynaSpec/PA-FR row exists)."""
    policy = results.get("dynaspec_policy")
    if policy is None:
        return ""
    lines = [f"## Shortlists at matched size (DynaSpec, PA-FR, FR-Spec){_gate_suffix(results.get('dynaspec_gates'))}", "",
             f"Budgets matched per γ to FR-Spec shortlist {_text(policy.get('match'))} "
             f"({_text(policy.get('match_size'))} tokens); router {_text(policy.get('router'))} over "
             f"{_text(policy.get('num_clusters'))} clusters ({_text(policy.get('clusters'))}).", "",
             "| " + " | ".join(SHORTLIST_HEADERS) + " |", "|" + "---|" * len(SHORTLIST_HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in shortlist_rows(results, policy.get("match"))]
    return "\n".join(lines) + "\n"


RDK_METHODS = in_section("out_of_vocabulary")
RDK_ANALYSIS_HEADERS = ["kept set", "size", "task", "target mass kept", "τ", "α TLI", "α RDK exact",
                        "α RDK-Taylor (prior)", "α prior mix (constant / confidence)", "α Taylor with true p (bound)"]
RDK_DECODE_HEADERS = ["task", "γ", "kept set", "method", "τ", "α"]


def rdk_analysis_rows(results: dict) -> list[list[str]]:
    """estimate_rdk's α at temperature 1 per kept set: held-out chat (τ and weights chosen on the other half) and,
    where analysed, code with the same choices."""
    analysis = results.get("rdk_analysis") or {}
    out = []
    for name, level in (analysis.get("levels") or {}).items():
        tasks = [("chat", level)] + ([("code", level["code"])] if level.get("code") else [])
        for task, figures in tasks:
            a = figures.get("alpha") or {}
            out.append([_text(name), _fmt(level.get("size"), ".0f"), task, _fmt(figures.get("target_mass_kept"), ".3f"),
                        _fmt(figures.get("tau"), ".0e"), _fmt(a.get("tli"), ".4f"), _fmt(a.get("rdk"), ".4f"),
                        _fmt(a.get("rdk_taylor"), ".4f"),
                        f"{_fmt(a.get('rdk_prior_constant'), '.4f')} / {_fmt(a.get('rdk_prior_confidence'), '.4f')}",
                        _fmt(a.get("oracle_taylor"), ".4f")])
    return out


def rdk_decode_rows(results: dict) -> list[list[str]]:
    """The decode rows of TLI and the RDK methods per task, γ and kept set (``intersection`` for tli*)."""
    rows = [r for r in _rows(results) if r.get("method") in RDK_METHODS]
    rows.sort(key=lambda r: (str(r.get("task")), r.get("gamma") or 0, str(r.get("shortlist") or "intersection"),
                             RDK_METHODS.index(r["method"])))
    return [[_text(r.get("task")), _fmt(r.get("gamma"), ".0f"), _text(r.get("shortlist") or "intersection"),
             _text(r.get("method")), _fmt(r.get("tau")), _fmt(r.get("acceptance_rate"), ".3f")] for r in rows]


def _gate_suffix(gates: dict | None) -> str:
    """``: gates **PASSED**`` for a section heading ('' when the bundle was not gated)."""
    return f": gates **{_verdict(gates.get('passed'))}**" if gates is not None else ""


def _md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *("| " + " | ".join(r) + " |" for r in rows)]


def rdk_markdown(results: dict) -> str:
    """The out-of-vocabulary drafting section of report.md ('' when no estimate_rdk artifact was evaluated)."""
    analysis = results.get("rdk_analysis")
    if analysis is None:
        return ""
    verdict = _gate_suffix(results.get("rdk_gates"))
    sparse, dense = _num(analysis.get("sparse_bytes")), _num(analysis.get("dense_bytes"))
    lines = [f"## Out-of-vocabulary drafting (RDK){verdict}", "",
             f"Moments from {_text(analysis.get('count'))} target positions ({_text(analysis.get('artifact'))}); "
             f"top-{_text(analysis.get('top_k'))} entries cover {_fmt(analysis.get('covered'), '.3f')} of the mass; "
             f"sparse second moment {_fmt(sparse / 2**20 if sparse else None, '.1f')} MiB vs "
             f"{_fmt(dense / 2**20 if dense else None, '.1f')} MiB for a dense |T|² matrix.", "",
             "α at temperature 1: held-out chat (τ and prior weight chosen on half the positions, α on the other "
             "half) and code (HumanEval solutions, the chat choices unchanged):",
             "", *_md_table(RDK_ANALYSIS_HEADERS, rdk_analysis_rows(results)), "",
             "Decoding (the evaluation's temperature):", "", *_md_table(RDK_DECODE_HEADERS, rdk_decode_rows(results))]
    return "\n".join(lines) + "\n"


SLRS_METHODS = in_section("string_level")
SLRS_HEADERS = ["task", "γ", "method", "τ", "α", "drafter calls / token", "ψ rows / token", "MBSU", "greedy equal"]


def slrs_rows(results: dict) -> list[list[str]]:
    """SLRS beside SLEM on the same byte drafter, per task and γ."""
    rows = [r for r in _rows(results) if r.get("method") in SLRS_METHODS]
    rows.sort(key=lambda r: (str(r.get("task")), r.get("gamma") or 0, SLRS_METHODS.index(r["method"])))
    return [[_text(r.get("task")), _fmt(r.get("gamma"), ".0f"), _text(r.get("method")), _fmt(r.get("tau")),
             _fmt(r.get("acceptance_rate"), ".3f"), _fmt(r.get("drafter_calls_per_token"), ".2f"),
             _fmt(r.get("psi_rows_per_token"), ".1f"), _fmt(r.get("mbsu"), ".2f", "×"),
             "yes" if r.get("greedy_equal") else "no"] for r in rows]


SLRS_NOTE = ("Byte-level drafter: SLRS (Alg. 3; ψ computed exactly over the trie of drafted strings, one batched "
             "drafter call per trie depth) against SLEM with the same bytes per target token. MBSU charges the "
             "drafter's parameter ratio per measured call. α counts an SLRS draw that ends inside a target token "
             "(the string has no target-token boundary there) as a draft rejected with certainty; SLEM drafts "
             "nothing in those events, so its α leaves them out: τ compares the two.")


def slrs_markdown(results: dict) -> str:
    """The byte-level drafter section of report.md ('' when neither slrs nor slem_bytes was evaluated)."""
    table = slrs_rows(results)
    if not table:
        return ""
    return "\n".join(["## String-level rejection sampling (SLRS)", "", SLRS_NOTE, "",
                      *_md_table(SLRS_HEADERS, table)]) + "\n"


BLOCK_METHODS = in_section("block_drafting")
BLOCK_HEADERS = ["task", "γ", "method", "τ", "τ − chain's (95 %)", "per-position acceptance",
                 "drafter forwards / round", "drafter ms / round", "drafter ms vs chain", "MBSU", "tokens/s", "speedup"]
BLOCK_NOTE = ("DFlash drafts a whole block in one drafter forward; EAGLE-3 runs one forward per draft (γ per round, "
              "its chain). Both read the target's features and are verified by the same lossless loop. MBSU charges "
              "the drafter's parameter ratio (DFlash: its layers plus the target's LM head) per measured forward. "
              "τ − chain's: the difference on the same prompts, ± 1.96 standard errors of the paired per-prompt "
              "difference (the prompts' draw only: a drafter retrained with another seed moves it too).")


def _tau_versus(row: dict, chain: dict | None) -> str:
    """``row``'s τ minus the chain's on the same prompts, ± 1.96 paired standard errors ('—' without both)."""
    if chain is None or row is chain:
        return MISSING
    keys = ("kept_per_prompt", "rounds_per_prompt")
    series = [row.get(k) for k in keys] + [chain.get(k) for k in keys]
    if not all(isinstance(x, list) for x in series) or len(series[0]) != len(series[2]):
        return MISSING
    paired = paired_tau_difference(*series)
    if paired is None:
        return MISSING
    difference, error = paired
    return f"{difference:+.2f} ± {1.96 * error:.2f}"


def block_rows(results: dict) -> list[list[str]]:
    """DFlash beside EAGLE-3 per task and γ (empty when no block drafter was evaluated): τ, per-position
    acceptance, drafter forwards and milliseconds per round (against the chain drafter's), MBSU, wall-clock."""
    rows = [r for r in _rows(results) if r.get("method") in BLOCK_METHODS]
    counted = [r for r in rows if r.get("drafter_calls_per_token") is not None]
    if not counted:
        return []
    chain = {(r.get("task"), r.get("gamma")): r for r in rows if r.get("drafter_calls_per_token") is None}
    rows.sort(key=lambda r: (str(r.get("task")), r.get("gamma") or 0, BLOCK_METHODS.index(r["method"])))
    out = []
    for r in rows:
        calls, tau = _num(r.get("drafter_calls_per_token")), _num(r.get("tau"))
        # a method that counts its forwards: calls per token × tokens per round; a chain: γ per round
        per_round = calls * tau if calls is not None and tau is not None else _num(r.get("gamma"))
        ms, base = _num(r.get("drafter_ms_per_round")), _num((chain.get((r.get("task"), r.get("gamma"))) or {})
                                                             .get("drafter_ms_per_round"))
        positions = " / ".join(_fmt(x, ".2f") for x in (r.get("per_position_acceptance") or [])) or MISSING
        versus = _tau_versus(r, chain.get((r.get("task"), r.get("gamma"))))
        out.append([_text(r.get("task")), _fmt(r.get("gamma"), ".0f"), _text(r.get("method")), _fmt(tau), versus,
                    positions,
                    _fmt(per_round, ".2f"), _fmt(ms, ".3f"), _fmt(ms / base if ms is not None and base else None,
                                                                   ".2f", "×"),
                    _fmt(r.get("mbsu"), ".2f", "×"), _fmt(r.get("tokens_per_s"), ".1f"),
                    _fmt(r.get("speedup"), ".2f", "×")])
    return out


def block_markdown(results: dict) -> str:
    """The block-drafting section of report.md ('' when no block drafter was evaluated)."""
    table = block_rows(results)
    if not table:
        return ""
    training = results.get("dflash_training") or {}
    return "\n".join([f"## Block drafting (DFlash) beside EAGLE-3{_gate_suffix(results.get('dflash_gates'))}", "",
                      BLOCK_NOTE, "",
                      f"DFlash drafter {_text(training.get('artifact'))}: checkpoint kept at step "
                      f"{_text(training.get('step'))}, held-out simulated τ {_fmt(training.get('simulated_tau'))}.",
                      "", *_md_table(BLOCK_HEADERS, table)]) + "\n"


DEVICE_HEADERS = ["task", "method", "γ", "shortlist (size)", "this device: tokens/s", "speedup", "other device", "tokens/s",
                  "speedup"]
DEVICE_NOTE = ("Wall-clock of this evaluation beside the same evaluation on another device (the artifact of the same "
               "config with evaluate.device changed, when the store holds it); speedup is against autoregressive "
               "decoding on the same device.")


def device_rows(results: dict) -> list[list[str]]:
    """This evaluation's wall-clock rows beside each other device's of the same config (empty when none was found)."""
    out = []
    for other in results.get("other_devices") or []:
        theirs = {(r.get("task"), r.get("method"), r.get("gamma"), r.get("shortlist")): r for r in other.get("rows", [])}
        for r in _rows(results):
            match = theirs.get((r.get("task"), r.get("method"), r.get("gamma"), r.get("shortlist")))
            if match is None:
                continue
            out.append([_text(r.get("task")), _text(r.get("method")), _fmt(r.get("gamma"), ".0f"),
                        _shortlist_label(r), _fmt(r.get("tokens_per_s"), ".1f"), _fmt(r.get("speedup"), ".2f", "×"),
                        f"{_text(other.get('device'))} ({_text(other.get('decode_path'))})",
                        _fmt(match.get("tokens_per_s"), ".1f"), _fmt(match.get("speedup"), ".2f", "×")])
    return out


def device_markdown(results: dict) -> str:
    """The device-comparison section of report.md ('' when no other device's evaluation was found)."""
    table = device_rows(results)
    if not table:
        return ""
    return "\n".join(["## Wall-clock on each device", "", DEVICE_NOTE,
                      f"This device: {_text(results.get('device'))} ({_text(results.get('decode_path'))}).", "",
                      *_md_table(DEVICE_HEADERS, table)]) + "\n"
