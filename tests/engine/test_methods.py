"""The method registry's own checks: every method names a known family, and a spec with an unknown one is refused."""

import pytest

from pipeline.engine.methods import FAMILIES, METHODS, MethodSpec


def test_every_method_has_a_family_and_every_family_a_method() -> None:
    assert {spec.family for spec in METHODS.values()} == set(FAMILIES)


def test_a_spec_with_an_unknown_family_is_refused() -> None:
    full = METHODS["full"]
    with pytest.raises(ValueError, match="family 'speculative' is not one of"):
        MethodSpec("other_full", full.needs, full.build, full.summary, "speculative")
