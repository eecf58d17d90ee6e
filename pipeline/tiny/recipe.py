"""The kit's build recipe, top to bottom: data → tokenizers → target → target text → drafters → report.

1. Short chats from the non-held-out packaged ShareGPT conversations; held-out ones measure models.
2. Two byte-complete BPE tokenizers trained on the message text ('Ġ' byte-level for target and
   drafter, '▁' Metaspace + byte fallback for drafter_other).
3. The target trains with cross-entropy on the chats under its chat template.
4. The target answers training prompts (T=1 samples): text from exactly the distribution that
   speculative decoding later drafts against.
5. The same-tokenizer drafter is distilled with forward KL to the target's next-token distributions,
   on raw chats and target-written chats mixed half and half.
6. The other-tokenizer drafter cannot fit the target's logits token by token (different vocabulary).
   Half of each batch is text (training chats and target answers) tokenised both ways: where a target
   token and a drafter token start at the same character, the target's distribution over the shared
   tokens is its soft target (:mod:`pipeline.tiny.crossvocab`); the other half is raw and
   target-written chats under its own template, with cross-entropy, so it learns turns and eos.
   Plain sequence-level distillation (cross-entropy on target-written text alone) was tried first
   and matched the target no better than raw text: a few minutes of CPU generate too little text.
7. The byte-level drafter (256 byte tokens, the target's specials and template; for string-level
   rejection sampling, :mod:`pipeline.engine.slrs`) cannot be distilled against the target's
   distributions either: one target token spans several bytes, and the target's distribution over
   the next *byte* would need a marginal over every token that starts with it. It is trained like the
   target, with next-byte cross-entropy, on training chats and target-written chats (the same text the
   other drafters see), mixed half and half like the same-tokenizer drafter's rows, so it learns the
   target's own phrasing where it can.
8. Measurements on held-out chats and on target answers to held-out prompts go into the report.

A build that is interrupted (Ctrl-C, a kill, a lost machine) keeps what it finished, the target's and each drafter's
trained weights and the target's answers, and the next build of the same kit resumes after them (:class:`Phases`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeline.checksums import write_json_atomic
from pipeline.data.sources import DEFAULT_HELDOUT_FRACTION, load_sharegpt, split_heldout
from pipeline.errors import DrafterError
from pipeline.progress import heartbeat
from pipeline.staged import staged_about, staged_ok, write_staged, write_staged_json
from pipeline.tiny import corpus
from pipeline.tiny.crossvocab import aligned_agreement, aligned_distill_loss, aligned_rows, shared_tokens
from pipeline.tiny.spec import ProfileSpec, kit_code_digest
from pipeline.tiny.text_tokenizers import byte_tokenizer, train_tokenizer
from pipeline.tiny.train import (
    build_model,
    distill_loss,
    fast_bf16,
    generate,
    measure,
    next_token_loss,
    param_count,
    train,
)


def _mix(raw: torch.Tensor, written: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """``rows`` rows, half target-written (repeated as needed) and half raw."""
    generator = torch.Generator().manual_seed(seed)
    half = rows // 2
    written_idx = torch.arange(half) % written.shape[0]
    raw_idx = torch.randperm(raw.shape[0], generator=generator)[: rows - half]
    return torch.cat([written[written_idx], raw[raw_idx]])


def _answer(
    model: Any, tokenizer: Any, prompts: list[corpus.Chat], spec: ProfileSpec, seed: int, log: Callable[[str], None]
) -> tuple[list[list[int]], list[list[int]]]:
    """Prompt ids (with generation prompt) and the target's sampled answers to them."""
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    budget = spec.context - spec.gen_new_tokens
    prompt_ids = [ids[-budget:] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    answers = generate(
        model,
        prompt_ids,
        max_new_tokens=spec.gen_new_tokens,
        batch_size=32,
        do_sample=True,
        seed=seed,
        pad_id=tokenizer.pad_token_id,
        eos_id=tokenizer.eos_token_id,
        log=log,
    )
    return prompt_ids, answers


def _rerender(
    tok_target: Any, tok_other: Any, prompts: list[corpus.Chat], answers: list[list[int]]
) -> list[list[int]]:
    """Target-written chats as text, re-tokenised under the other tokenizer's chat template."""
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        finished = bool(answer) and answer[-1] == tok_target.eos_token_id
        reply = tok_target.decode(answer, skip_special_tokens=True)
        if not reply.strip():
            continue  # nothing to learn from, and an empty final message cannot be continued
        chat = [
            *prompt,
            {"role": "assistant", "content": reply},
        ]
        # An answer cut by the token budget must not teach the drafter to end the turn there.
        text = tok_other.apply_chat_template(chat, tokenize=False, continue_final_message=not finished)
        out.append(tok_other(text, add_special_tokens=False)["input_ids"])
    return out


def _save(model: Any, tokenizer: Any, out_dir: Path) -> None:
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard progress bar per tiny model is noise in the log
    try:
        model.save_pretrained(str(out_dir))  # safetensors, config.json and generation_config.json
        tokenizer.save_pretrained(str(out_dir))
    finally:
        if bar:
            hf_logging.enable_progress_bar()


PHASES = ("target", "answers", "drafter", "drafter_other", "drafter_bytes")
"""What a build keeps as it goes, in order: each model's trained weights, and the target's answers."""


def _conditions(bf16: bool) -> dict:
    """What a kit's bytes depend on beyond its recipe (which names the kit's directory): the libraries, torch's
    threads (the kernels' summation order), mixed precision, and the code the recipe runs
    (:func:`~pipeline.tiny.spec.kit_code_digest`, also in the kit's hash)."""
    import tokenizers
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "threads": torch.get_num_threads(), "bf16": bf16, "code": kit_code_digest()}


