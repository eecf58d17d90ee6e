"""RDK's token-affinity matrix, applied exactly without forming it, and the cheaper redistributions.

RDK (Timor et al.) drafts from ``p' = Mᵀq'`` (Alg. 1, line 2), where ``q'`` is the TLI distribution over the
kept tokens ``I`` and ``M_ij = softmax_j(Ω_ij/τ)`` (Eq. 2) for ``i ∈ I, j ∈ T``. With ``Ω = S − μμᵀ`` and ``S``
sparse (:mod:`pipeline.rdk.moments`), every entry off the support of ``S`` is ``exp(−μ_iμ_j/τ)`` up to the
row's normaliser: a rank-one *exponent*, not a rank-one matrix, so ``Mᵀq'`` still looks like an
``|I|×|T|`` product. :func:`kernel_sum` evaluates ``Σ_i a_i exp(−u_i v_j)`` exactly in ``O(K(|I|+|T|))`` (plus
a dense block for the few "heavy" tokens whose ``μ`` exceeds ``√τ/2``, at most ``2/√τ`` of them since
``Σμ = 1``): for ``u_iv_j ≤ 1/4`` the power series of ``exp`` converges to float64 precision in ``K = 12``
terms, and it separates into ``K`` row sums and ``K`` column powers. :class:`Affinity` uses it for the
normalisers (once, when built) and for ``Mᵀq'`` (per draft step), adding the sparse part as a correction
on the stored pairs; :func:`dense_affinity` is the reference it is tested against.

Also here: the first-order Taylor form of Eq. 3 (:func:`taylor_redistribute`) and the rank-one limit of an
affinity, a mixture of ``q'`` with the prior restricted to out-of-vocabulary tokens (:class:`PriorMix`).
Every one returns a distribution over ``T`` that the drafter then samples from and hands to verification
unchanged, which is what keeps them lossless.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from pipeline.errors import DrafterError
from pipeline.rdk.moments import Moments

SERIES_TERMS = 12
"""Power-series terms of ``exp(−x)`` for ``x ≤ 1/4``: remainder ``≤ 0.25¹²/12! ≈ 1e-16``."""
LIGHT = 0.5
"""A token is "light" when its scaled mean ``μ/√τ`` is at most this, so light×light exponents are ``≤ 1/4``."""


def check_tau(tau: float) -> float:
    """``tau`` as a float; a non-positive or non-finite temperature is refused."""
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise DrafterError("The RDK affinity temperature must be a positive number.", expected="tau > 0 (Eq. 2)",
                           found=f"tau={tau!r}", fix="Pick tau on held-out rows (estimate_rdk.taus) or pass tau > 0.")
    return float(tau)


def check_kept(kept: Tensor, vocab_size: int, required: Sequence[int] = (), what: str = "the kept-token set") -> Tensor:
    """``kept`` as unique int64 ids in ``[0, vocab_size)`` that include every id in ``required`` (EOS)."""
    kept = torch.as_tensor(kept, dtype=torch.long).flatten().cpu()
    if kept.numel() == 0:
        raise DrafterError(f"RDK needs a non-empty {what} (the intersection I = T ∩ D).",
                           expected="at least one token the drafter and the target share", found="0 tokens",
                           fix="Use a drafter whose vocabulary overlaps the target's, or keep more tokens.")
    if int(kept.min()) < 0 or int(kept.max()) >= vocab_size:
        raise DrafterError(f"{what.capitalize()} holds ids outside the target vocabulary.",
                           expected=f"ids in [0, {vocab_size})", found=f"ids in [{int(kept.min())}, {int(kept.max())}]",
                           fix="Build the affinity with the moments of this target.")
    if torch.unique(kept).numel() != kept.numel():
        raise DrafterError(f"{what.capitalize()} repeats ids.", expected="unique ids",
                           found=f"{kept.numel() - torch.unique(kept).numel()} duplicates", fix="Deduplicate it.")
    missing = sorted(set(int(r) for r in required) - set(kept.tolist()))
    if missing:
        raise DrafterError(f"{what.capitalize()} drops the end-of-sequence token.",
                           expected=f"EOS id(s) {sorted(int(r) for r in required)} kept",
                           found=f"missing {missing}",
                           fix="Keep the special tokens in every pruning level (a drafter that cannot end a "
                               "sequence stalls the decode).")
    return kept


def held_bytes(*tensors: Tensor | None) -> int:
    """Bytes the tensors hold (a sparse CSR one: its row offsets, column indices and values); None counts 0."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        parts = (t.crow_indices(), t.col_indices(), t.values()) if t.layout == torch.sparse_csr else (t,)
        total += sum(part.numel() * part.element_size() for part in parts)
    return total


