"""Heterogeneous-vocabulary proposers (TLI, Union, SLEM): exact draft laws, losslessness, greedy exactness.

Target: a random tiny ``LlamaForCausalLM`` on a GPT-2-style byte-level tokenizer. Drafters use a
SentencePiece-style Metaspace tokenizer: one a copy of the target's weights with its vocabulary rows
re-indexed through the token map (so it agrees with the target wherever the two tokenizations line up,
and both the accept and reject paths run), one unrelated and random; plus a random drafter on a Greek
tokenizer that shares no token with the target. Models run in float64 so block and incremental
forwards agree far below any argmax gap. The lead can swap in the trained tiny kit here.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from tokenizers import Tokenizer

from pipeline.engine.hetero import (
    TLIProposer,
    intersection_pairs,
    tli_draft_distribution,
    union_draft_distribution,
)
from pipeline.engine.loop import first_rounds, generate_autoregressive, generate_speculative
from pipeline.engine.methods import build_proposer
from pipeline.engine.sampling import SamplingParams, sample, standardise
from pipeline.engine.session import TargetState
from pipeline.engine.slem import SLEMProposer, align_draft, align_drafts, byte_lengths
from pipeline.engine.verify import verify_speculative
from pipeline.errors import DrafterError
from pipeline.vocab.maps import VocabMap, decode_ids, encode_text
from tests.engine.conftest import method_inputs
from tests.engine.toy_tokenizers import byte_level_tokenizer, corpus, greek_tokenizer, metaspace_tokenizer

# Leading spaces: a Metaspace tokenizer prepends '▁' to the first word, so only then can the two
# tokenizations of a prompt line up. The first three line up token for token (the copied drafter then
# agrees with the target), the last two are split differently by the two tokenizers.
PROMPTS = [
    " the cat sat near the river",
    " the dog ran to the park",
    " hello world again",
    " speculative decoding lets a small",
    " the café served crème",
]
GREEDY = SamplingParams()


def _llama(vocab_size: int, seed: int, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        initializer_range=0.5,  # peaked next-token distributions from random weights
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float64).eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok_target() -> Tokenizer:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def tok_drafter() -> Tokenizer:
    return metaspace_tokenizer()


@pytest.fixture(scope="module")
def vmap(tok_target: Tokenizer, tok_drafter: Tokenizer) -> VocabMap:
    return VocabMap.build(tok_target, tok_drafter)


@pytest.fixture(scope="module")
def target_model(tok_target: Tokenizer) -> torch.nn.Module:
    """Random target whose head never prefers the single-byte alphabet (ids 0-256, logit 0), so its
    greedy text is mostly multi-byte tokens that decode cleanly and that SLEM can hand over."""
    model = _llama(tok_target.get_vocab_size(), seed=0)
    with torch.no_grad():
        model.lm_head.weight[:257] = 0.0
    return model


@pytest.fixture(scope="module")
def copied_drafter(target_model: torch.nn.Module, tok_drafter: Tokenizer, vmap: VocabMap) -> torch.nn.Module:
    """The target's weights with embedding and head rows re-indexed into the drafter vocabulary."""
    model = _llama(tok_drafter.get_vocab_size(), seed=1)
    state = {
        k: v for k, v in target_model.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k
    }
    model.load_state_dict(state, strict=False)
    inter_d, inter_t = vmap.intersection_ids_drafter, vmap.intersection_ids_target
    with torch.no_grad():
        model.lm_head.weight.zero_()  # drafter-only tokens get logit 0, like the target's byte alphabet
        model.model.embed_tokens.weight[inter_d] = target_model.model.embed_tokens.weight[inter_t]
        model.lm_head.weight[inter_d] = target_model.lm_head.weight[inter_t]
    return model


@pytest.fixture(scope="module")
def random_drafter(tok_drafter: Tokenizer) -> torch.nn.Module:
    return _llama(tok_drafter.get_vocab_size(), seed=2, hidden=32, layers=1)


@pytest.fixture(scope="module")
def prompt_ids(tok_target: Tokenizer) -> list[list[int]]:
    return [encode_text(tok_target, text, add_special_tokens=False) for text in PROMPTS]


