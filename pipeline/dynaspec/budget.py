"""Shortlist budgets per draft position: DynaSpec's cluster budget (Eq. 3) and PA-FR's token budget (App. A.3).

Draft position ``t = 0`` is the first drafted token of a speculation round.

* **DynaSpec-PA** (§4.2, Eq. 3): ``k_c(0) = k0``, ``k_c(1) = k1``, ``k_c(t) = ⌊(k1 + t) / (2t)⌋`` for
  ``t ≥ 2``, with ``k0 > k1``. ``⌊(k1 + t)/(2t)⌋ = ⌊k1/(2t) + 1/2⌋`` is ``k1/(2t)`` rounded half up; the
  paper's Alg. 1 (line 8) writes ``k1 // (2t)`` instead (rounded down). We follow Eq. 3. Both reach 0
  once ``t`` exceeds about ``k1/2`` — a draft step with no cluster cannot draft — so the budget is
  clamped to ``k_min`` (default 1).
* **DynaSpec-F**: a constant ``k`` clusters at every position.
* **PA-FR** (App. A.3): the ``K_fr(t)`` most frequent tokens, ``K_fr(t) = kmax`` for ``t ∈ {0, 1}`` and
  ``⌊kmax / (t + 1)⌋`` for ``t ≥ 2`` (clamped to ``k_min`` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.errors import DrafterError


def eq3(k0: int, k1: int, t: int, k_min: int = 1) -> int:
    """DynaSpec's position-aware cluster budget ``k_c(t)`` (Eq. 3), at least ``k_min``."""
    if t == 0:
        return k0
    if t == 1:
        return k1
    return max(k_min, (k1 + t) // (2 * t))


def pa_fr(kmax: int, t: int, k_min: int = 1) -> int:
    """PA-FR's token budget ``K_fr(t)`` (App. A.3), at least ``k_min``."""
    return kmax if t <= 1 else max(k_min, kmax // (t + 1))


@dataclass(frozen=True)
class ClusterBudget:
    """How many clusters the router may pick at each draft position.

    Attributes:
        kind: ``fixed`` (DynaSpec-F: ``k1`` everywhere) or ``pa`` (DynaSpec-PA: Eq. 3).
        k0: Clusters at ``t = 0`` (``pa``).
        k1: Clusters at ``t = 1`` (``pa``), and at every position (``fixed``).
        k_min: Floor of Eq. 3's decay (``pa``; ``evaluate.dynaspec_k_min``). A fixed budget has no decay: it
            neither uses nor checks it, and does not record it.
    """

    kind: str
    k1: int
    k0: int | None = None
    k_min: int = 1

    def check(self, num_clusters: int) -> None:
        """Refuse budgets Eq. 3 does not allow or the clustering cannot meet (``k0 > k1``, ``≤ M``)."""
        if self.kind not in ("fixed", "pa"):
            raise DrafterError("Unknown DynaSpec budget kind.", expected="fixed or pa", found=repr(self.kind))
        ks = {"k1": self.k1} | ({"k0": self.k0, "k_min": self.k_min} if self.kind == "pa" else {})
        bad = {k: v for k, v in ks.items() if v is None or not 1 <= v <= num_clusters}
        if bad:
            raise DrafterError("A DynaSpec cluster budget asks for more clusters than exist (or fewer than one).",
                               expected=f"budgets in [1, M={num_clusters}]", found=str(bad),
                               fix="Lower the budget or cluster the head into more clusters (cluster.clusters).")
        if self.kind == "pa" and self.k0 <= self.k1:
            raise DrafterError("DynaSpec's position-aware budget needs a larger first-step budget (Eq. 3: k0 > k1).",
                               expected="k0 > k1", found=f"k0={self.k0}, k1={self.k1}",
                               fix="Raise k0 above k1 (or use the fixed budget).")
        if self.kind == "pa" and self.k_min > self.k1:
            raise DrafterError("The floor of DynaSpec's position-aware budget (evaluate.dynaspec_k_min) is above the "
                               f"budget matched to the shortlist size (k1={self.k1} clusters): Eq. 3 would not decay.",
                               expected=f"evaluate.dynaspec_k_min <= {self.k1}", found=f"k_min={self.k_min}",
                               fix=f"Set evaluate.dynaspec_k_min to {self.k1} or less, or match a larger shortlist "
                                   "(evaluate.dynaspec_match), or evaluate without the position-aware DynaSpec method.")

    def at(self, t: int) -> int:
        """Clusters at draft position ``t``."""
        return self.k1 if self.kind == "fixed" else eq3(int(self.k0), self.k1, t, self.k_min)

    def label(self) -> str:
        return f"k={self.k1}" if self.kind == "fixed" else f"k0={self.k0},k1={self.k1}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "k0": self.k0, "k1": self.k1} | ({"k_min": self.k_min} if self.kind == "pa" else {})


def mean_size(sizes_by_k: list[float], budget_at: list[int]) -> float:
    """Mean shortlist size over draft positions with budgets ``budget_at`` (``sizes_by_k[k-1]`` = mean size
    of a ``k``-cluster shortlist)."""
    return sum(sizes_by_k[k - 1] for k in budget_at) / len(budget_at)


def match_budgets(sizes_by_k: list[float], target: float, gamma: int, k_min: int = 1) -> tuple[ClusterBudget, ClusterBudget]:
    """DynaSpec-F and DynaSpec-PA budgets whose mean shortlist size over ``gamma`` positions matches ``target``.

    Fixed: the ``k`` whose mean size is closest to ``target``. PA: ``k1`` = that ``k`` (position 1 gets the
    fixed budget) and ``k0 > k1`` the one bringing the mean over the ``gamma`` positions closest to the
    target (ties: the smaller mean). With ``gamma = 1`` only ``k0`` is used and exceeds ``k``.

    Args:
        sizes_by_k: Mean routed shortlist size for ``k = 1..M`` clusters (measured on held-out rows).
        target: The size to match (e.g. the FR-Spec shortlist's).
        gamma: Draft positions per round.
        k_min: Floor of the PA budget's decay (``evaluate.dynaspec_k_min``), recorded as given: a floor above the
            matched ``k1`` is left for :meth:`ClusterBudget.check` to refuse when the PA budget is used (the fixed
            budget, which has no floor, stays usable).
    """
    m = len(sizes_by_k)
    k = min(range(1, m + 1), key=lambda j: (abs(sizes_by_k[j - 1] - target), j))
    fixed = ClusterBudget("fixed", k)
    if k >= m:
        k = m - 1
    best = None
    for k0 in range(k + 1, m + 1):
        pa = ClusterBudget("pa", k, k0, k_min=k_min)
        size = mean_size(sizes_by_k, [pa.at(t) for t in range(gamma)])
        key = (abs(size - target), size)
        if best is None or key < best[0]:
            best = (key, pa)
    return fixed, best[1] if best else ClusterBudget("pa", max(1, k - 1), k, k_min=1)


def match_pa_fr(vocab_size: int, target: float, gamma: int, k_min: int = 1) -> int:
    """PA-FR's ``kmax`` whose mean token budget over ``gamma`` positions is closest to ``target`` (≤ V)."""
    best = None
    for kmax in range(1, vocab_size + 1):
        size = sum(pa_fr(kmax, t, k_min) for t in range(gamma)) / gamma
        key = (abs(size - target), size)
        if best is None or key < best[0]:
            best = (key, kmax)
        if size > target and best[1] != kmax:
            break
    return best[1]


@dataclass(frozen=True)
class ShortlistPolicy:
    """Everything the context-dependent shortlist methods need besides models: budgets and kept tokens.

    Attributes:
        keep_ids: Tokens every shortlist contains (the target's EOS).
        fixed: DynaSpec-F budget, or one per γ.
        pa: DynaSpec-PA budget (Eq. 3), or one per γ.
        pa_fr_kmax: PA-FR's ``kmax``, or one per γ.
        ranking: Token ids, most frequent first (PA-FR).
        k_min: Floor of the position-aware decays.
        match: What the budgets were matched to (e.g. ``top_k_512: 513 tokens``), for reports.
    """

    keep_ids: tuple[int, ...]
    fixed: Any = None
    pa: Any = None
    pa_fr_kmax: Any = None
    ranking: Any = None
    k_min: int = 1
    match: str | None = None