class SeparableKernel:
    """``a ↦ y``, ``y[..., j] = Σ_i a[..., i] · exp(−u_i v_j)`` for fixed non-negative ``u`` and ``v``: exact in
    O(K(|u| + |v|)) per call after an O(K(|u| + |v|) + |H|(|u| + |v|)) precomputation.

    Light pairs (``u_i, v_j ≤ light``) use the separable power series ``exp(−x) = Σ_k (−x)^k / k!``; pairs with a
    heavy side are summed densely over that side only (the heavy blocks are precomputed).

    Args:
        u: ``(n,)`` non-negative row scales.
        v: ``(m,)`` non-negative column scales.
    """

    def __init__(self, u: Tensor, v: Tensor, *, terms: int = SERIES_TERMS, light: float = LIGHT) -> None:
        u, v = u.to(torch.float64), v.to(torch.float64)
        self.width = v.numel()
        lu, lv = u <= light, v <= light
        # Index vectors, not masks: a boolean index is a nonzero() under the hood, a host sync on every call.
        self.lu, self.lv = torch.nonzero(lu).flatten(), torch.nonzero(lv).flatten()
        self.hu, self.hv = torch.nonzero(~lu).flatten(), torch.nonzero(~lv).flatten()
        k = torch.arange(terms, dtype=torch.float64, device=u.device)
        inv_fact = torch.exp(-torch.lgamma(k + 1))
        self.powers_u = _powers(u[self.lu], terms)  # (n_light, K): u_i^k
        self.powers_v = _powers(-v[self.lv], terms).T * inv_fact.unsqueeze(-1)  # (K, m_light): (−v_j)^k / k!
        self.heavy_cols = torch.exp(-u.unsqueeze(-1) * v[self.hv].unsqueeze(0))  # (n, m_heavy)
        self.heavy_rows = torch.exp(-u[self.hu].unsqueeze(-1) * v[self.lv].unsqueeze(0))  # (n_heavy, m_light)
        self.any_light = bool(self.lu.numel()) and bool(self.lv.numel())
        self.all_light = not self.hu.numel() and not self.hv.numel()

    def to(self, device: torch.device | str) -> SeparableKernel:
        for name in ("lu", "lv", "hu", "hv", "powers_u", "powers_v", "heavy_cols", "heavy_rows"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def step_bytes(self) -> int:
        """Bytes one call on one row reads from its precomputed tensors and writes (the ``(m,)`` float64 result)."""
        out = self.width * 8
        if self.all_light:
            return held_bytes(self.powers_u, self.powers_v) + out
        return held_bytes(self.lu, self.lv, self.hu, self.hv, self.powers_u, self.powers_v, self.heavy_cols,
                          self.heavy_rows) + out

    def __call__(self, a: Tensor) -> Tensor:
        """``(..., n)`` weights → ``(..., m)`` float64, without a host sync (fixed index vectors, no masks)."""
        a = a.to(torch.float64)
        if self.all_light:  # the common case at useful τ: no masks, two small matmuls
            return (a @ self.powers_u) @ self.powers_v
        last = a.dim() - 1
        out = a.new_zeros(a.shape[:-1] + (self.width,))
        if self.any_light:
            out.index_copy_(last, self.lv, (a.index_select(last, self.lu) @ self.powers_u) @ self.powers_v)
        if self.heavy_cols.shape[-1]:
            out.index_copy_(last, self.hv, a @ self.heavy_cols)
        if self.heavy_rows.shape[0]:
            out.index_add_(last, self.lv, a.index_select(last, self.hu) @ self.heavy_rows)
        return out


def _powers(x: Tensor, terms: int) -> Tensor:
    """``(n, terms)``: ``x^0 … x^(terms-1)`` by repeated multiplication (exact for any sign)."""
    out = x.new_ones(x.numel(), terms)
    if terms > 1:
        out[:, 1:] = torch.cumprod(x.unsqueeze(-1).expand(-1, terms - 1), dim=-1)
    return out


def kernel_sum(a: Tensor, u: Tensor, v: Tensor, *, terms: int = SERIES_TERMS, light: float = LIGHT) -> Tensor:
    """``y[..., j] = Σ_i a[..., i] · exp(−u_i v_j)`` exactly, once (see :class:`SeparableKernel`)."""
    return SeparableKernel(u, v, terms=terms, light=light)(a)


class Affinity:
    """The rows ``i ∈ I`` of RDK's affinity ``M`` (Eq. 2) as "closed form + sparse correction".

    ``M_ij = c_i exp(−μ_iμ_j/τ) + R_ij``: ``c_i`` is the row's normaliser share of an off-support entry and
    ``R`` (non-zero only on the stored pairs of ``S``) replaces those entries by ``exp(Ω_ij/τ)``'s true share.
    Rows are shifted by their maximum before exponentiating, so small ``τ`` cannot overflow.

    Args:
        moments: ``μ`` and the sparse second moment of the target.
        kept: ``I``, target ids in the order of the drafter's kept distribution ``q'``.
        tau: The affinity temperature ``τ > 0``.
        required: Ids ``kept`` must contain (EOS).
    """

    def __init__(self, moments: Moments, kept: Tensor, tau: float, required: Sequence[int] = ()) -> None:
        self.tau = check_tau(tau)
        self.vocab_size = moments.vocab_size
        self.kept = check_kept(kept, self.vocab_size, required)
        mu = moments.mu.to(torch.float64).clamp_min(0.0)
        self.scale = mu / math.sqrt(self.tau)  # u_j = μ_j/√τ, so μ_iμ_j/τ = u_i u_j
        u_kept = self.scale[self.kept]
        where = torch.full((self.vocab_size,), -1, dtype=torch.long)
        where[self.kept] = torch.arange(self.kept.numel())
        r = where[moments.rows]
        on = r >= 0
        r, c, s = r[on], moments.cols[on], moments.vals[on].to(torch.float64)
        off = -u_kept[r] * self.scale[c]  # the exponent an off-support entry would have
        full = off + s / self.tau  # Ω_ij/τ on the stored pairs
        # Row shift m_i: the largest exponent in the row (off-support exponents are at most −u_i·min_j u_j).
        shift = -u_kept * self.scale.min()
        shift = shift.scatter_reduce(0, r, full, reduce="amax")
        dense = kernel_sum(torch.ones(self.vocab_size, dtype=torch.float64), self.scale, u_kept)  # Σ_j exp(−u_i u_j)
        z = torch.exp(torch.log(dense) - shift)
        z = z.index_add(0, r, torch.exp(full - shift[r]) - torch.exp(off - shift[r]))
        log_norm = shift + torch.log(z)
        self.row_scale = torch.exp(-log_norm)  # c_i (underflows to 0 where off-support entries are negligible)
        self.rows, self.cols = r, c
        self.correction = torch.exp(full - log_norm[r]) - torch.exp(off - log_norm[r])
        self.kernel = SeparableKernel(u_kept, self.scale)
        self.correction_t = _csr(c, r, self.correction, (self.vocab_size, self.kept.numel()))  # Rᵀ, for Rᵀq' per step
        self._device = torch.device("cpu")

    def to(self, device: torch.device | str) -> Affinity:
        """Move the tensors used per draft step to ``device``."""
        device = torch.device(device)
        for name in ("kept", "scale", "row_scale", "rows", "cols", "correction", "correction_t"):
            setattr(self, name, getattr(self, name).to(device))
        self.kernel = self.kernel.to(device)
        self._device = device
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def step_bytes(self) -> int:
        """Bytes :meth:`redistribute` reads and writes for one row: the kernel's tensors, ``c``, the sparse
        correction ``Rᵀ`` and the ``(|T|,)`` float64 result (written by the kernel, then by the correction's sum)."""
        return self.kernel.step_bytes() + held_bytes(self.row_scale, self.correction_t) + self.vocab_size * 8

    def redistribute(self, q_kept: Tensor) -> Tensor:
        """``Mᵀq'``: ``(..., |I|)`` distributions over the kept tokens → ``(..., |T|)`` over the target's."""
        q_kept = q_kept.to(torch.float64)
        out = self.kernel(q_kept * self.row_scale)
        flat = q_kept.reshape(-1, q_kept.shape[-1])
        return out + (self.correction_t @ flat.T).T.reshape(out.shape)

    def dense_rows(self) -> Tensor:
        """The ``(|I|, |T|)`` rows of ``M`` from this representation (validation only: O(|I||T|) memory)."""
        eye = torch.eye(self.kept.numel(), dtype=torch.float64, device=self.device)
        return self.redistribute(eye)


def _csr(rows: Tensor, cols: Tensor, vals: Tensor, shape: tuple[int, int]) -> Tensor:
    """A CSR matrix from COO entries (a sparse matrix-vector product is several times faster than index_add)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), vals, shape).coalesce()
        return coo.to_sparse_csr()


def dense_affinity(moments: Moments, kept: Tensor, tau: float, ids: Tensor | None = None) -> Tensor:
    """Eq. 2 the direct way: ``softmax_j((S − μμᵀ)_ij/τ)`` for ``i ∈ kept``, from a dense ``S``.

    With ``ids`` the vocabulary is restricted to those tokens first (a sub-problem whose exact answer the
    sparse construction must reproduce when built from the same restricted moments); otherwise the whole
    vocabulary is used, which only small vocabularies afford. The reference for :class:`Affinity`.
    """
    tau = check_tau(tau)
    mu = moments.mu.to(torch.float64)
    s = moments.dense_second_moment(ids)
    if ids is not None:
        mu = mu[torch.as_tensor(ids, dtype=torch.long)]
    omega = s - torch.outer(mu, mu)
    return torch.softmax(omega[torch.as_tensor(kept, dtype=torch.long)] / tau, dim=-1)


def restrict(moments: Moments, ids: Tensor) -> Moments:
    """The moments of the sub-vocabulary ``ids`` (renumbered ``0..len(ids)-1``), for validating on a subset."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    where = torch.full((moments.vocab_size,), -1, dtype=torch.long)
    where[ids] = torch.arange(ids.numel())
    r, c = where[moments.rows], where[moments.cols]
    keep = (r >= 0) & (c >= 0)
    return Moments(mu=moments.mu[ids].clone(), rows=r[keep], cols=c[keep], vals=moments.vals[keep],
                   count=moments.count, top_k=moments.top_k, covered=moments.covered)


def scatter_kept(q_kept: Tensor, kept: Tensor, vocab_size: int) -> Tensor:
    """``q'`` over the kept tokens as a ``(..., |T|)`` vector (0 off ``I``)."""
    out = q_kept.new_zeros(q_kept.shape[:-1] + (vocab_size,), dtype=torch.float64)
    return out.index_copy_(-1, kept.to(q_kept.device), q_kept.to(torch.float64))


def taylor_redistribute(q: Tensor, prior: Tensor) -> Tensor:
    """RDK's first-order Taylor form (Eq. 3): ``p̃_j = (N q'_j + θ π_j)/(N + π_j)``, ``θ = πᵀq'``, normalised.

    Eq. 3 writes the target ``p`` for ``π``; ``p`` is not known while drafting, so a method passes the
    calibration prior ``μ`` (RDK-Taylor) and only the analysis passes the true ``p`` (an oracle upper bound,
    never a method). Note the size of the effect: an out-of-vocabulary token gets ``θπ_j/(N + π_j) ≈ θπ_j/N``,
    tiny for a large ``N = |T|``, so with a prior the form stays close to TLI.

    Args:
        q: ``(..., |T|)`` the TLI distribution ``q'`` (0 off ``I``).
        prior: ``(|T|,)`` or ``(..., |T|)`` the distribution standing in for ``p``.
    """
    q = q.to(torch.float64)
    prior = prior.to(torch.float64)
    n = q.shape[-1]
    theta = (q * prior).sum(-1, keepdim=True)
    tilde = (n * q + theta * prior) / (n + prior)
    return tilde / tilde.sum(-1, keepdim=True)


class TaylorForm:
    """:func:`taylor_redistribute` as a redistribution of kept-token distributions (RDK-Taylor with a prior).

    Args:
        prior: ``(|T|,)`` the calibration mean ``μ`` standing in for ``p`` in Eq. 3.
        kept: ``I``.
    """

    def __init__(self, prior: Tensor, kept: Tensor) -> None:
        self.prior = prior.to(torch.float64).clamp_min(0.0)
        self.kept = torch.as_tensor(kept, dtype=torch.long)

    def to(self, device: torch.device | str) -> TaylorForm:
        self.prior, self.kept = self.prior.to(device), self.kept.to(device)
        return self

    def step_bytes(self) -> int:
        """Bytes :meth:`redistribute` reads and writes for one row: the prior and ``I``, ``q'`` scattered onto
        ``(|T|,)`` float64, and the result."""
        return held_bytes(self.prior, self.kept) + 2 * self.prior.numel() * 8

    def redistribute(self, q_kept: Tensor) -> Tensor:
        """``(..., |I|)`` → ``(..., |T|)``: Eq. 3 with ``p := μ``."""
        return taylor_redistribute(scatter_kept(q_kept, self.kept, self.prior.numel()), self.prior)


class PriorMix:
    """The rank-one limit of an affinity: ``(1 − w) q' + w · π_OOV``, ``π_OOV`` = the prior on ``T∖I``, normalised.

    If every row of ``M`` equalled the prior restricted to out-of-vocabulary tokens, apart from keeping the
    row's own token, ``Mᵀq'`` would be this mixture. ``w`` is either one number (default: the prior's mass
    outside ``I``) or a table over bins of the drafter's confidence ``max q'`` (``edges`` and ``weights``,
    fitted on held-out rows as the mean target mass outside ``I`` per bin): a context-dependent weight.

    Args:
        prior: ``(|T|,)`` the calibration mean ``μ``.
        kept: ``I``.
        weight: A constant ``w``; ``None`` for the prior's mass outside ``I``.
        edges: Ascending bin edges on ``max q'`` (``len(weights) - 1`` of them) for a context-dependent ``w``.
        weights: ``w`` per bin.
    """

    def __init__(self, prior: Tensor, kept: Tensor, weight: float | None = None, *,
                 edges: Sequence[float] | None = None, weights: Sequence[float] | None = None) -> None:
        prior = prior.to(torch.float64).clamp_min(0.0)
        kept = torch.as_tensor(kept, dtype=torch.long)
        oov = prior.clone()
        oov[kept] = 0.0
        mass = float(oov.sum())
        self.oov = oov / mass if mass > 0 else oov
        self.kept = kept
        self.weight = (mass if weight is None else float(weight)) if mass > 0 else 0.0
        self.edges = None if edges is None else torch.tensor(list(edges), dtype=torch.float64)
        self.weights = None if weights is None else torch.tensor(list(weights), dtype=torch.float64)
        if (self.edges is None) != (self.weights is None) or (
                self.edges is not None and self.weights.numel() != self.edges.numel() + 1):
            raise DrafterError("A context-dependent prior weight needs one weight per bin.",
                               expected="len(weights) == len(edges) + 1",
                               found=f"{None if edges is None else len(edges)} edges, "
                                     f"{None if weights is None else len(weights)} weights",
                               fix="Fit both with fit_confidence_weights.")
        if mass <= 0:
            self.weights = None if self.weights is None else torch.zeros_like(self.weights)

    def to(self, device: torch.device | str) -> PriorMix:
        for name in ("oov", "kept", "edges", "weights"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self

    def weight_for(self, q_kept: Tensor) -> Tensor:
        """``w`` per row of ``(..., |I|)`` kept distributions, shape ``(..., 1)``."""
        if self.edges is None:
            return q_kept.new_full(q_kept.shape[:-1] + (1,), self.weight, dtype=torch.float64)
        conf = q_kept.to(torch.float64).amax(-1).contiguous()
        return self.weights[torch.bucketize(conf, self.edges)].unsqueeze(-1)

    def step_bytes(self) -> int:
        """Bytes :meth:`redistribute` reads and writes for one row: ``π_OOV``, ``I`` and the bins, ``q'`` scattered
        onto ``(|T|,)`` float64, and the result."""
        return held_bytes(self.oov, self.kept, self.edges, self.weights) + 2 * self.oov.numel() * 8

    def redistribute(self, q_kept: Tensor) -> Tensor:
        """``(..., |I|)`` → ``(..., |T|)``: the mixture."""
        w = self.weight_for(q_kept)
        q = scatter_kept(q_kept, self.kept, self.oov.numel())
        return (1.0 - w) * q + w * self.oov


def fit_confidence_weights(q_kept: Tensor, oov_mass: Tensor, bins: int = 8) -> tuple[list[float], list[float]]:
    """Bins of the drafter's confidence ``max q'`` (equal-count) and the mean target mass outside ``I`` in each.

    Args:
        q_kept: ``(n, |I|)`` held-out kept distributions.
        oov_mass: ``(n,)`` the target's mass outside ``I`` at the same positions.

    Returns:
        ``(edges, weights)`` for :class:`PriorMix`.
    """
    conf = q_kept.to(torch.float64).amax(-1)
    quantiles = torch.linspace(0, 1, bins + 1, dtype=torch.float64)[1:-1]
    edges = torch.unique(torch.quantile(conf, quantiles))
    which = torch.bucketize(conf, edges)
    weights = []
    overall = float(oov_mass.mean()) if oov_mass.numel() else 0.0
    for b in range(edges.numel() + 1):
        sel = which == b
        weights.append(float(oov_mass[sel].mean()) if bool(sel.any()) else overall)
    return edges.tolist(), weights


def acceptance(p: Tensor, q: Tensor) -> Tensor:
    """α = Σ min(p, q) along the last axis (Definition 2.1)."""
    return torch.minimum(p.to(torch.float64), q.to(torch.float64)).sum(-1)
