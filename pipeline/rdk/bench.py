"""Benchmarks for RDK's parts, each printing ratios against a baseline timed in the same run.

:func:`bench_estimation`: streaming moment estimation (:class:`~pipeline.rdk.moments.MomentSums`) of
synthetic peaked next-token distributions at a realistic vocabulary (default 128,256, Llama 3): contexts per
second, and the memory of the sparse second moment against the dense ``|T|²`` float32 matrix it avoids.

:func:`bench_redistribution`: one draft step's redistribution at that size for a kept set (default 32,768 of
128,256, FR-Spec's size): TLI (the kept distribution scattered into target space, the baseline), RDK-Taylor
(Eq. 3), the prior mix, and the exact sparse ``Mᵀq'`` (Eq. 2 via :class:`~pipeline.rdk.affinity.Affinity`) —
plus, for scale, the LM-head matmul of a 4096-wide drafter over the kept rows that produced ``q'``.
Distributions are synthetic: costs do not depend on their values, except the exact form's, which grows with
the number of "heavy" tokens (``μ > √τ/2``) — so ``μ`` is Zipf-like, as real token frequencies are.
"""

from __future__ import annotations

import json
import time

import torch

from pipeline.timing import device_name, median_seconds


def _zipf(vocab: int, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.randperm(vocab, generator=generator).to(torch.float64) + 1
    weights = ranks ** -1.1
    return weights / weights.sum()


def synthetic_distributions(n: int, vocab: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``(n, vocab)`` peaked distributions: a Zipf prior in log space plus Student-t noise (RDK §6.1)."""
    base = torch.log(_zipf(vocab, generator)).to(device, torch.float32)
    noise = torch.distributions.StudentT(5.0).sample((n, vocab)).to(device) * 1.5
    return torch.softmax(3.0 * base + noise, -1)


def bench_estimation(vocab: int = 128_256, top_k: int = 64, contexts: int = 2048, batch: int = 256,
                     seed: int = 0) -> dict:
    """Contexts/s of the streaming estimate, and its memory against a dense |T|² float32 matrix."""
    from pipeline.rdk.moments import MomentSums  # deferred: pulls in torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    probs = [synthetic_distributions(batch, vocab, gen, device) for _ in range(max(1, contexts // batch))]
    sums = MomentSums(vocab, top_k)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for p in probs:
        sums.add(p)
    sums.flush()
    seconds = time.perf_counter() - start
    moments = sums.moments()
    return {"device": device_name(device),
            "vocab": vocab, "top_k": top_k, "contexts": moments.count, "seconds": round(seconds, 3),
            "contexts_per_s": round(moments.count / seconds, 1), "nnz": moments.nnz,
            "sparse_mib": round(moments.sparse_bytes() / 2**20, 1), "dense_mib": round(moments.dense_bytes() / 2**20, 1),
            "dense_over_sparse": round(moments.dense_bytes() / moments.sparse_bytes(), 1),
            "top_k_mass": round(moments.covered, 4)}


def bench_redistribution(vocab: int = 128_256, kept: int = 32_768, hidden: int = 4096, top_k: int = 64,
                         tau: float = 1e-3, contexts: int = 1024, repeats: int = 20, seed: int = 0) -> dict:
    """Milliseconds per draft step of TLI, RDK-Taylor, the prior mix and exact RDK, and their ratio to TLI."""
    from pipeline.rdk.affinity import Affinity, PriorMix, TaylorForm, scatter_kept  # deferred: pulls in torch
    from pipeline.rdk.moments import MomentSums  # deferred: pulls in torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    sums = MomentSums(vocab, top_k)
    for _ in range(max(1, contexts // 256)):
        sums.add(synthetic_distributions(256, vocab, gen, device))
    moments = sums.moments()
    ids = torch.argsort(-moments.mu)[:kept]
    start = time.perf_counter()
    affinity = Affinity(moments, ids, tau).to(device)
    build = time.perf_counter() - start
    q = torch.softmax(torch.randn(kept, generator=gen, dtype=torch.float64), -1).to(device)
    taylor, mix = TaylorForm(moments.mu, ids).to(device), PriorMix(moments.mu, ids).to(device)
    head = torch.randn(kept, hidden, generator=gen).to(device)
    h = torch.randn(hidden, generator=gen).to(device)
    kept_ids = ids.to(device)
    timings = {
        "head_matmul": median_seconds(lambda: head @ h, device, repeats),
        "tli": median_seconds(lambda: scatter_kept(q, kept_ids, vocab), device, repeats),
        "rdk_taylor": median_seconds(lambda: taylor.redistribute(q), device, repeats),
        "rdk_prior": median_seconds(lambda: mix.redistribute(q), device, repeats),
        "rdk_exact": median_seconds(lambda: affinity.redistribute(q), device, repeats),
    }
    base = timings["tli"]
    heavy = int((affinity.scale > 0.5).sum())
    return {"device": device_name(device),
            "vocab": vocab, "kept": kept, "tau": tau, "heavy_tokens": heavy, "stored_pairs": int(affinity.correction.numel()),
            "affinity_build_s": round(build, 3),
            "ms": {k: round(1e3 * v, 3) for k, v in timings.items()},
            "vs_tli": {k: round(v / base, 2) for k, v in timings.items()}}


def bench_rdk(steps: int = 20) -> str:
    """``drafter bench rdk``: :func:`bench_estimation` and :func:`bench_redistribution` (``steps`` repeats of
    each draft step), as indented JSON."""
    return json.dumps({"estimation": bench_estimation(), "redistribution": bench_redistribution(repeats=steps)},
                      indent=2)
