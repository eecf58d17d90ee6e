"""Stage ``train_router``: the DynaSpec cluster router, trained on the target's own answers (DynaSpec §4.2).

Run alone with ``drafter train_router --config configs/tiny.yaml`` (it reuses, or first builds, the
calibration set of ``generate``, the counts of ``count`` and the clustering of ``cluster``). At every
answer position the frozen drafter (``cluster.drafter``) gives the router's input ``[E(x_t), h_{t-1}]`` and
its full-vocabulary distribution, whose top-L tokens' clusters are the multi-hot label; the router (a
2-layer ReLU MLP) learns them by binary cross-entropy under the shared harness
(:mod:`pipeline.training.harness`: DeepSpeed ZeRO on GPUs, DDP or one process on CPU, resumable after a
kill, per-step MLflow curves), keeping the checkpoint with the best loss on half of the held-out chats. Then,
on the other half, it measures for every budget ``k`` what the routed shortlist keeps of the drafter's top-L
mass and of the target's next-token mass, against an FR-Spec frequency shortlist of the same mean size. The
artifact holds ``router.safetensors`` + ``router_config.json`` (sizes, and the clustering, drafter head
and inputs it was trained for), ``routing.json`` (those curves) and ``training.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.artifacts import Artifact
from pipeline.config.schema import identity
from pipeline.config.sections import PipelineConfig
from pipeline.errors import DrafterError
from pipeline.models.loading import fingerprint, load_model
from pipeline.models.target import Target
from pipeline.orchestration.dag import plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, run_stage
from pipeline.progress import heartbeat
from pipeline.tracking import tracking_uri
from pipeline.training.harness import fit
from pipeline.training.plan import pad_id
from pipeline.vocab.tokens import stop_ids

SUMMARY: tuple[str, ...] = ("train_steps", "train_seconds")
"""Metrics ``drafter run`` prints for this stage: steps and training time."""


def _build(cfg: PipelineConfig, run: StageRun, calibration: Artifact, counts: Artifact,
           clusters: Artifact) -> BuildResult | None:
    import torch

    from pipeline.data.rows import CalibrationRows, split_by_chat  # deferred: pulls in torch
    from pipeline.dynaspec.clusters import Clustering, head_sha256  # deferred: pulls in numpy
    from pipeline.dynaspec.router import (  # deferred: pulls in torch
        Router,
        RouterTask,
        routing_curves,
        save_router,
    )
    from pipeline.vocab.counting import frequency_ranking  # deferred: pulls in pyarrow

    tr = cfg.train_router
    target_ = Target(cfg.target)
    tokenizer = target_.tokenizer()
    drafter = load_model(cfg.cluster.drafter, dtype="float32", device="cpu").eval()
    head = drafter.get_output_embeddings().weight
    clustering = Clustering.load(clusters.path)
    clustering.check_head(head, f"drafter {cfg.cluster.drafter!r}")
    data = CalibrationRows(calibration.path / "data", max_length=tr.max_length, eval_fraction=tr.eval_fraction,
                           eval_max_rows=tr.eval_max_rows, min_length=2, what="the DynaSpec router",
                           fraction_key="train_router.eval_fraction")
    pad = pad_id(tokenizer)
    # the checkpoint is chosen on half of the held-out chats and the routing curves are measured on the others
    choose, report = split_by_chat(data.heldout)
    if not (choose and report):
        raise DrafterError("The router's held-out rows come from fewer than two chats.",
                           expected="held-out rows from two or more chats (one half chooses the checkpoint, the "
                                    "other measures the routing curves)",
                           found=f"{len(data.heldout)} held-out row(s) from one chat",
                           fix="Raise train_router.eval_fraction or eval_max_rows, or generate more calibration data.")
    torch.manual_seed(tr.init_seed)
    hidden = int(head.shape[1])
    router = Router(2 * hidden, tr.hidden_size, clustering.num_clusters)
    task = RouterTask(router, drafter, torch.from_numpy(clustering.assignment), choose, top_l=tr.top_l, pad_id=pad)
    run.log(f"{len(data.train)} training rows; held-out rows: {len(choose)} choose the checkpoint, {len(report)} "
            f"measure the routing; router {2 * hidden} -> {tr.hidden_size} -> {clustering.num_clusters} clusters, "
            f"labels from the drafter's top-{tr.top_l}")
    result = fit(task, data.train, tr.train, run.staging / "train",
                 tracking_uri=tracking_uri(cfg.mlflow, cfg.workdir_path), experiment=cfg.mlflow.experiment,
                 run_name=f"{run.artifact_id}/training", label="train_router",
                 identity={"router": [2 * hidden, tr.hidden_size, clustering.num_clusters],
                           "train_router": identity(tr), "inputs": [calibration.id, counts.id, clusters.id]})
    if not result.is_global_zero:
        return None
    router = task.router.float().cpu().eval()
    target = target_.model(device="cpu", dtype="float32").eval()
    keep = stop_ids(tokenizer, target)  # every id a turn ends at (an end-of-turn id may be the config's alone)
    run.log(f"routing curves on {len(report)} held-out rows (the target on the CPU)")
    with heartbeat("train_router: routing curves", run.log):
        curves = routing_curves(router, drafter, target, report, clustering, frequency_ranking(counts),
                                top_l=tr.top_l, keep_ids=keep, pad_id=pad)
    best = result.best or {}
    metrics = {"train_steps": result.steps, "train_rows": len(data.train), "heldout_rows": len(data.heldout),
               "choose_rows": len(choose), "report_rows": len(report),
               "train_seconds": round(result.seconds, 2), "heldout_positions": curves["positions"]}
    metrics.update({f"best.{k}": round(v, 6) for k, v in (best.get("metrics") or {}).items()})
    m = clustering.num_clusters
    for k in sorted({1, max(1, m // 8), max(1, m // 4), max(1, m // 2)}):
        i = k - 1
        metrics.update({f"k{k}.size": round(curves["size"][i], 2),
                        f"k{k}.drafter_top_l_recall": round(curves["drafter_top_l_recall"][i], 5),
                        f"k{k}.target_mass": round(curves["target_mass"][i], 5),
                        f"k{k}.static_target_mass": round(curves["static_target_mass"][i], 5),
                        f"k{k}.static_drafter_top_l_recall": round(curves["static_drafter_top_l_recall"][i], 5)})
    run.log(f"trained {result.steps} steps; held-out loss {best.get('metrics', {}).get('loss', float('nan')):.4f} "
            f"at step {best.get('step')}; k={max(1, m // 4)}: size {curves['size'][max(1, m // 4) - 1]:.0f}, "
            f"target mass {curves['target_mass'][max(1, m // 4) - 1]:.3f} (static "
            f"{curves['static_target_mass'][max(1, m // 4) - 1]:.3f})")
    meta = {"clustering_sha256": clustering.content_sha256(), "clusters": clusters.id,
            "drafter": cfg.cluster.drafter, "drafter_head_sha256": head_sha256(head),
            "drafter_head_sha256_float16": head_sha256(head, "float16"),
            "drafter_weights": fingerprint(cfg.cluster.drafter).get("weights"), "top_l": tr.top_l,
            "keep_ids": keep, "calibration": calibration.id, "counts": counts.id}
    report = {**result.record(),
              "rows": {"train": len(data.train), "heldout": len(data.heldout), "dropped": data.dropped}}

    def write(out: Path) -> None:
        save_router(router, out, meta)
        (out / "routing.json").write_text(json.dumps(curves, indent=2))
        (out / "training.json").write_text(json.dumps(report, indent=2))

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Train (or reuse) the DynaSpec router this config plans for."""
    step = plan(cfg, ["train_router"])["train_router"]
    calibration, counts, clusters = step.input("generate"), step.input("count"), step.input("cluster")
    return run_stage(cfg, step, [calibration, counts, clusters],
                     build=lambda run: _build(cfg, run, calibration, counts, clusters), launch=launch)
