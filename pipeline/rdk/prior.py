"""What ``estimate_rdk`` publishes and evaluation loads: the moments, the kept-token sets, and each set's
chosen τ and prior weight — plus the held-out analysis that chooses them.

Kept sets: the FR pruning levels of a same-tokenizer drafter (the ``⌈f·|T|⌉`` most frequent calibration
tokens for each fraction ``f``, EOS and the other specials always added) and ``intersection``, ``T ∩ D`` of
the drafter with another tokenizer. For each set, :func:`analyse` measures on held-out target positions the
acceptance rate ``α = Σ min(p, q)`` (RDK Definition 2.1) of TLI, RDK-exact for every τ of a grid, RDK-Taylor
with the prior, the oracle Taylor form (true ``p``: an analysis upper bound, never a method) and the prior
mix with a constant and a confidence-binned weight. τ and the weight rule are chosen on one half of the
positions and every α is reported on the other half, so the table is not fitted to itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from pipeline.config.stages import rdk_level_name
from pipeline.errors import DrafterError
from pipeline.rdk.affinity import (
    Affinity,
    PriorMix,
    TaylorForm,
    acceptance,
    check_kept,
    fit_confidence_weights,
    scatter_kept,
    taylor_redistribute,
)
from pipeline.rdk.moments import MOMENTS_FILE, Moments, MomentSums

KEPT_FILE = "kept.safetensors"
RDK_FILE = "rdk.json"
INTERSECTION = "intersection"
PRUNED = "pruned"
"""The setting of the pruning levels (a same-tokenizer drafter's kept sets), as opposed to :data:`INTERSECTION`."""
EXACT, TAYLOR, PRIOR_MIX = "exact", "taylor", "prior_mix"
KINDS = (EXACT, TAYLOR, PRIOR_MIX)
"""Redistributions a kept set can be drafted with: the exact sparse affinity (Eq. 2), the Taylor form with the
calibration prior (Eq. 3) and the rank-one prior mix (the method registry, :mod:`pipeline.engine.methods`, says
which draft method uses which)."""


def level_name(fraction: float) -> str:
    """``keep_0.025`` for 2.5 % of the vocabulary (the config refuses fractions whose names collide)."""
    return rdk_level_name(fraction)


def pruning_levels(ranking: Sequence[int] | Tensor, vocab_size: int, fractions: Sequence[float],
                   required: Sequence[int]) -> dict[str, Tensor]:
    """The kept ids of each FR pruning level: the most frequent ``⌈f·|T|⌉`` tokens, then ``required`` ones.

    Args:
        ranking: Target ids, most frequent first (``count`` artifact).
        vocab_size: ``|T|``.
        fractions: Shares of the vocabulary to keep, each in (0, 1].
        required: Ids every level keeps (EOS and the other specials).
    """
    ranking = torch.as_tensor(ranking, dtype=torch.long).flatten()
    levels = {}
    for f in fractions:
        if not 0 < f <= 1:
            raise DrafterError("A pruning level must keep a share of the vocabulary in (0, 1].",
                               expected="0 < fraction <= 1", found=str(f), fix="Fix estimate_rdk.keep_fractions.")
        top = ranking[: max(1, math.ceil(f * vocab_size))].tolist()
        extra = [r for r in dict.fromkeys(int(x) for x in required) if r not in set(top)]
        levels[level_name(f)] = torch.tensor(top + extra, dtype=torch.long)
    return levels


@dataclass
class LevelFit:
    """One kept set's choices and held-out figures."""

    kept: Tensor
    tau: float
    prior_weight: dict
    figures: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"size": int(self.kept.numel()), "tau": self.tau, "prior_weight": self.prior_weight, **self.figures}


