"""DynaSpec's routed head: a drafter's LM head stored by cluster, evaluated on the chosen clusters' rows only.

The head's rows are stored once sorted by cluster, so a routed shortlist (DynaSpec §4.2: the union of the top-k
clusters, plus the tokens every shortlist keeps, such as EOS) is a few contiguous row ranges. Its logits come back
in a buffer of fixed capacity — the rows of the ``k`` largest clusters plus the kept tokens, known on the host from
``k`` alone — with ``-inf`` logits and id ``-1`` past the valid length, and that length stays on the device
(:class:`RoutedLogits`). Nothing on this path reads the device from the host, so the shape of every tensor
depends on ``k`` only (CUDA graphs can capture it; ``k`` may vary by draft position, one capacity per ``k``).

Three paths compute the same logits in the same order (ranges in the given cluster order, rows ascending within
a range, then the kept tokens whose cluster was not chosen):

* ``kernel`` — one Triton launch reading the chosen rows in place (:mod:`pipeline.engine.routed_triton`); the
  default on CUDA when Triton is installed. On CPU tensors Triton's interpreter runs it (tests; slow).
* ``torch`` — the same without Triton: each output slot's row found by a search over the ranges' cumulative
  lengths, rows gathered and multiplied in chunks of fixed size (no host synchronisation, fixed shapes; it
  computes the padding slots too, which the kernel skips). The default on CUDA without Triton; on the CPU its
  gather costs more than the full head (README, Measured), hence ``blocks`` there.
* ``blocks`` — one matmul per contiguous run of chosen clusters on views of the head (no copy, no padding);
  the host reads the chosen clusters to slice, which on CPU costs no synchronisation. The CPU default.

:meth:`RoutedHead.range_logits` serves any shortlist given as row ranges with the same kernel.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from pipeline.engine.proposers import LinearHead
from pipeline.errors import DrafterError

MODES = ("auto", "kernel", "torch", "blocks")
CHUNK_ELEMENTS = 1 << 20
"""The torch path gathers and multiplies this many weight elements at a time (4 MB of float32: cache-sized)."""


def triton_available() -> bool:
    """Whether Triton is installed (not imported: the kernel module is loaded on first use)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def kernel_loads() -> bool:
    """Whether the kernel module imports (Triton installed and importable with this torch): ``auto`` on CUDA uses the
    kernel only then, the torch path otherwise."""
    if not triton_available():
        return False
    try:
        from pipeline.engine import routed_triton  # noqa: F401  # deferred: pulls in triton
    except Exception:  # a Triton that does not import with this torch/CUDA: the torch path serves
        return False
    return True


def keep_tensor(keep_ids: Sequence[int], vocab: int, device: torch.device) -> Tensor:
    """Sorted distinct token ids to keep in every shortlist, checked against the vocabulary."""
    keep = sorted({int(t) for t in keep_ids})
    bad = [t for t in keep if not 0 <= t < vocab]
    if bad:
        raise DrafterError("Tokens to keep in every shortlist lie outside the drafter's vocabulary.",
                           expected=f"ids in [0, {vocab})", found=str(bad), fix="Pass the target's EOS id(s).")
    return torch.tensor(keep, dtype=torch.long, device=device)


class RoutedLogits(NamedTuple):
    """A routed shortlist's logits in a buffer of fixed capacity.

    Attributes:
        ids: ``(capacity,)`` token ids of a shortlist shared by every hidden row, or ``(B, capacity)`` one per row;
            ``-1`` past the valid length.
        logits: ``(capacity,)`` for one hidden state, else ``(B, capacity)``; ``-inf`` past the valid length.
        count: Valid entries (``()`` or ``(B,)``), on the device.
    """

    ids: Tensor
    logits: Tensor
    count: Tensor


