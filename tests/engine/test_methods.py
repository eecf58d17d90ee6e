"""The method registry: one entry per method is all the pipeline knows of it.

The registry's own consistency (families, sections, gate sets, inputs families, report order); what the
modules that read it derive from it (the stages and models a method needs, a bundle's candidates); that
importing it stays light; that the evaluator can prepare every inputs family; and that no module of
``pipeline/`` or ``jobs/`` but the registry names a method.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.engine.inputs import DRAFTER_MODELS, SameTokenizerInputs
from pipeline.engine.methods import (
    BASELINE,
    FAMILIES,
    GATE_SETS,
    METHOD_NAMES,
    METHODS,
    REPORT_ORDER,
    SECTIONS,
    MethodSpec,
    build_proposer,
    gate_candidates,
    in_section,
    methods_reading,
    models_read,
    stages_read,
)
from pipeline.errors import DrafterError

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = "pipeline/engine/methods.py"


def test_every_method_has_a_family_and_every_family_a_method() -> None:
    assert {spec.family for spec in METHODS.values()} == set(FAMILIES)


def test_a_spec_naming_an_unknown_family_section_gate_set_or_inputs_is_refused() -> None:
    full = METHODS["full"]
    with pytest.raises(ValueError, match="family 'speculative' is not one of"):
        replace(full, name="other_full", family="speculative")
    with pytest.raises(ValueError, match=r"sections \['appendix'\] are not among"):
        replace(full, name="other_full", sections=frozenset({"appendix"}))
    with pytest.raises(ValueError, match="gate set 'draft_vocab' is not one of"):
        replace(full, name="other_full", gates="draft_vocab")
    with pytest.raises(ValueError, match="is not an inputs dataclass of pipeline.engine.inputs"):
        MethodSpec("other_full", full.summary, full.family, dict, full.build, 15)


def test_report_order_is_the_baseline_then_every_method_once() -> None:
    assert REPORT_ORDER[0] == BASELINE and BASELINE not in METHODS
    assert sorted(REPORT_ORDER[1:]) == sorted(METHOD_NAMES)
    assert len({spec.order for spec in METHODS.values()}) == len(METHODS), "two methods share a report place"


def test_every_section_and_gate_set_lists_a_method_in_report_order() -> None:
    for section in SECTIONS:
        listed = in_section(section)
        assert listed, f"section {section!r} lists no method"
        assert list(listed) == sorted(listed, key=REPORT_ORDER.index)
    with pytest.raises(ValueError, match="unknown report section 'appendix'"):
        in_section("appendix")
    for gate in GATE_SETS.values():
        assert any(spec.gates == gate.name for spec in METHODS.values()), f"bundle {gate.name!r} has no method"


def test_a_bundle_chooses_among_the_methods_that_name_it() -> None:
    draft_vocab, eagle3, dynaspec, rdk, dflash = GATE_SETS.values()
    assert gate_candidates(draft_vocab, ["full"]) == "shortlist"  # decided even when shortlist is not evaluated
    assert gate_candidates(eagle3) == "eagle3"
    assert gate_candidates(dflash, ["eagle3", "dflash"]) == "dflash"
    # DynaSpec's bundle is gated on PA, or on F when PA is not evaluated
    assert gate_candidates(dynaspec, ["dynaspec", "dynaspec_pa"]) == "dynaspec_pa"
    assert gate_candidates(dynaspec, ["full", "dynaspec"]) == "dynaspec"
    assert gate_candidates(dynaspec, ["dynaspec_pa"]) == "dynaspec_pa"
    # RDK's: every redistributed method (pruned is their TLI baseline, not a candidate)
    assert gate_candidates(rdk, ["rdk"]) == ("rdk", "rdk_taylor", "rdk_prior", "tli_rdk", "tli_rdk_taylor",
                                             "tli_rdk_prior")
    assert [gate.summary_metrics()[0] for gate in GATE_SETS.values()] == [
        "gates_passed", "eagle3_gates_passed", "dynaspec_gates_passed", "rdk_gates_passed", "dflash_gates_passed"]


def test_opt_in_methods_are_outside_the_default_methods() -> None:
    """DFlash is evaluated only when named: the default evaluate.methods (part of the evaluate id) stays the list it
    was before it was registered, and every other method is in it, in registry order."""
    from pipeline.config.method_names import DEFAULT_METHOD_NAMES, OPT_IN_METHOD_NAMES
    from pipeline.config.sections import PipelineConfig

    assert OPT_IN_METHOD_NAMES == ("dflash",) and METHODS["dflash"].opt_in
    assert DEFAULT_METHOD_NAMES == tuple(name for name, spec in METHODS.items() if not spec.opt_in)
    assert PipelineConfig().evaluate.methods == list(DEFAULT_METHOD_NAMES)


def test_what_methods_read_comes_from_their_inputs_family() -> None:
    assert models_read(["full", "tli", "slrs", "eagle3"]) == {"drafter", "drafter_other", "drafter_bytes"}
    assert models_read(["eagle3"]) == set()
    assert stages_read(["eagle3", "dynaspec", "pruned"]) == {"train_drafter", "cluster", "train_router",
                                                              "estimate_rdk"}
    assert stages_read(["full", "shortlist", "pa_fr", "tli", "union", "slem", "slrs", "slem_bytes"]) == set()
    assert methods_reading(["full", "tli", "tli_rdk", "pruned"], "estimate_rdk") == ["tli_rdk", "pruned"]
    assert methods_reading(["full", "slrs", "slem_bytes"], "drafter_bytes") == ["slrs", "slem_bytes"]
    with pytest.raises(DrafterError, match=r"(?s)unknown draft method 'eagle'.*full"):
        stages_read(["eagle"])


def test_each_family_names_a_drafter_and_stages_evaluate_can_read() -> None:
    from pipeline.orchestration.dag import EVALUATE_UPSTREAM

    readable = set(EVALUATE_UPSTREAM) - {"count"}
    for family in {spec.inputs for spec in METHODS.values()}:
        assert family.MODEL is None or family.MODEL in DRAFTER_MODELS, family
        assert set(family.STAGES) <= readable, family
        assert family.MODEL is not None or family.STAGES, f"{family.__name__} loads no drafter from anywhere"


def test_each_factory_takes_its_familys_inputs() -> None:
    for name, spec in METHODS.items():
        (parameter,) = inspect.signature(spec.build).parameters.values()
        assert parameter.annotation == spec.inputs.__name__, name


def test_inputs_of_another_family_or_with_a_part_unset_are_refused() -> None:
    with pytest.raises(DrafterError, match="'full' is built from SameTokenizerInputs, not SimpleNamespace"):
        build_proposer("full", SimpleNamespace(drafter=object(), name=None))
    with pytest.raises(DrafterError, match=r"(?s)missing inputs.*\['drafter'\] unset"):
        build_proposer("full", SameTokenizerInputs(None))


def test_importing_the_registry_is_light() -> None:
    """The config layer reads the registry: it must not pull in torch (the factories import it when they build)."""
    code = ("import sys; import pipeline.engine.methods, pipeline.engine.inputs; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_every_inputs_family_has_an_evaluator_preparer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method of a family the evaluator cannot prepare is refused by name, before anything is loaded."""
    from pipeline.evaluation.configurations import Configurations

    configurations = object.__new__(Configurations)  # the table needs no loaded model
    assert {spec.inputs for spec in METHODS.values()} <= set(configurations.preparers())

    @dataclass(frozen=True)
    class LookupInputs:  # a family of its own, e.g. prompt lookup: no model
        MODEL = None
        STAGES = ()
        name: str | None = None

    monkeypatch.setitem(METHODS, "lookup", replace(METHODS["full"], name="lookup", inputs=LookupInputs))
    configurations.ev = SimpleNamespace(methods=["full", "lookup"])
    with pytest.raises(DrafterError, match=r"(?s)cannot prepare the inputs of methods \['lookup'\].*LookupInputs"):
        next(iter(configurations))