def analyse(p: Tensor, q_kept: Tensor, chats: Tensor, kept: Tensor, moments: Moments, taus: Sequence[float],
            required: Sequence[int] = (), chunk: int = 256) -> LevelFit:
    """Held-out α of every redistribution for one kept set; τ and the prior weight chosen on the positions of the
    even-numbered chats, all α reported on the odd-numbered chats' positions. (Choosing on even positions and
    reporting on the odd ones of the same answers scored each choice on the neighbours of the tokens it was
    chosen on.)

    Args:
        p: ``(n, |T|)`` target distributions at held-out positions (temperature 1).
        q_kept: ``(n, |I|)`` the drafter's TLI distributions over ``kept`` at the same positions.
        chats: ``(n,)`` the number of the chat each position comes from.
        kept: ``I``.
        moments: The calibration moments (prior ``μ``; RDK's ``S``).
        taus: The τ grid.
        required: Ids ``kept`` must hold (EOS).
    """
    kept = check_kept(kept, moments.vocab_size, required)
    odd = chats.to(torch.long) % 2 == 1
    fit, test = torch.nonzero(~odd).flatten(), torch.nonzero(odd).flatten()
    if not (fit.numel() and test.numel()):
        raise DrafterError("RDK's held-out analysis needs answer positions from at least two held-out chats.",
                           expected="positions from two or more chats (one to choose τ on, one to score it)",
                           found=f"{p.shape[0]} positions from {len(set(chats.tolist()))} chat(s)",
                           fix="Raise estimate_rdk.heldout_fraction or generate more calibration rows.")
    mu = moments.mu.to(torch.float64)
    curve = _tau_curve(p, q_kept, kept, moments, taus, required, {"alpha_fit": fit, "alpha": test}, chunk)
    best = max(curve, key=lambda c: c["alpha_fit"])
    oov = 1.0 - p[:, kept].to(torch.float64).sum(-1)
    edges, weights = fit_confidence_weights(q_kept[fit], oov[fit])
    constant = PriorMix(mu, kept)
    binned = PriorMix(mu, kept, edges=edges, weights=weights)
    fit_const = _mean_alpha(p, q_kept, constant.redistribute, fit, chunk)
    fit_binned = _mean_alpha(p, q_kept, binned.redistribute, fit, chunk)
    prior_weight = ({"mode": "confidence", "edges": edges, "weights": weights} if fit_binned > fit_const
                    else {"mode": "constant", "weight": constant.weight})
    figures = {
        "positions": {"fit": int(fit.numel()), "test": int(test.numel())},
        "target_mass_kept": float(p[test][:, kept].to(torch.float64).sum(-1).mean()),
        "alpha": {"tli": _mean_alpha(p, q_kept, _scatter(kept, moments.vocab_size), test, chunk), "rdk": best["alpha"],
                  **_prior_alphas(p, q_kept, kept, mu, constant, binned, test, chunk)},
        "tau_curve": curve,
        "prior_constant_weight": constant.weight,
        "prior_confidence": {"edges": edges, "weights": weights},
    }
    return LevelFit(kept=kept, tau=best["tau"], prior_weight=prior_weight, figures=figures)


