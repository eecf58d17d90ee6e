"""Streaming first and second moments of the target's next-token distribution, never as a dense |T|² matrix.

RDK §4 builds its token-affinity prior from the covariance ``Ω`` of the target distribution ``p``. Here
``μ = E[p]`` is accumulated exactly (a dense ``|T|`` vector) and the second moment ``S = E[p pᵀ]`` from each
distribution's ``top_k`` entries only: a position contributes the ``k²`` products of its kept entries, so
``S`` is sparse (its support is the token pairs that were ever both likely at once) and ``Ω = S − μμᵀ`` is
"sparse + rank one" (:class:`Moments`). The mass the kept entries cover is reported, since it bounds what the
sparsified ``S`` misses (``Σ_ij S_ij`` equals the mean of the squared covered mass).

Sums, not means, are accumulated, so shards and ranks combine by addition (:meth:`MomentSums.merge`) and a
killed job resumes from the shards it saved (``jobs/estimate_rdk.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pipeline.checksums import temp_sibling
from pipeline.errors import DrafterError

MOMENTS_FILE = "moments.safetensors"


def _coalesce(keys: Tensor, vals: Tensor) -> tuple[Tensor, Tensor]:
    """Sum ``vals`` over equal ``keys``; keys come back sorted and unique."""
    if keys.numel() == 0:
        return keys, vals
    unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=vals.dtype, device=vals.device).index_add_(0, inverse, vals)
    return unique, summed


class MomentSums:
    """Running sums of ``p`` and of the top-k outer products ``p_K p_Kᵀ`` over target positions.

    Args:
        vocab_size: ``|T|``, the width of the distributions added.
        top_k: Entries of each distribution kept for the second moment.
        flush_every: Pending outer-product entries that trigger a merge into the sorted sums (memory bound).
    """

    def __init__(self, vocab_size: int, top_k: int, *, flush_every: int = 4_000_000) -> None:
        if vocab_size < 1 or top_k < 1:
            raise DrafterError("RDK moments need a positive vocabulary and top_k.", expected="vocab_size, top_k >= 1",
                               found=f"vocab_size={vocab_size}, top_k={top_k}", fix="Set estimate_rdk.top_k >= 1.")
        self.vocab_size = vocab_size
        self.top_k = min(top_k, vocab_size)
        self.flush_every = flush_every
        self.count = 0
        self.p_sum = torch.zeros(vocab_size, dtype=torch.float64)
        self.covered_sum = 0.0
        self.keys = torch.zeros(0, dtype=torch.long)
        self.vals = torch.zeros(0, dtype=torch.float64)
        self._pending: list[tuple[Tensor, Tensor]] = []
        self._pending_size = 0

    @torch.no_grad()
    def add(self, probs: Tensor) -> None:
        """Add ``(n, |T|)`` next-token distributions (any device; summed in float64 on the CPU)."""
        if probs.ndim != 2 or probs.shape[-1] != self.vocab_size:
            raise DrafterError("RDK moments got distributions of the wrong width.",
                               expected=f"(n, {self.vocab_size})", found=str(tuple(probs.shape)),
                               fix="Estimate with the target whose vocabulary the moments are for.")
        if probs.shape[0] == 0:
            return
        probs = probs.to(torch.float64)
        self.count += probs.shape[0]
        self.p_sum += probs.sum(0).cpu()
        vals, idx = probs.topk(self.top_k, dim=-1)
        self.covered_sum += float(vals.sum())
        keys = (idx.unsqueeze(-1) * self.vocab_size + idx.unsqueeze(-2)).flatten().cpu()
        prods = (vals.unsqueeze(-1) * vals.unsqueeze(-2)).flatten().cpu()
        self._pending.append(_coalesce(keys, prods))
        self._pending_size += keys.numel()
        if self._pending_size >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Merge pending products into the sorted sums."""
        if not self._pending:
            return
        keys = torch.cat([self.keys, *(k for k, _ in self._pending)])
        vals = torch.cat([self.vals, *(v for _, v in self._pending)])
        self.keys, self.vals = _coalesce(keys, vals)
        self._pending, self._pending_size = [], 0

    def merge(self, other: MomentSums) -> MomentSums:
        """Add ``other``'s sums to these (shards, ranks); both must have the same width and top_k."""
        if (other.vocab_size, other.top_k) != (self.vocab_size, self.top_k):
            raise DrafterError("Cannot merge RDK moment sums of different shapes.",
                               expected=f"vocab_size={self.vocab_size}, top_k={self.top_k}",
                               found=f"vocab_size={other.vocab_size}, top_k={other.top_k}",
                               fix="Delete the stale shards (their config differs) and rerun.")
        other.flush()
        self._pending.append((other.keys, other.vals))
        self.flush()
        self.count += other.count
        self.p_sum += other.p_sum
        self.covered_sum += other.covered_sum
        return self

    def tensors(self) -> dict[str, Tensor]:
        """The sums as named tensors (safetensors payload)."""
        self.flush()
        return {"p_sum": self.p_sum, "keys": self.keys, "vals": self.vals,
                "meta": torch.tensor([self.count, self.vocab_size, self.top_k], dtype=torch.long),
                "covered_sum": torch.tensor([self.covered_sum], dtype=torch.float64)}

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor]) -> MomentSums:
        count, vocab, top_k = (int(x) for x in t["meta"])
        sums = cls(vocab, top_k)
        sums.count, sums.p_sum, sums.keys, sums.vals = count, t["p_sum"], t["keys"], t["vals"]
        sums.covered_sum = float(t["covered_sum"][0])
        return sums

    def save(self, path: str | Path) -> None:
        """Write the sums to ``path`` atomically (safetensors; a rename publishes the file)."""
        from safetensors.torch import save_file

        path = Path(path)
        tmp = temp_sibling(path)
        save_file(self.tensors(), str(tmp))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> MomentSums:
        from safetensors.torch import load_file

        return cls.from_tensors(load_file(str(path)))

    def moments(self) -> Moments:
        """The means: ``μ`` and the sparse ``S``."""
        if self.count == 0:
            raise DrafterError("No target positions were seen, so RDK has no moments to estimate.",
                               expected="calibration rows with assistant (loss-masked) tokens",
                               found="0 positions", fix="Check the calibration set (drafter generate).")
        self.flush()
        v = self.vocab_size
        return Moments(mu=self.p_sum / self.count, rows=self.keys // v, cols=self.keys % v,
                       vals=self.vals / self.count, count=self.count, top_k=self.top_k,
                       covered=self.covered_sum / self.count)


