"""EAGLE-3 test support shared by the CPU tests (test_eagle3_proposer.py) and the CUDA tests (test_cuda.py): a head
trained on the engine fixtures' target, the law a proposal must report recomputed without any cache, and the
decode checks run on whatever device the target is on."""

from __future__ import annotations

from typing import Any

import torch
from torch import Generator, Tensor

from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.engine.eagle3 import Eagle3Proposer
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.proposers import Proposal
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState
from pipeline.training.eagle3_objective import target_features, ttt_loss
from pipeline.vocab.counting import eagle3_offset_maps
from tests.helpers import drafted

GREEDY = SamplingParams()
DRAFT_VOCAB = 150
SEQUENCE = 48  # tokens per training sequence, prompt included


# --- building and training a drafter ---------------------------------------------------------------


def make_drafter(target: torch.nn.Module, draft_ids: Tensor, seed: int = 0) -> Eagle3Drafter:
    """A float64 EAGLE-3 head for ``target`` on its device, drafting over the target ids ``draft_ids``."""
    config = Eagle3Config.from_target(target.config, draft_vocab_size=int(draft_ids.numel()))
    embedding = target.get_input_embeddings()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = Eagle3Drafter(config, embedding)
    drafter = drafter.to(device=embedding.weight.device, dtype=torch.float64)
    drafter.set_vocab_maps(*eagle3_offset_maps(draft_ids.cpu().numpy(), config.target_vocab_size))
    return drafter.eval()


@torch.no_grad()
def _continuations(target: torch.nn.Module, prompts: list[list[int]], sampled: int, seed: int) -> Tensor:
    """Per prompt, its greedy continuation and ``sampled`` temperature-1 ones, all :data:`SEQUENCE` long."""
    device = target.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt] * (1 + sampled), device=device)
        while ids.shape[1] < SEQUENCE:
            logits = target(ids).logits[:, -1]
            nxt = sample(standardise(logits, SamplingParams(temperature=1.0)), gen)
            nxt[0] = logits[0].argmax()
            ids = torch.cat([ids, nxt[:, None]], dim=1)
        rows.append(ids)
    return torch.cat(rows)


def train_drafter(
    target: torch.nn.Module, prompts: list[list[int]], *, steps: int = 80, seed: int = 0
) -> Eagle3Drafter:
    """Self-distil an EAGLE-3 head from ``target`` (EAGLE-3 §3.2) on its continuations of ``prompts``.

    The draft vocabulary is the :data:`DRAFT_VOCAB` most frequent ids of the training sequences (a strict
    subset). Trained in float32 (twice as fast), returned in float64.
    """
    ids = _continuations(target, prompts, sampled=3, seed=seed)
    vocab = int(target.config.vocab_size)
    counts = torch.bincount(ids.flatten().cpu(), minlength=vocab)
    order = torch.sort(counts, descending=True, stable=True).indices
    drafter = make_drafter(target, order[:DRAFT_VOCAB].sort().values, seed)
    hidden, logits = target_features(target, ids, None, drafter.config.aux_layer_ids)
    drafter.float().train()
    optimiser = torch.optim.Adam(drafter.parameters(), lr=6e-3)
    mask = torch.ones_like(ids)
    for _ in range(steps):
        result = ttt_loss(drafter, ids, mask, hidden.float(), logits.float(), steps=2)
        optimiser.zero_grad()
        result.loss.backward()
        optimiser.step()
    return drafter.double().eval()


# --- the law a proposal must report, recomputed without any cache ------------------------------------


@torch.no_grad()
def fresh_state(target: torch.nn.Module, context: list[int], layers: tuple[int, ...]) -> TargetState:
    """The target's state for ``context`` from one uncached forward over every position but the newest."""
    prefix = context[:-1]
    device = target.get_input_embeddings().weight.device
    if not prefix:
        width = target.config.hidden_size
        empty = torch.zeros(0, width, dtype=torch.float64, device=device)
        return TargetState(layers, tuple(empty for _ in layers), None, 0)
    out = target(torch.tensor([prefix], device=device), output_hidden_states=True)
    return TargetState(layers, tuple(out.hidden_states[layer][0] for layer in layers), None, len(prefix))


