"""The routed head's Triton kernel: logits of a shortlist of an LM head's rows given as row ranges, read in place.

One launch computes a whole routed shortlist (DynaSpec §4.2) from the cluster-sorted head without a gathered copy
and without a host synchronisation. Each program is one work item, a tile of ``BLOCK_R`` consecutive rows of one
range (a chosen cluster ``[offsets[c], offsets[c + 1])`` or a caller's ``[start, start + length)``), or a tile of
the always-kept rows (EOS) whose cluster was not chosen. A program finds its own range from the chosen clusters
(a cumulative sum of tiles per range, in registers), multiplies its rows by the hidden state(s) — a GEMV over
``d`` in ``BLOCK_D`` chunks, accumulated in float32 (float64 for float64 weights) — and writes its logits and token
ids at their place in a compact output of fixed capacity; every program also writes ``-inf`` (ids ``-1``) over its
share of the padding past the valid length, and program 0 writes that length. The grid is sized by the host from
what it knows without reading the device: the tiles of the ``k`` largest clusters plus the kept rows' tiles.

This module imports Triton; :mod:`pipeline.engine.routed_head` imports it only when the kernel path is used.
On CUDA tensors the compiled kernel runs; on CPU tensors Triton's interpreter runs the same kernel, with or without
``TRITON_INTERPRET=1`` (which interprets every kernel, CUDA ones too), which is how the tests check it on machines
without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_ADD = tl.standard._sum_combine
"""The combine function of ``tl.sum``/``tl.cumsum``. Sums and scans here are ``tl.reduce``/``tl.associative_scan``
with it: those two are builtins that Triton's interpreter replaces with numpy (it recognises this combine), while
``tl.sum`` and ``tl.cumsum`` are jit functions the interpreter can call only when ``TRITON_INTERPRET=1`` was set
before triton was imported — so the kernel runs interpreted on CPU tensors in a process that also compiles it."""


@triton.jit
def _routed_gemv_kernel(
    weight_ptr, bias_ptr, hidden_ptr, order_ptr, range_a_ptr, range_b_ptr, keep_rows_ptr, keep_clusters_ptr,
    logits_ptr, ids_ptr, count_ptr,
    K, NKEEP, B, D, CAP, TILES, GRID,
    stride_w, stride_h, stride_out,
    FROM_CLUSTERS: tl.constexpr, HAS_BIAS: tl.constexpr, PER_ROW: tl.constexpr, ACC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_KEEP: tl.constexpr,
    BLOCK_B: tl.constexpr, PAD_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid // GRID  # the range row (the batch row with per-row shortlists; 0 for a shared one)
    p = pid % GRID  # the work item in that row: TILES range tiles, then the kept rows' tiles
    rr = tl.arange(0, BLOCK_R)
    s = tl.arange(0, BLOCK_S)
    in_s = s < K
    # this row's ranges: chosen clusters [offsets[c], offsets[c + 1]), or the caller's (start, length)
    if FROM_CLUSTERS:
        c = tl.load(range_a_ptr + r * K + s, mask=in_s, other=0)
        start = tl.load(range_b_ptr + c, mask=in_s, other=0)
        length = tl.where(in_s, tl.load(range_b_ptr + c + 1, mask=in_s, other=0) - start, 0)
    else:
        c = tl.load(range_a_ptr + r * K + s, mask=in_s, other=0)
        start = c
        length = tl.load(range_b_ptr + r * K + s, mask=in_s, other=0)
    tiles = (length + BLOCK_R - 1) // BLOCK_R
    tile_end = tl.associative_scan(tiles, 0, _ADD)
    row_end = tl.associative_scan(length, 0, _ADD)
    n_tiles = tl.reduce(tiles, 0, _ADD)
    n_rows = tl.reduce(length, 0, _ADD)
    slot = tl.reduce((tile_end <= p).to(tl.int32), 0, _ADD)  # the range holding tile p
    sel = s == slot
    tile = p - tl.reduce(tl.where(sel, tile_end - tiles, 0), 0, _ADD)
    live_c = rr < tl.where(p < n_tiles, tl.reduce(tl.where(sel, length, 0), 0, _ADD) - tile * BLOCK_R, 0)
    rows_c = tl.reduce(tl.where(sel, start, 0), 0, _ADD) + tile * BLOCK_R + rr
    pos_c = tl.reduce(tl.where(sel, row_end - length, 0), 0, _ADD) + tile * BLOCK_R + rr
    # kept rows whose cluster is not chosen follow the ranges, in their given order
    jall = tl.arange(0, BLOCK_KEEP)
    kc_all = tl.load(keep_clusters_ptr + jall, mask=jall < NKEEP, other=-1)
    if FROM_CLUSTERS:
        hit_all = tl.reduce(((kc_all[:, None] == c[None, :]) & in_s[None, :]).to(tl.int32), 1, _ADD)
        extra_all = (jall < NKEEP) & (hit_all == 0)
    else:
        extra_all = jall < 0
    n_extra = tl.reduce(extra_all.to(tl.int64), 0, _ADD)
    total = n_rows + n_extra
    j = (p - TILES) * BLOCK_R + rr  # this program's kept rows, when it is a kept-rows tile
    kc = tl.load(keep_clusters_ptr + j, mask=(j >= 0) & (j < NKEEP), other=-1)
    if FROM_CLUSTERS:
        hit = tl.reduce(((kc[:, None] == c[None, :]) & in_s[None, :]).to(tl.int32), 1, _ADD)
        extra = (j >= 0) & (j < NKEEP) & (hit == 0)
    else:
        extra = j < -1
    before = tl.reduce(((jall[None, :] < j[:, None]) & extra_all[None, :]).to(tl.int64), 1, _ADD)
    rows_k = tl.load(keep_rows_ptr + j, mask=extra, other=0)
    is_keep = p >= TILES
    rows = tl.where(is_keep, rows_k, rows_c)
    live = tl.where(is_keep, extra, live_c)
    pos = tl.where(is_keep, n_rows + before, pos_c)

    if PER_ROW:
        hb = r + tl.arange(0, BLOCK_B)
        in_b = hb < r + 1
    else:
        hb = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        in_b = hb < B
    acc = tl.full((BLOCK_B, BLOCK_R), 0, dtype=ACC)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < D
        w = tl.load(weight_ptr + rows[:, None] * stride_w + dd[None, :], mask=live[:, None] & dm[None, :], other=0.0)
        h = tl.load(hidden_ptr + hb[:, None] * stride_h + dd[None, :], mask=in_b[:, None] & dm[None, :], other=0.0)
        acc += tl.reduce(h.to(ACC)[:, None, :] * w.to(ACC)[None, :, :], 2, _ADD)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=live, other=0.0).to(ACC)[None, :]
    tl.store(logits_ptr + hb[:, None] * stride_out + pos[None, :], acc, mask=in_b[:, None] & live[None, :])
    tl.store(ids_ptr + r * CAP + pos, tl.load(order_ptr + rows, mask=live, other=0), mask=live)
    # padding: each program writes its share of [total, CAP)
    for i in range(PAD_TILES):
        pad = total + (p * PAD_TILES + i) * BLOCK_R + rr
        in_pad = pad < CAP
        tl.store(logits_ptr + hb[:, None] * stride_out + pad[None, :],
                 tl.full((BLOCK_B, BLOCK_R), float("-inf"), dtype=ACC), mask=in_b[:, None] & in_pad[None, :])
        tl.store(ids_ptr + r * CAP + pad, tl.full((BLOCK_R,), -1, dtype=tl.int64), mask=in_pad)
    if p == 0:
        tl.store(count_ptr + r, total)


@functools.cache
def _interpreted():  # noqa: ANN202 - Triton's own callable type
    """The same kernel run by Triton's interpreter: CPU tensors (what ``TRITON_INTERPRET=1`` does for every kernel)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(getattr(_routed_gemv_kernel, "fn", _routed_gemv_kernel))


