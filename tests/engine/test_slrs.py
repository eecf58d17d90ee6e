"""String-level rejection sampling (SLRS, Alg. 3) on the tiny kit's target and byte-level drafter.

psi against an independent brute-force enumeration, the law of the drafted first token, the verifier's
output law with psi as q (sub-stochastic: mass on "no token"), greedy exactness in the decode loop,
the conditioning of later draft positions, and bad inputs. Models run in float64 so the trie's cached,
batched forwards and the brute force's uncached ones agree far below any top-k gap.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch

from pipeline.engine.inputs import ByteInputs
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.methods import build_proposer
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import TargetState
from pipeline.engine.slem import align_draft
from pipeline.engine.slrs import SLRSProposer
from pipeline.engine.verify import verify_speculative
from pipeline.errors import DrafterError
from pipeline.vocab.tokens import bytes_to_unicode
from tests.engine.conftest import assert_acceptance_law, assert_counts_match

QUESTIONS = [
    "What is the capital of France?",
    "How do I sort a list in Python?",
    "Write a poem about the sea.",
]
SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def kit(tiny_kit) -> dict[str, Any]:
    """The kit's target and byte drafter (float64, CPU) with their tokenizers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(role: str) -> tuple[torch.nn.Module, Any]:
        path = tiny_kit.path(role)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        return model, AutoTokenizer.from_pretrained(path)

    return {role: load(role) for role in ("target", "drafter_bytes")}


def _prompt(tokenizer: Any, question: str, answer_start: str = "") -> list[int]:
    chat = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) + answer_start
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _proposer(kit: dict[str, Any], **kwargs: Any) -> SLRSProposer:
    (drafter, tok_b), (_, tok_t) = kit["drafter_bytes"], kit["target"]
    return SLRSProposer(drafter, tok_b, tok_t, **kwargs)


def _brute_force_psi(
    kit: dict[str, Any],
    proposer: SLRSProposer,
    context: list[int],
    k: int,
    lookahead: int,
    params: SamplingParams,
) -> tuple[dict[int, float], float]:
    """psi and P(none) by walking every drafted string with an uncached drafter forward per prefix.

    Shares nothing with the proposer but its text bridge (``drafter_ids``): bytes are read through GPT-2's
    byte table, the valid UTF-8 prefix by trial decoding, t1 by the one-draft ``align_draft``.
    """
    drafter, tok_b = kit["drafter_bytes"]
    tok_t = kit["target"][1]
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    base = proposer.drafter_ids(context)
    psi: dict[int, float] = defaultdict(float)
    none = 0.0

    def leaf(prefix: bytes, ended_by: int | None, prob: float) -> None:
        nonlocal none
        text = next(t for end in range(len(prefix), -1, -1) if (t := _decodes(prefix[:end])) is not None)
        if ended_by is not None and not prefix:
            first = tok_t.convert_tokens_to_ids(tok_b.convert_ids_to_tokens(ended_by))
            first = first if first in tok_t.all_special_ids else -1
        else:
            ids = align_draft(tok_t, context, text) if text else []
            first = ids[0] if ids else -1
        if first < 0:
            none += prob
        else:
            psi[first] += prob

    def walk(ids: list[int], prefix: bytes, prob: float) -> None:
        if len(ids) == lookahead:
            return leaf(prefix, None, prob)
        with torch.no_grad():
            logits = drafter(torch.tensor([base + ids])).logits[0, -1]
        top = torch.topk(standardise(logits, params), k)
        for token, p in zip(top.indices.tolist(), (top.values / top.values.sum()).tolist(), strict=True):
            if p == 0:
                continue
            if token in tok_b.all_special_ids:
                leaf(prefix, token, prob * p)
            else:
                walk(ids + [token], prefix + bytes([to_byte[tok_b.convert_ids_to_tokens(token)]]), prob * p)

    walk([], b"", 1.0)
    return dict(psi), none


