"""Token clusters of an LM head: spherical k-means with FAISS (DynaSpec §4.2, "Vocabulary partition").

Each row ``W[v]`` of the drafter's output embedding (the paper's column ``W_LM[:, v]``; Hugging Face
stores the head as ``(V, d)``) is normalised to unit length, and the rows are clustered by spherical
k-means (inner-product assignment, centroids renormalised each iteration) into ``M`` clusters whose sizes
are left unbalanced, as the paper prescribes: semantically dense regions keep large clusters. Every
token lands in exactly one cluster (the final assignment is a nearest-centroid search over *all* rows,
not only the rows FAISS sampled for training), except that all-zero rows (a padded head's), which have no
direction, are left out of k-means and dealt round the clusters in id order. A head with a non-finite entry, or
with fewer distinct directions than clusters, is refused. :class:`Clustering` is what the ``cluster`` stage writes
and what the router and the routed proposer read; it carries the SHA-256 of the head it was computed
from so that it is never applied to another head.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import DrafterError
from pipeline.progress import heartbeat

CLUSTERS_FILE = "clusters.safetensors"
SUMMARY_FILE = "clusters.json"


def head_sha256(weight: Any, rounded_to: str = "bfloat16") -> str:
    """SHA-256 of an LM head's weight rounded to bfloat16 (and its shape): the identity a clustering and a
    router are tied to. Rounding first makes the same checkpoint match whether it was loaded in float32,
    float64 or bfloat16 (the cluster stage reads float32, evaluate the target's dtype); another head differs.

    A head loaded in float16 rounds to bfloat16 differently (twice, and float16's small numbers are coarser), so
    clusterings and routers also record the digest rounded to float16 (``rounded_to="float16"``), which a float16
    load of the same checkpoint reproduces: :func:`head_dtype` says which digest a loaded head is compared with."""
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[rounded_to]
    tensor = weight.detach() if isinstance(weight, torch.Tensor) else torch.as_tensor(np.asarray(weight))
    tensor = tensor.to("cpu", dtype).contiguous()
    digest = hashlib.sha256(f"{tuple(tensor.shape)}|{rounded_to}|".encode())
    digest.update(tensor.view(torch.int16).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def head_dtype(weight: Any) -> str:
    """The rounding a loaded head's digest is taken at: ``float16`` for a head held in float16, else ``bfloat16``."""
    return "float16" if str(getattr(weight, "dtype", "")) in ("torch.float16", "float16") else "bfloat16"


def normalised_rows(weight: Any) -> np.ndarray:
    """The head's rows as unit vectors, float32 C-contiguous (what FAISS takes). A zero row stays zero."""
    import torch

    rows = weight.detach().to("cpu", torch.float32).numpy() if isinstance(weight, torch.Tensor) else np.asarray(
        weight, dtype=np.float32)
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return np.ascontiguousarray(rows / np.maximum(norms, 1e-12), dtype=np.float32)


@dataclass
class Clustering:
    """A partition of the vocabulary into ``M`` clusters of an LM head's unit rows.

    Attributes:
        assignment: ``(V,)`` int64, the cluster of each token id.
        centroids: ``(M, d)`` float32 unit centroids.
        head_sha256: :func:`head_sha256` of the head clustered.
        meta: How it was computed (backend, seconds, iterations, objective).
        head_sha256_float16: the head's digest rounded to float16, which a float16 load of it is compared with;
            empty for a clustering made before it was recorded.
    """

    assignment: np.ndarray
    centroids: np.ndarray
    head_sha256: str
    meta: dict = field(default_factory=dict)
    head_sha256_float16: str = ""

    def __post_init__(self) -> None:
        self.assignment = np.asarray(self.assignment, dtype=np.int64)
        self.centroids = np.asarray(self.centroids, dtype=np.float32)
        m = self.num_clusters
        if self.assignment.ndim != 1 or (self.assignment.size and (self.assignment.min() < 0
                                                                   or self.assignment.max() >= m)):
            raise DrafterError("A token clustering assigns tokens to clusters that do not exist.",
                               expected=f"one cluster id in [0, {m}) per token",
                               found=f"ids in [{self.assignment.min()}, {self.assignment.max()}]",
                               fix="Rebuild it with `drafter cluster`.")

    @classmethod
    def of_head(cls, assignment: Any, centroids: Any, weight: Any, meta: dict | None = None) -> Clustering:
        """A clustering of head ``weight``, recording its digest at each rounding :func:`head_dtype` may ask for."""
        return cls(assignment, centroids, head_sha256(weight), meta or {}, head_sha256(weight, "float16"))

    @property
    def vocab_size(self) -> int:
        return int(self.assignment.size)

    @property
    def num_clusters(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per cluster, ``(M,)``."""
        return np.bincount(self.assignment, minlength=self.num_clusters)

    def content_sha256(self) -> str:
        """SHA-256 of the assignment and centroids: what a router records as the clustering it was trained for."""
        digest = hashlib.sha256(self.head_sha256.encode())
        digest.update(self.assignment.tobytes())
        digest.update(self.centroids.tobytes())
        return digest.hexdigest()

    def layout(self) -> tuple[np.ndarray, np.ndarray]:
        """``(order, offsets)``: token ids sorted by cluster (stable: ascending ids inside a cluster), and
        ``offsets[m]:offsets[m+1]`` the slice of ``order`` that is cluster ``m``."""
        order = np.argsort(self.assignment, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        return order.astype(np.int64), offsets

    def summary(self, special_ids: list[int] | None = None) -> dict:
        """Sizes and imbalance (the paper leaves clusters unbalanced; this says how much)."""
        sizes = self.sizes
        nonzero = sizes[sizes > 0]
        share = sizes / max(sizes.sum(), 1)
        entropy = float(-(share[share > 0] * np.log(share[share > 0])).sum())
        out = {"vocab_size": self.vocab_size, "clusters": self.num_clusters, "empty_clusters": int((sizes == 0).sum()),
               "size_min": int(sizes.min()), "size_max": int(sizes.max()), "size_mean": float(sizes.mean()),
               "size_median": float(np.median(sizes)), "size_std": float(sizes.std()),
               "max_over_mean": float(sizes.max() / max(sizes.mean(), 1e-12)),
               # exp(entropy) / M: 1.0 for equal sizes, -> 1/M when one cluster holds everything
               "effective_clusters_share": float(np.exp(entropy) / self.num_clusters),
               "largest_10_share": float(np.sort(share)[::-1][:10].sum()),
               "nonempty_clusters": int(nonzero.size), "head_sha256": self.head_sha256,
               "head_sha256_float16": self.head_sha256_float16, **self.meta}
        if special_ids:
            out["special_token_clusters"] = {int(t): int(self.assignment[t]) for t in special_ids
                                             if 0 <= t < self.vocab_size}
        return out

    def check_head(self, weight: Any, what: str = "the drafter's LM head") -> None:
        """Refuse to apply this clustering to a head it was not computed from."""
        rows = int(weight.shape[0])
        if rows != self.vocab_size:
            raise DrafterError(f"The token clustering is for an LM head of another size than {what}.",
                               expected=f"{rows} rows (tokens)", found=f"a clustering of {self.vocab_size} tokens",
                               fix="Cluster this drafter's head (`drafter cluster` with cluster.drafter set to it).")
        rounding = head_dtype(weight)
        recorded = self.head_sha256_float16 if rounding == "float16" else self.head_sha256
        if not recorded:
            raise DrafterError(f"The token clustering does not record the float16 digest of its head, and {what} is "
                               "held in float16.", expected="a clustering made since 2026-11-28 (cluster stage 2)",
                               found="a clustering with the bfloat16 digest alone",
                               fix="Rerun `drafter cluster` (the current stage version rebuilds it), or load the "
                                   "drafter in bfloat16 or float32.")
        found = head_sha256(weight, rounding)
        if found != recorded:
            raise DrafterError(f"The token clustering was computed from another LM head than {what}.",
                               expected=f"head sha256 {found[:16]}… ({rounding})",
                               found=f"clustering of head {recorded[:16]}…",
                               fix="Cluster this drafter's head (`drafter cluster` with cluster.drafter set to it), "
                                   "or evaluate with the drafter the clustering was made for.")

    def save(self, directory: str | Path, special_ids: list[int] | None = None) -> None:
        from safetensors.numpy import save_file

        directory = Path(directory)
        save_file({"assignment": self.assignment, "centroids": self.centroids}, str(directory / CLUSTERS_FILE),
                  metadata={"head_sha256": self.head_sha256, "head_sha256_float16": self.head_sha256_float16})
        (directory / SUMMARY_FILE).write_text(json.dumps(self.summary(special_ids), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> Clustering:
        """Read a ``cluster`` artifact's clustering (safetensors; no pickle)."""
        from safetensors import safe_open
        from safetensors.numpy import load_file

        path = Path(directory) / CLUSTERS_FILE
        if not path.is_file():
            raise DrafterError(f"No token clustering at {directory}.", expected=f"{CLUSTERS_FILE} (a cluster artifact)",
                               found="no such file", fix="Point at a `drafter cluster` artifact directory.")
        tensors = load_file(str(path))
        with safe_open(str(path), framework="numpy") as handle:
            recorded = handle.metadata() or {}
        head, head16 = recorded.get("head_sha256", ""), recorded.get("head_sha256_float16", "")
        meta = json.loads((Path(directory) / SUMMARY_FILE).read_text()) if (Path(directory) / SUMMARY_FILE).is_file() else {}
        keep = {k: meta[k] for k in ("backend", "seconds", "niter", "redo", "seed", "objective", "cpu_reason",
                                      "zero_rows") if k in meta}
        return cls(tensors["assignment"], tensors["centroids"], head, keep, head16)


def faiss_gpu_status(faiss: Any) -> tuple[int, str]:
    """GPUs FAISS sees, and when none why not (this FAISS build has no GPU support, or no CUDA device is visible)."""
    if not hasattr(faiss, "StandardGpuResources") or not hasattr(faiss, "get_num_gpus"):
        return 0, (f"the installed FAISS ({faiss.__version__}) is a CPU-only build: install the gpu extra "
                   f"(pip install '.[gpu]', the faiss-gpu package) in place of faiss-cpu")
    gpus = int(faiss.get_num_gpus())
    return gpus, "" if gpus else f"FAISS {faiss.__version__} has GPU support but sees no CUDA device"


def spherical_kmeans(weight: Any, clusters: int, *, niter: int = 20, redo: int = 1, seed: int = 0,
                     use_gpu: bool | None = None, max_points_per_centroid: int | None = None,
                     verbose: bool = False, log: Callable[[str], None] | None = None) -> Clustering:
    """Spherical k-means of the head's unit rows with FAISS (DynaSpec §4.2).

    Args:
        weight: ``(V, d)`` LM-head weight (torch or numpy).
        clusters: ``M``; at most ``V``.
        niter: Lloyd iterations per run.
        redo: Independent runs (different seeds); the one with the best objective is kept.
        seed: FAISS's seed: the same weight and arguments give the same clustering.
        use_gpu: True: FAISS-GPU (the ``faiss-gpu`` package), an error without a GPU; False: the CPU index;
            None: a GPU index whenever FAISS sees a GPU, else (or when the GPU run fails) the CPU index, and
            ``log`` says why.
        max_points_per_centroid: FAISS samples at most this many rows per centroid for training; None
            trains on every row. The assignment always covers every row.
        verbose: FAISS's progress lines.
        log: Where the line saying why the CPU index was used goes (also kept in ``meta["cpu_reason"]``).

    Returns:
        The :class:`Clustering` (assignment by nearest centroid under inner product, every token in
        exactly one cluster).
    """
    import faiss

    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite row is refused below, by its id
        x = normalised_rows(weight)
    vocab, dim = x.shape
    if not 1 <= clusters <= vocab:
        raise DrafterError("The number of token clusters does not fit the vocabulary.",
                           expected=f"cluster.clusters in [1, {vocab}] (the head has {vocab} rows)",
                           found=str(clusters), fix="Set cluster.clusters to a smaller number.")
    live = _trainable_rows(x, clusters)
    gpus, why_not = faiss_gpu_status(faiss)
    if use_gpu and gpus == 0:
        raise DrafterError("cluster.device=cuda but FAISS sees no GPU.",
                           expected="faiss-gpu (pip install '.[gpu]') on a machine with CUDA",
                           found=why_not, fix="Use cluster.device=auto or cpu.")
    started = time.perf_counter()
    cpu_reason = "" if use_gpu or gpus else why_not
    if use_gpu is False:
        cpu_reason = "cluster.device=cpu"
    result = None
    if use_gpu or (use_gpu is None and gpus):
        try:
            result = _kmeans(faiss, x[live], clusters, niter, redo, seed, max_points_per_centroid, verbose, gpu=True,
                             log=log)
        except Exception as error:  # a GPU run that fails (memory, CUDA runtime) falls back when not forced
            if use_gpu:
                raise
            cpu_reason = f"the FAISS GPU run failed ({type(error).__name__}: {error})"
    if result is None:
        if use_gpu is None and log is not None:
            log(f"k-means on the CPU index: {cpu_reason}")
        result = _kmeans(faiss, x[live], clusters, niter, redo, seed, max_points_per_centroid, verbose, gpu=False,
                         log=log)
    centroids, nearest_live, objective, on_gpu = result
    nearest = np.empty(vocab, dtype=np.int64)
    nearest[live] = nearest_live
    zero = np.flatnonzero(~live)
    nearest[zero] = np.arange(zero.size) % clusters  # no direction: dealt round the clusters in id order
    meta = {"backend": f"faiss-{'gpu' if on_gpu else 'cpu'} {faiss.__version__}",
            "seconds": round(time.perf_counter() - started, 4), "niter": niter, "redo": redo, "seed": seed,
            "objective": objective, "zero_rows": int(zero.size)}
    if not on_gpu:
        meta["cpu_reason"] = cpu_reason
    return Clustering.of_head(nearest, centroids, weight, meta)


def _trainable_rows(x: np.ndarray, clusters: int) -> np.ndarray:
    """The rows k-means trains on and assigns by their nearest centroid: every row but the all-zero ones (padding rows
    of a head wider than its tokenizer, which have no direction: under inner product they tie with every centroid and
    would all land in cluster 0). Refuses a head with a NaN or infinite entry (FAISS would abort on an assertion), and
    fewer distinct non-zero directions than ``clusters`` (the surplus clusters would stay empty)."""
    bad = np.flatnonzero(~np.isfinite(x).all(axis=1))
    if bad.size:
        raise DrafterError("The LM head to cluster has rows with NaN or infinite entries.",
                           expected="finite weights in every row", found=f"{bad.size} such rows (ids {bad[:8].tolist()}"
                           + (", ..." if bad.size > 8 else "") + ")",
                           fix="Check the drafter checkpoint (cluster.drafter): a diverged or corrupt head cannot be "
                               "clustered.")
    live = np.linalg.norm(x, axis=1) > 0.5  # unit rows; a zero row (or one below 1e-12) stays near zero
    distinct = int(np.unique(x[live].view(np.dtype((np.void, x.dtype.itemsize * x.shape[1]))).ravel()).size)
    if distinct < clusters:
        raise DrafterError("The LM head has fewer distinct token directions than clusters asked for: some clusters "
                           "would stay empty.",
                           expected=f"cluster.clusters <= {distinct} (distinct non-zero unit rows of the head; "
                                    f"{int((~live).sum())} all-zero rows left out)",
                           found=f"cluster.clusters={clusters}", fix=f"Set cluster.clusters to {distinct} or less.")
    return live


def _kmeans(faiss: Any, x: np.ndarray, clusters: int, niter: int, redo: int, seed: int,
            max_points_per_centroid: int | None, verbose: bool, gpu: bool, log: Callable[[str], None] | None = None
            ) -> tuple[np.ndarray, np.ndarray, float, bool]:
    """FAISS spherical k-means on one backend: centroids, every row's nearest centroid, objective, on GPU. Two calls
    that can run minutes at a production vocabulary: a line every 30 s while they do (:func:`heartbeat`)."""
    vocab, dim = x.shape
    kmeans = faiss.Kmeans(dim, clusters, niter=niter, nredo=redo, seed=seed, spherical=True, gpu=gpu,
                          verbose=verbose, max_points_per_centroid=max_points_per_centroid or vocab,
                          min_points_per_centroid=1)
    with heartbeat(f"k-means of {vocab:,} rows into {clusters:,} clusters ({'GPU' if gpu else 'CPU'} index)", log):
        kmeans.train(x)
        centroids = np.ascontiguousarray(kmeans.centroids, dtype=np.float32)
        index = faiss.IndexFlatIP(dim)
        if gpu:
            index = faiss.index_cpu_to_all_gpus(index)
        index.add(centroids)
        _, nearest = index.search(x, 1)
    objective = float(kmeans.obj[-1]) if len(kmeans.obj) else float("nan")
    return centroids, nearest[:, 0].astype(np.int64), objective, gpu


def mean_cosine_to_centroid(weight: Any, clustering: Clustering) -> float:
    """Mean cosine between each head row and its cluster's centroid: the quality of an assignment."""
    x = normalised_rows(weight)
    return float(np.einsum("ij,ij->i", x, clustering.centroids[clustering.assignment]).mean())


def sklearn_kmeans_seconds(weight: Any, clusters: int, *, niter: int = 20, seed: int = 0) -> float:
    """Seconds scikit-learn's ``KMeans`` (Lloyd, one init) takes on the same unit rows: the baseline the
    FAISS timing is compared with (it is Euclidean k-means on unit vectors, the usual stand-in)."""
    from sklearn.cluster import KMeans

    x = normalised_rows(weight)
    started = time.perf_counter()
    KMeans(n_clusters=clusters, n_init=1, max_iter=niter, tol=0.0, random_state=seed, algorithm="lloyd").fit(x)
    return time.perf_counter() - started
