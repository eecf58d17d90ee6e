"""Stage ``generate``: the calibration set — the target (or a drafter) answering prompts, as Arrow.

Run alone with ``drafter generate --config configs/tiny.yaml``. Prompts come from a packaged or user
dataset (held-out conversations excluded, so ``evaluate`` never sees them); each is cut to its first
user turn and rendered with the chat template. A Lightning ``predict`` loop answers them in batches
(left padding, KV cache, temperature/top-p), one *shard* of prompts per predict step. Shards are
dealt to ranks round-robin and each is written atomically, with its checksum, when complete, so a killed
run restarted with the same config skips finished shards (redoing any that no longer match their checksum,
:mod:`pipeline.staged`) and ends with exactly the rows of an uninterrupted run.
Shard ``i`` samples with seed ``seed + i``: the rows do not depend on how many ranks ran.
``kind: raw`` stores the dataset's own assistant turns instead (no model runs), for comparison.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.config.stages import GenerateConfig
from pipeline.data.calibration import (
    PROMPT_DIGESTS,
    chunks,
    encode_prompt,
    first_prompt,
    prompt_digests,
    raw_row,
    read_shard,
    shard_name,
    write_shard,
)
from pipeline.data.records import Conversation
from pipeline.data.sources import load_conversations, planned_sha256, split_heldout
from pipeline.errors import DrafterError
from pipeline.models.loading import load_model
from pipeline.models.target import Target
from pipeline.orchestration.dag import plan
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, log, run_stage
from pipeline.progress import LOG_INTERVAL_S, Progress, heartbeat, silent
from pipeline.staged import staged_about, staged_ok, write_staged
from pipeline.training.harness import predict_shards, shard_trainer
from pipeline.training.ranks import took_part
from pipeline.vocab.tokens import stop_ids

SUMMARY: tuple[str, ...] = ("rows", "assistant_tokens", "tokens_per_s")
"""Metrics ``drafter run`` prints for this stage: rows written, assistant tokens and generation throughput."""


def select_conversations(gen: GenerateConfig,
                         planned: dict | None = None) -> tuple[list[Conversation], dict, list[str]]:
    """The calibration conversations: the source minus its held-out share, capped at ``limit``; the source's counts
    (stage metrics) and its notes (what loading it did, for the log). ``planned`` is the source's fingerprint in the
    stage's id: a local file's bytes parsed must be those it hashes (each rank reads and checks the file itself)."""
    convs, report = load_conversations(gen.source, revision=gen.source_revision, sha256=planned_sha256(planned or {}))
    train = split_heldout(convs, gen.heldout_fraction, heldout=False)
    if gen.limit is not None:
        train = train[: gen.limit]
    if not train:
        raise DrafterError(f"No conversations left from {gen.source!r} after the held-out split.",
                           expected="at least one conversation", found=f"{len(convs)} read, 0 kept",
                           fix="Use a larger dataset or lower generate.heldout_fraction.")
    counts = {"source_records_read": report.records_read, "source_records_dropped": report.records_dropped}
    return train, counts, report.notes


def answer_law(gen: GenerateConfig) -> dict:
    """``generate``'s sampling arguments for the answers' law: greedy at temperature 0, else temperature then
    nucleus ``top_p`` with top-k off (``top_k=0``; left unset, transformers filters to the 50 likeliest tokens)."""
    if gen.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": 0}


def _make_module(cfg: PipelineConfig, prompts: list[tuple[str, list[int]]], pending: list[int], staging: Path,
                 groups: dict[str, str] | None = None):
    """The predict module answering ``prompts`` (id, token ids); ``groups`` maps an id to its chat's split group
    (an id not in it is its own group)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import GenerationConfig

    from pipeline.timing import device_name  # deferred: pulls in torch

    gen = cfg.generate
    target = Target(cfg.target)

    class GenerateModule(L.LightningModule):
        """Answers one shard of prompts per predict step and writes it atomically."""

        def __init__(self) -> None:
            super().__init__()
            # The drafter kind shares the target's tokenizer (checked in main), so prompts and stop
            # tokens always come from the target's.
            self.tokenizer = target.tokenizer()
            self.lm = target.model() if gen.kind != "drafter" else load_model(gen.drafter, dtype=cfg.target.dtype)
            self.stops = stop_ids(self.tokenizer, self.lm)
            self.law = answer_law(gen)
            # The answers follow generate.temperature / top_p and nothing else, the law evaluate decodes with: an
            # emptied generation config leaves no room for transformers' top-k 50 default or for the processors a
            # hub model's generation_config.json sets (top_k, repetition_penalty, min_p, ...).
            self.lm.generation_config = GenerationConfig()
            self.generated_tokens = 0
            self.generate_seconds = 0.0
            self.progress: Progress | None = None

        def predict_dataloader(self) -> DataLoader:
            mine = pending[self.global_rank :: self.trainer.world_size]
            return DataLoader(mine, batch_size=1, collate_fn=lambda b: b[0])

        def on_predict_start(self) -> None:
            if self.trainer.is_global_zero:  # rank zero's share stands for the whole job's pace
                log("generate", f"{self.trainer.world_size} rank(s) on {self.trainer.num_nodes} node(s) answer "
                                f"{len(pending)} shard(s)")
                mine = pending[self.global_rank :: self.trainer.world_size]
                total = sum(len(prompts[i * gen.shard_size : (i + 1) * gen.shard_size]) for i in mine)
                self.progress = Progress("generate", total, "prompt")

        def on_predict_end(self) -> None:
            if self.progress is not None:
                self.progress.close()

        @torch.inference_mode()
        def predict_step(self, shard: int, batch_idx: int) -> int:
            items = prompts[shard * gen.shard_size : (shard + 1) * gen.shard_size]
            torch.manual_seed(gen.seed + shard)
            rows, start = [], time.perf_counter()
            for _, batch in chunks(items, gen.batch_size):
                # a batch of long answers on one GPU can outlast the progress line's 30 s: it speaks then
                with heartbeat(f"generate: answering {len(batch)} prompts", None if self.progress else silent,
                               grace=LOG_INTERVAL_S):
                    rows += self._answer(batch)
                if self.progress is not None:
                    seconds = self.generate_seconds + time.perf_counter() - start
                    self.progress.update(len(batch), tokens_per_s=self.generated_tokens / max(seconds, 1e-9))
            self.generate_seconds += time.perf_counter() - start
            write_staged(staging / shard_name(shard), lambda tmp: write_shard(tmp, rows),
                         about={"device": device_name(self.device)})
            return len(rows)

        def _answer(self, batch: list[tuple[str, list[int]]]) -> list[dict]:
            tok = self.tokenizer
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch], device=self.device)
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch],
                                     device=self.device)
            stops = self.stops
            out = self.lm.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=gen.max_new_tokens,
                                   pad_token_id=pad, eos_token_id=stops, **self.law)
            rows = []
            for (pid, ids), seq in zip(batch, out[:, width:].tolist()):
                response, finished = [], False
                for t in seq:
                    response.append(t)
                    if t in stops:
                        finished = True
                        break
                self.generated_tokens += len(response)
                rows.append({"input_ids": ids + response, "loss_mask": [0] * len(ids) + [1] * len(response),
                             "prompt_id": pid, "prompt_len": len(ids), "response_len": len(response),
                             "finished": finished, "group": (groups or {}).get(pid, pid)})
            return rows

    return GenerateModule()


