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
