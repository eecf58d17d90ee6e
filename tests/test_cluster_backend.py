"""Where the ``cluster`` stage's k-means runs: a FAISS GPU index whenever FAISS sees a GPU, else the CPU index with
a log line saying why; and on a GPU, the same assignment quality as on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobs.cluster import cluster_head
from pipeline.config.sections import load_config
from pipeline.dynaspec.clusters import faiss_gpu_status, mean_cosine_to_centroid, spherical_kmeans
from pipeline.errors import DrafterError
from tests.helpers import skip_unless


def _head(rows: int, dim: int) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))


def test_cpu_index_when_faiss_sees_no_gpu_and_the_log_says_why() -> None:
    """On a machine where FAISS sees no GPU, cluster.device=auto clusters on the CPU index and logs one line giving
    the reason (kept in clusters.json as cpu_reason); cluster.device=cpu logs nothing; cluster.device=cuda refuses."""
    import faiss

    gpus, why = faiss_gpu_status(faiss)
    if gpus:
        pytest.skip(f"FAISS sees {gpus} GPU(s) here: tests/test_cluster_backend.py's gpu test covers this machine")
    assert why  # a CPU-only build, or a GPU build without a device
    head = _head(512, 32)
    lines: list[str] = []
    cfg = load_config(None, ["cluster.clusters=8", "cluster.redo=1", "cluster.niter=5"])
    auto = cluster_head(cfg, head, lines.append)
    assert lines == [f"k-means on the CPU index: {why}"]
    assert auto.meta["backend"].startswith("faiss-cpu") and auto.meta["cpu_reason"] == why
    assert ("CPU-only build" in why and "gpu extra" in why) or "sees no CUDA device" in why
    lines.clear()
    forced = cluster_head(load_config(None, ["cluster.clusters=8", "cluster.redo=1", "cluster.niter=5",
                                             "cluster.device=cpu"]), head, lines.append)
    assert lines == [] and np.array_equal(forced.assignment, auto.assignment)
    with pytest.raises(DrafterError, match="FAISS sees no GPU"):
        spherical_kmeans(head, 8, use_gpu=True)


@pytest.mark.gpu
def test_gpu_index_matches_cpu_quality() -> None:
    """32,768 × 256 random rows into 128 clusters: the GPU index is used under auto, and its assignment's mean
    cosine to centroid is within 1 % of the CPU index's."""
    import faiss

    gpus, why = faiss_gpu_status(faiss)
    skip_unless(bool(gpus), f"FAISS sees no GPU: {why}", "DRAFTER_REQUIRE_FAISS_GPU",
                "install a FAISS built with GPU support (faiss-gpu-cu12) in place of faiss-cpu")
    head = _head(32_768, 256)
    lines: list[str] = []
    gpu = spherical_kmeans(head, 128, niter=20, seed=0, log=lines.append)
    cpu = spherical_kmeans(head, 128, niter=20, seed=0, use_gpu=False)
    assert gpu.meta["backend"].startswith("faiss-gpu") and lines == []
    assert cpu.meta["backend"].startswith("faiss-cpu")
    on_gpu, on_cpu = mean_cosine_to_centroid(head, gpu), mean_cosine_to_centroid(head, cpu)
    assert abs(on_gpu - on_cpu) <= 0.01 * on_cpu, (on_gpu, on_cpu)


def test_a_head_with_nan_or_inf_rows_is_refused_before_faiss() -> None:
    """A NaN or infinite head entry made FAISS abort on a C++ assertion inside k-means; it is a DrafterError naming
    the rows and what to check."""
    for bad in (np.nan, np.inf):
        head = _head(200, 8).numpy()
        head[5, 3] = bad
        with pytest.raises(DrafterError, match=r"NaN or infinite(.|\n)*ids \[5\](.|\n)*cluster\.drafter"):
            spherical_kmeans(head, 8, niter=5, use_gpu=False)


def test_fewer_distinct_directions_than_clusters_are_refused() -> None:
    """200 rows on 3 directions (rescaled copies count as one) into 16 clusters published 13 empty clusters with exit 0;
    now refused naming cluster.clusters and the most it can be. 3 clusters of them have none empty."""
    rng = np.random.default_rng(0)
    head = rng.standard_normal((3, 8)).astype(np.float32)[rng.integers(0, 3, 200)] * 2.0 ** rng.integers(0, 3, (200, 1))
    with pytest.raises(DrafterError, match=r"fewer distinct token directions(.|\n)*cluster\.clusters <= 3"):
        spherical_kmeans(head, 16, niter=5, use_gpu=False)
    assert spherical_kmeans(head, 3, niter=5, use_gpu=False).summary()["empty_clusters"] == 0


def test_all_zero_rows_stay_out_of_k_means_and_are_dealt_round_the_clusters() -> None:
    """All-zero (padding) rows tie with every centroid and all went to cluster 0, inflating it. They are left out of
    training (the other rows' clustering is the one they would get alone) and dealt round the clusters in id order,
    so no cluster gets more than its share of them; the clustering says how many there were."""
    head = _head(300, 8).numpy()
    head[100:200] = 0
    clustering = spherical_kmeans(head, 8, niter=5, seed=0, use_gpu=False)
    zero = np.r_[100:200]
    assert np.bincount(clustering.assignment[zero], minlength=8).tolist() == [13] * 4 + [12] * 4
    alone = spherical_kmeans(np.delete(head, zero, axis=0), 8, niter=5, seed=0, use_gpu=False)
    assert np.array_equal(np.delete(clustering.assignment, zero), alone.assignment)
    assert np.array_equal(clustering.centroids, alone.centroids)
    assert clustering.summary()["zero_rows"] == 100 and alone.summary()["zero_rows"] == 0