def _build(cfg: PipelineConfig, run: StageRun, planned_source: dict) -> BuildResult | None:
    gen = cfg.generate
    convs, source_report, source_notes = select_conversations(gen, planned_source)
    for note in source_notes:
        run.log(f"source: {note}")
    target = Target(cfg.target)
    tokenizer = target.tokenizer()
    if gen.kind == "raw":
        prompts = [(c.id, c) for c in convs]
    else:  # a chat template and a tokenizer over every prompt: a minute for the 68k of a ShareGPT dump
        prompts = []
        with Progress("generate: encoding prompts", len(convs), "prompt", log=run.log) as encoding:
            for c in convs:
                if (msgs := first_prompt(c)) is not None:
                    prompts.append((c.id, encode_prompt(tokenizer, msgs, gen.max_prompt_tokens,
                                                          "generate.max_prompt_tokens")))
                encoding.update(1)
    n_shards = (len(prompts) + gen.shard_size - 1) // gen.shard_size
    # a staged shard counts as done only if it matches its checksum; a damaged one is deleted (logged) and redone
    pending = [i for i in range(n_shards) if not staged_ok(run.staging / shard_name(i), run.log)]
    run.log(f"{len(prompts)} prompts in {n_shards} shards; {n_shards - len(pending)} already done (resumed)")
    started = time.perf_counter()
    generated, gen_seconds, ranks = 0, 0.0, []
    if gen.kind == "raw":
        stops = set(stop_ids(tokenizer, target))  # a turn's mask ends at its end-of-turn id, as a generated answer
        with Progress("generate: raw rows", len(pending), "shard", log=run.log) as rendering:
            for shard in pending:
                rows = [r for _, c in prompts[shard * gen.shard_size : (shard + 1) * gen.shard_size]
                        if (r := raw_row(tokenizer, c, gen.max_prompt_tokens + gen.max_new_tokens, stops)) is not None]
                write_staged(run.staging / shard_name(shard), lambda tmp, rows=rows: write_shard(tmp, rows))
                rendering.update(1)
    elif pending:
        module = _make_module(cfg, prompts, pending, run.staging, {c.id: c.split_key for c in convs})
        trainer = shard_trainer("generate", gen.accelerator, gen.devices, gen.num_nodes, gen.collective_timeout)
        ranks = predict_shards(trainer, module, "generate", gen.collective_timeout)
        generated, gen_seconds = module.generated_tokens, module.generate_seconds
        if not trainer.is_global_zero:
            return None
    files = [run.staging / shard_name(i) for i in range(n_shards)]
    unsound = [p.name for p in files if not staged_ok(p, run.log)]  # checked again before anything is published
    if unsound:
        raise DrafterError(f"{len(unsound)} of {n_shards} calibration shards are missing or damaged after "
                           f"generation: {', '.join(unsound[:8])}{' …' if len(unsound) > 8 else ''}.",
                           fix="Rerun the same command: sound shards are kept and only these are redone.")
    computed_on = _computed_on(files, run) if gen.kind != "raw" else {}
    tables = [read_shard(p) for p in files]
    rows = sum(t.num_rows for t in tables)
    if gen.kind == "raw":  # a conversation with no assistant turn the template renders within the budget has no row
        source_report["raw_conversations_dropped"] = len(prompts) - rows
        if len(prompts) > rows:
            run.log(f"raw: {len(prompts) - rows} of {len(prompts)} conversations dropped: no assistant turn to learn "
                    f"within generate.max_prompt_tokens + generate.max_new_tokens tokens")
    assistant = sum(sum(m) for t in tables for m in t.column("loss_mask").to_pylist())
    if rows == 0 or assistant == 0:
        raise DrafterError(f"The calibration set from {gen.source!r} has no assistant tokens.",
                           expected="conversations with assistant turns (kind=raw) or prompts to answer",
                           found=f"{rows} rows, 0 assistant tokens",
                           fix="Check the dataset's roles (user/assistant or human/gpt) or use kind=target.")
    elapsed = time.perf_counter() - started
    metrics = {"rows": rows, "shards": n_shards, "resumed_shards": n_shards - len(pending),
               "assistant_tokens": assistant, "generated_tokens": generated,
               "tokens_per_s": round(generated / gen_seconds, 1) if gen_seconds else 0.0,
               "build_seconds": round(elapsed, 2), "computed_on": computed_on, **source_report, **took_part(ranks)}
    run.log(f"{rows} rows, {assistant} assistant tokens"
            + (f", {metrics['tokens_per_s']} generated tokens/s" if generated else ""))

    digests = prompt_digests(convs)

    def write(out: Path) -> None:
        (out / PROMPT_DIGESTS).write_text(json.dumps({"digests": digests}))
        # Hard links, not moves: if publishing fails the staged shards survive for the rerun.
        (out / "data").mkdir()
        for path in files:
            try:
                os.link(path, out / "data" / path.name)
            except OSError:
                shutil.copy2(path, out / "data" / path.name)

    return BuildResult(write, metrics)


