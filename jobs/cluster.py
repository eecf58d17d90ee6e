"""Stage ``cluster``: spherical k-means of the drafter's LM head with FAISS (DynaSpec §4.2).

Run alone with ``drafter cluster --config configs/tiny.yaml``. Reads the head of ``cluster.drafter`` (the
same-tokenizer drafter DynaSpec routes over), normalises each token's row to unit length, and clusters
the rows into ``cluster.clusters`` unbalanced clusters with FAISS (a GPU index whenever FAISS sees a GPU —
the ``gpu`` extra's ``faiss-gpu`` —, the CPU index otherwise, with a log line saying why; inner-product metric,
seeded). Not a training job, so no Lightning: it follows the
stage contract (artifact id, manifest, atomic publish, MLflow run) like every other stage. Writes
``clusters.safetensors`` (token → cluster assignment, unit centroids; the head's SHA-256 in its metadata)
and ``clusters.json`` (sizes, imbalance, where the special tokens fell, timing).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.errors import DrafterError
from pipeline.models.loading import load_model, load_tokenizer
from pipeline.models.target import Target
from pipeline.orchestration.dag import plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, run_stage
from pipeline.vocab.tokens import vocab_hash

SUMMARY: tuple[str, ...] = ("clusters", "max_over_mean", "cluster_seconds")
"""Metrics ``drafter run`` prints for this stage: clusters, their largest size over the mean and clustering time."""


def cluster_head(cfg: PipelineConfig, weight: object, log: Callable[[str], None] | None = None) -> object:
    """The clustering this config asks for, of ``weight`` (a ``(V, d)`` head); ``log`` hears why the CPU index was
    used when ``cluster.device=auto`` and FAISS sees no GPU (or its GPU run failed)."""
    from pipeline.dynaspec.clusters import spherical_kmeans  # deferred: pulls in numpy

    cc = cfg.cluster
    use_gpu = None if cc.device == "auto" else cc.device == "cuda"
    return spherical_kmeans(weight, cc.clusters, niter=cc.niter, redo=cc.redo, seed=cc.seed, use_gpu=use_gpu,
                            max_points_per_centroid=cc.max_points_per_centroid, log=log)


def _build(cfg: PipelineConfig, run: StageRun) -> BuildResult:

    drafter = load_model(cfg.cluster.drafter, dtype="float32", device="cpu")
    tokenizer = Target(cfg.target).tokenizer()
    weight = drafter.get_output_embeddings().weight
    if weight.shape[0] < len(tokenizer):
        raise DrafterError(f"The drafter {cfg.cluster.drafter!r} has fewer LM-head rows than the target has tokens.",
                           expected=f"at least {len(tokenizer)} rows (one per target token)",
                           found=f"{weight.shape[0]} rows",
                           fix="Cluster a drafter that shares the target's tokenizer (cluster.drafter).")
    drafter_tok = load_tokenizer(cfg.cluster.drafter)

    if vocab_hash(drafter_tok) != vocab_hash(tokenizer):
        raise DrafterError(f"The drafter {cfg.cluster.drafter!r} does not share the target's tokenizer.",
                           expected="the target's vocabulary (DynaSpec drafts over the target's token ids)",
                           found="another vocabulary",
                           fix="Set cluster.drafter to a same-tokenizer drafter (like evaluate.drafter).")
    clustering = cluster_head(cfg, weight, run.log)
    specials = sorted(set(tokenizer.all_special_ids))
    summary = clustering.summary(specials)
    run.log(f"{clustering.num_clusters} clusters of {clustering.vocab_size} head rows in {summary['seconds']:.2f} s "
            f"({summary['backend']}): sizes {summary['size_min']}..{summary['size_max']} "
            f"(max/mean {summary['max_over_mean']:.2f}, {summary['empty_clusters']} empty; "
            f"{summary['zero_rows']} all-zero rows, left out of k-means and dealt round the clusters in id order)")
    metrics = {k: summary[k] for k in ("clusters", "vocab_size", "empty_clusters", "size_min", "size_max",
                                       "size_mean", "size_std", "max_over_mean", "effective_clusters_share",
                                       "objective", "zero_rows")}
    metrics["cluster_seconds"] = summary["seconds"]

    def write(out: Path) -> None:
        clustering.save(out, specials)

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Cluster (or reuse the clustering of) the drafter head this config names."""
    step = plan(cfg, ["cluster"])["cluster"]
    return run_stage(cfg, step, [], build=lambda run: _build(cfg, run), launch=launch)