def _decodes(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_bridge_gives_the_drafter_its_own_chat_format(kit) -> None:
    """Target context -> drafter ids keeps the shared specials: exactly the byte tokenizer's own rendering."""
    tok_t, tok_b = kit["target"][1], kit["drafter_bytes"][1]
    chat = [{"role": "user", "content": "Ünïcödé café?"}]
    expected = tok_b(tok_b.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]  # fmt: skip
    assert _proposer(kit).drafter_ids(_prompt(tok_t, chat[0]["content"])) == expected


@pytest.mark.parametrize(
    ("answer_start", "params"), [("", SAMPLED), (" The weather tod", SamplingParams(1.0, top_p=0.9))]
)
def test_psi_equals_brute_force(kit, answer_start: str, params: SamplingParams) -> None:
    """byte_top_k = 3, lookahead = 3 (27 strings), in every pruning mode; psi sums to 1 - P(none).
    A context ending mid-word puts mass on "none" (drafts that merge with its last token)."""
    tok_t = kit["target"][1]
    context = _prompt(tok_t, QUESTIONS[0], answer_start)
    rows = []
    for prune in ("off", "rows", "calls"):
        proposer = _proposer(kit, byte_top_k=3, lookahead=3, prune=prune)
        proposal = proposer.propose(context, 1, params, torch.Generator().manual_seed(0), TargetState())
        assert len(proposal.tokens) == 1 and proposal.q.shape == (1, len(tok_t))
        rows.append(proposal.q[0])
        if prune == "rows":
            assert proposer.stats.pruned > 0  # the exhaustive one-byte check fired, and psi is unchanged
    psi, none = _brute_force_psi(kit, proposer, context, 3, 3, params)
    expected = torch.zeros(len(tok_t), dtype=torch.float64)
    expected[list(psi)] = torch.tensor(list(psi.values()), dtype=torch.float64)
    for row in rows:
        torch.testing.assert_close(row, expected, atol=1e-10, rtol=0)
        assert abs(float(row.sum()) - (1 - none)) < 1e-10
    assert len(psi) >= 2
    if answer_start:
        assert none > 0.01


def test_drafted_first_token_follows_psi(kit) -> None:
    """n = 3,000 proposals (gamma = 1, one generator) from one context: the counts of t1 and of "none"
    match n * psi and n * (1 - sum psi) outcome by outcome (Bernstein bound of ``assert_counts_match``,
    failure probability ~1.5e-8 per outcome and side); psi is the same row in every proposal. Pruning
    is off only for speed (its tokenizer checks cost ~3x the drafter here); psi with pruning equals the
    brute force above, and the walk stops at a determined node the same way in both."""
    tok_t = kit["target"][1]
    context = _prompt(tok_t, QUESTIONS[1], " You can use")
    proposer = _proposer(kit, byte_top_k=3, lookahead=3, prune="off")
    generator = torch.Generator().manual_seed(1)
    n, drawn, psi = 3000, [], None
    for _ in range(n):
        proposal = proposer.propose(context, 1, SAMPLED, generator, TargetState())
        psi = proposal.q[0] if psi is None else psi
        torch.testing.assert_close(proposal.q[0], psi, atol=1e-12, rtol=0)
        drawn.append(proposal.tokens[0])
    law = torch.cat([psi, (1 - psi.sum()).clamp(min=0).reshape(1)])  # last bin: none (-1)
    counts = torch.bincount(torch.tensor(drawn) % law.numel(), minlength=law.numel())
    assert_counts_match(counts, law, n, "drafted t1")
    assert int((law > 0.05).sum()) >= 2  # a law with several likely outcomes, not a point mass
    stats = proposer.stats
    assert stats.proposed == n and 0 < stats.path_forwards <= 3 * n


def test_verifying_psi_emits_the_target_law(kit) -> None:
    """n = 200,000 verified one-token blocks with q = psi from a context ending mid-word (so a "none"
    draft, -1, happens with probability 1 - sum psi > 0 and is always rejected) and p the target's
    distribution there at temperature 1, top-k 64 (so psi also drafts tokens with p = 0): the emitted
    token follows p outcome by outcome, and the accepted count follows [1 - a, a] with
    a = sum min(p, psi) (both with the Bernstein bound of ``assert_counts_match``). Columns outside
    supp(p) ∪ supp(psi) are dropped (never drawn nor emitted) to keep the batch small. verify_blocks
    cannot be used: it draws from the renormalised q, never the "none" outcome."""
    target, tok_t = kit["target"]
    context = _prompt(tok_t, QUESTIONS[0], " The weather tod")
    psi = _proposer(kit, byte_top_k=3, lookahead=3).propose(
        context, 1, SAMPLED, torch.Generator().manual_seed(2), TargetState()
    ).q[0]
    with torch.no_grad():
        p = standardise(target(torch.tensor([context])).logits[0, -1], SamplingParams(1.0, top_k=64))
    support = torch.nonzero((p > 0) | (psi > 0)).flatten()
    p, psi = p[support], psi[support]
    none = 1 - float(psi.sum())
    assert none > 0.01 and float(torch.minimum(p, psi).sum()) > 0.02 and bool(((psi > 0) & (p == 0)).any())
    generator = torch.Generator().manual_seed(3)
    n = 200_000
    drafts = torch.multinomial(torch.cat([psi, torch.tensor([none], dtype=torch.float64)]), n, replacement=True,
                               generator=generator)  # fmt: skip
    drafts[drafts == psi.numel()] = -1
    accepted, token = verify_speculative(p.expand(n, 2, -1), psi.expand(n, 1, -1), drafts.unsqueeze(1), generator)
    emitted = torch.where(accepted == 1, drafts, token)
    assert_counts_match(torch.bincount(emitted, minlength=p.numel()), p, n, "emitted token")
    assert_acceptance_law(p.expand(2, -1), psi.unsqueeze(0), accepted, n)


def test_later_drafts_are_conditioned_on_the_earlier_ones(kit) -> None:
    """With gamma = 3, row i of q is exactly psi after context + the first i drafts (a fresh proposer)."""
    tok_t = kit["target"][1]
    context = _prompt(tok_t, QUESTIONS[2])
    proposal = _proposer(kit).propose(context, 3, SAMPLED, torch.Generator().manual_seed(4), TargetState())
    assert len(proposal.tokens) == proposal.q.shape[0] >= 2
    for i, token in enumerate(proposal.tokens):
        fresh = _proposer(kit).propose(
            context + proposal.tokens[:i], 1, SAMPLED, torch.Generator(), TargetState()
        )
        torch.testing.assert_close(proposal.q[i], fresh.q[0], atol=1e-12, rtol=0)
        if token >= 0:
            assert proposal.q[i, token] > 0


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_speculative_equals_autoregressive(kit, gamma: int) -> None:
    target, tok_t = kit["target"]
    proposer = _proposer(kit)
    accepted = 0
    for question in QUESTIONS:
        ids = _prompt(tok_t, question)
        reference = generate_autoregressive(target, ids, 24, GREEDY, torch.Generator(), tok_t.eos_token_id)
        result = generate_speculative(
            target, proposer, ids, 24, gamma, GREEDY, torch.Generator(), tok_t.eos_token_id
        )
        assert result.tokens == reference.tokens, (gamma, question)
        accepted += sum(result.accepted_per_round)
    assert accepted > 0, "the accept path never ran; the test would not catch a bad accept"


def test_lookups_kept_across_rounds_give_what_a_fresh_proposer_gives(kit) -> None:
    """t1 lookups are kept by look-behind window across proposals: proposing after A, B (another window), then A
    again gives each context the psi a fresh proposer gives it."""
    tok_t = kit["target"][1]
    contexts = [_prompt(tok_t, QUESTIONS[0], " The weather tod"), _prompt(tok_t, QUESTIONS[1], " You can use")]

    def psi(proposer: SLRSProposer, context: list[int]) -> torch.Tensor:
        return proposer.propose(context, 1, SAMPLED, torch.Generator().manual_seed(0), TargetState()).q[0]

    fresh = [psi(_proposer(kit, byte_top_k=3, lookahead=3), context) for context in contexts]
    kept = _proposer(kit, byte_top_k=3, lookahead=3)
    for i in (0, 1, 0):
        torch.testing.assert_close(psi(kept, contexts[i]), fresh[i], atol=0, rtol=0)
    assert not torch.equal(fresh[0], fresh[1])


def test_calls_pruning_skips_the_last_depths_call_under_greedy_decoding(kit) -> None:
    """Greedy tries have one node a depth, so proving the depth ``lookahead - 1`` node determined skips that
    depth's whole call: the default ``"calls"`` mode makes exactly one call fewer per pruned node than no
    pruning, for the same tokens (psi in every mode: test_psi_equals_brute_force)."""
    target, tok_t = kit["target"]
    ids = _prompt(tok_t, QUESTIONS[0])
    runs = {}
    for prune in ("off", "calls"):
        proposer = _proposer(kit, prune=prune)
        result = generate_speculative(target, proposer, ids, 24, 3, GREEDY, torch.Generator(), tok_t.eos_token_id)
        runs[prune] = (result.tokens, proposer.stats)
    assert runs["off"][0] == runs["calls"][0]
    off, calls = runs["off"][1], runs["calls"][1]
    assert calls.pruned > 0 and off.pruned == 0
    assert off.trie_calls - calls.trie_calls == calls.pruned
    assert off.trie_nodes - calls.trie_nodes == calls.pruned


def test_registry_methods_decode_and_count_their_drafter_work(kit) -> None:
    """``slrs`` and ``slem_bytes`` built by name run through the loop at temperature 1 (γ 3): every round's
    q passes the verifier's checks, SLRS gets drafts accepted, and both count drafter calls (SLRS: one
    per trie depth, so at most ``lookahead`` per proposed token, and at least one psi row per call)."""
    target, tok_t = kit["target"]
    drafter, tok_b = kit["drafter_bytes"]
    prompts = [_prompt(tok_t, q) for q in QUESTIONS[:2]]
    inputs = ByteInputs(drafter_bytes=drafter, drafter_bytes_tokenizer=tok_b, target_tokenizer=tok_t,
                        byte_top_k=3, lookahead=3)  # fmt: skip
    for method in ("slrs", "slem_bytes"):
        proposer = build_proposer(method, inputs)
        assert proposer.name == method
        results = [generate_speculative(target, proposer, ids, 16, 3, SAMPLED, torch.Generator().manual_seed(1),
                                        tok_t.eos_token_id) for ids in prompts]  # fmt: skip
        drafted = sum(sum(r.drafted_per_round) for r in results)
        assert drafted > 0 and proposer.drafter_calls > 0
        if method == "slrs":
            assert sum(sum(r.accepted_per_round) for r in results) > 0
            assert proposer.stats.proposed == drafted  # a "-1" draft is proposed and verified too
            assert proposer.drafter_calls <= 3 * drafted < proposer.drafter_rows
    with pytest.raises(DrafterError, match="byte budget"):
        build_proposer("slem_bytes", ByteInputs(drafter_bytes=drafter, drafter_bytes_tokenizer=tok_b,
                                                target_tokenizer=tok_t, lookahead=0))  # fmt: skip


def test_bad_inputs_are_refused(kit) -> None:
    (drafter, tok_b), (_, tok_t) = kit["drafter_bytes"], kit["target"]
    for kwargs, what in (({"byte_top_k": 0}, "byte_top_k"), ({"lookahead": 0}, "lookahead"),
                         ({"byte_top_k": 64, "lookahead": 4}, "too large"), ({"prune": True}, "prune mode")):  # fmt: skip
        with pytest.raises(DrafterError, match=what) as err:
            SLRSProposer(drafter, tok_b, tok_t, **kwargs)
        assert "expected" in str(err.value) and "what to do" in str(err.value)
    with pytest.raises(DrafterError, match="byte-level drafter") as err:
        SLRSProposer(drafter, tok_t, tok_t)  # a subword vocabulary
    assert "multi-byte text tokens" in str(err.value)
