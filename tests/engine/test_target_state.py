"""The target state the speculative loop hands proposers (``TargetState``), on the trained tiny kit.

A recording proposer wraps each registered method's real proposer, asks for the target's hidden states
at layers (0, 1, -1), and keeps what it receives every round. Each recorded state must equal what a
fresh, uncached forward of the target over the accepted prefix (every context token but the newest)
gives: the hidden states at those layers for every position, and the standardised distribution at the
last one. Sampling at temperature 1 with a fixed seed makes drafts get rejected, so the loop's crops of
the KV cache and of the captured states are exercised (the test asserts rejections happened).

Tolerance: the models run in float64. Layer 0 (the embedding output) is a table lookup and must match
bit for bit. Deeper layers are computed incrementally in the loop (prefill, then one verify forward per
round over the cached keys/values) but in one batched forward here; the matmuls have different shapes,
so they may round differently in the last bits. They must agree to ``atol = 1e-10`` (float64 round-off
is ~1e-16 relative; any real error such as a stale or misaligned row is of order 1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Generator

from pipeline.engine.inputs import SameTokenizerInputs, ShortlistInputs
from pipeline.engine.loop import generate_speculative
from pipeline.engine.methods import METHOD_NAMES, build_proposer
from pipeline.engine.proposers import Proposal
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import TargetState
from pipeline.errors import DrafterError
from tests.engine.conftest import kit_proposer_inputs

LAYERS = (0, 1, -1)
PARAMS = SamplingParams(temperature=1.0)
TEXTS = ["def add(a, b):\n    return", "The weather today is"]


class _Recording:
    """Wraps a proposer, asks for :data:`LAYERS` (then any other layers the proposer reads itself, as
    EAGLE-3 does), and keeps a copy of each (context, state) it gets."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, inner.name
        self.target_layers = LAYERS + tuple(layer for layer in inner.target_layers if layer not in LAYERS)
        self.rounds: list[tuple[list[int], TargetState]] = []

    def reset(self) -> None:
        self.inner.reset()

    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        # The hidden tensors are views into buffers the loop reuses: keep copies.
        hidden = tuple(h.clone() for h in state.hidden)
        last_p = None if state.last_p is None else state.last_p.clone()
        self.rounds.append((list(context), TargetState(state.layers, hidden, last_p, state.length)))
        return self.inner.propose(context, gamma, params, generator, state)


def _check_state(target: torch.nn.Module, context: list[int], state: TargetState) -> None:
    prefix = context[:-1]
    assert state.layers[: len(LAYERS)] == LAYERS and state.length == len(prefix)
    if not prefix:
        assert all(h.shape[0] == 0 for h in state.hidden)
        return
    with torch.no_grad():
        out = target(torch.tensor([prefix]), output_hidden_states=True)
    for layer, got in zip(state.layers, state.hidden, strict=True):
        want = out.hidden_states[layer][0]
        assert got.shape == want.shape, (layer, got.shape, want.shape)
        if layer == 0:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_proposers_receive_the_targets_state(method: str, kit) -> None:
    """Two prompts x 40 tokens at gamma = 4 (temperature 1, seed 0): every round's state matches an
    uncached target forward over the accepted prefix, and last_p is its standardised last row (None
    only on the first round, before the target has emitted anything)."""
    target, target_tok = kit["target"]
    proposer = _Recording(build_proposer(method, kit_proposer_inputs(kit)[method]))
    generator = torch.Generator().manual_seed(0)
    rejections = rounds_checked = 0
    for text in TEXTS:
        prompt = target_tok(text).input_ids
        proposer.rounds.clear()
        result = generate_speculative(target, proposer, prompt, 40, 4, PARAMS, generator)
        rejections += sum(a < d for a, d in zip(result.accepted_per_round, result.drafted_per_round))
        # One prefill (the prompt minus its newest token) plus one verify forward per round.
        assert result.target_forwards == len(result.accepted_per_round) + 1
        for index, (context, state) in enumerate(proposer.rounds):
            assert context[: len(prompt)] == prompt
            _check_state(target, context, state)
            if index == 0:
                assert state.last_p is None and context == prompt
            else:
                with torch.no_grad():
                    logits = target(torch.tensor([context[:-1]])).logits[0, -1]
                torch.testing.assert_close(state.last_p, standardise(logits, PARAMS), rtol=0, atol=1e-10)
            rounds_checked += 1
    assert rounds_checked >= 10
    assert rejections > 0, "no draft was rejected, so the crop of the captured states went untested"


def test_one_token_prompt_starts_with_an_empty_state(kit) -> None:
    """No prefill for a one-token prompt: the first state covers nothing, the next ones match."""
    target, target_tok = kit["target"]
    proposer = _Recording(build_proposer("full", kit_proposer_inputs(kit)["full"]))
    generator = torch.Generator().manual_seed(1)
    result = generate_speculative(target, proposer, [target_tok.bos_token_id], 12, 3, PARAMS, generator)
    assert result.target_forwards == len(result.accepted_per_round)
    assert proposer.rounds[0][1].length == 0
    for context, state in proposer.rounds:
        _check_state(target, context, state)


def test_layers_the_target_lacks_are_refused(kit) -> None:
    target, target_tok = kit["target"]
    proposer = _Recording(build_proposer("full", kit_proposer_inputs(kit)["full"]))
    depth = target.config.num_hidden_layers + 1
    proposer.target_layers = (0, depth)
    with pytest.raises(DrafterError, match="layers the target does not have"):
        generate_speculative(target, proposer, target_tok("a b").input_ids, 4, 2, PARAMS, torch.Generator())


def test_unknown_method_is_refused_naming_the_valid_ones(kit) -> None:
    with pytest.raises(DrafterError, match=r"(?s)unknown draft method .eagle.*full.*shortlist"):
        build_proposer("eagle", SameTokenizerInputs(kit["drafter"][0]))
    with pytest.raises(DrafterError, match=r"(?s)missing inputs.*\['shortlist'\]"):
        build_proposer("shortlist", ShortlistInputs(kit["drafter"][0], None))
    with pytest.raises(DrafterError, match="'shortlist' is built from ShortlistInputs, not SameTokenizerInputs"):
        build_proposer("shortlist", SameTokenizerInputs(kit["drafter"][0]))
