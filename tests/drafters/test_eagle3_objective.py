"""The EAGLE-3 training-time-test objective (pipeline.training.eagle3_objective): the loss's alignment, decay and
masking, its memory shape, simulated τ, the target features it reads, and that it trains on the tiny kit's target.

Unit tests use the random 3-layer Llama config of eagle3_support.py; the training test uses the tiny kit's target.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.errors import DrafterError
from pipeline.training.eagle3_objective import simulated_tau, target_features, ttt_loss
from pipeline.vocab.counting import eagle3_offset_maps, top_k
from tests.drafters.eagle3_support import VD, V, make_drafter, random_batch

# --- the objective ---------------------------------------------------------------------------------

def test_one_step_loss_is_the_plain_soft_cross_entropy() -> None:
    drafter = make_drafter()
    b = random_batch()
    ids, mask, hidden, target = b["input_ids"], b["loss_mask"], b["hidden"], b["logits"]
    result = ttt_loss(drafter, ids, mask, hidden, target, steps=1)
    # By hand: row t reads (x_{t+1}, f_t), predicts x_{t+2} against the target at t+1.
    logits, _ = drafter(ids[:, 1:], hidden[:, :-1])
    q = torch.softmax(target[:, 1:, drafter.draft_to_target], dim=-1)
    ce = -(q * torch.log_softmax(logits, dim=-1)).sum(-1)
    keep = torch.zeros_like(ce, dtype=torch.bool)
    keep[:, :-1] = mask[:, 2:].bool()
    keep &= drafter.t2d[target[:, 1:].argmax(-1)]
    assert 5 < keep.sum() < mask[:, 2:].sum()  # some rows learnable, some target argmaxes outside the draft vocab
    expected = ((ce * keep).sum(-1) / keep.sum(-1).clamp(min=1)).mean()  # per example, then over examples
    assert torch.allclose(result.loss, expected, atol=1e-5)
    assert torch.allclose(result.per_step_loss, expected.detach()[None], atol=1e-5)
    assert result.tokens == int(mask[:, 2:].sum())
    hits = (logits.argmax(-1) == q.argmax(-1)) & keep
    assert result.per_step_acc[0].item() == pytest.approx(hits.sum().item() / result.tokens)


def test_steps_are_decayed_and_summed() -> None:
    drafter = make_drafter()
    b = random_batch(length=16)
    result = ttt_loss(drafter, b["input_ids"], b["loss_mask"], b["hidden"], b["logits"], steps=5, decay=0.8)
    assert result.per_step_loss.shape == result.per_step_acc.shape == (5,)
    assert result.loss.item() == pytest.approx(sum(0.8**i * float(x) for i, x in enumerate(result.per_step_loss)),
                                               rel=1e-5)
    assert result.per_step_tokens.tolist() == [int(b["loss_mask"][:, 2 + s :].sum()) for s in range(5)]


def test_masked_positions_contribute_nothing() -> None:
    drafter = make_drafter()
    b = random_batch(length=14)
    base = ttt_loss(drafter, b["input_ids"], b["loss_mask"], b["hidden"], b["logits"], steps=4)
    # Target position j supervises token j+1: only j with loss_mask[j+1] = 1 (and j < T-1) may count.
    unused = torch.ones_like(b["loss_mask"], dtype=torch.bool)
    unused[:, :-1] = b["loss_mask"][:, 1:] == 0
    noisy = b["logits"].clone()
    noisy[unused] = 50 * torch.randn(int(unused.sum()), V)
    moved = ttt_loss(drafter, b["input_ids"], b["loss_mask"], b["hidden"], noisy, steps=4)
    assert unused.any() and torch.equal(moved.loss, base.loss)
    assert torch.equal(moved.per_step_acc, base.per_step_acc)
    # ...while a change at a used position does move it.
    noisy[~unused] = 50 * torch.randn(int((~unused).sum()), V)
    assert ttt_loss(drafter, b["input_ids"], b["loss_mask"], b["hidden"], noisy, steps=4).loss != base.loss


def test_logits_are_one_step_of_the_draft_vocabulary_at_a_time() -> None:
    """By structure: lm_head runs once per step on at most (B, T) rows, and autograd keeps nothing as wide
    as the target vocabulary and no drafter logits at all: the only draft-vocabulary tensors it holds are
    the target's gathered probabilities, one (B, T-1-s, V_draft) view per step."""
    drafter = make_drafter()
    b = random_batch(length=16)
    batch, length = b["input_ids"].shape
    shapes: list[tuple[int, ...]] = []
    drafter.lm_head.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = ttt_loss(drafter, b["input_ids"], b["loss_mask"], b["hidden"], b["logits"], steps=6)
    assert shapes == [(batch, length - 1 - s, VD) for s in range(6)]
    assert not [s for s in saved if V in s]
    assert sorted(s for s in saved if s and s[-1] == VD) == sorted((batch, length - 1 - s, VD) for s in range(6))
    result.loss.backward()  # rebuilds each step's logits once more
    assert len(shapes) == 12 and all(p.grad is not None for p in drafter.parameters())


