"""The EAGLE-3 proposer (pipeline.engine.eagle3) in the lossless decode loop, with a real target and a
really trained EAGLE-3 head.

Target: the random float64 4-layer ``LlamaForCausalLM`` of ``conftest.py`` (features at its default
``aux_layer_ids`` (1, 2, 3)). Drafter: an :class:`Eagle3Drafter` over the target's embedding whose draft
vocabulary is a strict subset of the target's (the 150 most frequent of 300 ids in its training data), so
target mass outside it, reachable only through the verifier's residual, is exercised. A random head
almost never agrees with the target, so the fixture trains it for a few seconds the way EAGLE-3 is
trained (Li et al. 2025, §3.2: the training-time test, :func:`ttt_loss`, on the target's own features and
logits) on the target's greedy and sampled continuations of the test prompts: self-distillation, in
which the head partly memorises those continuations. Both accepted and rejected drafts then occur in
every decode test, and the tests assert that they did. Its quality is beside the point: every
property checked here (q is the law the drafts were drawn from, greedy output equals the target's,
the output law is the target's) must hold for any head.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from pipeline.drafters.eagle3 import Eagle3Drafter
from pipeline.engine.eagle3 import Eagle3Proposer
from pipeline.engine.inputs import FeatureInputs, SameTokenizerInputs
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.methods import build_proposer
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import TargetState
from pipeline.engine.static import DecodeOptions
from pipeline.errors import DrafterError
from tests.engine.conftest import assert_acceptance_law, assert_counts_match, verify_blocks
from tests.engine.eagle3_support import (
    GREEDY,
    Recording,
    _accepts_and_rejects,
    fresh_state,
    law_from_scratch,
    train_drafter,
)
from tests.helpers import drafted

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def eagle3(target: torch.nn.Module, prompts: list[list[int]]) -> Eagle3Drafter:
    """The trained head (about 5 s on one thread)."""
    torch.set_num_threads(1)
    return train_drafter(target, prompts)


def test_q_is_the_drafters_law_from_scratch(target, eagle3, prompts) -> None:
    """Every q row equals the law recomputed from scratch (atol 1e-9, float64; drafts only where q > 0):
    over two sampled generations (temperature 0.7, top-k 40, top-p 0.95; gamma 4), over a greedy one
    (gamma 5, deep accepts) whose rounds are each also asked with those sampling parameters first
    (:class:`Recording` ``shadow``), and after re-syncing the cache by hand to a rewound and to a
    diverging context. After every call only target rows stay cached (the draft rows are cropped)."""
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.95)
    sampled = Recording(Eagle3Proposer(eagle3))
    gen = torch.Generator().manual_seed(0)
    results = [generate_speculative(target, sampled, p, 40, 4, params, gen) for p in prompts[:2]]
    greedy = Recording(Eagle3Proposer(eagle3), shadow=params)
    results.append(generate_speculative(target, greedy, prompts[2], 40, 5, GREEDY, gen))
    accepted, rejected = _accepts_and_rejects(results)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert max(results[-1].accepted_per_round) >= 2  # crops deep into a proposal happened
    rounds = sampled.rounds + greedy.rounds
    assert len(rounds) >= 40
    for context, round_params, (tokens, q) in rounds:
        assert q.dtype == torch.float64 and q.shape == (len(tokens), target.config.vocab_size)
        assert all(q[i, t] > 0 for i, t in enumerate(tokens))
        scratch = law_from_scratch(target, eagle3, context, tokens, round_params)
        torch.testing.assert_close(q, scratch, rtol=0, atol=1e-9)
    inner = greedy.inner
    last = greedy.rounds[-1][0]
    for context in (last[: len(last) - 7], last[:5] + prompts[0][1:], last):
        tokens, q = drafted(inner.propose(context, 3, params, gen, fresh_state(target, context, inner.target_layers)))
        assert inner.cache.length == len(context) - 1  # target rows only: the draft rows were cropped
        torch.testing.assert_close(q, law_from_scratch(target, eagle3, context, tokens, params), rtol=0, atol=1e-9)


def test_each_target_row_is_computed_once(target, eagle3, prompts) -> None:
    """No per-round recompute of the prefix: across a generation, ``fc`` (which only target rows go
    through) sees each target position exactly once."""
    fused: list[int] = []
    handle = eagle3.fc.register_forward_hook(lambda _m, args, _out: fused.append(args[0].shape[1]))
    try:
        proposer = Recording(Eagle3Proposer(eagle3))
        generate_speculative(target, proposer, prompts[0], 30, 4, GREEDY, torch.Generator())
    finally:
        handle.remove()
    assert len(fused) == len(proposer.rounds) and min(fused) >= 1
    assert sum(fused) == len(proposer.rounds[-1][0]) - 1


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_equals_autoregressive(target, eagle3, prompts, gamma: int, path: str) -> None:
    """Every prompt, 40 new tokens: greedy speculative decoding emits the autoregressive tokens exactly,
    with some drafts accepted and some rejected, on the eager path and on the static one (its head's static
    buffers and the target's static cache through commits after accepted drafts and rollbacks after rejected
    ones: the kit's tests run it with an untrained head, which accepts nothing)."""
    options = DecodeOptions(path)
    proposer = Eagle3Proposer(eagle3)
    results = []
    for prompt in prompts:
        ar = generate_autoregressive(target, prompt, 40, GREEDY, torch.Generator(), options=options)
        spec = generate_speculative(target, proposer, prompt, 40, gamma, GREEDY, torch.Generator(), options=options)
        assert spec.tokens == ar.tokens, (prompt, gamma)
        assert spec.target_forwards == len(spec.accepted_per_round) + 1  # prefill + one per round
        results.append(spec)
    accepted, rejected = _accepts_and_rejects(results)
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_one_token_prompt(target, eagle3, tokenizer) -> None:
    """No target feature exists before the first verify forward: the first round drafts nothing, later
    rounds draft as usual, and the output is still the autoregressive one."""
    prompt = [tokenizer.bos_token_id]
    ar = generate_autoregressive(target, prompt, 20, GREEDY, torch.Generator())
    spec = generate_speculative(target, Eagle3Proposer(eagle3), prompt, 20, 3, GREEDY, torch.Generator())
    assert spec.tokens == ar.tokens
    assert spec.drafted_per_round[0] == 0 and spec.drafted_per_round[1] == 3


def _statistics_case(
    target: torch.nn.Module, eagle3: Eagle3Drafter, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[int], Tensor, Tensor]:
    """A real context (the first prompt and part of its greedy continuation), a real gamma = 3 proposal
    there, and the target's laws ``p`` (4 rows) given the context and the first i drafts: the first
    context along the continuation where every path of the verifier runs (each draft accepted with
    probability in (0.05, 0.95), and at least 1 % of p_0 and p_1 on ids outside the draft vocabulary,
    reachable only through the residual) and no first draft has q above 0.7."""
    continuation = generate_autoregressive(target, prompts[0], 30, GREEDY, torch.Generator()).tokens
    outside = ~eagle3.t2d
    for k in range(0, 30, 3):
        context = prompts[0] + continuation[:k]
        proposer = Eagle3Proposer(eagle3)
        gen = torch.Generator().manual_seed(k)
        drafts, q = drafted(proposer.propose(context, 3, params, gen, fresh_state(target, context, proposer.target_layers)))
        with torch.no_grad():
            logits = target(torch.tensor([context + drafts])).logits[0, len(context) - 1 :]
        p = standardise(logits, params)  # row i: given context + drafts[:i]
        a = torch.minimum(p[:3], q).sum(-1)
        spread = float(q[0].max()) < 0.7  # so that the first drafts' law is worth testing
        if spread and bool(((a > 0.05) & (a < 0.95)).all()) and bool((p[:2, outside].sum(-1) > 0.01).all()):
            return context, p, q
    raise AssertionError("no context along the continuation exercises every path of the verifier")


def test_verify_level_output_law_and_acceptance_law(target, eagle3, prompts) -> None:
    """Speculative sampling with the real rows: p_i the target's law (temperature 1) given the context
    and the first i drafts of one real gamma = 3 eagle3 proposal, q_i that proposal's q rows
    (:func:`_statistics_case`). Over n = 200,000 blocks (x_i ~ q_i, verified by the loop's
    verify_speculative, batched), the first two emitted tokens follow p_0 and p_1, and the accepted
    count k has law [1-a0, a0(1-a1), a0 a1 (1-a2), a0 a1 a2] with a_i = Σ min(p_i, q_i) (Leviathan et al.
    2023, Thm. 3.5 and §3.1). Bound per outcome (conftest.assert_counts_match): Bernstein at failure
    probability e^-18 per side, |count - n π| <= 6 + 6 sqrt(1 + n π (1 - π)) (6σ for large counts); an
    outcome with π = 0 must never occur. The rows act as a target whose law at step i is p_i whatever
    was drawn before, which is all the theorem needs; that real drafts follow q is the next test's."""
    _, p, q = _statistics_case(target, eagle3, prompts, SamplingParams(temperature=1.0))
    outside = ~eagle3.t2d
    gen = torch.Generator().manual_seed(5)
    n = 200_000
    x, n_accepted, next_token = verify_blocks(p, q, n, gen)  # x_i ~ q_i, verified block by block
    first = torch.where(n_accepted >= 1, x[:, 0], next_token)
    assert_counts_match(torch.bincount(first, minlength=p.shape[1]), p[0], n, "first emitted token")
    assert int(outside[first].sum()) > 0  # emitted through the residual, off the draft vocabulary
    reached = n_accepted >= 1
    second = torch.where(n_accepted[reached] >= 2, x[reached, 1], next_token[reached])
    assert_counts_match(torch.bincount(second, minlength=p.shape[1]), p[1], int(reached.sum()), "second emitted token")
    assert_acceptance_law(p, q, n_accepted, n)


def test_drafted_tokens_follow_q(target, eagle3, prompts) -> None:
    """2,000 gamma = 2 proposals from one context (temperature 1, top-p 0.9, so q has zeros): q_0 is the
    same every time (the cache is reused, not corrupted by the previous draft rows), the first drafts
    follow q_0, and the second drafts after the commonest first draft follow that q_1; bound as in
    conftest.assert_counts_match (Bernstein, ~6σ; never a q = 0 token)."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    context, _, _ = _statistics_case(target, eagle3, prompts, SamplingParams(temperature=1.0))
    proposer = Eagle3Proposer(eagle3)
    state = fresh_state(target, context, proposer.target_layers)
    gen = torch.Generator().manual_seed(6)
    n = 2000
    firsts, seconds, q0, q1 = [], {}, None, {}
    for _ in range(n):
        (d0, d1), q = drafted(proposer.propose(context, 2, params, gen, state))
        q0 = q[0] if q0 is None else q0
        assert torch.equal(q[0], q0)
        q1.setdefault(d0, q[1])
        assert torch.equal(q[1], q1[d0])
        firsts.append(d0)
        seconds.setdefault(d0, []).append(d1)
    assert int((q0 == 0).sum()) > int((~eagle3.t2d).sum())  # top-p cut some draft-vocabulary ids too
    vocab = q0.numel()
    assert_counts_match(torch.bincount(torch.tensor(firsts), minlength=vocab), q0, n, "first draft")
    common = max(seconds, key=lambda d: len(seconds[d]))
    m = len(seconds[common])
    assert m >= 200, m
    assert_counts_match(torch.bincount(torch.tensor(seconds[common]), minlength=vocab), q1[common], m, "second draft")
    assert math.isclose(float(q0.sum()), 1.0, abs_tol=1e-12)


def test_state_that_does_not_cover_the_context_is_refused(target, eagle3, prompts) -> None:
    proposer = Eagle3Proposer(eagle3)
    context = prompts[0]
    layers = proposer.target_layers
    state = fresh_state(target, context, layers)
    gen = torch.Generator()
    with pytest.raises(DrafterError, match=r"does not cover the context(.|\n)*length 5(.|\n)*state length 0"):
        proposer.propose(context[:6], 2, GREEDY, gen, TargetState())
    short = fresh_state(target, context[:-1], layers)
    with pytest.raises(DrafterError, match=rf"does not cover the context(.|\n)*state length {len(context) - 2}"):
        proposer.propose(context, 2, GREEDY, gen, short)
    wrong = TargetState((0, 1, -1), state.hidden, None, state.length)  # -1 is layer 4, not 3
    with pytest.raises(DrafterError, match=r"lacks layers(.|\n)*\[1, 2, 3\](.|\n)*\[0, 1, -1\]"):
        proposer.propose(context, 2, GREEDY, gen, wrong)
    narrow = TargetState(layers, tuple(h[:, :32] for h in state.hidden), None, state.length)
    with pytest.raises(DrafterError, match=r"do not fit(.|\n)*\(\d+, 64\) per layer"):
        proposer.propose(context, 2, GREEDY, gen, narrow)
    # The same layers named from the end (and a superset of them) are accepted.
    renamed = TargetState((0, 1, 2, -2), (state.hidden[0],) + state.hidden, None, state.length)
    tokens, q = drafted(proposer.propose(context, 2, GREEDY, gen, renamed))
    assert tokens == proposer.propose(context, 2, GREEDY, gen, state).token_list()


def test_registry_builds_it(eagle3) -> None:
    proposer = build_proposer("eagle3", FeatureInputs(eagle3, target_vocab_size=320, name="e3"))
    assert isinstance(proposer, Eagle3Proposer) and proposer.name == "e3"
    assert proposer.target_layers == eagle3.config.aux_layer_ids == (1, 2, 3)
    assert proposer.target_vocab_size == 320
    with pytest.raises(DrafterError, match=r"missing inputs(.|\n)*\['eagle3'\] unset"):
        build_proposer("eagle3", FeatureInputs(None))
    with pytest.raises(DrafterError, match="'eagle3' is built from FeatureInputs, not SameTokenizerInputs"):
        build_proposer("eagle3", SameTokenizerInputs(eagle3))
    with pytest.raises(DrafterError, match=r"ids the target cannot emit(.|\n)*below the target's logit width 200"):
        Eagle3Proposer(eagle3, target_vocab_size=200)