class Phases:
    """The phases an interrupted build finished, kept under ``directory`` for the next build of the same kit.

    Each is a staged file (:mod:`pipeline.staged`: written whole, checksummed, redone if damaged): a model's trained
    weights with its losses, or the target's answers. A stamp records the build's conditions (:func:`_conditions`);
    a build under others starts afresh, so a resumed build writes the bytes an uninterrupted one would. Every phase
    seeds its own randomness, so a kept phase leaves the next one as computing it would have. With ``directory``
    None nothing is kept.
    """

    def __init__(self, directory: Path | None, conditions: dict, log: Callable[[str], None]) -> None:
        self.directory, self.log = directory, log
        if directory is None:
            return
        stamp = directory / "stamp.json"
        if directory.is_dir():
            try:
                kept = json.loads(stamp.read_text())
            except (OSError, ValueError):
                kept = None
            if kept != conditions:
                log("  an interrupted build under other conditions (libraries, threads, code) left phases: "
                    "starting afresh")
                shutil.rmtree(directory)
        write_json_atomic(stamp, conditions)
        done = [phase for phase in PHASES if self._path(phase).is_file()]
        if done:
            log(f"  resuming an interrupted build: {', '.join(done)} done before")

    def _path(self, phase: str) -> Path:
        assert self.directory is not None
        return self.directory / (f"{phase}.json" if phase == "answers" else f"{phase}.safetensors")

    def _kept(self, phase: str) -> Path | None:
        """The phase's kept file, if there is a sound one (a damaged one is deleted, logged: :func:`staged_ok`)."""
        return self._path(phase) if self.directory is not None and staged_ok(self._path(phase), self.log) else None

    def trained(self, phase: str, model: Any, run: Callable[[], list[float]]) -> list[float]:
        """``run()``, which trains ``model`` in place and returns its losses; or the weights and losses kept."""
        from safetensors.torch import load_file, save_file

        if (path := self._kept(phase)) is not None:
            missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:  # only the head tied to the embedding is not saved
                raise DrafterError(f"The kept {phase} weights do not fit the {phase} model.",
                                   expected="the model's parameters", found=f"missing {missing}, unexpected {unexpected}",
                                   fix=f"Delete {self.directory} and build again.")
            model.eval()  # as training leaves it
            self.log(f"  {phase}: trained weights kept by the interrupted build")
            return [float(loss) for loss in staged_about(path)["losses"]]
        losses = run()
        if self.directory is not None:
            weights = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()
                       if name != "lm_head.weight" or not model.config.tie_word_embeddings}
            write_staged(self._path(phase), lambda tmp: save_file(weights, str(tmp)), about={"losses": losses})
        return losses

    def answered(self, run: Callable[[], dict]) -> dict:
        """``run()``, the target's answers (JSON: lists of ids), or the answers kept."""
        if (path := self._kept("answers")) is not None:
            self.log("  target answers: kept by the interrupted build")
            return json.loads(path.read_text())
        answers = run()
        if self.directory is not None:
            write_staged_json(self._path("answers"), answers)
        return answers