def transfer(fit: LevelFit, p: Tensor, q_kept: Tensor, moments: Moments, taus: Sequence[float],
             required: Sequence[int] = (), chunk: int = 256) -> dict:
    """α of one kept set's choices (τ and both prior weights, fitted on the calibration chats by :func:`analyse`)
    on every position of another task (code), nothing refitted; plus that task's own τ curve, to show what a τ
    chosen on it would give.

    Args:
        fit: The kept set's :class:`LevelFit` from the calibration analysis.
        p: ``(n, |T|)`` target distributions at the other task's positions.
        q_kept: ``(n, |I|)`` the drafter's TLI distributions over ``fit.kept`` there.
        moments: The calibration moments.
        taus: The τ grid of the curve.
        required: Ids the kept set must hold.
    """
    kept = check_kept(fit.kept, moments.vocab_size, required)
    every = torch.arange(p.shape[0])
    mu = moments.mu.to(torch.float64)
    confidence = fit.figures["prior_confidence"]
    constant = PriorMix(mu, kept)
    binned = PriorMix(mu, kept, edges=confidence["edges"], weights=confidence["weights"])
    curve = _tau_curve(p, q_kept, kept, moments, taus, required, {"alpha": every}, chunk)
    at_tau = next((c["alpha"] for c in curve if c["tau"] == fit.tau), None)
    if at_tau is None:
        at_tau = _mean_alpha(p, q_kept, Affinity(moments, kept, fit.tau, required).redistribute, every, chunk)
    best = max(curve, key=lambda c: c["alpha"])
    return {"positions": int(p.shape[0]), "tau": fit.tau,
            "target_mass_kept": float(p[:, kept].to(torch.float64).sum(-1).mean()),
            "alpha": {"tli": _mean_alpha(p, q_kept, _scatter(kept, moments.vocab_size), every, chunk), "rdk": at_tau,
                      **_prior_alphas(p, q_kept, kept, mu, constant, binned, every, chunk)},
            "best_tau_here": {"tau": best["tau"], "alpha": best["alpha"]}, "tau_curve": curve}


def _mean_alpha(p: Tensor, q_kept: Tensor, transform_rows, idx: Tensor, chunk: int) -> float:  # noqa: ANN001
    """Mean ``α = Σ min(p, transform(q'))`` over the positions ``idx``, ``chunk`` rows at a time."""
    total = 0.0
    for start in range(0, idx.numel(), chunk):
        sel = idx[start : start + chunk]
        total += float(acceptance(p[sel].to(torch.float64), transform_rows(q_kept[sel])).sum())
    return total / max(1, idx.numel())


def _scatter(kept: Tensor, vocab_size: int):  # noqa: ANN202
    """TLI's draft: ``q'`` placed on its kept ids of ``T``."""
    return lambda q: scatter_kept(q, kept, vocab_size)


def _tau_curve(p: Tensor, q_kept: Tensor, kept: Tensor, moments: Moments, taus: Sequence[float],
               required: Sequence[int], splits: dict[str, Tensor], chunk: int) -> list[dict]:
    """Exact RDK's mean α at every τ of the grid on each named split of the positions."""
    curve = []
    for tau in taus:
        affinity = Affinity(moments, kept, tau, required)
        curve.append({"tau": tau, **{name: _mean_alpha(p, q_kept, affinity.redistribute, idx, chunk)
                                     for name, idx in splits.items()}})
    return curve


def _prior_alphas(p: Tensor, q_kept: Tensor, kept: Tensor, mu: Tensor, constant: PriorMix, binned: PriorMix,
                  idx: Tensor, chunk: int) -> dict:
    """α of RDK-Taylor with the prior, both prior mixes and the oracle Taylor bound on the positions ``idx``."""
    return {"rdk_taylor": _mean_alpha(p, q_kept, TaylorForm(mu, kept).redistribute, idx, chunk),
            "rdk_prior_constant": _mean_alpha(p, q_kept, constant.redistribute, idx, chunk),
            "rdk_prior_confidence": _mean_alpha(p, q_kept, binned.redistribute, idx, chunk),
            "oracle_taylor": _oracle(p, q_kept, kept, idx, chunk)}


def _oracle(p: Tensor, q_kept: Tensor, kept: Tensor, idx: Tensor, chunk: int) -> float:
    """Eq. 3 with the true ``p`` (an upper bound for the analysis; never a drafting method)."""
    total = 0.0
    for start in range(0, idx.numel(), chunk):
        sel = idx[start : start + chunk]
        target = p[sel].to(torch.float64)
        total += float(acceptance(target, taylor_redistribute(scatter_kept(q_kept[sel], kept, p.shape[-1]),
                                                              target)).sum())
    return total / max(1, idx.numel())


