"""The DFlash proposer (pipeline/engine/dflash.py) on the engine fixtures' target: one drafter forward per round,
``q`` the exact law of what it samples (each block row on its own, so the drafts are independent given the context),
the cached context equal to a fresh computation after any rejection, greedy speculative decoding equal to greedy
autoregressive decoding with a trained drafter whose drafts are accepted, and a short training run that learns."""

from __future__ import annotations

import pytest
import torch

from pipeline.drafters.dflash import DFlashDrafter
from pipeline.engine.dflash import DFlashProposer
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState
from pipeline.training.dflash_task import block_loss, draw_blocks, tapped_features
from tests.engine.conftest import assert_counts_match, make_dflash

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

GREEDY = SamplingParams()
SEQUENCE = 48


def _state(target: torch.nn.Module, context: list[int], layers: tuple[int, ...]) -> TargetState:
    """The target's state for ``context`` computed from scratch (every position but the newest)."""
    with torch.no_grad():
        out = target(torch.tensor([context[:-1]]), output_hidden_states=True)
    return TargetState(layers, tuple(out.hidden_states[i][0] for i in layers), None, len(context) - 1)


@torch.no_grad()
def _continuations(target: torch.nn.Module, prompts: list[list[int]], sampled: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt] * (1 + sampled))
        while ids.shape[1] < SEQUENCE:
            logits = target(ids).logits[:, -1]
            nxt = sample(standardise(logits, SamplingParams(temperature=1.0)), gen)
            nxt[0] = logits[0].argmax()
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        rows.append(ids)
    return torch.cat(rows)


def train_dflash(target: torch.nn.Module, prompts: list[list[int]], *, steps: int = 60) -> tuple[DFlashDrafter, list]:
    """A 1-layer, B = 5 DFlash drafter self-distilled from ``target`` on its continuations (float32, then float64);
    its held-out-free training losses."""
    ids = _continuations(target, prompts, sampled=3, seed=0)
    drafter = make_dflash(target, block_size=5).float().train()
    hidden, logits = tapped_features(target, ids, None, drafter.config.hidden_state_indices)
    mask, lengths = torch.ones_like(ids), torch.full((ids.shape[0],), ids.shape[1])
    optimiser = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        blocks = draw_blocks(mask, lengths, 5, 12, generator)
        result = block_loss(drafter, ids, hidden.float(), logits.float(), blocks, decay=4.0, loss="kl")
        optimiser.zero_grad()
        result.loss.backward()
        optimiser.step()
        losses.append(float(result.loss.detach()))
    return drafter.double().eval(), losses


@pytest.fixture(scope="module")
def trained(target, prompts) -> tuple[DFlashDrafter, list]:
    return train_dflash(target, prompts)


def test_one_forward_per_round_and_q_is_the_law_of_each_row(target, prompts) -> None:
    drafter = make_dflash(target, block_size=6)
    proposer = DFlashProposer(drafter)
    context = prompts[0] + [5, 7]
    state = _state(target, context, proposer.target_layers)
    params = SamplingParams(temperature=0.8, top_p=0.9)
    proposal = proposer.propose(context, 4, params, torch.Generator().manual_seed(0), state)
    assert proposer.drafter_calls == 1 and len(proposal.tokens) == 4
    # q recomputed without the cache: the block forward over the whole context
    hidden = torch.cat([h for h in state.hidden], dim=-1).unsqueeze(0)
    n = len(context) - 1
    out = drafter(drafter.block_ids(torch.tensor([context[-1]])), hidden, torch.arange(n, n + 6).unsqueeze(0),
                  torch.arange(n).unsqueeze(0))
    torch.testing.assert_close(proposal.q, standardise(drafter.logits(out[0, 1:5]), params), rtol=0, atol=1e-12)
    # γ beyond B - 1: the block's B - 1 drafts, still one forward
    assert len(proposer.propose(context, 9, params, torch.Generator(), state).tokens) == 5
    assert proposer.drafter_calls == 2


def test_drafts_are_independent_draws_from_their_rows(target, prompts) -> None:
    """3,000 proposals from one context (top-k 3, so each row has 3 outcomes and a pair 9): the joint counts of
    (draft 1, draft 2) match n · q1 ⊗ q2 outcome by outcome within a 6σ Bernstein bound (no pair of zero
    probability), i.e. each draft follows its own row whatever the other drew — the law verification assumes."""
    proposer = DFlashProposer(make_dflash(target, block_size=4))
    context = prompts[1]
    state = _state(target, context, proposer.target_layers)
    params = SamplingParams(temperature=1.0, top_k=3)
    generator = torch.Generator().manual_seed(1)
    first = proposer.propose(context, 2, params, generator, state)
    q1, q2 = first.q[0], first.q[1]
    vocab = q1.numel()
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    n = 3000
    for _ in range(n):
        tokens = proposer.propose(context, 2, params, generator, state).token_list()
        counts[tokens[0] * vocab + tokens[1]] += 1
    assert_counts_match(counts, torch.outer(q1, q2).flatten(), n, "joint law of drafts 1 and 2")


def test_the_cached_context_equals_a_fresh_one_after_a_rejection(target, prompts) -> None:
    drafter = make_dflash(target, block_size=5)
    cached = DFlashProposer(drafter)
    long = prompts[2] + [11, 12, 13, 14]
    cached.propose(long, 4, GREEDY, torch.Generator(), _state(target, long, cached.target_layers))
    rejected = prompts[2] + [11, 40]  # diverges from what the cache holds after two tokens
    for context in (rejected, rejected + [41, 42], prompts[2][:3]):
        fresh = DFlashProposer(drafter)
        state = _state(target, context, cached.target_layers)
        params = SamplingParams(temperature=1.0)
        got = cached.propose(context, 4, params, torch.Generator().manual_seed(3), state)
        want = fresh.propose(context, 4, params, torch.Generator().manual_seed(3), state)
        assert got.token_list() == want.token_list()
        torch.testing.assert_close(got.q, want.q, rtol=0, atol=1e-10)


def test_training_lowers_the_loss(trained) -> None:
    _, losses = trained
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:5]) / 5, losses


@pytest.mark.parametrize("gamma", [1, 3, 4, 6])
def test_greedy_equals_autoregressive_with_a_trained_drafter(gamma: int, target, prompts, trained) -> None:
    """Token for token, every prompt, γ below, at and above B − 1 = 4; drafts are accepted (so both the accept and
    the reject paths run) and each drafting round costs one drafter forward."""
    drafter, _ = trained
    proposer = DFlashProposer(drafter)
    accepted = rounds = 0
    for prompt in prompts:
        want = generate_autoregressive(target, prompt, 24, GREEDY, torch.Generator()).tokens
        before = proposer.drafter_calls
        got = generate_speculative(target, proposer, prompt, 24, gamma, GREEDY, torch.Generator())
        assert got.tokens == want
        assert proposer.drafter_calls - before == sum(1 for d in got.drafted_per_round if d)
        accepted += sum(got.accepted_per_round)
        rounds += len(got.accepted_per_round)
    assert accepted > 0 and accepted < rounds * min(gamma, 4)


def test_a_state_without_its_layers_is_refused(target, prompts) -> None:
    from pipeline.errors import DrafterError

    proposer = DFlashProposer(make_dflash(target))
    context = prompts[0]
    state = _state(target, context, (0,))
    with pytest.raises(DrafterError, match="lacks layers"):
        proposer.propose(context, 3, GREEDY, torch.Generator(), state)
