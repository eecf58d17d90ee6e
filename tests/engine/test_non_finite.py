"""Laws that are not laws: a target whose logits overflow (NaN or infinity) and a drafter whose distribution does.

The sampler's round-off guard gave ``-1`` for a row with no positive entry (a NaN row, an all-zero residual of NaNs),
and the loops reported it as a generated token: exit 0 where the target alone was broken, and, where only the drafter
was, the next verify forward died in the embedding (an IndexError here, a device-side assert on a GPU). The zero-q
checks read ``q(x) <= 0``, which a NaN passes. Now no draw leaves the vocabulary, and a generation whose target
logits or draft distributions were not finite ends in a :class:`DrafterError` that says which.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.proposers import FullHeadProposer, Proposal
from pipeline.engine.sampling import SamplingParams, sample
from pipeline.engine.static import DecodeOptions
from pipeline.engine.verify import verify_speculative
from pipeline.errors import DrafterError

SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _OnTheHost:
    """Hands the inner proposer's drafts over as host ids (the host round), as the string-level methods do."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, "host"

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, *args: Any) -> Proposal:
        proposal = self.inner.propose(*args)
        return Proposal(proposal.token_list(), proposal.q)


def _poisoned(model: torch.nn.Module, value: float, row: int = 3) -> torch.nn.Module:
    """A copy of ``model`` whose LM head row ``row`` is ``value``: every logit row then holds it."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.get_output_embeddings().weight[row] = value
    return broken


def test_a_row_with_no_positive_entry_never_draws_an_id_outside_the_vocabulary() -> None:
    generator = torch.Generator().manual_seed(0)
    for row in (torch.full((5,), float("nan")), torch.zeros(5), torch.tensor([0.2, float("nan"), 0.3, 0.0, 0.5])):
        drawn = sample(row.to(torch.float64).expand(64, 5), generator)
        assert bool(((drawn >= 0) & (drawn < 5)).all()), drawn


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_a_target_whose_logits_are_not_finite_is_refused_by_both_loops(
        target: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]], value: float,
        params: SamplingParams) -> None:
    broken = _poisoned(target, value)
    prompt = prompts[0]
    match = r"target's logits are not finite"
    with pytest.raises(DrafterError, match=match):
        generate_autoregressive(broken, prompt, 4, params, torch.Generator().manual_seed(0))
    for proposer in (FullHeadProposer(drafter), _OnTheHost(FullHeadProposer(drafter))):
        for path in ("eager", "static"):
            with pytest.raises(DrafterError, match=match):
                generate_speculative(broken, proposer, prompt, 6, 3, params, torch.Generator().manual_seed(0),
                                     options=DecodeOptions(path=path))
    # the same target healthy: no error on any path
    generate_autoregressive(target, prompt, 4, params, torch.Generator().manual_seed(0))


def test_a_drafter_whose_distribution_is_not_finite_is_refused_where_it_was_silent_or_an_index_error(
        target: torch.nn.Module, drafter: torch.nn.Module, prompts: list[list[int]]) -> None:
    """A healthy target, a drafter whose head overflowed: its q is NaN everywhere, which the zero-q checks let
    through; the target's residual became NaN and the emitted token -1."""
    broken = _poisoned(drafter, float("nan"))
    for proposer in (FullHeadProposer(broken), _OnTheHost(FullHeadProposer(broken))):
        for seed in range(3):
            with pytest.raises(DrafterError, match=r"zero or non-finite draft probability"):
                generate_speculative(target, proposer, prompts[0], 8, 3, SAMPLED, torch.Generator().manual_seed(seed))
    # greedy drafting from NaN logits still drafts one-hot rows: verification is exact match, the output the target's
    greedy = generate_speculative(target, FullHeadProposer(broken), prompts[0], 8, 3, GREEDY, torch.Generator())
    assert greedy.tokens == generate_autoregressive(target, prompts[0], 8, GREEDY, torch.Generator()).tokens


def test_verify_refuses_a_draft_law_or_a_target_law_that_is_not_finite() -> None:
    p = torch.softmax(torch.randn(2, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64), -1)
    nan = torch.full((1, 4), float("nan"), dtype=torch.float64)
    with pytest.raises(DrafterError, match=r"zero or non-finite draft probability"):
        verify_speculative(p, nan, [2], torch.Generator().manual_seed(0))
    half = p[:1].clone()
    half[0, 0] = float("nan")  # q(x) is fine at the drafted token, NaN elsewhere: the residual would be NaN
    with pytest.raises(DrafterError, match=r"zero or non-finite draft probability"):
        verify_speculative(p, half, [2], torch.Generator().manual_seed(0))
    with pytest.raises(DrafterError, match=r"target's logits are not finite"):
        verify_speculative(torch.full_like(p, float("nan")), p[:1], [2], torch.Generator().manual_seed(0))