def _computed_on(files: list[Path], run: StageRun) -> dict[str, int]:
    """Shards by the device that answered them. A run resumed on another kind of device (a GPU job requeued on
    the CPU, or on another GPU model) finishes with answers from both: each is the target's, but the set's bytes
    match no single-device run, so the manifest says which shards came from where and the log says it too."""
    devices = Counter(staged_about(path).get("device", "not recorded") for path in files)
    if len(devices) > 1:
        run.log("the calibration set mixes answers computed on several devices (sampling is not bit-reproducible "
                "across them): " + "; ".join(f"{count} shard(s) on {name}" for name, count in devices.most_common()))
    return dict(devices)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Build (or reuse) the calibration set for ``cfg.target``."""
    step = plan(cfg, ["generate"])["generate"]
    if cfg.generate.kind == "drafter":
        other = step.config["models"]["generator"]
        if other["vocab_hash"] != step.fingerprint["vocab_hash"]:
            raise DrafterError("generate.kind=drafter needs a drafter that shares the target's tokenizer.",
                               expected=f"vocab_hash {step.fingerprint['vocab_hash'][:12]}",
                               found=f"vocab_hash {other['vocab_hash'][:12]}",
                               fix="Pick a same-tokenizer drafter, or use kind=target.")
    return run_stage(cfg, step, [], build=lambda run: _build(cfg, run, step.config["data"]["source"]),
                     launch=launch)