def test_simulated_tau() -> None:
    assert simulated_tau(torch.tensor([1.0, 1.0, 1.0])).item() == pytest.approx(4.0)
    assert simulated_tau(torch.tensor([0.5, 0.5])).item() == pytest.approx(1.75)
    assert simulated_tau(torch.tensor([0.0, 1.0])).item() == pytest.approx(1.0)


def test_too_many_steps_raise() -> None:
    drafter = make_drafter()
    b = random_batch(length=6)
    with pytest.raises(DrafterError, match=r"1 <= steps <= T - 2 \(T = 6(.|\n)*steps=5"):
        ttt_loss(drafter, b["input_ids"], b["loss_mask"], b["hidden"], b["logits"], steps=5)


# --- on the tiny kit's target ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_batch(tiny_kit: object) -> dict:
    """Four ShareGPT conversations rendered with the tiny target's chat template (assistant tokens
    masked in), right-padded to 64 tokens, and the target's features for them."""
    from pipeline.data.calibration import raw_row
    from pipeline.data.sources import load_sharegpt
    from pipeline.models.loading import load_model, load_tokenizer

    model, tokenizer = load_model("tiny:test/target"), load_tokenizer("tiny:test/target")
    convs, _ = load_sharegpt()
    count, length, rows = 4, 64, []
    for conv in convs:
        row = raw_row(tokenizer, conv, length)
        if row is not None and sum(row["loss_mask"]) >= 24:
            rows.append(row)
        if len(rows) == count:
            break
    ids = torch.full((count, length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(count, length, dtype=torch.long)
    attention = torch.zeros(count, length, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n], mask[i, :n], attention[i, :n] = torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]), 1
    config = Eagle3Config.from_target(model.config, draft_vocab_size=256)
    hidden, logits = target_features(model, ids, attention, config.aux_layer_ids)
    return {"model": model, "config": config, "input_ids": ids, "loss_mask": mask, "hidden": hidden,
            "logits": logits}


def test_target_features_are_the_named_layers(target_batch: dict) -> None:
    model, ids = target_batch["model"], target_batch["input_ids"][:2, :20]
    assert target_batch["config"].aux_layer_ids == (0, 1, 2)  # the kit's target has 3 layers
    hidden, logits = target_features(model, ids, None, (0, 1, 3))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert hidden.shape == (2, 20, 3 * model.config.hidden_size) and logits.shape == (2, 20, model.config.vocab_size)
    assert torch.equal(hidden, torch.cat([out.hidden_states[i] for i in (0, 1, 3)], dim=-1))
    assert not hidden.requires_grad
    with pytest.raises(DrafterError, match=r"each in \[0, 3\](.|\n)*\(0, 1, 4\)"):
        target_features(model, ids, None, (0, 1, 4))


def test_training_lowers_the_loss_on_the_tiny_target(target_batch: dict) -> None:
    """60 AdamW steps on four rows of the real tiny target's features: the unrolled loss falls below
    0.7x its start and each step's agreement with the target rises (the drafter can memorise them)."""
    torch.manual_seed(0)
    # These matmuls are tiny: on a shared 2-core machine a second intra-op thread only adds waiting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first, last = _train(target_batch)
    finally:
        torch.set_num_threads(threads)
    assert last.loss.item() < 0.7 * first.loss.item(), (first.loss.item(), last.loss.item())
    assert (last.per_step_acc > first.per_step_acc).all(), (first.per_step_acc, last.per_step_acc)
    assert last.per_step_acc[0] > 0.3 and last.simulated_tau > first.simulated_tau + 0.3
    assert target_batch["model"].get_input_embeddings().weight.grad is None


def _train(target_batch: dict) -> tuple:
    model, config = target_batch["model"], target_batch["config"]
    ids, mask = target_batch["input_ids"], target_batch["loss_mask"]
    counts = np.bincount(ids[mask.bool()].numpy(), minlength=config.target_vocab_size)
    drafter = Eagle3Drafter(config, model.get_input_embeddings())
    drafter.set_vocab_maps(*eagle3_offset_maps(top_k(counts, config.draft_vocab_size), config.target_vocab_size))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)

    def run() -> object:
        return ttt_loss(drafter, ids, mask, target_batch["hidden"], target_batch["logits"], steps=7)

    first = run()
    for _ in range(60):
        result = run()
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
    with torch.no_grad():
        last = run()
    print(f"loss {first.loss.item():.3f} -> {last.loss.item():.3f}; acc {first.per_step_acc.tolist()} -> "
          f"{last.per_step_acc.tolist()}; tau {first.simulated_tau.item():.2f} -> {last.simulated_tau.item():.2f}")
    return first, last