@dataclass
class Moments:
    """``μ = E[p]`` and the top-k sparsified ``S = E[p pᵀ]`` (COO, symmetric, both orders stored).

    ``Ω = S − μμᵀ``: on the stored pairs ``S_ij − μ_iμ_j``, elsewhere ``−μ_iμ_j`` (RDK Eq. 2's input).

    Attributes:
        mu: ``(|T|,)`` float64 mean next-token distribution (sums to 1).
        rows, cols, vals: The stored entries of ``S`` (rows sorted).
        count: Target positions averaged over.
        top_k: Entries kept per distribution.
        covered: Mean mass of the kept entries (1.0 means ``S`` is exact).
    """

    mu: Tensor
    rows: Tensor
    cols: Tensor
    vals: Tensor
    count: int
    top_k: int
    covered: float

    @property
    def vocab_size(self) -> int:
        return int(self.mu.numel())

    @property
    def nnz(self) -> int:
        return int(self.vals.numel())

    def dense_second_moment(self, ids: Tensor | None = None) -> Tensor:
        """``S`` as a dense matrix, or its ``(ids, ids)`` block: for validation on small vocabularies only."""
        v = self.vocab_size
        if ids is None:
            out = torch.zeros(v, v, dtype=torch.float64)
            out[self.rows, self.cols] = self.vals
            return out
        ids = torch.as_tensor(ids, dtype=torch.long)
        where = torch.full((v,), -1, dtype=torch.long)
        where[ids] = torch.arange(ids.numel())
        r, c = where[self.rows], where[self.cols]
        keep = (r >= 0) & (c >= 0)
        out = torch.zeros(ids.numel(), ids.numel(), dtype=torch.float64)
        out[r[keep], c[keep]] = self.vals[keep]
        return out

    def dense_bytes(self) -> int:
        """Bytes a dense float32 ``|T|²`` covariance would take (what the sparse form avoids)."""
        return 4 * self.vocab_size**2

    def sparse_bytes(self) -> int:
        """Bytes of this representation (μ, and int64 row/col + float64 value per stored entry)."""
        return 8 * self.vocab_size + 24 * self.nnz
