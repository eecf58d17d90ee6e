"""The decode loops with real Hugging Face models (fixtures in ``conftest.py``): greedy speculative
decoding reproduces greedy autoregressive decoding token for token, sampled speculative decoding has the
target's law, KV caches agree with no-cache recomputation, and bad inputs raise ``DrafterError``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline.engine.loop import first_rounds, generate_autoregressive, generate_speculative
from pipeline.engine.methods import build_proposer
from pipeline.engine.proposers import FullHeadProposer, Proposal, ShortlistProposer
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import ModelSession, TargetState
from pipeline.errors import DrafterError
from tests.engine.conftest import assert_counts_match, method_inputs
from tests.helpers import drafted

GREEDY = SamplingParams()
NEW_TOKENS = 32


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _Untranslatable:
    """Wraps a proposer and pretends ids divisible by 7 have no target id (Union-style ``-1`` drafts):
    their mass leaves ``q`` (rows become sub-stochastic), exactly as a cross-vocabulary drafter reports it."""

    target_layers: tuple[int, ...] = ()

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, "untranslatable"

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, *args: Any) -> Proposal:  # context, gamma, params, generator, state
        tokens, q = drafted(self.inner.propose(*args))
        q = q.clone()
        q[:, ::7] = 0.0
        return Proposal([-1 if t % 7 == 0 else t for t in tokens], q)


class _ExactMatch(_Untranslatable):
    """Wraps a proposer and hides its distributions (``q=None``), as SLEM does."""

    def propose(self, *args: Any) -> Proposal:
        return Proposal(self.inner.propose(*args).tokens, None)


class _Silent(_Untranslatable):
    """Wraps a proposer and drafts nothing in odd rounds (the first included), returning ``empty_q`` as q,
    as TLI, SLRS and EAGLE-3 do when the context gives the drafter nothing to start from."""

    def __init__(self, inner: Any, empty_q: torch.Tensor | None) -> None:
        super().__init__(inner)
        self.name, self.empty_q, self.rounds = "silent", empty_q, 0

    def reset(self) -> None:
        super().reset()
        self.rounds = 0

    def propose(self, *args: Any) -> Proposal:
        self.rounds += 1
        return Proposal([], self.empty_q) if self.rounds % 2 else self.inner.propose(*args)


class _Fixed(_Untranslatable):
    """Returns the same proposal every round."""

    def __init__(self, proposal: Proposal) -> None:
        self.name, self.proposal = "fixed", proposal

    def reset(self) -> None:
        pass

    def propose(self, *args: Any) -> Proposal:
        return self.proposal


def _proposer(
    kind: str, drafter: torch.nn.Module, tied_drafter: torch.nn.Module, shortlist: torch.Tensor
) -> Any:
    """``kind`` is a registered method, optionally prefixed ``tied_`` (the tied-head drafter), or a
    wrapper of the full-head method (``untranslatable``, ``exact``)."""
    wrapper = {"untranslatable": _Untranslatable, "exact": _ExactMatch}.get(kind)
    tied = kind.startswith("tied_")
    method = "full" if wrapper else kind.removeprefix("tied_")
    inputs = method_inputs(method, drafter=tied_drafter if tied else drafter, shortlist=shortlist)
    proposer = build_proposer(method, inputs)
    return wrapper(proposer) if wrapper else proposer


@pytest.fixture(scope="module")
def greedy_reference(target: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [
        generate_autoregressive(target, prompt, NEW_TOKENS, GREEDY, torch.Generator()).tokens
        for prompt in prompts
    ]


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize(
    "kind", ["full", "shortlist", "tied_full", "tied_shortlist", "untranslatable", "exact"]
)
def test_greedy_speculative_equals_autoregressive(
    kind: str, gamma: int, target, drafter, tied_drafter, shortlist, prompts, greedy_reference
) -> None:
    proposer = _proposer(kind, drafter, tied_drafter, shortlist)
    accepted = 0
    for prompt, reference in zip(prompts, greedy_reference, strict=True):
        result = generate_speculative(target, proposer, prompt, NEW_TOKENS, gamma, GREEDY, torch.Generator())
        assert result.tokens == reference
        assert len(result.tokens) == NEW_TOKENS and result.stop_reason == "length"
        assert result.target_forwards == 1 + len(result.accepted_per_round)  # the prompt's prefill, one a round
        assert sum(result.position_accepts) == sum(result.accepted_per_round)
        assert result.position_attempts[0] == sum(1 for d in result.drafted_per_round if d > 0)
        accepted += sum(result.accepted_per_round)
    if kind in ("full", "shortlist", "untranslatable", "exact"):
        assert accepted > 0, (
            "the layer-skip drafter should get some drafts accepted, or the accept path is untested"
        )


SETTINGS = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]
EMPTY_Q = {
    "rows_of_target_width": torch.zeros(0, 300, dtype=torch.float64),
    "narrower_rows": torch.zeros(0, 120, dtype=torch.float64),
    "one_dimensional": torch.zeros(0),
    "none": None,
}


@pytest.mark.parametrize("params", SETTINGS, ids=["greedy", "t1", "t0.7_p0.9"])
@pytest.mark.parametrize("empty_q", list(EMPTY_Q), ids=list(EMPTY_Q))
def test_rounds_without_drafts_sample_from_the_target(
    empty_q: str, params: SamplingParams, target, drafter, prompts, greedy_reference
) -> None:
    """Every other round drafts nothing, its q an empty tensor of any shape or None: the round emits one
    token of the target (the greedy output is still the autoregressive one) and the decode completes."""
    proposer = _Silent(FullHeadProposer(drafter), EMPTY_Q[empty_q])
    for prompt, reference in zip(prompts, greedy_reference, strict=True):
        result = generate_speculative(
            target, proposer, prompt, NEW_TOKENS, 3, params, torch.Generator().manual_seed(0)
        )
        assert len(result.tokens) == NEW_TOKENS and all(0 <= t < 300 for t in result.tokens)
        assert result.drafted_per_round[0::2] == [0] * len(result.drafted_per_round[0::2])
        assert result.accepted_per_round[0::2] == [0] * len(result.accepted_per_round[0::2])
        assert result.target_forwards == 1 + len(result.accepted_per_round) > 2  # the prefill, one a round
        if params.greedy:
            assert result.tokens == reference


def test_rounds_without_drafts_emit_the_targets_law(target, prompts) -> None:
    """Zero-draft first rounds after one prefill (``first_rounds``) at temperature 0.8, top-p 0.9: 1,000 first
    tokens within 6 sigma (Bernstein, ``conftest.assert_counts_match``) of 1000 * p, none outside the nucleus."""
    params, samples = SamplingParams(temperature=0.8, top_p=0.9), 1000
    p = _target_distribution(target, prompts[0], params)[-1]
    proposer = _Fixed(Proposal([], torch.zeros(0, 300, dtype=torch.float64)))
    counts = torch.zeros(300, dtype=torch.float64)
    for step in first_rounds(target, proposer, prompts[0], 2, params, torch.Generator().manual_seed(5), samples):
        assert step.drafted == 0
        counts[step.emitted[0]] += 1
    assert_counts_match(counts, p, samples, "first token after a zero-draft round")


@pytest.mark.parametrize(
    ("proposal", "found"),
    [
        (Proposal([5, 6], torch.full((1, 300), 1 / 300, dtype=torch.float64)), r"shape \(1, 300\)"),
        (Proposal([5], torch.full((300,), 1 / 300, dtype=torch.float64)), r"shape \(300,\)"),
        (Proposal([], torch.zeros(0, 301, dtype=torch.float64)), "301 columns"),
    ],
    ids=["fewer_rows_than_drafts", "one_dimensional_q_with_a_draft", "empty_but_too_wide"],
)
def test_proposals_whose_q_does_not_fit_are_refused(proposal: Proposal, found: str, target, prompts) -> None:
    params = SamplingParams(temperature=1.0)
    with pytest.raises(DrafterError, match=found):
        generate_speculative(target, _Fixed(proposal), prompts[0], 5, 2, params, torch.Generator())


def test_self_drafting_accepts_every_draft(target, prompts) -> None:
    """Drafter = target: greedy and temperature-1 rounds accept all drafts (p = q up to float64 round-off)."""
    gamma = 4
    for params in (GREEDY, SamplingParams(temperature=1.0)):
        result = generate_speculative(
            target, FullHeadProposer(target), prompts[0], 23, gamma, params, torch.Generator().manual_seed(0)
        )
        assert result.accepted_per_round == result.drafted_per_round
        assert result.drafted_per_round == [4, 4, 4, 4, 2]  # the last round is capped at the length budget
        # the prompt's prefill, then one forward a round: on the eager path too, where the first round ran the prompt
        # itself and its forward counted as a round's verify time (the decode bench's per-round figures held it)
        assert result.target_forwards == 1 + 5 and result.prefill_seconds > 0 and len(result.tokens) == 23


def test_eos_stops_and_truncates(target, drafter, prompts, greedy_reference) -> None:
    reference = greedy_reference[1]
    eos = reference[10]
    cut = reference.index(eos) + 1
    for gamma in (3, 5):
        result = generate_speculative(
            target, FullHeadProposer(drafter), prompts[1], NEW_TOKENS, gamma, GREEDY, torch.Generator(), eos
        )
        assert result.tokens == reference[:cut] and result.stop_reason == "eos"
    baseline = generate_autoregressive(target, prompts[1], NEW_TOKENS, GREEDY, torch.Generator(), [eos, -5])
    assert baseline.tokens == reference[:cut] and baseline.stop_reason == "eos"


def test_drafts_after_an_accepted_eos_count_neither_as_drafted_nor_accepted(target, prompts, greedy_reference) -> None:
    """The target drafting for itself (every draft accepted, γ = 4: rounds emit tokens 0-4, 5-9, …) with EOS = a token
    the second round drafts after its first position (the reference's token j, 6 ≤ j ≤ 8, at its first occurrence):
    the round keeps j - 4 tokens. Its 4 accepted drafts used to count, so α and the per-position acceptance said 4 of
    4 while τ counted the kept tokens."""
    reference = greedy_reference[0]
    (j, *_) = [j for j in (6, 7, 8) if reference.index(reference[j]) == j] or [None]
    assert j is not None, f"no token first seen at 6..8 in {reference[:10]}: pick another prompt"
    result = generate_speculative(target, FullHeadProposer(target), prompts[0], NEW_TOKENS, 4, GREEDY,
                                  torch.Generator(), reference[j])
    kept = j - 4
    assert result.tokens == reference[: j + 1] and result.stop_reason == "eos"
    assert result.accepted_per_round == [4, kept] and result.drafted_per_round == [4, kept]
    assert result.position_attempts == [2] * kept + [1] * (4 - kept) == result.position_accepts


@pytest.mark.parametrize("gamma", [0, -2])
def test_non_positive_gamma_is_refused(gamma: int, target, drafter, prompts) -> None:
    with pytest.raises(DrafterError, match="gamma"):
        generate_speculative(
            target, FullHeadProposer(drafter), prompts[0], 5, gamma, GREEDY, torch.Generator()
        )


def test_empty_prompt_is_refused(target) -> None:
    with pytest.raises(DrafterError, match="empty prompt"):
        generate_autoregressive(target, [], 5, GREEDY, torch.Generator())


def _target_distribution(target: torch.nn.Module, ids: list[int], params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        return standardise(target(torch.tensor([ids])).logits[0], params)


def _first_token_counts(kind: str, params: SamplingParams, samples: int, fixtures: tuple) -> tuple:
    target, drafter, tied_drafter, shortlist, prompt = fixtures
    proposer = _proposer(kind, drafter, tied_drafter, shortlist)
    counts = torch.zeros(target.config.vocab_size, dtype=torch.float64)
    rejected = 0
    # the loop's first round, repeated after one prefill (first_rounds; that it is the loop's first round, draw for
    # draw, is test_every_method.py::test_first_rounds_repeat_the_loops_first_round_after_one_prefill)
    for step in first_rounds(target, proposer, prompt, 2, params, torch.Generator().manual_seed(42), samples):
        counts[step.emitted[0]] += 1
        rejected += step.accepted == 0
    return counts, rejected


@pytest.mark.parametrize(
    ("kind", "params", "samples"),
    [
        ("shortlist", SamplingParams(temperature=1.0), 2000),
        ("untranslatable", SamplingParams(temperature=1.0, top_k=8), 1000),
        ("exact", SamplingParams(temperature=0.8, top_p=0.9), 1000),
    ],
)
def test_first_token_law_matches_target(
    kind: str, params: SamplingParams, samples: int, target, drafter, tied_drafter, shortlist, prompts
) -> None:
    """Repeated first rounds of speculation (gamma = 2) at a fixed context, after one prefill (``first_rounds``): each
    token's count of first emissions is within 6 sigma (Bernstein, ``conftest.assert_counts_match``) of
    samples * p, and tokens the target's top-k / top-p removed never appear. Sample sizes (1,000-2,000)
    are in the parametrisation. The verifier's own law is tested at n = 200,000 in test_verify.py and in the
    proposer tests."""
    prompt = prompts[2]
    p = _target_distribution(target, prompt, params)[-1]
    counts, rejected = _first_token_counts(
        kind, params, samples, (target, drafter, tied_drafter, shortlist, prompt)
    )
    assert_counts_match(counts, p, samples, f"first token ({kind})")
    assert 0 < rejected < samples  # both the accept and the residual paths produced first tokens


def test_target_cache_matches_recompute(target, prompts) -> None:
    """Prefill, score drafts, crop to a partial acceptance, score again: every row equals a no-cache
    forward over the same sequence (float64, tolerance 1e-10)."""
    params = SamplingParams(temperature=1.0)
    model = ModelSession(target)
    sequence = list(prompts[0])
    drafts = [5, 17, 42, 99]
    p = standardise(model.feed(sequence + drafts, len(drafts) + 1), params)
    full = _target_distribution(target, sequence + drafts, params)
    torch.testing.assert_close(p, full[-len(drafts) - 1 :], rtol=0, atol=1e-10)
    model.crop(len(sequence) + 2)  # two drafts accepted, then a corrected token 7
    sequence += drafts[:2] + [7]
    p = standardise(model.move_to(sequence + [8, 9], 3), params)
    full = _target_distribution(target, sequence + [8, 9], params)
    torch.testing.assert_close(p, full[-3:], rtol=0, atol=1e-10)
    assert model.cache.get_seq_length() == len(sequence) + 2 and model.ids == sequence + [8, 9]


@pytest.mark.parametrize("kind", ["full", "shortlist"])
def test_proposer_cache_matches_recompute(kind: str, drafter, tied_drafter, shortlist, prompts) -> None:
    """A proposer that re-syncs by common prefix (including a diverged context) returns the same q rows
    as a no-cache forward of the drafter over context + earlier drafts (float64, tolerance 1e-10)."""
    params = SamplingParams(temperature=1.0)
    proposer = _proposer(kind, drafter, tied_drafter, shortlist)
    generator = torch.Generator().manual_seed(3)
    contexts = [prompts[1], prompts[1] + [4, 5, 6], prompts[1][:6] + [11, 12], prompts[1][:6] + [11, 12, 13]]
    for context in contexts:
        tokens, q = drafted(proposer.propose(context, 3, params, generator, TargetState()))
        for i, token in enumerate(tokens):
            with torch.no_grad():
                logits = drafter(torch.tensor([context + tokens[:i]])).logits[0, -1]
            if kind == "shortlist":
                expected = torch.zeros(logits.shape[-1], dtype=torch.float64)
                expected[shortlist] = standardise(logits[shortlist], params)
                assert token in set(shortlist.tolist())
            else:
                expected = standardise(logits, params)
            torch.testing.assert_close(q[i], expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("kind", ["full", "shortlist"])
def test_drafted_tokens_follow_q(kind: str, drafter, tied_drafter, shortlist, prompts) -> None:
    """n = 2,000 γ = 1 proposals of the plain draft loop (the full head, and FR-Spec's shortlist head) from one
    context at temperature 1: every call reports the same q row, and the drafted-token counts match it within the
    Bernstein bound of ``conftest.assert_counts_match`` (|count − n·q| ≤ 6 + 6·sqrt(1 + n·q·(1 − q)) per token,
    e^-18 per side), none where q = 0. Nothing compared q with what this loop drafts: a loop sampling from probs**1.3
    passed every test; at this context the normal approximation leaves it under 1e-8 to pass this one."""
    proposer = _proposer(kind, drafter, tied_drafter, shortlist)
    context = prompts[2]
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    n = 2000
    counts = torch.zeros(drafter.config.vocab_size)
    q0 = None
    for _ in range(n):
        tokens, q = drafted(proposer.propose(context, 1, params, gen, TargetState()))
        q0 = q[0] if q0 is None else q0
        torch.testing.assert_close(q[0], q0, rtol=0, atol=0)  # the same context, the same law
        counts[tokens[0]] += 1
    assert int((q0 > 0).sum()) > 1  # a law with a choice to make
    assert_counts_match(counts, q0, n, f"{kind} drafts")


def test_shortlist_validation(drafter, tokenizer, prompts) -> None:
    for bad, message in (
        (torch.tensor([], dtype=torch.long), "shortlist is empty"),
        (torch.tensor([1, 2, 300]), "ids outside the vocabulary"),
        (torch.tensor([3, 4, 3]), "repeats token ids"),
    ):
        with pytest.raises(DrafterError, match=message):
            ShortlistProposer(drafter, bad)
    eos = tokenizer.eos_token_id
    ShortlistProposer.check(torch.tensor([eos, *prompts[0]]), tokenizer, prompts[:1])
    with pytest.raises(DrafterError, match="end-of-sequence"):
        ShortlistProposer.check(torch.tensor([2, 3, 4]), tokenizer)
    with pytest.raises(DrafterError, match="shares no token"):
        ShortlistProposer.check(torch.tensor([eos, 299]), tokenizer, [[5, 6, 7]])
    # an end-of-turn id the decodes stop at (a generation config's, beside the tokenizer's EOS) must be there too
    with pytest.raises(DrafterError, match=r"end-of-turn token\n.*\n  found:    missing \[299\]"):
        ShortlistProposer.check(torch.tensor([eos, *prompts[0]]), tokenizer, prompts[:1], stop=[eos, 299])
    ShortlistProposer.check(torch.tensor([eos, 299, *prompts[0]]), tokenizer, prompts[:1], stop=[eos, 299])


def test_full_head_maps_ids_beyond_target_vocabulary(drafter, prompts) -> None:
    """A drafter wider than the target: ids >= target width become -1 and q is cut to the target width."""
    proposer = FullHeadProposer(drafter, target_vocab_size=150)
    generator = torch.Generator().manual_seed(0)
    tokens, q = drafted(proposer.propose(prompts[0], 5, SamplingParams(temperature=1.0), generator, TargetState()))
    assert q.shape == (5, 150)
    assert all(t == -1 or 0 <= t < 150 for t in tokens)
    assert bool((q.sum(-1) < 1).all())
