"""Training, distillation, generation and measurement of the kit's tiny Llama models on CPU.

Plain loops, readable top to bottom (nanoGPT style): AdamW with warmup and cosine decay over a fixed
number of steps (never a time budget, so a build is deterministic for a profile), cross-entropy on
packed rows, or forward KL to a frozen teacher's next-token distribution for same-tokenizer
distillation. :func:`generate` produces target-written responses for sequence-level distillation of the
other-tokenizer drafter; :func:`measure` gives held-out loss, mean top-1 probability and, against a
teacher, top-1 agreement and ``sum_x min(p, q)`` (the expected acceptance rate of one speculative
sampling step, Leviathan et al. 2023, §3).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.progress import Progress
from pipeline.tiny.spec import ModelSpec


def build_model(spec: ModelSpec, tokenizer: Any, context: int, seed: int) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` sized by ``spec`` for ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,  # the embedding is most of a tiny model; tying halves it
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def param_count(model: Any) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def _lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(rows: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless shuffled batches of rows, epoch after epoch, in a seeded order."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(rows.shape[0], generator=generator)
        for start in range(0, rows.shape[0] - batch_size + 1, batch_size):
            yield rows[order[start : start + batch_size]]


StepLoss = Callable[[Any], torch.Tensor]
"""Given the model being trained, draws the next batch and returns its loss."""


def next_token_loss(rows: torch.Tensor, batch_size: int, seed: int) -> StepLoss:
    """Cross-entropy of each next token on packed ``rows``."""
    stream = batches(rows, batch_size, seed)

    def step(model: Any) -> torch.Tensor:
        batch = next(stream)
        logits = model(input_ids=batch).logits.float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())

    return step


def distill_loss(rows: torch.Tensor, teacher: Any, batch_size: int, seed: int) -> StepLoss:
    """Forward KL(teacher ‖ model) at every position; the teacher must share the model's tokenizer."""
    stream = batches(rows, batch_size, seed)

    def step(model: Any) -> torch.Tensor:
        batch = next(stream)
        with torch.no_grad():
            target_logp = F.log_softmax(teacher(input_ids=batch).logits.float(), dim=-1)
        kl = F.kl_div(F.log_softmax(model(input_ids=batch).logits.float(), dim=-1), target_logp, log_target=True,
                      reduction="none")  # fmt: skip
        return kl.sum(-1).mean()

    return step


def fast_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), where mixed precision pays."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def train(
    model: Any,
    step_loss: StepLoss,
    *,
    steps: int,
    lr: float,
    seed: int,
    log: Callable[[str], None],
    name: str,
    bf16: bool = False,
) -> list[float]:
    """Train ``model`` for ``steps`` AdamW steps on ``step_loss``; returns the per-step losses.

    With ``bf16`` the forward passes run under bfloat16 autocast (weights, optimizer state and losses stay
    float32): ~1.5x faster on a CPU with native bfloat16 dot products.
    """
    torch.manual_seed(seed)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    losses: list[float] = []
    with Progress(name, steps, "step", log=log) as progress:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, steps, lr)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = step_loss(model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            recent = losses[-20:]
            progress.update(1, loss=sum(recent) / len(recent))
    model.eval()
    return losses


@torch.no_grad()
def measure(model: Any, rows: torch.Tensor, *, batch_size: int = 16, teacher: Any | None = None) -> dict:
    """Held-out next-token loss and mean top-1 probability; with a teacher, agreement figures too.

    Returns:
        ``loss`` (nats/token), ``top1_prob`` (mean max probability), ``top1_accuracy``, ``tokens``; with
        ``teacher``: ``top1_agreement`` (argmax equal) and ``expected_acceptance`` (mean ``sum min(p, q)``).
    """
    model.eval()
    sums = {"loss": 0.0, "top1_prob": 0.0, "top1_accuracy": 0.0, "top1_agreement": 0.0, "overlap": 0.0}
    count = 0
    for start in range(0, rows.shape[0], batch_size):
        batch = rows[start : start + batch_size]
        logp = F.log_softmax(model(input_ids=batch).logits[:, :-1].float(), dim=-1)
        labels = batch[:, 1:]
        top_logp, top_ids = logp.max(-1)
        sums["loss"] += -logp.gather(-1, labels[..., None]).sum().item()
        sums["top1_prob"] += top_logp.exp().sum().item()
        sums["top1_accuracy"] += (top_ids == labels).sum().item()
        if teacher is not None:
            p = F.softmax(teacher(input_ids=batch).logits[:, :-1].float(), dim=-1)
            sums["top1_agreement"] += (p.argmax(-1) == top_ids).sum().item()
            sums["overlap"] += torch.minimum(p, logp.exp()).sum().item()
        count += labels.numel()
    out = {k: sums[k] / count for k in ("loss", "top1_prob", "top1_accuracy")}
    if teacher is not None:
        out["top1_agreement"] = sums["top1_agreement"] / count
        out["expected_acceptance"] = sums["overlap"] / count
    out["tokens"] = count
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


@torch.no_grad()
def generate(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    batch_size: int,
    do_sample: bool,
    seed: int,
    pad_id: int,
    eos_id: int,
    log: Callable[[str], None] | None = None,
) -> list[list[int]]:
    """Continue each prompt (left-padded in batches); returns each response, cut after its first eos."""
    progress = Progress("target answers", len(prompts), "prompt", log=log)
    model.eval()
    torch.manual_seed(seed)
    responses: list[list[int]] = []
    # Sorting by length keeps padding small; results are put back in prompt order.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    by_index: dict[int, list[int]] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(chunk):
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=1.0 if do_sample else None,
            top_k=0 if do_sample else None,
            top_p=1.0 if do_sample else None,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )
        for row, i in enumerate(chunk):
            new = out[row, width:].tolist()
            by_index[i] = new[: new.index(eos_id) + 1] if eos_id in new else new
        progress.update(len(chunk))
    progress.close()
    responses = [by_index[i] for i in range(len(prompts))]
    return responses
