"""The house plan, enforced: layers only point down, and no import cycle between the project's modules.

Every import counts, wherever it stands (module level, inside a function, under ``TYPE_CHECKING``). A module may
import its own package and any package of a lower layer; same-layer packages may not import each other unless
listed. See docs/ARCHITECTURE.md for what each layer owns.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[set[str]] = [
    {"jobs"},
    {"pipeline.orchestration"},
    {"pipeline.evaluation"},
    {"pipeline.training", "pipeline.registry"},
    {"pipeline.tracking"},
    {"pipeline.engine"},
    {"pipeline.dynaspec", "pipeline.rdk", "pipeline.models"},
    {"pipeline.drafters", "pipeline.tiny"},
    {"pipeline.vocab"},
    {"pipeline.data", "pipeline.artifacts", "pipeline.staged"},
    {"pipeline.config", "pipeline.hub"},
    {"pipeline.errors", "pipeline.progress", "pipeline.checksums", "pipeline.runlog", "pipeline.timing", "pipeline.cache",
     "pipeline.temporaries", "pipeline"},
]
"""Top to bottom. ``pipeline`` itself is the package's ``__init__``."""

SIDEWAYS = {("pipeline.rdk", "pipeline.dynaspec"): "none today; listed so a new edge is a decision"}
"""Same-layer imports allowed, with the reason."""


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "pipeline" and len(parts) > 1 else parts[0]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "jobs"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _own(name: str, modules: set[str]) -> str | None:
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, me: str, modules: set[str]) -> set[str]:
    found = set()
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod (not pkg's __init__); `from mod import name` imports mod
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            if (target := _own(name, modules) if name not in modules else name) and target != me:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {me: _imports(path, me, set(modules)) for me, path in modules.items()}


def _layer(package: str) -> int:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise AssertionError(f"package {package} is in no layer of tests/test_layers.py: place it")


def test_every_import_points_down_a_layer() -> None:
    wrong = defaultdict(set)
    for me, targets in _graph().items():
        for target in targets:
            a, b = _package(me), _package(target)
            if a == b or (a, b) in SIDEWAYS:
                continue
            if _layer(b) <= _layer(a):
                wrong[f"{a} -> {b}"].add(f"{me} imports {target}")
    assert not wrong, "imports that do not point down:\n" + "\n".join(
        f"{edge}: {sorted(why)[:3]}" for edge, why in sorted(wrong.items()))


def test_no_import_cycle_between_modules() -> None:
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_the_library_never_imports_the_recipes() -> None:
    bad = [f"{me} -> {t}" for me, targets in _graph().items() if me.startswith("pipeline")
           for t in targets if t.startswith("jobs")]
    assert not bad, bad