def build_into(spec: ProfileSpec, out: Path, log: Callable[[str], None], *, keep: Path | None = None) -> dict:
    """Run the recipe for ``spec`` and save every role of :data:`~pipeline.tiny.spec.ROLES` under ``out``.

    Args:
        keep: Where the finished phases are kept for a build after an interruption to resume from (:class:`Phases`);
            None keeps nothing.

    Returns:
        The report (figures of every stage), without build time, which the caller adds.
    """
    torch.manual_seed(spec.seed)
    bf16 = spec.mixed_precision and fast_bf16()
    phases = Phases(keep, _conditions(bf16), log)
    convs, data_report = load_sharegpt()
    train_convs = split_heldout(convs, DEFAULT_HELDOUT_FRACTION, heldout=False)[: spec.train_conversations]
    eval_convs = split_heldout(convs, DEFAULT_HELDOUT_FRACTION, heldout=True)[: spec.eval_conversations]
    train_chats = corpus.make_chats(train_convs, spec.max_turns, spec.max_chars)
    eval_chats = corpus.make_chats(eval_convs, spec.max_turns, spec.max_chars)
    log(f"  data: {len(train_chats)} training chats, {len(eval_chats)} held-out chats")

    texts = corpus.text_of(train_chats)
    tok_t = train_tokenizer("bytelevel", texts, spec.vocab_target)
    tok_o = train_tokenizer("metaspace", texts, spec.vocab_other)
    log(f"  tokenizers: 'Ġ' byte-level {len(tok_t)} tokens, '▁' metaspace {len(tok_o)} tokens")

    rows_t = corpus.pack(corpus.render_ids(tok_t, train_chats), spec.context)
    eval_t = corpus.pack(corpus.render_ids(tok_t, eval_chats), spec.context)
    target = build_model(spec.target, tok_t, spec.context, spec.seed)
    log(f"  target: {param_count(target):,} params, {spec.target_steps} steps on {rows_t.numel():,} tokens")
    target_losses = phases.trained("target", target, lambda: train(
        target, next_token_loss(rows_t, spec.batch_size, spec.seed), steps=spec.target_steps,
        lr=spec.target_lr, seed=spec.seed, log=log, name="target", bf16=bf16,
    ))  # fmt: skip

    prompts = corpus.first_user_prompts(train_chats)[: spec.gen_prompts]
    eval_prompts = corpus.first_user_prompts(eval_chats)

    def answer() -> dict:
        prompt_ids, answers = _answer(target, tok_t, prompts, spec, spec.seed + 1, log)
        eval_prompt_ids, eval_answers = _answer(target, tok_t, eval_prompts, spec, spec.seed + 2, log)
        return {"prompt_ids": prompt_ids, "answers": answers, "eval_prompt_ids": eval_prompt_ids,
                "eval_answers": eval_answers}

    written = phases.answered(answer)
    prompt_ids, answers = written["prompt_ids"], written["answers"]
    eval_prompt_ids, eval_answers = written["eval_prompt_ids"], written["eval_answers"]
    finished = sum(bool(a) and a[-1] == tok_t.eos_token_id for a in answers) / len(answers)
    log(f"  target wrote {sum(map(len, answers)):,} tokens for {len(prompts)} prompts ({finished:.0%} ended)")
    written_t = corpus.pack([p + a for p, a in zip(prompt_ids, answers, strict=True)], spec.context)
    eval_written_t = corpus.pack(
        [p + a for p, a in zip(eval_prompt_ids, eval_answers, strict=True)], spec.context
    )

    drafter_rows = spec.drafter_steps * spec.batch_size
    drafter = build_model(spec.drafter, tok_t, spec.context, spec.seed + 3)
    drafter_mix = _mix(rows_t, written_t, drafter_rows, spec.seed)
    drafter_losses = phases.trained("drafter", drafter, lambda: train(
        drafter, distill_loss(drafter_mix, target, spec.batch_size, spec.seed + 3), steps=spec.drafter_steps,
        lr=spec.drafter_lr, seed=spec.seed + 3, log=log, name="drafter (KL to target)", bf16=bf16,
    ))  # fmt: skip

    rows_o = corpus.pack(corpus.render_ids(tok_o, train_chats), spec.context)
    eval_o = corpus.pack(corpus.render_ids(tok_o, eval_chats), spec.context)
    written_o = corpus.pack(_rerender(tok_t, tok_o, prompts, answers), spec.context)
    eval_written_o = corpus.pack(_rerender(tok_t, tok_o, eval_prompts, eval_answers), spec.context)
    shared = shared_tokens(tok_t, tok_o)
    answer_texts = [tok_t.decode(a, skip_special_tokens=True) for a in answers]
    aligned = aligned_rows(tok_t, tok_o, texts + answer_texts, spec.context)
    eval_aligned = aligned_rows(tok_t, tok_o, corpus.text_of(eval_chats), spec.context)
    eval_written_aligned = aligned_rows(
        tok_t, tok_o, [tok_t.decode(a, skip_special_tokens=True) for a in eval_answers], spec.context
    )
    log(f"  vocabularies share {len(shared[0])} tokens; {aligned.drafter.shape[0]} aligned rows")
    other = build_model(spec.other, tok_o, spec.context, spec.seed + 4)
    other_loss = aligned_distill_loss(
        aligned, torch.cat([rows_o, written_o]), target, shared, spec.batch_size, spec.seed + 4
    )
    other_losses = phases.trained("drafter_other", other, lambda: train(
        other, other_loss, steps=spec.other_steps, lr=spec.other_lr, seed=spec.seed + 4, log=log,
        name="drafter_other (aligned soft targets)", bf16=bf16,
    ))  # fmt: skip

    tok_b = byte_tokenizer("bytelevel")
    rows_b = corpus.pack(corpus.render_ids(tok_b, train_chats), spec.byte_context)
    eval_b = corpus.pack(corpus.render_ids(tok_b, eval_chats), spec.byte_context)
    written_b = corpus.pack(_rerender(tok_t, tok_b, prompts, answers), spec.byte_context)
    eval_written_b = corpus.pack(_rerender(tok_t, tok_b, eval_prompts, eval_answers), spec.byte_context)
    byte_model = build_model(spec.byte_drafter, tok_b, spec.byte_context, spec.seed + 5)
    byte_mix = _mix(rows_b, written_b, spec.byte_steps * spec.batch_size, spec.seed + 5)
    log(f"  drafter_bytes: {param_count(byte_model):,} params, {spec.byte_steps} steps of "
        f"{spec.batch_size}x{spec.byte_context} bytes")  # fmt: skip
    byte_losses = phases.trained("drafter_bytes", byte_model, lambda: train(
        byte_model, next_token_loss(byte_mix, spec.batch_size, spec.seed + 5), steps=spec.byte_steps,
        lr=spec.byte_lr, seed=spec.seed + 5, log=log, name="drafter_bytes (next-byte CE)", bf16=bf16,
    ))  # fmt: skip

    for role, model, tok in (
        ("target", target, tok_t),
        ("drafter", drafter, tok_t),
        ("drafter_other", other, tok_o),
        ("drafter_bytes", byte_model, tok_b),
    ):
        _save(model, tok, out / role)
    log("  measuring on held-out text")
    with heartbeat("  measuring on held-out text", log):  # nine passes: 15-30 s on two cores
        target_heldout = measure(target, eval_t)
        eval_text = [tok_t.apply_chat_template(chat, tokenize=False) for chat in eval_chats]
        n_bytes, n_tokens = (
            sum(map(len, tok(eval_text, add_special_tokens=False)["input_ids"])) for tok in (tok_b, tok_t)
        )
        bytes_per_token = n_bytes / n_tokens
        report = {
            "data": {**vars(data_report), "train_chats": len(train_chats), "eval_chats": len(eval_chats)},
            "heldout_fraction": DEFAULT_HELDOUT_FRACTION,
            "target": {
                "params": param_count(target),
                "vocab_size": len(tok_t),
                "uniform_loss": round(float(torch.log(torch.tensor(float(len(tok_t))))), 4),
                "final_train_loss": round(sum(target_losses[-20:]) / len(target_losses[-20:]), 4),
                "heldout": target_heldout,
                "answers_ended_with_eos": round(finished, 3),
            },
            "drafter": {
                "params": param_count(drafter),
                "vocab_size": len(tok_t),
                "final_train_kl": round(sum(drafter_losses[-20:]) / len(drafter_losses[-20:]), 4),
                "heldout": measure(drafter, eval_t, teacher=target),
                "heldout_target_written": measure(drafter, eval_written_t, teacher=target),
            },
            "drafter_other": {
                "params": param_count(other),
                "vocab_size": len(tok_o),
                "final_train_loss": round(sum(other_losses[-20:]) / len(other_losses[-20:]), 4),
                "shared_vocab": len(shared[0]),
                "heldout": measure(other, eval_o),
                "heldout_target_written": measure(other, eval_written_o),
                "heldout_aligned": aligned_agreement(target, other, eval_aligned, shared),
                "heldout_target_written_aligned": aligned_agreement(target, other, eval_written_aligned, shared),
            },
            "drafter_bytes": {
                "params": param_count(byte_model),
                "vocab_size": len(tok_b),
                "context_bytes": spec.byte_context,
                "final_train_loss": round(sum(byte_losses[-20:]) / len(byte_losses[-20:]), 4),
                # Losses are nats per byte; the target's, for comparison, is its per-token loss spread
                # over the mean bytes per target token of the held-out chats (specials count as one byte).
                "heldout": measure(byte_model, eval_b),
                "heldout_target_written": measure(byte_model, eval_written_b),
                "bytes_per_target_token": round(bytes_per_token, 4),
                "target_heldout_nats_per_byte": round(target_heldout["loss"] / bytes_per_token, 4),
            },
            "context": spec.context,
            "train_precision": "bfloat16 autocast" if bf16 else "float32",
        }
    return report
