"""Stage ``estimate_rdk``: the target's next-token moments and RDK's affinities (Timor et al., RDK §4, Eq. 2).

Run alone with ``drafter estimate_rdk --config configs/tiny.yaml`` (it reuses, or first builds, the calibration set
of ``generate`` and the counts of ``count``). A Lightning ``predict`` pass runs the frozen target over the
calibration rows' answer positions, shard by shard: each shard's sums (``Σp`` and the sparse ``Σ p_K p_Kᵀ`` of
each distribution's top-k entries, :mod:`pipeline.rdk.moments`) are saved atomically to the staging directory
with their checksum, so a killed job resumes from the shards it finished (redoing any that no longer match their
checksum, :mod:`pipeline.staged`) and ranks (``estimate_rdk.devices``/``num_nodes``) split
the shards; rank 0 adds them up. Then, on held-out conversations, it measures α for TLI and each redistribution
for every kept set — the FR pruning levels of ``evaluate.drafter`` and ``T ∩ D`` of ``evaluate.drafter_other`` —
and chooses τ (grid) and the prior weight (:func:`pipeline.rdk.prior.analyse`); the same choices are then scored
on code (HumanEval solutions, :func:`pipeline.rdk.prior.transfer`). Writes ``moments.safetensors``,
``kept.safetensors`` and ``rdk.json`` (choices, α table, τ curves, throughput, memory against a dense |T|²).
"""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.artifacts import Artifact
from pipeline.config.sections import PipelineConfig
from pipeline.data.sources import unseen_humaneval
from pipeline.errors import DrafterError
from pipeline.models.context import context_length
from pipeline.models.loading import load_model, load_tokenizer
from pipeline.models.target import Target
from pipeline.orchestration.dag import plan
from pipeline.orchestration.limits import check_rdk_code_problems, not_same_tokenizer
from pipeline.orchestration.lock import Launch
from pipeline.orchestration.stage import BuildResult, StageRun, log, run_stage
from pipeline.progress import Progress, heartbeat
from pipeline.staged import staged_ok, write_staged
from pipeline.training.harness import predict_shards, shard_trainer
from pipeline.training.ranks import took_part
from pipeline.vocab.tokens import vocab_hash

SUMMARY: tuple[str, ...] = ("rows",)
"""Metrics ``drafter run`` prints for this stage: calibration rows the moments were estimated on."""

SHARD = "sums-{:05d}.safetensors"


def answer_steps(row: object) -> list[int]:
    """A row's answer positions ``t`` (``loss_mask[t] = 1``, predicted from ``input_ids[:t]``): the one numbering of
    answer positions that :func:`answer_distributions`, :func:`answer_chats` and the other-tokenizer drafter's
    positions share, so a picked position means the same one in each."""
    return [t for t in range(1, len(row.input_ids)) if row.loss_mask[t]]


