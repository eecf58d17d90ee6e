"""The DFlash proposer (pipeline/engine/dflash.py) on the engine fixtures' target: one drafter forward per round,
``q`` the exact law of what it samples (each block row on its own, so the drafts are independent given the context),
the cached context equal to a fresh computation after any rejection, greedy speculative decoding equal to greedy
autoregressive decoding with a trained drafter whose drafts are accepted, and a short training run that learns.
The same for a drafter with its own draft-vocabulary head (``head: draft``): its drafts are target ids of that
vocabulary, ``q`` is zero off it, and verification still emits the target's law (the rest through the residual)."""

from __future__ import annotations

import pytest
import torch

from pipeline.drafters.dflash import DFlashDrafter
from pipeline.engine.dflash import DFlashProposer
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState
from pipeline.engine.static import DecodeOptions
from pipeline.training.dflash_task import block_loss, draw_blocks, tapped_features
from tests.engine.conftest import (
    assert_acceptance_law,
    assert_counts_match,
    make_dflash,
    verify_blocks,
)

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


def train_dflash(target: torch.nn.Module, prompts: list[list[int]], *, steps: int = 60,
                 draft_ids: torch.Tensor | None = None) -> tuple[DFlashDrafter, list]:
    """A 1-layer, B = 5 DFlash drafter self-distilled from ``target`` on its continuations (float32, then float64);
    its held-out-free training losses. With ``draft_ids``, its own head over those target ids."""
    ids = _continuations(target, prompts, sampled=3, seed=0)
    drafter = make_dflash(target, block_size=5, draft_ids=draft_ids).float().train()
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


@pytest.fixture(scope="module")
def trained_draft_head(target, prompts, shortlist) -> tuple[DFlashDrafter, list]:
    """As ``trained``, with its own head over the engine fixtures' shortlist (121 of 300 ids)."""
    return train_dflash(target, prompts, draft_ids=shortlist)


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


def test_the_head_runs_over_the_whole_block_whatever_is_drafted(target, prompts) -> None:
    """One head shape a round (B rows, the first sliced off after), so the rows drafted are the same bits whether 2
    or all B − 1 are asked for."""
    drafter = make_dflash(target, block_size=6).float()
    proposer = DFlashProposer(drafter)
    context = prompts[0] + [5, 7]
    state = _state(target, context, proposer.target_layers)
    hidden = [h.float() for h in state.hidden]
    rows = []
    handle = drafter.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        every = proposer.block_logits(context, hidden, state)
        two = proposer.block_logits(context, hidden, state, drafts=2)
    finally:
        handle.remove()
    assert rows == [6, 6] and every.shape[0] == 5 and two.shape[0] == 2
    torch.testing.assert_close(two, every[:2], rtol=0, atol=0)


@pytest.mark.parametrize("head", ["target", "draft"])
def test_drafts_are_independent_draws_from_their_rows(head: str, target, prompts, shortlist) -> None:
    """3,000 proposals from one context (top-k 3, so each row has 3 outcomes and a pair 9): the joint counts of
    (draft 1, draft 2) match n · q1 ⊗ q2 outcome by outcome within a 6σ Bernstein bound (no pair of zero
    probability), i.e. each draft follows its own row whatever the other drew — the law verification assumes.
    With a draft-vocabulary head the counts are of target ids, against ``q`` in target-id space."""
    proposer = DFlashProposer(make_dflash(target, block_size=4, draft_ids=shortlist if head == "draft" else None))
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


def _rejected(result) -> int:  # noqa: ANN001
    """Rounds of ``result`` that rejected a draft (a round cut short by the length budget rejects nothing)."""
    return sum(a < d for a, d in zip(result.accepted_per_round, result.drafted_per_round, strict=True))


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("gamma", [1, 3, 4, 6])
def test_greedy_equals_autoregressive_with_a_trained_drafter(gamma: int, path: str, target, prompts, trained) -> None:
    """Token for token, every prompt, γ below, at and above B − 1 = 4, on the eager path and the static one (its
    static context cache through accepted and rejected drafts: the kit's tests run it with an untrained drafter,
    which accepts nothing); drafts are accepted and rejected, and each drafting round costs one drafter forward."""
    drafter, _ = trained
    proposer, options = DFlashProposer(drafter), DecodeOptions(path)
    accepted = rejected = 0
    for prompt in prompts:
        want = generate_autoregressive(target, prompt, 24, GREEDY, torch.Generator(), options=options).tokens
        before = proposer.drafter_calls
        got = generate_speculative(target, proposer, prompt, 24, gamma, GREEDY, torch.Generator(), options=options)
        assert got.tokens == want
        assert proposer.drafter_calls - before == sum(1 for d in got.drafted_per_round if d)
        accepted += sum(got.accepted_per_round)
        rejected += _rejected(got)
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_a_state_without_its_layers_is_refused(target, prompts) -> None:
    from pipeline.errors import DrafterError

    proposer = DFlashProposer(make_dflash(target))
    context = prompts[0]
    state = _state(target, context, (0,))
    with pytest.raises(DrafterError, match="lacks layers"):
        proposer.propose(context, 3, GREEDY, torch.Generator(), state)


