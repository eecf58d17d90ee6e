"""The routed head's three paths (pipeline.engine.routed_head) against the full head, on awkward clusterings.

A synthetic head (37 rows × 20 columns: not a multiple of any tile) clustered by hand into clusters of sizes 1, 1, 2,
3, 5, 7, 9 and 9 rows, tiles of 4 rows (so clusters end inside a tile and span several), kept rows inside and outside
the chosen clusters, one hidden state and a batch of 3 (one shortlist shared, and one per row), k from 1 to M. The
Triton kernel runs in Triton's interpreter on these CPU tensors (what ``TRITON_INTERPRET=1`` does), so it is checked
on every machine; the `gpu` test at the end runs it compiled.

The reference is the full head in float64 at the shortlist's ids; tolerances are those of each dtype's rounding of
one output (bf16: 2^-8 relative; fp16: 2^-11; fp32 and fp64 accumulate in their own precision).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.dynaspec.clusters import Clustering
from pipeline.engine.routed_head import RoutedHead, triton_available
from tests.helpers import requires_triton

SIZES = [1, 1, 2, 3, 5, 7, 9, 9]
KEEP = [0, 36]  # token 0 is in a size-1 cluster (cluster 5 after the shuffle below), token 36 in another
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
needs_triton = requires_triton()


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def _setup(dtype: torch.dtype, bias: bool = False) -> tuple[torch.nn.Module, Clustering]:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(sum(SIZES), 20, generator=gen, dtype=torch.float64).to(dtype)
    model = _Head(weight)
    if bias:
        model.lm_head.bias = torch.nn.Parameter(torch.randn(sum(SIZES), generator=gen, dtype=torch.float64).to(dtype))
    # cluster ids shuffled over tokens so clusters are not contiguous in token order
    assignment = np.random.default_rng(0).permutation(np.repeat(np.arange(len(SIZES)), SIZES))
    clustering = Clustering.of_head(assignment, np.zeros((len(SIZES), 20), np.float32), weight)
    return model, clustering


def _expected_ids(clustering: Clustering, chosen: list[int]) -> set[int]:
    return set(np.flatnonzero(np.isin(clustering.assignment, chosen)).tolist()) | set(KEEP)


def _check(out, hidden: torch.Tensor, model: torch.nn.Module, clustering: Clustering, chosen_per_row: list[list[int]],
           capacity: int, dtype: torch.dtype) -> None:
    """Every row: valid length = the shortlist's size, its ids are the chosen clusters' members plus KEEP once each,
    its logits are the full head's at those ids, and the padding is id -1 / logit -inf up to the fixed capacity."""
    head = model.get_output_embeddings()
    full = torch.nn.functional.linear(hidden.double(), head.weight.double(),
                                      None if head.bias is None else head.bias.double())
    full = full.reshape(-1, full.shape[-1])
    logits = out.logits.reshape(-1, capacity)
    ids = out.ids.reshape(-1, capacity).expand(logits.shape[0], capacity)
    count = out.count.reshape(-1).expand(logits.shape[0])
    assert logits.dtype == dtype and out.ids.dtype == torch.long
    for b in range(logits.shape[0]):
        expected = _expected_ids(clustering, chosen_per_row[b % len(chosen_per_row)])
        n = int(count[b])
        assert n == len(expected)
        assert sorted(ids[b, :n].tolist()) == sorted(expected)
        assert (ids[b, n:] == -1).all() and torch.isneginf(logits[b, n:]).all()
        scale = float(full[b].detach().abs().max())
        torch.testing.assert_close(logits[b, :n].double(), full[b, ids[b, :n]], rtol=0,
                                   atol=TOLERANCE[dtype] * max(scale, 1.0))


CASES = [[5], [0, 1], [6, 2, 0], [3, 7, 4, 5], list(range(len(SIZES)))]
"""Chosen clusters: a size-1 cluster holding a kept token; two size-1 clusters; clusters ending mid-tile in an
unsorted order; both 9-row clusters with others; all of them (k = M, every kept token inside)."""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", [pytest.param("kernel", marks=needs_triton), "torch", "blocks"])
def test_paths_match_the_full_head(dtype: torch.dtype, mode: str) -> None:
    model, clustering = _setup(dtype, bias=dtype == torch.float32)
    routed = RoutedHead(model, clustering, KEEP, mode=mode, block_rows=4)
    gen = torch.Generator().manual_seed(1)
    for chosen in CASES:
        c = torch.tensor(chosen)
        one = torch.randn(20, generator=gen, dtype=torch.float64).to(dtype)
        out = routed.shortlist(one, c)
        assert out.logits.shape == (routed.capacity(len(chosen)),) and out.count.shape == ()
        _check(out, one, model, clustering, [chosen], routed.capacity(len(chosen)), dtype)
        batch = torch.randn(3, 20, generator=gen, dtype=torch.float64).to(dtype)
        _check(routed.shortlist(batch, c), batch, model, clustering, [chosen], routed.capacity(len(chosen)), dtype)


