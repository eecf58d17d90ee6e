"""The synthetic RDK study (pipeline.rdk.synthetic) on a 3,000-token vocabulary: what must hold does hold.

Every assertion is either guaranteed by the definitions (nested kept sets, TLI ≥ masked, the Taylor form's
``2/N`` bound) or, for the prior mixture's gain, checked on seeds 0–4 with the margin stated at the test.
"""

from __future__ import annotations

import json

import pytest

from pipeline.errors import DrafterError
from pipeline.rdk.synthetic import METHODS, main, synthetic_study

VOCAB = 3_000
KEPT = (VOCAB, 300, 75, 8)
TAUS = (1e-6, 1e-4, 1e-2)
FLOAT32 = 1e-6
"""Tolerance for identities that are exact in reals: p and q are float32 softmaxes (Σq = 1 ± ~1e-7)."""
SMALL = dict(vocab=VOCAB, kept_sizes=KEPT, contexts=48, calibration=64, validation=8, taus=TAUS, chunk=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def study() -> dict:
    return synthetic_study(**SMALL, seed=0)


def _alpha(row: dict, name: str) -> float:
    return row["methods"][name]["alpha"]


def test_every_draft_is_a_distribution_and_every_alpha_a_probability(study: dict) -> None:
    for row in study["kept"]:
        assert set(row["methods"]) == set(METHODS[1:7])
        for name, result in row["methods"].items():
            assert 0.0 <= result["alpha"] <= 1.0, (row["kept"], name)
            if name != "masked":  # the masked drafter is sub-stochastic by design
                assert result["mass_error"] < 1e-9, (row["kept"], name, result["mass_error"])
    for result in study["references"].values():
        assert 0.0 <= result["alpha"] <= 1.0


def test_sample_sizes_and_settings_are_reported(study: dict) -> None:
    assert study["sample_sizes"] == {"calibration": 64, "validation": 8, "held_out": 48}
    assert [row["kept"] for row in study["kept"]] == sorted(KEPT, reverse=True)
    assert study["settings"]["vocab"] == VOCAB and study["seconds"]["total"] > 0


def test_pruning_orderings_that_hold_per_context(study: dict) -> None:
    # q restricted to a kept set is pointwise <= q, and <= its renormalisation; the kept sets are nested.
    full = study["references"]["full"]["alpha"]
    masked = [_alpha(row, "masked") for row in study["kept"]]  # largest kept size first
    for row in study["kept"]:
        assert _alpha(row, "tli") >= _alpha(row, "masked") - FLOAT32
        assert row["methods"]["masked"]["gain_vs_tli"] <= FLOAT32
        assert full >= _alpha(row, "masked") - FLOAT32
    assert all(a >= b - FLOAT32 for a, b in zip(masked, masked[1:]))


def test_keeping_the_whole_vocabulary_is_the_full_drafter(study: dict) -> None:
    whole = study["kept"][0]
    full = study["references"]["full"]["alpha"]
    assert whole["kept"] == VOCAB and whole["prior_mass_outside"] == 0.0
    for name in ("masked", "tli", "prior_mix"):
        assert _alpha(whole, name) == pytest.approx(full, abs=FLOAT32), name


def test_taylor_form_moves_alpha_by_at_most_two_over_n(study: dict) -> None:
    # Eq. 3 changes q'_j by π_j(θ − q'_j)/(N + π_j): at most 2θ/N in L1 before normalising, 4θ/N after,
    # so |α_Taylor − α_TLI| <= 2/N for any prior, the true p included.
    for row in study["kept"]:
        for name in ("rdk_taylor_prior", "rdk_taylor_oracle"):
            assert abs(row["methods"][name]["gain_vs_tli"]) <= 2.0 / VOCAB, (row["kept"], name)


def test_off_vocabulary_mass_of_the_redistributions(study: dict) -> None:
    # Eq. 3 puts θπ_j/(N + π_j) <= θπ_j/N on an out-of-vocabulary token, normalised by a sum >= 1 − 2/N:
    # at most 1/(N − 2) in all. The prior mixture puts exactly w = the prior's mass outside I there.
    for row in study["kept"]:
        for name in ("rdk_taylor_prior", "rdk_taylor_oracle"):
            assert -1e-12 <= row["methods"][name]["draft_mass_outside_kept"] <= 1.0 / (VOCAB - 2) + 1e-12
        mix = row["methods"]["prior_mix"]["draft_mass_outside_kept"]
        assert mix == pytest.approx(row["prior_mass_outside"], abs=1e-9)


def test_tau_curve_has_one_entry_per_tau_and_the_choice_is_its_best(study: dict) -> None:
    assert any("alpha_validation" in point for row in study["kept"] for point in row["tau_curve"])  # a choice to check
    for row in study["kept"]:
        curve = row["tau_curve"]
        assert [point["tau"] for point in curve] == list(TAUS)
        fitted = [point for point in curve if "alpha_validation" in point]
        assert all(0.0 <= point["alpha_validation"] <= 1.0 for point in fitted)
        assert all(isinstance(point["skipped"], str) for point in curve if "alpha_validation" not in point)
        if fitted:
            assert row["tau_chosen"] == max(fitted, key=lambda p: p["alpha_validation"])["tau"]
            assert "alpha" in row["methods"]["rdk_exact"]


def test_prior_mix_recovers_acceptance_at_the_smallest_kept_size(study: dict) -> None:
    # Measured on seeds 0–4 (48 held-out contexts, 8 of 3,000 tokens kept): gain over TLI 0.256–0.275 with
    # paired standard error 0.010–0.012. Asserted with a wide margin: gain > 0.1 and > 5 standard errors.
    gain = study["kept"][-1]["methods"]["prior_mix"]
    assert study["kept"][-1]["kept"] == 8
    assert gain["gain_vs_tli"] > max(0.1, 5 * gain["gain_stderr"])


def test_a_tau_past_the_dense_budget_is_skipped_and_said(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import pipeline.rdk.synthetic as synthetic

    monkeypatch.setattr(synthetic, "MAX_DENSE", -1)
    result = synthetic_study(vocab=500, kept_sizes=(50,), contexts=8, calibration=16, validation=4, taus=TAUS)
    row = result["kept"][0]
    assert row["tau_chosen"] is None and all("dense" in point["skipped"] for point in row["tau_curve"])
    assert "skipped" in row["methods"]["rdk_exact"] and "alpha" in row["methods"]["tli"]
    synthetic.plot(result, tmp_path / "skipped.png")  # the plot leaves the skipped method out
    assert (tmp_path / "skipped.png").stat().st_size > 0


def test_same_seed_same_numbers() -> None:
    settings = SMALL | {"kept_sizes": (75,), "taus": (1e-4,), "contexts": 16, "calibration": 32}
    first, second = synthetic_study(**settings, seed=1), synthetic_study(**settings, seed=1)
    assert first["kept"][0]["methods"] == second["kept"][0]["methods"]


def test_impossible_sizes_are_refused() -> None:
    with pytest.raises(DrafterError, match="impossible sizes"):
        synthetic_study(vocab=100, kept_sizes=(200,), contexts=4, calibration=4, validation=4)


def test_main_writes_json_and_plot(tmp_path) -> None:
    main(["--out", str(tmp_path), "--vocab", "1000", "--kept", "100", "10", "--contexts", "16",
          "--calibration", "32", "--validation", "8"])
    result = json.loads((tmp_path / "synthetic.json").read_text())
    assert [row["kept"] for row in result["kept"]] == [100, 10]
    assert result["sample_sizes"]["held_out"] == 16
    assert (tmp_path / "synthetic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
