"""Hostile registry refs (issue 21): Hypothesis over ``NAME@ALIAS`` / ``NAME/VERSION`` / ``models:/`` refs against one
local store holding one registered bundle."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from pipeline.config.sections import MlflowConfig
from pipeline.errors import DrafterError
from pipeline.registry import parse_ref, pull, read_bundle_json, register
from tests.registry_support import make_bundle, make_components, registry_cfg

# --- hostile refs (issue 21): Hypothesis over NAME@ALIAS / NAME/VERSION / models:/ refs -------------
# One local store holds one registered bundle; every generated ref is parsed and pulled from it. Each either
# pulls that bundle (a ref that names it) or raises DrafterError with expected and what to do, and a refused
# pull writes nothing at the destination.

REF_NAME = "drafter-org-target-refs-draft-vocab"


@pytest.fixture(scope="module")
def local_registry(tmp_path_factory: pytest.TempPathFactory) -> tuple[MlflowConfig, Path]:
    root = tmp_path_factory.mktemp("refs")
    cfg = registry_cfg(f"sqlite:///{root / 'work' / 'mlflow.db'}")
    register(make_bundle(REF_NAME, make_components(root), 2.0), cfg, root / "work")
    return cfg, root / "work"


REF_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)
# Mostly refs of the right shape (so they reach the registry) with odd names, aliases and versions; some any text.
NAME = st.one_of(st.just(REF_NAME), st.from_regex(r"[^/@:]{1,12}", fullmatch=True), st.just("a'b\"c%_*\\"))
ALIAS = st.one_of(st.sampled_from(["champion", "candidate", "latest"]), st.from_regex(r"[\w-]{1,10}", fullmatch=True))
VERSION = st.one_of(st.sampled_from(["1", "2", "0", "01", "9" * 30]), st.from_regex(r"[0-9]{1,20}", fullmatch=True))
REF = st.one_of(
    st.tuples(st.sampled_from(["", "models:/"]), NAME, st.one_of(ALIAS.map("@".__add__), VERSION.map("/".__add__)))
    .map("".join),
    st.tuples(st.sampled_from(["", "models:/", "models://", "runs:/", " ", "MODELS:/"]), st.one_of(NAME, REF_TEXT),
              st.sampled_from(["@", "/", ":", "@@", "", "/@", "@/"]), st.one_of(ALIAS, VERSION, REF_TEXT)).map("".join),
    st.text(st.characters(exclude_categories=()), max_size=40),
)


NAMING_IT = {f"{REF_NAME}@champion", f"{REF_NAME}@candidate", f"{REF_NAME}/1"}
"""The spellings that name the registered bundle (with or without ``models:/``, around any whitespace): each must pull."""


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(REF)
@example(f"{REF_NAME}@champion")
@example(f"models:/{REF_NAME}@candidate")
@example(f" {REF_NAME}/1 ")
@example(f"{REF_NAME}/١")  # Arabic-Indic digits: refused, a version is ASCII digits
@example(f"{REF_NAME}/{'9' * 30}")  # a version beyond any database integer
def test_any_ref_pulls_its_bundle_or_is_refused(local_registry: tuple[MlflowConfig, Path],
                                                tmp_path_factory: pytest.TempPathFactory, ref: str) -> None:
    cfg, workdir = local_registry
    to = tmp_path_factory.mktemp("pull") / "bundle"
    try:
        parse_ref(ref)
        pulled = pull(ref, to, cfg, workdir)
    except DrafterError as err:
        assert ref.strip().removeprefix("models:/") not in NAMING_IT, f"{ref!r} names the bundle, refused:\n{err}"
        assert err.expected and err.fix, f"a DrafterError without expected/what to do:\n{err}"
        assert not to.exists()
        event("refused: " + " ".join(err.problem.split()[:3]))  # --hypothesis-show-statistics
        return
    assert read_bundle_json(pulled)["name"] == REF_NAME
    event("pulled")