def _proposer(
    method: str, drafter: torch.nn.Module, tok_drafter: Tokenizer, tok_target: Tokenizer, vmap: VocabMap
):
    inputs = method_inputs(method, drafter_other=drafter, drafter_other_tokenizer=tok_drafter,
                           target_tokenizer=tok_target, vocab_map=vmap)
    return build_proposer(method, inputs)


# ---------------------------------------------------------------------------------------------------
# Verify level: the draft laws of TLI and Union are lossless (200k draws, batched).


def _check_law(emitted: torch.Tensor, p: torch.Tensor) -> None:
    """Counts within 6σ of n·p per token (+1 for the discreteness), and never a token with p = 0."""
    n = emitted.numel()
    counts = torch.bincount(emitted, minlength=p.numel()).to(torch.float64)
    assert counts[p == 0].sum() == 0, "emitted a token the target gives probability 0"
    bound = 6 * torch.sqrt(n * p * (1 - p)) + 1
    assert bool(((counts - n * p).abs() <= bound).all()), (counts / n, p)


@pytest.mark.parametrize("method", ["tli", "union"])
def test_verify_level_output_law_and_acceptance_law(method: str) -> None:
    """n = 200,000 blocks of gamma = 3 drafts; the first two emitted tokens must follow p_0 and p_1
    (6σ per token), and the accepted-count law must be [1-a0, a0(1-a1), a0 a1 (1-a2), a0 a1 a2]
    (6σ per count) with a_i = Σ min(p_i, q_i), q_i the proposer's target-space draft law."""
    gen = torch.Generator().manual_seed(0)
    n, gamma, v_target = 200_000, 3, 7
    # Drafter ids 2 and 5 have no target id; target ids 4 (and drafter-less) is outside D.
    d2t = torch.tensor([0, 2, -1, 3, 5, -1, 6, 1])
    t2d = torch.full((v_target,), -1)
    t2d[d2t[d2t >= 0]] = torch.nonzero(d2t >= 0).flatten()
    vocab_map = VocabMap(drafter_to_target=d2t, target_to_drafter=t2d)
    p = torch.tensor(
        [
            [0.30, 0.00, 0.25, 0.05, 0.20, 0.10, 0.10],  # p = 0 on target id 1 (drafter id 7)
            [0.10, 0.40, 0.00, 0.20, 0.05, 0.15, 0.10],
            [0.05, 0.05, 0.50, 0.10, 0.10, 0.10, 0.10],
            [0.20, 0.20, 0.10, 0.10, 0.10, 0.20, 0.10],
        ],
        dtype=torch.float64,
    )
    logits = torch.randn(gamma, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1.5
    logits[0, 7] = 3.0  # the drafter likes a token the target never emits here
    params = SamplingParams(temperature=0.9, top_k=6)
    inter_d, inter_t, d2t_padded = intersection_pairs(vocab_map, 8, v_target)
    law = tli_draft_distribution if method == "tli" else union_draft_distribution
    probs, q = law(logits, inter_d, inter_t, v_target, params)
    draws = sample(probs.unsqueeze(0).expand(n, -1, -1), gen)
    tokens = inter_t[draws] if method == "tli" else d2t_padded[draws]
    if method == "union":
        assert bool((tokens == -1).any())  # the D∖T path really runs
        assert torch.allclose(
            q.sum(-1) + probs[:, d2t_padded < 0].sum(-1), torch.ones(gamma, dtype=torch.float64)
        )
    else:
        assert torch.allclose(q.sum(-1), torch.ones(gamma, dtype=torch.float64))
    n_acc, next_token = verify_speculative(
        p.unsqueeze(0).expand(n, -1, -1), q.unsqueeze(0).expand(n, -1, -1), tokens, gen
    )
    first = torch.where(n_acc >= 1, tokens[:, 0], next_token)
    _check_law(first, p[0])
    reached = n_acc >= 1
    second = torch.where(n_acc[reached] >= 2, tokens[reached, 1], next_token[reached])
    _check_law(second, p[1])
    a = torch.minimum(p[:gamma], q).sum(-1)
    expected = [float(a[:k].prod() * (1 - a[k])) for k in range(gamma)] + [float(a.prod())]
    counts = torch.bincount(n_acc, minlength=gamma + 1).to(torch.float64)
    for k, e in enumerate(expected):
        assert abs(counts[k] - n * e) <= 6 * math.sqrt(n * e * (1 - e)) + 1, (k, counts[k] / n, e)


# ---------------------------------------------------------------------------------------------------
# Proposer level: q is exactly the law of the drafted tokens, through the cached, re-synced drafter.


@pytest.mark.parametrize("method", ["tli", "union"])
def test_proposal_q_is_the_drafters_law_from_scratch(
    method: str, copied_drafter, tok_drafter, tok_target, vmap, prompt_ids
) -> None:
    """Across a generation (cache crops and re-syncs), every q row equals the law recomputed by an
    uncached forward over drafter_ids(context) + earlier drafts."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    proposer = _proposer(method, copied_drafter, tok_drafter, tok_target, vmap)
    gen = torch.Generator().manual_seed(3)
    context = list(prompt_ids[0])
    inter_d, inter_t, d2t = intersection_pairs(vmap, tok_drafter.get_vocab_size(), vmap.target_vocab_size)
    law = tli_draft_distribution if method == "tli" else union_draft_distribution
    for _ in range(6):
        proposal = proposer.propose(context, 4, params, gen, TargetState())
        assert proposal.q is not None and proposal.q.shape == (len(proposal.tokens), vmap.target_vocab_size)
        ids = encode_text(tok_drafter, decode_ids(tok_target, context), add_special_tokens=True)
        drafted = proposer.session.ids[len(ids) :]
        for i, token in enumerate(proposal.tokens):
            with torch.no_grad():
                logits = copied_drafter(torch.tensor([ids + drafted[:i]])).logits[0, -1]
            _, q = law(logits, inter_d, inter_t, vmap.target_vocab_size, params)
            assert torch.allclose(proposal.q[i], q, atol=1e-9)
            if token >= 0:
                assert proposal.q[i, token] > 0
        if method == "union" and proposal.tokens[-1] == -1:
            assert len(proposal.tokens) <= 4  # the draft stops at the first token outside T
        # Advance the context with a mix of accepted drafts and a fresh token, as the loop would.
        keep = [t for t in proposal.tokens[:2] if t >= 0]
        context += keep + [int(torch.randint(300, (1,), generator=gen))]


@pytest.mark.parametrize("method", ["tli", "union"])
def test_drafted_tokens_follow_q(
    method: str, copied_drafter, tok_drafter, tok_target, vmap, prompt_ids
) -> None:
    """n = 2,000 proposals from one context: first-draft counts vs q_0, each within 6σ + 1 of n·q_0 (per token:
    ``_check_law``), none where q_0 = 0. At temperature 1 this context's q_0 puts 0.96 on one token, and 1,500 draws
    missed a drafter sampling from probs**1.3 instead of its q about half the time; at temperature 1.5 (top-k 10) the
    top token has 0.81, and the normal approximation leaves that drafter under 1e-14 to pass at n = 2,000."""
    params = SamplingParams(temperature=1.5, top_k=10)
    proposer = _proposer(method, copied_drafter, tok_drafter, tok_target, vmap)
    gen = torch.Generator().manual_seed(4)
    n = 2000
    firsts = []
    q0 = None
    for _ in range(n):
        proposal = proposer.propose(prompt_ids[1], 1, params, gen, TargetState())
        q0 = proposal.q[0] if q0 is None else q0
        assert torch.equal(proposal.q[0], q0)
        firsts.append(proposal.tokens[0])
    drafted = torch.tensor(firsts)
    if method == "union":
        # Union's q drops D∖T mass; the -1 draws must make up exactly the missing mass.
        missing = max(0.0, 1 - float(q0.sum()))  # rounding can leave -1e-16 when all mass is in T
        count = float((drafted == -1).sum())
        assert abs(count - n * missing) <= 6 * math.sqrt(n * missing * (1 - missing)) + 1
        drafted = drafted[drafted >= 0]
        q0 = q0 / q0.sum()
        n = drafted.numel()
    _check_law(drafted, q0)


# ---------------------------------------------------------------------------------------------------
# SLEM's look-behind re-alignment.


def _ids(tokenizer: Tokenizer, *tokens: str) -> list[int]:
    ids = [tokenizer.token_to_id(t) for t in tokens]
    assert None not in ids, tokens
    return ids


def test_align_draft_continues_after_the_window(tok_target: Tokenizer) -> None:
    context = _ids(tok_target, "Ġthe", "Ġcat")
    assert align_draft(tok_target, context, " sat") == _ids(tok_target, "Ġsat")


def test_align_draft_realigns_a_resplit_window(tok_target: Tokenizer) -> None:
    # ' the' spelled as three tokens: re-encoding merges them into 'Ġthe', but a token boundary still
    # sits where the context's text ends, so the draft after it is usable.
    context = _ids(tok_target, "Ġthe", "Ġ", "t", "he")
    assert align_draft(tok_target, context, " cat") == _ids(tok_target, "Ġcat")


def test_align_draft_proposes_nothing_when_the_draft_merges_into_the_context(tok_target: Tokenizer) -> None:
    # ' the caf' + 'é served': the target spells ' café' as one token, so no continuation of the
    # context's 'Ġc', 'af' tokens is a canonical spelling of the draft.
    context = encode_text(tok_target, " the caf", add_special_tokens=False)
    assert tok_target.token_to_id("ĠcafÃ©") is not None
    assert align_draft(tok_target, context, "é served") == []


def test_align_drafts_with_byte_sizes_finds_the_same_boundaries(tok_target: Tokenizer) -> None:
    """The byte-size shortcut of the re-split search changes nothing: 300 random cuts of corpus
    sentences, each context also spelt non-canonically (its last word split into single bytes, so the
    window re-splits), with 12 drafts each, align alike with and without ``byte_lengths``."""
    from pipeline.vocab.tokens import bytes_to_unicode

    symbol = bytes_to_unicode()
    sizes = byte_lengths(tok_target)
    assert sizes is not None and byte_lengths(metaspace_tokenizer()) is None
    rng = random.Random(11)
    sentences = corpus(3)
    found = missed = 0
    for _ in range(300):
        sentence = " " + rng.choice(sentences)
        cut = rng.randint(2, len(sentence) - 2)
        head, _, last = sentence[:cut].rpartition(" ")
        context = encode_text(tok_target, head, add_special_tokens=False)
        context += [tok_target.token_to_id(symbol[b]) for b in (" " + last).encode()]
        drafts = [sentence[cut : cut + rng.randint(0, 8)] for _ in range(12)]
        plain = align_drafts(tok_target, context, drafts, 4)
        assert align_drafts(tok_target, context, drafts, 4, sizes) == plain
        found += sum(bool(ids) for ids in plain)
        missed += sum(not ids for draft, ids in zip(drafts, plain, strict=True) if draft)
    assert found > 300 and missed > 300  # the re-split search both found and missed boundaries


@pytest.mark.parametrize("side", ["byte_level", "metaspace"])
def test_align_draft_always_spells_the_draft(
    side: str, tok_target: Tokenizer, tok_drafter: Tokenizer
) -> None:
    """300 random cuts of corpus sentences (context = canonical prefix tokens, draft = the next few
    characters): the proposal is empty or decodes, after the context, to exactly the draft; and it is
    non-empty for most cuts at a word boundary."""
    tokenizer = tok_target if side == "byte_level" else tok_drafter
    rng = random.Random(7)
    sentences = corpus(3)
    aligned_at_words = words = 0
    for _ in range(300):
        sentence = " " + rng.choice(sentences)
        cut = rng.randint(2, len(sentence) - 2)
        prefix, draft = sentence[:cut], sentence[cut : cut + rng.randint(1, 12)]
        context = encode_text(tokenizer, prefix, add_special_tokens=False)
        proposal = align_draft(tokenizer, context, draft, lookbehind=4)
        if proposal:
            assert decode_ids(tokenizer, context + proposal) == decode_ids(tokenizer, context) + draft
        if draft.startswith(" "):
            words += 1
            aligned_at_words += bool(proposal)
    assert words > 20 and aligned_at_words >= 0.9 * words


# ---------------------------------------------------------------------------------------------------
# Loop level: greedy exactness and the sampled first-token law.


@pytest.fixture(scope="module")
def greedy_reference(target_model, prompt_ids) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [generate_autoregressive(target_model, ids, 20, GREEDY, gen).tokens for ids in prompt_ids]


@pytest.mark.parametrize("drafter_kind", ["copied", "random"])
@pytest.mark.parametrize("method", ["tli", "union", "slem"])
def test_greedy_speculative_equals_autoregressive(
    method, drafter_kind, request, target_model, tok_drafter, tok_target, vmap, prompt_ids, greedy_reference
) -> None:
    drafter = request.getfixturevalue(f"{drafter_kind}_drafter")
    proposer = _proposer(method, drafter, tok_drafter, tok_target, vmap)
    accepted = 0
    for gamma in (1, 3, 5):
        for ids, reference in zip(prompt_ids, greedy_reference, strict=True):
            result = generate_speculative(target_model, proposer, ids, 20, gamma, GREEDY, torch.Generator())
            assert result.tokens == reference, (method, gamma, decode_ids(tok_target, ids))
            accepted += sum(result.accepted_per_round)
    if drafter_kind == "copied":
        assert accepted > 0, "the accept path never ran; the test would not catch a bad accept"


def test_slem_with_no_shared_token_is_still_exact(
    target_model, tok_target, prompt_ids, greedy_reference
) -> None:
    tok_greek = greek_tokenizer()
    greek_map = VocabMap.build(tok_target, tok_greek)
    assert greek_map.intersection_size == 0
    drafter = _llama(tok_greek.get_vocab_size(), seed=5, hidden=32, layers=1)
    with pytest.raises(DrafterError, match="share no token"):
        TLIProposer(drafter, tok_greek, tok_target, greek_map)
    proposer = SLEMProposer(drafter, tok_greek, tok_target)
    drafted = 0
    for gamma in (1, 3):
        for ids, reference in zip(prompt_ids, greedy_reference, strict=True):
            result = generate_speculative(target_model, proposer, ids, 20, gamma, GREEDY, torch.Generator())
            assert result.tokens == reference
            drafted += sum(result.drafted_per_round)
    assert drafted > 0  # SLEM really proposed (Greek text re-encoded into byte-level target tokens)


# P(χ²_7 > 40) ≈ 1.1e-6: a correct sampler fails this bound about once in a million runs (fewer
# degrees of freedom after pooling only make the tail lighter).
_CHI2_7_BOUND = 40.0


@pytest.mark.parametrize("method", ["tli", "union", "slem"])
def test_sampled_first_token_follows_the_target(
    method, target_model, copied_drafter, tok_drafter, tok_target, vmap, prompt_ids
) -> None:
    """500 first rounds at γ = 1 after one prefill, at temperature 1, top-k 8 (so p has zeros): the first emitted token
    never has p = 0, and its counts (tokens with n·p < 5 pooled into one bin, at least three bins) give χ²
    (≤ 7 d.o.f.) below 40 against p from one plain target forward; over a tenth of the first drafts accepted and
    over a tenth rejected."""
    params = SamplingParams(temperature=1.0, top_k=8)
    ids = prompt_ids[0]
    assert vmap.drafter_to_target[encode_text(tok_drafter, PROMPTS[0], add_special_tokens=True)].tolist() == ids
    with torch.no_grad():
        p = standardise(target_model(torch.tensor([ids])).logits[0, -1], params)
    proposer = _proposer(method, copied_drafter, tok_drafter, tok_target, vmap)
    gen = torch.Generator().manual_seed(6)
    n = 500
    firsts, accepted, rejected = [], 0, 0
    for step in first_rounds(target_model, proposer, ids, 1, params, gen, n):  # the loop's first round, n times
        firsts.append(step.emitted[0])
        accepted += step.accepted
        rejected += step.accepted < step.drafted
    counts = torch.bincount(torch.tensor(firsts), minlength=p.numel()).to(torch.float64)
    assert counts[p == 0].sum() == 0
    big, small = n * p >= 5, (p > 0) & (n * p < 5)
    observed = torch.cat([counts[big], counts[small].sum().reshape(1)])
    expected = torch.cat([n * p[big], (n * p[small]).sum().reshape(1)])
    keep = expected > 0
    assert int(keep.sum()) >= 3, expected  # one bin, or two, would test next to nothing
    chi2 = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert chi2 < _CHI2_7_BOUND, (chi2, observed / n, expected / n)
    assert accepted > n // 10, accepted  # the accept rule itself was exercised, often
    assert rejected > n // 10, rejected  # and the residual after a rejected draft