# --- no method name outside the registry -------------------------------------------------------------------

ALLOWED: dict[str, tuple[frozenset[str], str]] = {
    "pipeline/config/method_names.py": (frozenset(METHOD_NAMES),
                                        "the leaf list of names the config layer validates against; the registry "
                                        "checks itself against it when it is built"),
    "jobs/benches.py": (frozenset({"rdk"}), "`drafter bench rdk`, a benchmark's name on the command line"),
    "jobs/estimate_rdk.py": (frozenset({"tli", "rdk", "rdk_taylor"}),
                             "keys of rdk.json's held-out α figures (estimate_rdk's artifact format)"),
    "pipeline/rdk/prior.py": (frozenset({"tli", "rdk", "rdk_taylor"}),
                              "keys of rdk.json's held-out α figures, which this module writes"),
    "pipeline/rdk/bench.py": (frozenset({"tli", "rdk_taylor", "rdk_prior"}),
                              "labels of the redistribution timings `drafter bench rdk` prints"),
    "pipeline/rdk/synthetic.py": (frozenset({"full", "tli"}),
                                  "the §6 synthetic study's own estimators (the full drafter, TLI), not draft methods"),
    "pipeline/engine/bench.py": (frozenset({"full"}), "the full LM head, one of the head variants timed"),
    "pipeline/evaluation/plots.py": (frozenset({"full", "shortlist"}),
                                     "matplotlib's fillstyle 'full'; the key of the shortlist-size plot"),
}
"""Module → the method-named strings it may hold in a naming position, and why they are not method names there."""