def answer_distributions(model, rows: list, batch_size: int, device,  # noqa: ANN001
                         picked: set[int] | None = None) -> object:
    """``(n, |T|)`` float32 next-token distributions of ``model`` at every answer position of ``rows``
    (position ``t`` with ``loss_mask[t] = 1``, predicted from ``input_ids[:t]``), in row order; only the answer
    positions numbered in ``picked`` (their order among all of them) when given."""
    import torch

    from pipeline.data.calibration import chunks  # deferred: pulls in pyarrow

    out, seen = [], 0
    for _, batch in chunks(rows, batch_size):
        if picked is not None:
            answers = sum(len(answer_steps(r)) for r in batch)
            if not any(seen <= i < seen + answers for i in picked):
                seen += answers  # no position picked in this batch: no forward
                continue
        width = max(len(r.input_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, : len(r.input_ids)] = torch.tensor(r.input_ids)
            attention[i, : len(r.input_ids)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=attention.to(device)).logits
        for i, r in enumerate(batch):
            at = [t - 1 for t in answer_steps(r)]
            if picked is not None:
                seen, at = seen + len(at), [t for k, t in enumerate(at, seen) if k in picked]
            if at:
                out.append(torch.softmax(logits[i, at].float(), -1))
    return torch.cat(out) if out else None


def spread(n: int, limit: int) -> list[int]:
    """``min(n, limit)`` of the indices ``0 … n-1``, evenly spread (all of them when ``n <= limit``): a cap on the
    positions analysed that keeps every chat's share, where the first ``limit`` positions were a few chats' answers."""
    return list(range(n)) if n <= limit else [i * n // limit for i in range(limit)]


def answer_chats(rows: list) -> list[int]:
    """The chat each answer position of ``rows`` comes from (:func:`~pipeline.data.rows.chat_numbers`), in
    :func:`answer_distributions`' order."""
    from pipeline.data.rows import chat_numbers  # deferred: pulls in torch

    return [n for n, r in zip(chat_numbers(rows), rows) for _ in answer_steps(r)]


def _make_module(cfg: PipelineConfig, shards: list[list], pending: list[int], staging: Path, vocab: int):
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from pipeline.rdk.moments import MomentSums  # deferred: pulls in torch

    er = cfg.estimate_rdk

    class EstimateModule(L.LightningModule):
        """Sums one shard of calibration rows per predict step and saves them atomically."""

        def __init__(self) -> None:
            super().__init__()
            self.lm = Target(cfg.target).model()
            self.positions = 0
            self.seconds = 0.0
            self.progress: Progress | None = None

        def predict_dataloader(self) -> DataLoader:
            mine = pending[self.global_rank :: self.trainer.world_size]
            return DataLoader(mine, batch_size=1, collate_fn=lambda b: b[0])

        def on_predict_start(self) -> None:
            if self.trainer.is_global_zero:
                log("estimate_rdk", f"{self.trainer.world_size} rank(s) on {self.trainer.num_nodes} node(s) sum "
                                    f"{len(pending)} shard(s)")
                total = len(pending[self.global_rank :: self.trainer.world_size])
                self.progress = Progress("estimate_rdk: moments", total, "shard")

        def on_predict_end(self) -> None:
            if self.progress is not None:
                self.progress.close()

        @torch.inference_mode()
        def predict_step(self, shard: int, batch_idx: int) -> int:
            start = time.perf_counter()
            sums = MomentSums(vocab, er.top_k)
            probs = answer_distributions(self.lm, shards[shard], er.batch_size, self.device)
            if probs is not None:
                sums.add(probs)
                self.positions += probs.shape[0]
            write_staged(staging / SHARD.format(shard), sums.save)
            self.seconds += time.perf_counter() - start
            if self.progress is not None:
                self.progress.update(1, contexts_per_s=self.positions / max(self.seconds, 1e-9))
            return sums.count

    return EstimateModule()


def _estimate(cfg: PipelineConfig, run: StageRun, train: list, vocab: int) -> tuple[object, dict] | None:
    """The merged moment sums (None on ranks other than 0) and the estimation figures."""

    from pipeline.rdk.moments import MomentSums  # deferred: pulls in torch

    er = cfg.estimate_rdk
    shards = [train[i : i + er.shard_rows] for i in range(0, len(train), er.shard_rows)]
    # a staged shard counts as done only if it matches its checksum; a damaged one is deleted (logged) and redone
    pending = [i for i in range(len(shards)) if not staged_ok(run.staging / SHARD.format(i), run.log)]
    run.log(f"{len(train)} rows in {len(shards)} shards; {len(shards) - len(pending)} already summed (resumed)")
    started = time.perf_counter()
    module, ranks = None, []
    if pending:
        module = _make_module(cfg, shards, pending, run.staging, vocab)
        trainer = shard_trainer("estimate_rdk", er.accelerator, er.devices, er.num_nodes, er.collective_timeout)
        ranks = predict_shards(trainer, module, "estimate_rdk", er.collective_timeout)
        if not trainer.is_global_zero:
            return None
    unsound = [SHARD.format(i) for i in range(len(shards)) if not staged_ok(run.staging / SHARD.format(i), run.log)]
    if unsound:
        raise DrafterError(f"{len(unsound)} of {len(shards)} RDK moment shards are missing or damaged after "
                           f"estimation: {', '.join(unsound[:8])}{' …' if len(unsound) > 8 else ''}.",
                           fix="Rerun the same command: sound shards are kept and only these are redone.")
    total = MomentSums(vocab, er.top_k)
    with Progress("estimate_rdk: merging shard sums", len(shards), "shard", log=run.log) as merging:
        for i in range(len(shards)):
            total.merge(MomentSums.load(run.staging / SHARD.format(i)))
            merging.update(1)
    seconds = module.seconds if module is not None else 0.0
    figures = {"positions": total.count, "rows": len(train), "shards": len(shards),
               "resumed_shards": len(shards) - len(pending), "estimate_seconds": round(time.perf_counter() - started, 2),
               "contexts_per_s": round(module.positions / seconds, 1) if module is not None and seconds else None,
               **took_part(ranks)}
    return total, figures


def _heldout_inputs(cfg: PipelineConfig, rows: list, target, drafter, kept_sets: dict, tokenizer,  # noqa: ANN001
                    other: tuple | None, what: str) -> tuple[dict, object]:
    """Per kept set: (p, q_kept) at the answer positions of ``rows`` (temperature 1), at most heldout_max_positions,
    and the chat each of those positions comes from (:func:`answer_chats`). ``other`` is the other-tokenizer drafter
    as (model, tokenizer, its T ∩ D ids) when ``intersection`` is kept."""
    import torch

    from pipeline.rdk.prior import INTERSECTION  # deferred: pulls in torch

    er = cfg.estimate_rdk
    chats = answer_chats(rows)
    if not chats:
        raise DrafterError(f"The {what} have no answer positions for RDK's analysis.",
                           fix="Raise estimate_rdk.heldout_fraction or generate more rows.")
    order = spread(len(chats), er.heldout_max_positions)  # only these positions' distributions are computed
    picked = set(order)
    p = answer_distributions(target, rows, er.batch_size, "cpu", picked).double()
    q_full = answer_distributions(drafter, rows, er.batch_size, "cpu", picked).double()
    logq = torch.log(q_full.clamp_min(1e-300))
    out = {name: (p, torch.softmax(logq[:, kept], -1)) for name, kept in kept_sets.items() if name != INTERSECTION}
    if other is not None:
        out[INTERSECTION] = (p, _other_positions(other, rows, tokenizer, picked))
    return out, torch.tensor([chats[i] for i in order])


def _code_rows(cfg: PipelineConfig, tokenizer, calibration: Artifact) -> list:  # noqa: ANN001
    """Code contexts for the α table: the last ``estimate_rdk.code_problems`` HumanEval problems that neither the
    calibration set ``calibration`` drew on (its manifest's ``generate`` section says how it was drawn: a set named
    by ``estimate_rdk.calibration`` may come from another source than this config's) nor the evaluation decodes (:func:`~pipeline.data.sources.unseen_humaneval`: evaluate
    takes the first ones), each as evaluate encodes its prompt (chat template, ``evaluate.max_prompt_tokens``)
    followed by the canonical solution's tokens and EOS, as if the target had written it; answer positions only.
    A row is cut to ``estimate_rdk.max_length`` and to the context of the target and of the drafter that reads it.

    The answer is encoded on its own and appended, the way generated tokens follow a prompt: templating the
    whole turn would let BPE merge the template's newline with the solution's leading indentation."""
    from pipeline.data.calibration import encode_prompt  # deferred: pulls in pyarrow
    from pipeline.data.rows import Row  # deferred: pulls in torch

    er, ev, gen = cfg.estimate_rdk, cfg.evaluate, cfg.generate
    drew = {"source": gen.source, "heldout_fraction": gen.heldout_fraction, "source_revision": gen.source_revision,
            **{k: v for k, v in (calibration.manifest.get("config", {}).get("generate") or {}).items()
               if k in ("source", "heldout_fraction", "source_revision")}}
    unseen = unseen_humaneval(drew["source"], drew["heldout_fraction"], with_solutions=True,
                              revision=drew["source_revision"])
    check_rdk_code_problems(cfg, unseen=len(unseen))
    contexts = [context_length(cfg.target.model, cfg.target.revision, cfg.target.trust_remote_code),
                context_length(ev.drafter)]  # a drafter never runs its own code (target.trust_remote_code)
    limit = min([er.max_length] + [c for c in contexts if c])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows = []
    for conv in unseen[len(unseen) - er.code_problems :]:
        prompt = encode_prompt(tokenizer, conv.messages[:1], ev.max_prompt_tokens, "evaluate.max_prompt_tokens")
        answer = tokenizer.encode(conv.messages[1]["content"], add_special_tokens=False) + eos
        ids = (prompt + answer)[:limit]
        if len(ids) > len(prompt):
            rows.append(Row(len(rows), ids, ([0] * len(prompt) + [1] * len(answer))[: len(ids)]))
    return rows


def _other_positions(other: tuple, heldout: list, tokenizer, picked: set[int]):  # noqa: ANN001
    """The other-tokenizer drafter's TLI distributions at the same positions (the answer positions numbered in
    ``picked``): the target prefix as text, re-encoded by the drafter, its last logits restricted to T ∩ D (one
    uncached forward per position)."""
    import torch

    from pipeline.vocab.maps import decode_ids, encode_text  # deferred: pulls in torch

    model, other_tok, inter_d = other
    rows, seen = [], -1
    for r in heldout:
        for t in answer_steps(r):
            seen += 1
            if seen not in picked:
                continue
            ids = encode_text(other_tok, decode_ids(tokenizer, r.input_ids[:t]), add_special_tokens=True)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].double()
            rows.append(torch.softmax(logits[inter_d], -1))
    return torch.stack(rows)


def _alpha_line(tau: float, figures: dict) -> str:
    a = figures["alpha"]
    return (f"target mass {figures['target_mass_kept']:.3f}, tau={tau:g}; alpha TLI {a['tli']:.4f}, RDK {a['rdk']:.4f}, "
            f"Taylor {a['rdk_taylor']:.4f}, prior mix {a['rdk_prior_constant']:.4f}/{a['rdk_prior_confidence']:.4f}, "
            f"oracle {a['oracle_taylor']:.4f}")


def _build(cfg: PipelineConfig, run: StageRun, calibration: Artifact, counts: Artifact) -> BuildResult | None:
    from pipeline.data.rows import CalibrationRows  # deferred: pulls in torch
    from pipeline.engine.hetero import intersection_pairs  # deferred: pulls in torch
    from pipeline.rdk.prior import (  # deferred: pulls in torch
        INTERSECTION,
        RDKPrior,
        analyse,
        pruning_levels,
        transfer,
    )
    from pipeline.vocab.counting import frequency_ranking  # deferred: pulls in pyarrow
    from pipeline.vocab.maps import VocabMap  # deferred: pulls in torch

    er, ev = cfg.estimate_rdk, cfg.evaluate
    target_ = Target(cfg.target)
    tokenizer = target_.tokenizer()
    if (ours := vocab_hash(tokenizer)) != (theirs := vocab_hash(load_tokenizer(ev.drafter))):
        raise not_same_tokenizer(ev.drafter, "evaluate.drafter", ours, theirs, "estimate_rdk")  # before any work
    data = CalibrationRows(calibration.path / "data", max_length=er.max_length, eval_fraction=er.heldout_fraction,
                           eval_max_rows=10**9, min_length=2, what="the RDK moments",
                           fraction_key="estimate_rdk.heldout_fraction")  # refuses no training or no held-out rows
    code_rows = _code_rows(cfg, tokenizer, calibration) if er.code_problems else []  # refuses an overlap before any work
    probe = target_.model(device="cpu", dtype="float32").eval()
    vocab = int(probe.get_output_embeddings().weight.shape[0])
    estimated = _estimate(cfg, run, data.train, vocab)
    if estimated is None:
        return None
    sums, figures = estimated
    moments = sums.moments()
    run.log(f"moments of {moments.count} target positions: top-{moments.top_k} entries cover "
            f"{moments.covered:.1%} of the mass; {moments.nnz:,} stored pairs ({moments.sparse_bytes() / 2**20:.1f} MiB "
            f"vs {moments.dense_bytes() / 2**20:.1f} MiB dense)")
    special = sorted(set(tokenizer.all_special_ids))
    kept_sets = pruning_levels(frequency_ranking(counts), vocab, er.keep_fractions, special)
    other = None
    if ev.drafter_other:
        other_tok = load_tokenizer(ev.drafter_other)
        other_model = load_model(ev.drafter_other, dtype="float32", device="cpu").eval()
        inter_d, inter_t, _ = intersection_pairs(VocabMap.build(tokenizer, other_tok),
                                                 other_model.get_output_embeddings().weight.shape[0], vocab)
        kept_sets[INTERSECTION] = inter_t
        other = (other_model, other_tok, inter_d)
    started = time.perf_counter()
    drafter = load_model(ev.drafter, dtype="float32", device="cpu").eval()
    run.log(f"held-out analysis: the target's and drafters' distributions on {len(data.heldout)} held-out rows"
            + (f" and {len(code_rows)} HumanEval solutions" if code_rows else "") + ", on the CPU")
    with heartbeat("estimate_rdk: held-out distributions", run.log):
        inputs, chats = _heldout_inputs(cfg, data.heldout, probe, drafter, kept_sets, tokenizer, other,
                                        "held-out calibration rows")
        code = _heldout_inputs(cfg, code_rows, probe, drafter, kept_sets, tokenizer, other,
                               "HumanEval solutions")[0] if code_rows else {}
    levels = {}
    for name, kept in kept_sets.items():
        required = () if name == INTERSECTION else special
        p, q_kept = inputs[name]
        levels[name] = analyse(p[: q_kept.shape[0]], q_kept, chats[: q_kept.shape[0]], kept, moments, er.taus,
                               required)
        run.log(f"{name} ({kept.numel()} kept), chat: " + _alpha_line(levels[name].tau, levels[name].figures))
        if name in code:
            p, q_kept = code[name]
            levels[name].figures["code"] = transfer(levels[name], p[: q_kept.shape[0]], q_kept, moments, er.taus,
                                                    required)
            run.log(f"{name} ({kept.numel()} kept), code: " + _alpha_line(levels[name].tau, levels[name].figures["code"]))
    figures["analysis_seconds"] = round(time.perf_counter() - started, 2)
    meta = {"vocab_hash": vocab_hash(tokenizer), "vocab_size": vocab, "required_ids": special,
            "top_k": moments.top_k, "count": moments.count, "covered": moments.covered, "nnz": moments.nnz,
            "sparse_bytes": moments.sparse_bytes(), "dense_bytes": moments.dense_bytes(), "taus": list(er.taus),
            "calibration": calibration.id, "counts": counts.id, "drafter": ev.drafter,
            "drafter_other": ev.drafter_other, **figures}
    prior = RDKPrior(moments, levels, meta)
    metrics = {"positions": moments.count, "top_k_mass": round(moments.covered, 6), "nnz": moments.nnz,
               "sparse_mib": round(moments.sparse_bytes() / 2**20, 3), "dense_mib": round(moments.dense_bytes() / 2**20, 3),
               **{k: v for k, v in figures.items() if isinstance(v, (int, float))},
               "nodes": figures["nodes"], "ranks": figures["ranks"]}
    for name, fit in levels.items():
        metrics[f"{name}.tau"] = fit.tau
        metrics.update({f"{name}.alpha.{k}": round(v, 6) for k, v in fit.figures["alpha"].items()})
        if "code" in fit.figures:
            metrics.update({f"{name}.code.alpha.{k}": round(v, 6) for k, v in fit.figures["code"]["alpha"].items()})

    def write(out: Path) -> None:
        prior.save(out, sums)

    return BuildResult(write, metrics)


def main(cfg: PipelineConfig, launch: Launch | None = None) -> Artifact | None:
    """Estimate (or reuse) the RDK moments and affinity choices this config plans for."""
    step = plan(cfg, ["estimate_rdk"])["estimate_rdk"]
    calibration, counts = step.input("generate"), step.input("count")
    return run_stage(cfg, step, [calibration, counts], build=lambda run: _build(cfg, run, calibration, counts), launch=launch)