def rows_of_ranges(starts: Tensor, lengths: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Row of each output slot for ``(R, S)`` row ranges laid end to end: ``(R, capacity)`` rows (``-1`` past the
    valid length) and ``(R,)`` valid lengths. Fixed shapes, no host synchronisation."""
    ends = torch.cumsum(lengths, 1)
    count = ends[:, -1]
    pos = torch.arange(capacity, device=starts.device).expand(starts.shape[0], capacity).contiguous()
    slot = torch.searchsorted(ends, pos, right=True).clamp_(max=starts.shape[1] - 1)
    rows = starts.gather(1, slot) + pos - (ends - lengths).gather(1, slot)
    return torch.where(pos < count[:, None], rows, -1), count


class RoutedHead:
    """A drafter's LM head stored by cluster, evaluated on the union of chosen clusters plus kept tokens.

    Args:
        model: The drafter (its output embedding is the head).
        clustering: The head's :class:`~pipeline.dynaspec.clusters.Clustering` (checked against the head).
        keep_ids: Token ids in every shortlist (EOS).
        mode: ``auto`` (the kernel on CUDA where Triton imports, ``torch`` on CUDA otherwise, ``blocks`` on CPU),
            ``kernel``, ``torch`` or ``blocks``; see the module docstring.
        block_rows: Rows per kernel work item (default 32 on CUDA; 256 on CPU, where Triton's interpreter runs the
            kernel and each work item costs milliseconds).
    """

    def __init__(self, model: torch.nn.Module, clustering: Any, keep_ids: Sequence[int], mode: str = "auto",
                 block_rows: int | None = None) -> None:
        weight = model.get_output_embeddings().weight
        clustering.check_head(weight)
        device = weight.device
        order, offsets = clustering.layout()
        self.order = torch.from_numpy(order).to(device)
        self.offsets = torch.from_numpy(offsets).to(device)
        self.sizes = self.offsets[1:] - self.offsets[:-1]
        self.assignment = torch.from_numpy(clustering.assignment).to(device)
        self.head = LinearHead(model, self.order)  # rows in cluster order: a cluster is one contiguous block
        self.num_clusters = clustering.num_clusters
        keep = keep_tensor(keep_ids, clustering.vocab_size, device)
        position = torch.empty_like(self.order)
        position[self.order] = torch.arange(self.order.numel(), device=device)
        self.keep_clusters = self.assignment[keep]
        self.keep_rows = position[keep]
        if mode not in MODES:
            raise DrafterError("Unknown routed-head mode.", expected=", ".join(MODES), found=repr(mode))
        if mode == "kernel" and not triton_available():
            raise DrafterError("The routed head's kernel needs Triton.", expected="triton installed",
                               found="no triton module", fix="pip install triton, or use mode torch or blocks.")
        if mode == "auto":
            mode = ("kernel" if kernel_loads() else "torch") if device.type == "cuda" else "blocks"
        self.mode = mode
        self.block_rows = block_rows or (32 if device.type == "cuda" else 256)
        sizes = np.diff(offsets)
        # host-known bounds for k chosen clusters: the k largest clusters' rows and row tiles
        self._rows_upto = np.concatenate([[0], np.cumsum(np.sort(sizes)[::-1])]).tolist()
        self._tiles_upto = np.concatenate([[0], np.cumsum(np.sort(-(-sizes // self.block_rows))[::-1])]).tolist()
        self._offsets = offsets.tolist()
        self._keep = list(zip(self.keep_clusters.tolist(), self.keep_rows.tolist()))
        self._plain = self.head.softcap is None and self.head.logit_scale is None

    def capacity(self, k: int) -> int:
        """Output slots for ``k`` chosen clusters: the ``k`` largest clusters' rows plus the kept tokens."""
        return int(self._rows_upto[k]) + len(self._keep)

    def ranges(self, clusters: Tensor) -> tuple[Tensor, Tensor]:
        """``(starts, lengths)``, ``(R, k + kept)``: the chosen clusters' row ranges, then one range per kept token
        (length 0 when its cluster is chosen)."""
        c = clusters.reshape(-1, clusters.shape[-1])
        starts, lengths = self.offsets[c], self.sizes[c]
        if self.keep_rows.numel():
            chosen = (self.keep_clusters[None, :, None] == c[:, None, :]).any(-1)
            starts = torch.cat([starts, self.keep_rows.expand(c.shape[0], -1)], 1)
            lengths = torch.cat([lengths, (~chosen).to(lengths.dtype)], 1)
        return starts, lengths

    def select(self, clusters: Tensor) -> tuple[Tensor, Tensor]:
        """Rows (into the cluster-sorted head) of the chosen clusters' union plus kept tokens: ``(R, capacity)``,
        ``-1`` past the valid length, and the ``(R,)`` valid lengths."""
        starts, lengths = self.ranges(clusters)
        return rows_of_ranges(starts, lengths, self.capacity(clusters.shape[-1]))

    def token_ids(self, rows: Tensor) -> Tensor:
        """Token ids of head rows (``-1`` stays ``-1``)."""
        return torch.where(rows >= 0, self.order[rows.clamp(min=0)], -1)

    def shortlist(self, hidden: Tensor, clusters: Tensor) -> RoutedLogits:
        """Logits of the chosen clusters' rows plus kept tokens.

        Args:
            hidden: ``(d,)`` or ``(B, d)`` hidden state(s).
            clusters: ``(k,)`` chosen clusters shared by every hidden row, or ``(B, k)`` one set per row.
        """
        h = hidden.reshape(-1, hidden.shape[-1])
        per_row = clusters.dim() == 2
        if per_row and clusters.shape[0] != h.shape[0]:
            raise DrafterError("One set of clusters per hidden row was expected.", expected=f"{h.shape[0]} rows",
                               found=f"{clusters.shape[0]}")
        if self.mode == "blocks" and not per_row:
            out = self._blocks(h, clusters)
        else:
            c = clusters.reshape(-1, clusters.shape[-1])
            if self.mode == "kernel":
                ids, logits, count = self._kernel(h, c, per_row, self.capacity(c.shape[1]),
                                                  int(self._tiles_upto[c.shape[1]]), c, self.offsets, True)
            else:
                rows, count = self.select(c)
                ids, logits = self.token_ids(rows), self._gathered(h, rows, per_row)
            out = RoutedLogits(ids if per_row else ids[0], logits, count if per_row else count[0])
        logits = out.logits if self._plain else self.head.finish(out.logits).masked_fill(out.ids < 0, float("-inf"))
        return RoutedLogits(out.ids, logits[0] if hidden.dim() == 1 else logits, out.count)

    def range_logits(self, hidden: Tensor, starts: Tensor, lengths: Tensor, capacity: int) -> RoutedLogits:
        """Logits of any shortlist given as row ranges of the stored head (``(R, S)`` starts and lengths, ``R`` 1 or
        ``B``; at most ``capacity`` rows in all), by the kernel or the torch path."""
        h = hidden.reshape(-1, hidden.shape[-1])
        per_row = starts.dim() == 2 and starts.shape[0] > 1
        s, n = starts.reshape(-1, starts.shape[-1]), lengths.reshape(-1, lengths.shape[-1])
        if self.mode == "kernel":
            tiles = -(-capacity // self.block_rows) + s.shape[1]  # a range wastes at most one partial tile
            ids, logits, count = self._kernel(h, s, per_row, capacity, tiles, s, n, False)
        else:
            rows, count = rows_of_ranges(s, n, capacity)
            ids, logits = self.token_ids(rows), self._gathered(h, rows, per_row)
        if not self._plain:
            logits = self.head.finish(logits).masked_fill(ids < 0, float("-inf"))
        return RoutedLogits(ids if per_row else ids[0], logits[0] if hidden.dim() == 1 else logits,
                            count if per_row else count[0])

    def _kernel(self, h: Tensor, c: Tensor, per_row: bool, capacity: int, tiles: int, range_a: Tensor,
                range_b: Tensor, from_clusters: bool) -> tuple[Tensor, Tensor, Tensor]:
        from pipeline.engine import routed_triton  # deferred: pulls in triton

        weight = self.head.weight
        logits = torch.empty(h.shape[0], capacity, dtype=weight.dtype, device=weight.device)
        ids = torch.empty(c.shape[0], capacity, dtype=torch.long, device=weight.device)
        count = torch.empty(c.shape[0], dtype=torch.long, device=weight.device)
        routed_triton.launch(weight, self.head.bias, h.contiguous(), self.order, range_a.contiguous(),
                             range_b.contiguous(), self.keep_rows, self.keep_clusters, from_clusters=from_clusters,
                             per_row=per_row, capacity=capacity, tiles=tiles, block_rows=self.block_rows,
                             block_d=128 if weight.shape[1] >= 128 else 64, logits=logits, ids=ids, count=count)
        return ids, logits, count

    def _gathered(self, h: Tensor, rows: Tensor, per_row: bool) -> Tensor:
        """The torch path's logits: rows gathered and multiplied a cache-sized chunk at a time (``-inf`` padding)."""
        weight, bias = self.head.weight, self.head.bias
        safe = rows.clamp(min=0)
        capacity = rows.shape[1]
        step = max(1, CHUNK_ELEMENTS // weight.shape[1])
        out = torch.empty(h.shape[0], capacity, dtype=weight.dtype, device=h.device)
        for a in range(0, capacity, step):
            index = safe[:, a:a + step]
            if per_row:
                part = torch.bmm(weight[index], h.unsqueeze(-1)).squeeze(-1)
                out[:, a:a + step] = part if bias is None else part + bias[index]
            else:
                out[:, a:a + step] = torch.nn.functional.linear(
                    h, weight.index_select(0, index[0]), None if bias is None else bias.index_select(0, index[0]))
        return out.masked_fill(rows < 0, float("-inf"))

    def _blocks(self, h: Tensor, clusters: Tensor) -> RoutedLogits:
        """``blocks``: one matmul per contiguous run of chosen clusters, on views (the host reads the clusters),
        padded to the capacity like the other paths."""
        chosen = sorted(set(clusters.tolist()))
        runs: list[list[int]] = []
        for c in chosen:  # merge adjacent clusters into one contiguous block
            if runs and runs[-1][1] == self._offsets[c]:
                runs[-1][1] = self._offsets[c + 1]
            else:
                runs.append([self._offsets[c], self._offsets[c + 1]])
        picked = set(chosen)
        runs += [[row, row + 1] for cluster, row in self._keep if cluster not in picked]
        weight, bias = self.head.weight, self.head.bias
        parts = [torch.nn.functional.linear(h, weight[a:b], None if bias is None else bias[a:b]) for a, b in runs]
        n = sum(b - a for a, b in runs)
        pad = self.capacity(clusters.shape[-1]) - n
        parts.append(torch.full((h.shape[0], pad), float("-inf"), dtype=parts[0].dtype, device=h.device))
        ids = torch.cat([self.order[a:b] for a, b in runs] + [torch.full((pad,), -1, device=h.device)])
        return RoutedLogits(ids, torch.cat(parts, -1), torch.tensor(n, device=h.device))