def _naming_positions(tree: ast.AST) -> list[ast.Constant]:
    """String constants in a position that looks a method up or enumerates methods: an operand of a comparison
    or membership test (or an element of a literal one), an element of a tuple/list/set literal, a dict key, a
    subscript, or the value of a keyword argument named ``method``/``methods``. Docstrings, parameter defaults
    (a proposer's own default label), assignments, other call arguments and f-string text are not."""
    found: dict[int, ast.Constant] = {}

    def strings(node: ast.AST | None) -> list[ast.Constant]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node]
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return [c for element in node.elts for c in strings(element)]
        return []

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            candidates = [c for operand in (node.left, *node.comparators) for c in strings(operand)]
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            candidates = strings(node)
        elif isinstance(node, ast.Dict):
            candidates = [c for key in node.keys for c in strings(key)]
        elif isinstance(node, ast.Subscript):
            candidates = strings(node.slice)
        elif isinstance(node, ast.keyword) and node.arg in ("method", "methods"):
            candidates = strings(node.value)
        else:
            continue
        found.update((id(c), c) for c in candidates)
    return list(found.values())


def _method_names_outside_the_registry() -> dict[str, set[str]]:
    names = set(METHOD_NAMES)
    hits: dict[str, set[str]] = {}
    for path in sorted([*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("jobs/**/*.py")]):
        module = path.relative_to(ROOT).as_posix()
        if module == REGISTRY:
            continue
        for constant in _naming_positions(ast.parse(path.read_text(encoding="utf-8"))):
            if constant.value in names:
                hits.setdefault(module, set()).add(f"{constant.value}@{constant.lineno}")
    return hits


def test_no_module_but_the_registry_names_a_method() -> None:
    """Issue 22: `dynaspec_pa` was a string in 6 modules and `rdk_taylor` in 8. A module that needs to know
    about methods asks the registry (a spec's family, inputs, sections, gates) instead of listing names."""
    unexplained = {}
    for module, hits in _method_names_outside_the_registry().items():
        allowed = ALLOWED.get(module, (frozenset(), ""))[0]
        rest = sorted(hit for hit in hits if hit.partition("@")[0] not in allowed)
        if rest:
            unexplained[module] = rest
    assert not unexplained, f"method names outside {REGISTRY} (ask the registry, or list the use in ALLOWED " \
                            f"with its reason): {unexplained}"


def test_the_allowed_uses_are_still_there() -> None:
    """An ALLOWED entry nothing matches any more is removed, so the list stays an inventory, not a loophole."""
    hits = _method_names_outside_the_registry()
    for module, (allowed, why) in ALLOWED.items():
        assert why, module
        used = {hit.partition("@")[0] for hit in hits.get(module, ())}
        assert allowed <= used, f"{module}: {sorted(allowed - used)} no longer appear; drop them from ALLOWED"


def test_the_scan_sees_what_it_is_meant_to() -> None:
    """The positions it flags (and the docstring, default and call argument it does not)."""
    source = '''
"""full and shortlist in a docstring."""
def f(rows, name="tli", method="x"):
    """eagle3 in a docstring."""
    keep = [r for r in rows if r.method == "eagle3" or r.method in ("rdk", "pruned")]
    order = ("full", "shortlist")
    table = {"slem": 1}
    first = rows["union"]
    g(method="slrs")
    return rows.get("dynaspec"), f"{name}:tli"
'''
    flagged = sorted(c.value for c in _naming_positions(ast.parse(source)) if c.value in METHOD_NAMES)
    assert flagged == ["eagle3", "full", "pruned", "rdk", "shortlist", "slem", "slrs", "union"]
