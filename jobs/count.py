"""Stage ``count``: loss-masked token frequencies and the shortlists / draft vocabularies built on them.

Run alone with ``drafter count --config configs/tiny.yaml`` (it reuses, or first builds, the
calibration set of ``generate``; set ``count.calibration=PATH`` to count a set made elsewhere). Writes ``counts.safetensors`` (int64 counts
over the target vocabulary), ``shortlists.safetensors`` (one sorted id tensor per rule: ``top_k_512``,
``top_p_0.95``, ``min_count_2``), EAGLE-3 ``d2t``/``t2d`` for the ``draft_vocab_size`` most frequent
tokens, ``token_map.pt`` for SGLang's ``--speculative-token-map``, and ``shortlists.json`` with each
shortlist's size and mass coverage.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.data.calibration import shard_files
from pipeline.errors import DrafterError
from pipeline.models.target import Target
from pipeline.orchestration.dag import plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, run_stage
from pipeline.vocab import counting
from pipeline.vocab.tokens import stop_ids

SUMMARY: tuple[str, ...] = ("tokens_per_s", "tokens_counted", "distinct_tokens")
"""Metrics ``drafter run`` prints for this stage: counting throughput, tokens counted and distinct tokens."""


def _build(cfg: PipelineConfig, run: StageRun, calibration: Artifact) -> BuildResult:
    import torch
    from safetensors.numpy import save_file

    target = Target(cfg.target)
    tokenizer = target.tokenizer()
    vocab_size = len(tokenizer)
    files = shard_files(calibration.path / "data")
    if not files:
        raise DrafterError(f"The calibration artifact {calibration.id} holds no shards.",
                           fix="Rerun `drafter generate` for this config.")
    start = time.perf_counter()
    counts = counting.count_shards(files, vocab_size, cfg.count.workers)
    seconds = time.perf_counter() - start
    total = int(counts.sum())
    if total == 0:
        raise DrafterError(f"The calibration set {calibration.id} has no assistant (loss-masked) tokens to count.",
                           expected="rows whose loss_mask marks the assistant's tokens",
                           fix="Regenerate it: with generate.kind=raw the dataset needs assistant turns.")
    # every special token and every id an answer ends at (an end-of-turn id can be the generation config's alone,
    # e.g. Llama-3.1's <|eom_id|>): rarely counted, so a frequency cut would drop them
    specials = sorted(set(tokenizer.all_special_ids) | set(stop_ids(tokenizer, target)))
    lists = counting.shortlists(counts, cfg.count, specials)
    draft_ids = counting.top_k(counts, cfg.count.draft_vocab_size)
    if cfg.count.always_include_special:
        draft_ids = counting.with_specials(draft_ids, specials)
    d2t, t2d = counting.eagle3_offset_maps(draft_ids, vocab_size)
    by_freq = np.argsort(-counts[draft_ids], kind="stable")
    summary = {name: {"size": int(ids.size), "coverage": round(counting.coverage(counts, ids), 6)}
               for name, ids in lists.items()}
    metrics = {"tokens_counted": total, "vocab_size": vocab_size, "distinct_tokens": int((counts > 0).sum()),
               "count_seconds": round(seconds, 4), "tokens_per_s": round(total / max(seconds, 1e-9), 1),
               **{f"{name}.coverage": s["coverage"] for name, s in summary.items()},
               **{f"{name}.size": s["size"] for name, s in summary.items()}}
    run.log(f"{total} tokens counted ({metrics['distinct_tokens']} distinct of {vocab_size}) "
            f"at {metrics['tokens_per_s']:.3g} tokens/s")

    def write(out: Path) -> None:
        save_file({"counts": counts}, str(out / "counts.safetensors"))
        save_file({name: ids.astype(np.int64) for name, ids in lists.items()}, str(out / "shortlists.safetensors"))
        save_file({"d2t": d2t, "t2d": t2d}, str(out / "eagle3_maps.safetensors"))
        # SGLang reads this with torch.load(weights_only=True): a plain int64 tensor, no objects.
        torch.save(torch.from_numpy(draft_ids[by_freq].astype(np.int64)), out / "token_map.pt")
        (out / "shortlists.json").write_text(json.dumps(
            {"shortlists": summary, "draft_vocab_size": int(draft_ids.size), "special_ids": specials,
             "calibration": calibration.id}, indent=2))

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Count (or reuse counts of) the calibration set this config plans for (or names)."""
    step = plan(cfg, ["count"])["count"]
    calibration = step.input("generate")
    return run_stage(cfg, step, [calibration], build=lambda run: _build(cfg, run, calibration), launch=launch)