def test_a_draft_vocabulary_head_drafts_its_ids_and_q_is_their_law(target, prompts, shortlist) -> None:
    """``q`` is the own head's standardised rows scattered onto the draft vocabulary's target ids (zero elsewhere, one
    in all), and the drafts are target ids of that vocabulary; the head starts as the target's rows of those ids."""
    drafter = make_dflash(target, block_size=6, draft_ids=shortlist)
    torch.testing.assert_close(drafter.lm_head.weight, target.get_output_embeddings().weight[shortlist], rtol=0, atol=0)
    proposer = DFlashProposer(drafter)
    context = prompts[0] + [5, 7]
    state = _state(target, context, proposer.target_layers)
    params = SamplingParams(temperature=1.0)
    vocab = target.config.vocab_size
    for seed in range(20):
        proposal = proposer.propose(context, 5, params, torch.Generator().manual_seed(seed), state)
        assert set(proposal.token_list()) <= set(shortlist.tolist())
    assert proposal.q.shape == (5, vocab)
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[shortlist] = False
    assert float(proposal.q[:, outside].abs().sum()) == 0.0
    hidden = torch.cat(list(state.hidden), dim=-1).unsqueeze(0)
    n = len(context) - 1
    out = drafter(drafter.block_ids(torch.tensor([context[-1]])), hidden, torch.arange(n, n + 6).unsqueeze(0),
                  torch.arange(n).unsqueeze(0))
    rows = standardise(drafter.logits(out[0, 1:]), params)
    assert rows.shape == (5, shortlist.numel())
    torch.testing.assert_close(proposal.q[:, shortlist], rows, rtol=0, atol=1e-12)
    torch.testing.assert_close(proposal.q.sum(-1), torch.ones(5, dtype=proposal.q.dtype), rtol=0, atol=1e-12)


def test_verify_level_output_law_with_a_draft_vocabulary_head(target, prompts, trained_draft_head, shortlist) -> None:
    """Speculative sampling with a real γ = 3 proposal of the trained draft-vocabulary drafter (temperature 1): p_i the
    target's law given the context and the first i drafts, q_i the proposal's rows (zero off the 121 draft ids). Over
    n = 200,000 blocks (x_i ~ q_i, verified by the loop's verify_speculative), the first two emitted tokens follow p_0
    and p_1 and the accepted count follows [1-a0, a0(1-a1), a0 a1 (1-a2), a0 a1 a2], a_i = Σ min(p_i, q_i) (Leviathan
    et al. 2023, Thm. 3.5); ids outside the draft vocabulary are emitted (through the residual). Bound per outcome:
    conftest.assert_counts_match (Bernstein at failure probability e^-18 per side, ~6σ; a π = 0 outcome never)."""
    drafter, _ = trained_draft_head
    params = SamplingParams(temperature=1.0)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[shortlist] = False
    continuation = generate_autoregressive(target, prompts[0], 30, GREEDY, torch.Generator()).tokens
    for k in range(0, 30, 3):  # the first context where every path of the verifier runs
        context = prompts[0] + continuation[:k]
        proposer = DFlashProposer(drafter)
        proposal = proposer.propose(context, 3, params, torch.Generator().manual_seed(k),
                                    _state(target, context, proposer.target_layers))
        drafts, q = proposal.token_list(), proposal.q
        with torch.no_grad():
            p = standardise(target(torch.tensor([context + drafts])).logits[0, len(context) - 1 :], params)
        a = torch.minimum(p[:3], q).sum(-1)
        if bool(((a > 0.05) & (a < 0.95)).all()) and bool((p[:2, outside].sum(-1) > 0.01).all()):
            break
    else:
        raise AssertionError("no context along the continuation exercises every path of the verifier")
    gen = torch.Generator().manual_seed(5)
    n = 200_000
    x, n_accepted, next_token = verify_blocks(p, q, n, gen)
    first = torch.where(n_accepted >= 1, x[:, 0], next_token)
    assert_counts_match(torch.bincount(first, minlength=p.shape[1]), p[0], n, "first emitted token")
    assert int(outside[first].sum()) > 0
    reached = n_accepted >= 1
    second = torch.where(n_accepted[reached] >= 2, x[reached, 1], next_token[reached])
    assert_counts_match(torch.bincount(second, minlength=p.shape[1]), p[1], int(reached.sum()), "second emitted token")
    assert_acceptance_law(p, q, n_accepted, n)


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("gamma", [1, 4, 6])
def test_greedy_equals_autoregressive_with_a_draft_vocabulary_head(gamma: int, path: str, target, prompts,
                                                                    trained_draft_head) -> None:
    """As for the target's head: token for token, every prompt, on both paths; some drafts accepted, some rejected;
    the training loss fell."""
    drafter, losses = trained_draft_head
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:5]) / 5, losses
    proposer, options = DFlashProposer(drafter), DecodeOptions(path)
    accepted = rejected = 0
    for prompt in prompts:
        want = generate_autoregressive(target, prompt, 24, GREEDY, torch.Generator(), options=options).tokens
        got = generate_speculative(target, proposer, prompt, 24, gamma, GREEDY, torch.Generator(), options=options)
        assert got.tokens == want
        accepted += sum(got.accepted_per_round)
        rejected += _rejected(got)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
