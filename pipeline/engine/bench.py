"""Benchmarks for DynaSpec's parts, each printing ratios against a baseline timed in the same run.

:func:`bench_head`: one draft step's LM head at a realistic size (default 128k × 4096, Llama-3-8B's head)
and at the tiny kit's size: the full head, a static FR-Spec head (a pre-sliced ``(k, d)`` matrix), and
the routed head (router MLP + top-k + the chosen clusters' rows, the code the proposer runs: rows stored
by cluster) on each of its paths — the Triton kernel, the torch path without host synchronisation, per-block
matmuls on views —, with the routed shortlist sized like DynaSpec's (≈ 28k of 128k). Weights are
synthetic (latency does not depend on their values) and the clusters unbalanced (log-normal sizes).

:func:`bench_cluster`: spherical k-means with FAISS against scikit-learn's ``KMeans`` on the same unit
rows (and FAISS-GPU when FAISS sees a GPU).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pipeline.progress import heartbeat
from pipeline.timing import device_name, interleaved_medians, median_seconds


class _Head(torch.nn.Module):
    """A bare LM head with the accessor the proposers use."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.lm_head.weight = torch.nn.Parameter(weight, requires_grad=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def unbalanced_assignment(vocab: int, clusters: int, seed: int = 0) -> np.ndarray:
    """A token → cluster map with log-normal cluster sizes (every cluster non-empty), tokens shuffled."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(0.0, 0.8, clusters)
    sizes = np.maximum(1, np.floor(sizes / sizes.sum() * (vocab - clusters)).astype(np.int64) + 1)
    sizes[np.argmax(sizes)] += vocab - sizes.sum()
    return rng.permutation(np.repeat(np.arange(clusters), sizes))


def bench_head(vocab: int = 128_256, hidden: int = 4096, clusters: int = 1024, static: int = 32_768,
               routed_share: float = 0.22, router_hidden: int = 512, repeats: int = 50, device: str | None = None,
               dtype: str | None = None, interpreted_repeats: int = 1) -> dict:
    """Time one draft step's head: full vs static vs routed (router + the routed head), for each path of the routed
    head (:mod:`pipeline.engine.routed_head`: ``kernel`` where Triton is installed — interpreted on CPU, which is
    a correctness run, not a speed figure —, ``torch`` and ``blocks``), all on one head in one run.

    Args:
        vocab, hidden: The head's shape.
        clusters: M.
        static: Rows of the static FR-Spec head.
        routed_share: Target share of the vocabulary in the routed shortlist (DynaSpec ≈ 28.7k / 128k).
        router_hidden: Width of the router MLP (input 2 × hidden).
        repeats: Timed calls per variant (median reported).
        device: cpu or cuda (default: cuda when present).
        dtype: float32 (CPU default) or bfloat16 (CUDA default).
        interpreted_repeats: Timed calls of the kernel when Triton's interpreter runs it (CPU; no warm-up: at
            128k × 4096 one interpreted call takes ~20 s).

    Returns:
        ``{"device", "dtype", "shape", "clusters", "k", "rows", "paths", "ms", "vs_full"}``; ``ms`` holds
        ``full``, ``static``, ``router_mlp_topk`` and, per path, ``routed_<path>`` (router + head) and
        ``head_<path>`` (the routed head alone, given the clusters).
    """
    from pipeline.dynaspec.clusters import Clustering  # deferred: pulls in numpy
    from pipeline.dynaspec.router import Router  # deferred: pulls in torch
    from pipeline.engine.routed_head import RoutedHead, triton_available  # deferred: pulls in torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(device=dev, dtype=dt)
    h = torch.randn(hidden, generator=gen).to(device=dev, dtype=dt)
    assignment = unbalanced_assignment(vocab, clusters)
    clustering = Clustering.of_head(assignment, np.zeros((clusters, hidden), np.float32), weight)
    model = _Head(weight)
    routed = RoutedHead(model, clustering, keep_ids=[0], mode="torch")  # one stored head; its path switched below
    router = Router(2 * hidden, router_hidden, clusters).to(device=dev, dtype=dt).eval()
    feature = torch.randn(2 * hidden, generator=gen).to(device=dev, dtype=dt)
    # k: clusters whose mean union size is the routed share (by the mean cluster size)
    k = max(1, min(clusters, round(routed_share * clusters)))
    static_rows = weight[:static].clone()
    chosen = torch.topk(router(feature), k).indices
    paths = (["kernel"] if triton_available() else []) + ["torch", "blocks"]

    @torch.no_grad()
    def full() -> torch.Tensor:
        return torch.nn.functional.linear(h, weight)

    @torch.no_grad()
    def static_head() -> torch.Tensor:
        return torch.nn.functional.linear(h, static_rows)

    @torch.no_grad()
    def head_only() -> torch.Tensor:
        return routed.shortlist(h, chosen).logits

    @torch.no_grad()
    def routed_step() -> torch.Tensor:
        return routed.shortlist(h, torch.topk(router(feature), k).indices).logits

    @torch.no_grad()
    def router_only() -> torch.Tensor:
        return torch.topk(router(feature), k).indices

    rows = int(routed.shortlist(h, chosen).count)

    def on(path: str, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            routed.mode = path
            return fn()
        return call

    # every variant timed in turn in each round (a shared machine's load moves them alike); the interpreted
    # kernel (seconds per call on CPU) apart, after them
    interpreted = dev.type != "cuda"
    fns = {"full": full, "static": static_head, "router_mlp_topk": router_only}
    for path in paths:
        if not (path == "kernel" and interpreted):
            fns |= {f"head_{path}": on(path, head_only), f"routed_{path}": on(path, routed_step)}
    ms = {name: 1e3 * s for name, s in interleaved_medians(fns, dev, repeats).items()}
    if "kernel" in paths and interpreted:  # no compilation to warm up; ~20 s a call at 128k × 4096
        with heartbeat(f"the routed head's kernel in Triton's interpreter ({vocab:,} × {hidden:,})"):
            ms["head_kernel"] = 1e3 * median_seconds(on("kernel", head_only), dev, interpreted_repeats, warmup=0)
            ms["routed_kernel"] = 1e3 * median_seconds(on("kernel", routed_step), dev, interpreted_repeats, warmup=0)
    name = device_name(dev)
    return {"device": name, "dtype": str(dt).replace("torch.", ""), "shape": [vocab, hidden], "clusters": clusters,
            "k": k, "rows": {"full": vocab, "static": static, "routed": rows, "capacity": routed.capacity(k)},
            "paths": paths, "interpreted": dev.type != "cuda", "ms": ms,
            "vs_full": {n: v / ms["full"] for n, v in ms.items()}}


def head_table(results: list[dict]) -> str:
    lines = ["| head | device | dtype | routed path | rows (full / static / routed / capacity) | full ms | "
             "static ms (× full) | routed ms (× full) | of which routed head | router |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms, vs, n = r["ms"], r["vs_full"], r["rows"]
        for path in r["paths"]:
            label = path + (" (Triton interpreter: not a speed figure)" if path == "kernel" and r["interpreted"] else "")
            lines.append(f"| {r['shape'][0]}×{r['shape'][1]}, M={r['clusters']}, k={r['k']} | {r['device']} | "
                         f"{r['dtype']} | {label} | {n['full']} / {n['static']} / {n['routed']} / {n['capacity']} | "
                         f"{ms['full']:.3f} | {ms['static']:.3f} ({vs['static']:.2f}×) | {ms[f'routed_{path}']:.3f} "
                         f"({vs[f'routed_{path}']:.2f}×) | {ms[f'head_{path}']:.3f} | {ms['router_mlp_topk']:.3f} |")
    return "\n".join(lines)


def bench_heads(steps: int = 10) -> str:
    """``drafter bench head``: :func:`bench_head` at 128k × 4096 (``steps`` repeats) and at the tiny kit's size
    (at least 200 repeats: a tiny head's step is too short to time fewer), as one :func:`head_table`."""
    results = [bench_head(repeats=steps)]
    results.append(bench_head(vocab=2048, hidden=96, clusters=64, static=512, routed_share=0.25, router_hidden=256,
                              repeats=max(steps, 200), interpreted_repeats=5))
    return head_table(results)


def bench_cluster(rows: int = 32_768, dim: int = 1024, clusters: int = 256, niter: int = 20,
                  sklearn: bool = True) -> str:
    """FAISS spherical k-means vs scikit-learn KMeans on the same synthetic unit rows (ratios printed)."""
    import faiss

    from pipeline.dynaspec.clusters import (  # deferred: pulls in numpy
        sklearn_kmeans_seconds,
        spherical_kmeans,
    )

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, dim, generator=gen)
    lines = [f"k-means of {rows} × {dim} unit rows into {clusters} clusters, {niter} iterations, 1 run "
             f"({torch.get_num_threads()} CPU threads)", "| implementation | seconds | vs FAISS-CPU |", "|---|---|---|"]
    cpu = spherical_kmeans(weight, clusters, niter=niter, redo=1, use_gpu=False).meta["seconds"]
    lines.append(f"| faiss-cpu {faiss.__version__} (spherical) | {cpu:.2f} | 1.00× |")
    if faiss.get_num_gpus() > 0:
        gpu = spherical_kmeans(weight, clusters, niter=niter, redo=1, use_gpu=True).meta["seconds"]
        lines.append(f"| faiss-gpu (spherical) | {gpu:.2f} | {gpu / cpu:.2f}× |")
    if sklearn:
        with heartbeat("scikit-learn KMeans"):
            sk = sklearn_kmeans_seconds(weight, clusters, niter=niter)
        lines.append(f"| scikit-learn KMeans (lloyd) | {sk:.2f} | {sk / cpu:.2f}× |")
    return "\n".join(lines)