@torch.no_grad()
def law_from_scratch(
    target: torch.nn.Module, drafter: Eagle3Drafter, context: list[int], drafts: list[int], params: SamplingParams
) -> Tensor:
    """``(len(drafts), V)``: the law of each draft given ``context`` and the drafts before it, from an
    uncached target forward and uncached drafter steps over the whole prefix (rows ``t``: token
    ``x_{t+1}`` with fused feature ``f_t``; then each draft with the previous row's output)."""
    state = fresh_state(target, context, drafter.config.aux_layer_ids)
    features = drafter.fc(torch.cat(state.hidden, dim=-1))
    draft_ids = drafter.draft_to_target
    rows = []
    for i in range(len(drafts)):
        ids = torch.tensor([context[1:] + drafts[:i]], device=features.device)
        last = drafter.step(ids, features[None])[0, -1]
        law = standardise(drafter.logits(last), params)
        q = torch.zeros(int(target.config.vocab_size), dtype=torch.float64, device=features.device)
        rows.append(q.index_copy(0, draft_ids, law))
        features = torch.cat([features, last[None]])
    return torch.stack(rows)


class Recording:
    """Wraps a proposer and keeps each round's context, sampling parameters and proposal.

    With ``shadow`` set, each round first asks the proposer with those parameters (recorded, then
    discarded) and then with the loop's (recorded and returned): the loop's parameters decide which
    drafts get accepted, hence how the proposer's cache is cropped and re-synced, while the shadow
    proposals give a sharp law to check at every cache state that produced.
    """

    def __init__(self, inner: Eagle3Proposer, shadow: SamplingParams | None = None) -> None:
        self.inner, self.name, self.target_layers = inner, inner.name, inner.target_layers
        self.shadow = shadow
        self.generator = torch.Generator().manual_seed(99)
        self.rounds: list[tuple[list[int], SamplingParams, tuple[list[int], torch.Tensor]]] = []

    def reset(self) -> None:
        self.inner.reset()

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        if self.shadow is not None:
            shadow = self.inner.propose(context, gamma, self.shadow, self.generator, state)
            self.rounds.append((list(context), self.shadow, drafted(shadow)))
        proposal = self.inner.propose(context, gamma, params, generator, state)
        self.rounds.append((list(context), params, drafted(proposal)))  # host ids for the checks
        return proposal


def _accepts_and_rejects(results: list[Any]) -> tuple[int, int]:
    accepted = sum(sum(r.accepted_per_round) for r in results)
    rejected = sum(sum(a < d for a, d in zip(r.accepted_per_round, r.drafted_per_round)) for r in results)
    return accepted, rejected


def check_on_device(target: torch.nn.Module, prompts: list[list[int]]) -> None:
    """The decode checks on whatever device ``target`` is on (``test_cuda.py`` runs them on a GPU): a head
    trained there drafts with q on that device in float64; greedy speculative output equals the
    autoregressive one for gamma 1, 3 and 5, with drafts accepted and rejected; a sampled generation's
    q rows equal the law recomputed from scratch (atol 1e-9)."""
    device = target.get_input_embeddings().weight.device
    eagle3 = train_drafter(target, prompts)
    assert eagle3.fc.weight.device == device
    results = []
    for gamma in (1, 3, 5):
        for prompt in prompts:
            gen = torch.Generator(device=device).manual_seed(0)
            ar = generate_autoregressive(target, prompt, 32, GREEDY, gen)
            spec = generate_speculative(target, Eagle3Proposer(eagle3), prompt, 32, gamma, GREEDY, gen)
            assert spec.tokens == ar.tokens, (prompt, gamma)
            results.append(spec)
    accepted, rejected = _accepts_and_rejects(results)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95)
    recording = Recording(Eagle3Proposer(eagle3), shadow=params)
    gen = torch.Generator(device=device).manual_seed(1)
    generate_speculative(target, recording, prompts[0], 32, 4, GREEDY, gen)
    for context, round_params, (tokens, q) in recording.rounds:
        assert q.device == device and q.dtype == torch.float64
        scratch = law_from_scratch(target, eagle3, context, tokens, round_params)
        torch.testing.assert_close(q, scratch, rtol=0, atol=1e-9)


# --- tests -----------------------------------------------------------------------------------------
