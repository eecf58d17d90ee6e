"""The tiny kit's content hash: the same in every process, one per profile, and a function of the kit's code (not of
its prose), so a kit cached by other code is never taken for this code's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.tiny import kit_hash


def test_kit_hash_is_stable_and_per_profile() -> None:
    """The same hash in another process under another string-hash seed (a kit built once is found again)."""
    import subprocess
    import sys

    script = "from pipeline.tiny import kit_hash; print(kit_hash('test'))"
    for seed in ("1", "2"):
        other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        assert other == kit_hash("test"), (seed, other)
    assert kit_hash("test") != kit_hash("default")
    assert len(kit_hash("default")) == 12 and int(kit_hash("default"), 16) >= 0


BOOKKEEPING = {"pipeline.checksums", "pipeline.errors", "pipeline.hub", "pipeline.progress", "pipeline.staged"}
"""Modules the kit's code imports that decide nothing a build writes: errors, progress lines, checksums of staged
files, the hub client (hub datasets; the kit reads the packaged text)."""


def _pipeline_imports(module: str) -> set[str]:
    """The project modules ``module``'s source imports (``from pipeline.tiny import corpus`` names a module)."""
    import ast
    import importlib.util

    found = set()
    for node in ast.walk(ast.parse(Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("pipeline")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline"):
            if node.module == "pipeline.tiny":  # the package's submodules by name, its other names are not modules
                found |= {n for n in (f"{node.module}.{a.name}" for a in node.names) if importlib.util.find_spec(n)}
            else:
                found.add(node.module)
    return found


def test_the_kit_hash_follows_the_kits_code_and_not_its_prose(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kits are cached under their hash, so code that builds another kit must name another hash: the hash holds a
    digest of the kit's code (``spec.KIT_CODE_MODULES``) where a manual version number used to be, and every project
    module that code imports is in that list or in :data:`BOOKKEEPING`. Docstrings and comments are left out: an
    edit to the prose keeps a cached kit."""
    from pipeline.tiny import spec

    assert spec.code_without_prose('"""A module."""\nX = 1  # one\n') == spec.code_without_prose("X = 1\n")
    assert spec.code_without_prose('def f():\n    """Doc."""\n    return 1\n') == spec.code_without_prose(
        "def f():\n    return 1\n")
    assert spec.code_without_prose("X = 1\n") != spec.code_without_prose("X = 2\n")
    before = kit_hash("test")
    monkeypatch.setattr(spec, "kit_code_digest", lambda: "another recipe")
    assert kit_hash("test") != before
    imported = set().union(*map(_pipeline_imports, spec.KIT_CODE_MODULES))
    assert "pipeline.tiny.corpus" in imported and "pipeline.errors" in imported  # the walk sees both forms
    assert imported - set(spec.KIT_CODE_MODULES) - BOOKKEEPING == set()