@pytest.mark.parametrize("mode", [pytest.param("kernel", marks=needs_triton), "torch"])
def test_one_shortlist_per_row_and_k_varying_by_position(mode: str) -> None:
    """A batch of 3 rows, each with its own clusters (k = 3), then k = 1..M in turn (the position-aware budget):
    the capacity is the k largest clusters plus the kept tokens, whatever was chosen."""
    model, clustering = _setup(torch.float32)
    routed = RoutedHead(model, clustering, KEEP, mode=mode, block_rows=4)
    gen = torch.Generator().manual_seed(2)
    rows = [[6, 2, 0], [7, 1, 5], [3, 4, 2]]
    hidden = torch.randn(3, 20, generator=gen)
    out = routed.shortlist(hidden, torch.tensor(rows))
    assert out.ids.shape == out.logits.shape == (3, routed.capacity(3)) and out.count.shape == (3,)
    _check(out, hidden, model, clustering, rows, routed.capacity(3), torch.float32)
    largest = sorted(SIZES, reverse=True)
    for k in range(1, len(SIZES) + 1):
        assert routed.capacity(k) == sum(largest[:k]) + len(KEEP)
        chosen = list(range(k))
        one = torch.randn(20, generator=gen)
        _check(routed.shortlist(one, torch.tensor(chosen)), one, model, clustering, [chosen], routed.capacity(k),
               torch.float32)


@needs_triton
def test_kernel_and_torch_path_give_the_same_layout() -> None:
    """Same order (ranges in the given cluster order, then kept tokens outside them), same values."""
    model, clustering = _setup(torch.float64)
    kernel = RoutedHead(model, clustering, KEEP, mode="kernel", block_rows=4)
    torch_path = RoutedHead(model, clustering, KEEP, mode="torch")
    hidden = torch.randn(2, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for chosen in CASES:
        a, b = kernel.shortlist(hidden, torch.tensor(chosen)), torch_path.shortlist(hidden, torch.tensor(chosen))
        assert torch.equal(a.ids, b.ids) and torch.equal(a.count, b.count)
        torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", [pytest.param("kernel", marks=needs_triton), "torch"])
def test_any_shortlist_given_as_row_ranges(mode: str) -> None:
    """Row ranges of the stored head (a prefix, ranges of length 0 and 1, one over a tile boundary), per row."""
    model, clustering = _setup(torch.float32)
    routed = RoutedHead(model, clustering, KEEP, mode=mode, block_rows=4)
    hidden = torch.randn(2, 20, generator=torch.Generator().manual_seed(4))
    starts = torch.tensor([[0, 9, 30, 13], [5, 5, 36, 0]])
    lengths = torch.tensor([[6, 0, 1, 7], [3, 2, 1, 0]])
    out = routed.range_logits(hidden, starts, lengths, capacity=16)
    stored = routed.head.weight.double()
    for b in range(2):
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts[b].tolist(), lengths[b].tolist())])
        n = rows.numel()
        assert int(out.count[b]) == n and (out.ids[b, n:] == -1).all() and torch.isneginf(out.logits[b, n:]).all()
        assert torch.equal(out.ids[b, :n], routed.order[rows])
        torch.testing.assert_close(out.logits[b, :n].double(), stored[rows] @ hidden[b].double(), rtol=0, atol=1e-5)


def test_torch_path_has_no_host_synchronisation() -> None:
    """The torch path traces whole under ``torch.compile(fullgraph=True)``: a ``.item()``, ``.tolist()``,
    ``int(tensor)`` or an output shape that depends on tensor values would be a graph break, which fullgraph
    turns into an error (shown by the ``blocks`` path, which reads the clusters on the host). Its output shapes
    depend on k only, and the compiled graph gives the eager result for other clusters of the same k."""
    model, clustering = _setup(torch.float32)
    routed = RoutedHead(model, clustering, KEEP, mode="torch", block_rows=4)
    hidden = torch.randn(20, generator=torch.Generator().manual_seed(5))
    compiled = torch.compile(lambda h, c: routed.shortlist(h, c), fullgraph=True, backend="eager", dynamic=False)
    for chosen in ([6, 2, 0], [7, 1, 5], [0, 1, 2]):
        eager, traced = routed.shortlist(hidden, torch.tensor(chosen)), compiled(hidden, torch.tensor(chosen))
        assert traced.logits.shape == (routed.capacity(3),)
        assert torch.equal(eager.ids, traced.ids) and torch.equal(eager.logits, traced.logits)
    torch._dynamo.reset()
    routed.mode = "blocks"
    blocks = torch.compile(lambda h, c: routed.shortlist(h, c), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="tolist"):
        blocks(hidden, torch.tensor([6, 2, 0]))
    torch._dynamo.reset()


@pytest.mark.gpu
def test_kernel_on_cuda_matches_and_never_synchronises() -> None:
    """On CUDA in bf16 and fp32: the compiled kernel and the torch path match the full head, and neither makes a
    host synchronisation (``torch.cuda.set_sync_debug_mode('error')`` raises on any)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import copy

    for dtype in (torch.bfloat16, torch.float32):
        reference, clustering = _setup(dtype)
        model = copy.deepcopy(reference).to("cuda")
        for mode in (["kernel"] if triton_available() else []) + ["torch"]:
            routed = RoutedHead(model, clustering, KEEP, mode=mode, block_rows=4)
            hidden = torch.randn(3, 20, device="cuda").to(dtype)
            for chosen in CASES:
                c = torch.tensor(chosen, device="cuda")
                routed.shortlist(hidden, c)  # compile outside the checked region
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out = routed.shortlist(hidden, c)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                cpu = type(out)(out.ids.cpu(), out.logits.cpu(), out.count.cpu())
                _check(cpu, hidden.cpu(), reference, clustering, [chosen], routed.capacity(len(chosen)), dtype)