def _next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def launch(weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, order: torch.Tensor,
           range_a: torch.Tensor, range_b: torch.Tensor, keep_rows: torch.Tensor, keep_clusters: torch.Tensor, *,
           from_clusters: bool, per_row: bool, capacity: int, tiles: int, block_rows: int, block_d: int,
           logits: torch.Tensor, ids: torch.Tensor, count: torch.Tensor) -> None:
    """Run the kernel into ``logits`` ``(B, capacity)``, ``ids`` ``(R, capacity)`` and ``count`` ``(R,)``.

    ``range_a``/``range_b`` are ``(R, K)`` chosen clusters and the head's ``(M + 1,)`` cluster offsets
    (``from_clusters``), or ``(R, K)`` row starts and lengths. ``tiles`` bounds the range tiles of one row
    (host-known: the ``K`` largest ranges' tiles); ``R`` is 1 for a shortlist shared by the ``B`` hidden rows and
    ``B`` for one shortlist per row (``per_row``)."""
    n_rows_r, k = range_a.shape
    batch = hidden.shape[0]
    n_keep = int(keep_rows.numel())
    keep_tiles = -(-n_keep // block_rows) if from_clusters else 0
    grid_per_row = max(1, tiles + keep_tiles)
    pad_tiles = max(1, -(-capacity // (grid_per_row * block_rows)))
    block_b = 1 if per_row else min(_next_pow2(batch), 16)
    grid = (n_rows_r * grid_per_row, 1 if per_row else -(-batch // block_b))
    acc = tl.float64 if weight.dtype == torch.float64 else tl.float32
    kernel = _routed_gemv_kernel if weight.device.type == "cuda" else _interpreted()
    kernel[grid](
        weight, bias if bias is not None else weight, hidden, order, range_a, range_b,
        keep_rows, keep_clusters, logits, ids, count,
        k, n_keep, batch, weight.shape[1], capacity, tiles, grid_per_row,
        weight.stride(0), hidden.stride(0), logits.stride(0),
        FROM_CLUSTERS=from_clusters, HAS_BIAS=bias is not None, PER_ROW=per_row, ACC=acc,
        BLOCK_R=block_rows, BLOCK_D=block_d, BLOCK_S=_next_pow2(k, 2), BLOCK_KEEP=_next_pow2(n_keep, 2),
        BLOCK_B=block_b, PAD_TILES=pad_tiles,
    )