class RDKPrior:
    """An ``estimate_rdk`` artifact loaded for drafting: moments, kept sets and their choices.

    Args:
        moments: The calibration moments.
        levels: Kept-set name → :class:`LevelFit` (``keep_<f>`` levels and ``intersection``).
        meta: The rest of ``rdk.json`` (target vocabulary hash, estimation figures).
    """

    def __init__(self, moments: Moments, levels: dict[str, LevelFit], meta: dict) -> None:
        self.moments, self.levels, self.meta = moments, levels, meta

    def names(self, setting: str) -> list[str]:
        """Kept-set names of a setting: :data:`PRUNED` (same tokenizer) or :data:`INTERSECTION`."""
        return [n for n in self.levels if (n == INTERSECTION) == (setting == INTERSECTION)]

    def level(self, name: str) -> LevelFit:
        if name not in self.levels:
            raise DrafterError(f"The RDK artifact has no kept set {name!r}.", expected=f"one of {sorted(self.levels)}",
                               found=name, fix="Evaluate with the estimate_rdk artifact built for this config.")
        return self.levels[name]

    def transform(self, kind: str, name: str) -> object:
        """The redistribution ``kind`` (one of :data:`KINDS`) over kept set ``name``.

        A pruning level must keep EOS (``required_ids``); the intersection need not, since every
        redistribution puts mass on all of ``T``.
        """
        fit = self.level(name)
        mu = self.moments.mu
        required = () if name == INTERSECTION else self.meta.get("required_ids", ())
        check_kept(fit.kept, self.moments.vocab_size, required)
        if kind == EXACT:
            return Affinity(self.moments, fit.kept, fit.tau, required)
        if kind == TAYLOR:
            return TaylorForm(mu, fit.kept)
        if kind == PRIOR_MIX:
            w = fit.prior_weight
            if w.get("mode") == "confidence":
                return PriorMix(mu, fit.kept, edges=w["edges"], weights=w["weights"])
            return PriorMix(mu, fit.kept, w.get("weight"))
        raise DrafterError(f"Unknown RDK redistribution {kind!r}.", expected=f"one of {list(KINDS)}", found=kind)

    def check_target(self, vocab_hash: str, width: int) -> None:
        """Refuse an affinity estimated for another target or tokenizer."""
        if self.meta.get("vocab_hash") != vocab_hash or self.moments.vocab_size != width:
            raise DrafterError("The RDK affinity was estimated for another target or tokenizer.",
                               expected=f"vocab_hash {vocab_hash[:12]}, {width} logits",
                               found=f"vocab_hash {str(self.meta.get('vocab_hash'))[:12]}, "
                                     f"{self.moments.vocab_size} logits",
                               fix="Run estimate_rdk for this target (drafter run does).")

    def save(self, directory: str | Path, sums: MomentSums) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        sums.save(directory / MOMENTS_FILE)
        save_file({name: fit.kept.contiguous() for name, fit in self.levels.items()}, str(directory / KEPT_FILE))
        record = {**self.meta, "levels": {name: fit.record() for name, fit in self.levels.items()}}
        (directory / RDK_FILE).write_text(json.dumps(record, indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> RDKPrior:
        """Read an ``estimate_rdk`` artifact (safetensors and JSON; nothing is unpickled)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        record = json.loads((directory / RDK_FILE).read_text())
        kept = load_file(str(directory / KEPT_FILE))
        moments = MomentSums.load(directory / MOMENTS_FILE).moments()
        levels = {}
        for name, item in record.pop("levels").items():
            if name not in kept:
                raise DrafterError(f"The RDK artifact at {directory} lacks the kept ids of {name!r}.",
                                   fix="Rebuild it with `drafter estimate_rdk`.")
            figures = {k: v for k, v in item.items() if k not in ("size", "tau", "prior_weight")}
            levels[name] = LevelFit(kept=kept[name].to(torch.long), tau=float(item["tau"]),
                                    prior_weight=item["prior_weight"], figures=figures)
        return cls(moments, levels, record)
