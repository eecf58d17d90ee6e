"""Every registered draft method decodes every kind of prompt at every kind of sampling (issue 20).

Methods come from the registry (``METHODS``), built from the trained tiny kit by
``conftest.kit_proposer_inputs``; prompts are a one-token prompt, a BOS-only prompt, one that fills the
target's context (``max_position_embeddings``) with the new tokens, and an ordinary one; sampling is
greedy, temperature 1, and temperature 0.7 with top-p 0.9. Each decode must complete and emit only
target ids, and the greedy ones must equal greedy autoregressive decoding token for token.

Several of these rounds draft nothing: EAGLE-3 has no target feature on a one-token prompt's first
round, and the cross-tokenizer drafters (TLI, Union, TLI+RDK) see no text in a BOS-only prompt.
``test_rounds_without_drafts_happen`` checks that they do, so the matrix really covers that path; SLRS
drafts nothing there only when it keeps no specials (the kit's byte drafter shares the target's BOS).
"""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.methods import METHOD_NAMES
from pipeline.engine.sampling import SamplingParams
from tests.helpers import first_token_law

SETTINGS = {
    "greedy": SamplingParams(),
    "t1": SamplingParams(temperature=1.0),
    "t0.7_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
}
NEW_TOKENS = 12
AT_LIMIT_NEW_TOKENS = 6
GAMMA = 4
ORDINARY = "def add(a, b):\n    return"
LONG_TEXT = (
    "Speculative decoding drafts a few tokens with a small model and checks them all with the large one. "
    "When the draft agrees, several tokens come out of one forward pass of the target model; "
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def cases(kit) -> dict[str, tuple[list[int], int]]:
    """``{case: (prompt, max_new_tokens)}``; the at-limit prompt plus its new tokens is exactly the context."""
    target, tokenizer = kit["target"]
    context = int(target.config.max_position_embeddings)
    text = tokenizer(LONG_TEXT * 8, add_special_tokens=False).input_ids
    at_limit = [tokenizer.bos_token_id] + text[: context - AT_LIMIT_NEW_TOKENS - 1]
    assert len(at_limit) + AT_LIMIT_NEW_TOKENS == context
    return {
        "one_token": (tokenizer("The", add_special_tokens=False).input_ids[:1], NEW_TOKENS),
        "bos_only": ([tokenizer.bos_token_id], NEW_TOKENS),
        "at_context_limit": (at_limit, AT_LIMIT_NEW_TOKENS),
        "ordinary": ([tokenizer.bos_token_id] + tokenizer(ORDINARY, add_special_tokens=False).input_ids, NEW_TOKENS),
    }


@pytest.fixture(scope="module")
def greedy_reference(kit, cases) -> dict[str, list[int]]:
    target, tokenizer = kit["target"]
    return {
        case: generate_autoregressive(
            target, prompt, new, SETTINGS["greedy"], torch.Generator(), tokenizer.eos_token_id
        ).tokens
        for case, (prompt, new) in cases.items()
    }


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("case", ["one_token", "bos_only", "at_context_limit", "ordinary"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_completes(method: str, case: str, setting: str, kit, proposers, cases, greedy_reference) -> None:
    target, tokenizer = kit["target"]
    prompt, new = cases[case]
    params = SETTINGS[setting]
    result = generate_speculative(
        target, proposers[method], prompt, new, GAMMA, params, torch.Generator().manual_seed(0), tokenizer.eos_token_id
    )
    vocab = target.get_output_embeddings().weight.shape[0]
    assert all(0 <= token < vocab for token in result.tokens), result.tokens
    if result.stop_reason == "eos":
        assert result.tokens[-1] == tokenizer.eos_token_id and len(result.tokens) <= new
    else:
        assert len(result.tokens) == new
    assert len(prompt) + len(result.tokens) <= target.config.max_position_embeddings
    if params.greedy:
        assert result.tokens == greedy_reference[case]


@pytest.mark.parametrize(
    ("method", "case"),
    [("eagle3", "one_token"), ("eagle3", "bos_only"), ("dflash", "one_token"), ("dflash", "bos_only"),
     *((method, "bos_only") for method in ("tli", "union", "tli_rdk", "tli_rdk_taylor", "tli_rdk_prior"))],
)
def test_rounds_without_drafts_happen(method: str, case: str, kit, proposers, cases) -> None:
    """The first round of these pairs drafts nothing, so the matrix above decodes zero-draft rounds at
    temperature > 0 (where they used to end the decode with an IndexError)."""
    target, _ = kit["target"]
    prompt, new = cases[case]
    result = generate_speculative(
        target, proposers[method], prompt, new, GAMMA, SETTINGS["t1"], torch.Generator().manual_seed(0)
    )
    assert result.drafted_per_round[0] == 0 and len(result.tokens) == new


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_slrs_without_shared_specials_on_a_bos_only_prompt(setting: str, kit, cases, greedy_reference) -> None:
    """The registry's SLRS hands shared specials to its byte drafter, and the kit's has all of the target's,
    so a BOS-only prompt still gives it a BOS to draft from. Without ``keep_specials`` the prompt has no
    text for it: the first round drafts nothing, and the decode completes (greedy: the autoregressive one)."""
    from pipeline.engine.slrs import SLRSProposer

    (target, target_tok), (drafter, drafter_tok) = kit["target"], kit["drafter_bytes"]
    vocab = target.get_output_embeddings().weight.shape[0]
    proposer = SLRSProposer(drafter, drafter_tok, target_tok, keep_specials=False, target_vocab_size=vocab)
    prompt, new = cases["bos_only"]
    result = generate_speculative(target, proposer, prompt, new, GAMMA, SETTINGS[setting],
                                  torch.Generator().manual_seed(0), target_tok.eos_token_id)
    assert result.drafted_per_round[0] == 0 and all(0 <= token < vocab for token in result.tokens)
    assert len(result.tokens) == new or result.tokens[-1] == target_tok.eos_token_id
    if SETTINGS[setting].greedy:
        assert result.tokens == greedy_reference["bos_only"]


NO_FIRST_ACCEPT_AT_T1 = {"slem_bytes"}
"""Methods whose first draft the target never accepted in 300 sampled first rounds at temperature 1: the untrained byte
drafter's strings never spell the token the target samples there. It verifies by exact match, so its first token is
the target's own sample whichever branch runs; the exact-match accept branch's law is tested in
``test_verify.py::test_exact_match_verification``, and in the real loop at a lower temperature below."""


FIRST_ROUND_LAW = ("full", "dynaspec", "rdk", "tli", "slem", "eagle3", "dflash")
"""The methods whose sampled first rounds (``first_rounds`` at temperature 1) are binned here, one per way of drafting:
a drafter session under the full head, under the routed head, under RDK's redistribution; another tokenizer's drafter
mapped token by token, or handed over as text; EAGLE-3's chain on the target's features; DFlash's block. Every
method's first rounds are binned by the evaluate stage's own check in ``tests/test_evaluate.py`` (the same
``first_rounds`` and chi-square, at 200 draws, SLRS's trie there 3 bytes deep and wide; for SLEM on bytes also the
lower-temperature test below), and every method's every emitted position, first rounds included, is tested in
``test_position_law.py`` (40 generations of 32 tokens each). Every method's greedy first rounds are compared with the
loop's here."""


@pytest.mark.parametrize("method", METHOD_NAMES)
def test_first_rounds_repeat_the_loops_first_round_after_one_prefill(kit, proposers, cases, method: str) -> None:
    """evaluate's losslessness check draws n first rounds after one prefill (`first_rounds`): the target's cache is
    cropped back and the proposer re-syncs to the context each time. Greedy, every draw must emit exactly what the
    decode loop's first round emits, and the proposer must draft in every round it drafts in the loop; at
    temperature 1, for :data:`FIRST_ROUND_LAW`, the first tokens are samples of the target's p (chi-square over 300
    draws, pooled tail, at least three bins, fails below p = 1e-4), with first drafts both accepted and rejected."""
    from pipeline.engine.loop import first_rounds

    target, _ = kit["target"]
    prompt, _ = cases["ordinary"]
    loop = generate_speculative(target, proposers[method], prompt, GAMMA + 1, GAMMA, SETTINGS["greedy"],
                                torch.Generator().manual_seed(0))
    first = loop.tokens[: loop.accepted_per_round[0] + 1]
    rounds = first_rounds(target, proposers[method], prompt, GAMMA, SETTINGS["greedy"],
                          torch.Generator().manual_seed(0), 3)
    assert [r.emitted for r in rounds] == [first] * 3
    assert [r.drafted for r in rounds] == [loop.drafted_per_round[0]] * 3
    if method not in FIRST_ROUND_LAW:
        return
    pvalue, bins, accepted, rejected = first_token_law(target, proposers[method], prompt, GAMMA, SETTINGS["t1"])
    # three bins or more (one tests nothing), and both verification branches taken: accepted and rejected drafts
    assert bins >= 3 and pvalue >= 1e-4, (method, pvalue, bins)
    assert accepted > 0 and rejected > 0, (method, accepted, rejected)


REPEATED = "def add(a, b):\n    return a + b\n\n" * 4 + "def add(a, b):\n    return"
"""A context the kit's target continues with some confidence (its largest probability at temperature 0.3: 0.45)."""


@pytest.mark.parametrize("method", sorted(NO_FIRST_ACCEPT_AT_T1))
def test_the_exact_match_accept_branch_runs_at_a_lower_temperature(method: str, kit, proposers) -> None:
    """What the temperature-1 test above cannot reach: at temperature 0.3 on a repeated context the byte drafter's
    first draft spells the target's sample in some rounds, so the accept branch of exact-match verification runs
    in the real loop (and the reject branch in others), and the first emitted tokens are still samples of the
    target's p at that temperature (300 rounds, chi-square as above: pooled tail, at least three bins, fails below
    p = 1e-4)."""
    target, tokenizer = kit["target"]
    prompt = [tokenizer.bos_token_id] + tokenizer(REPEATED, add_special_tokens=False).input_ids
    pvalue, bins, accepted, rejected = first_token_law(target, proposers[method], prompt, GAMMA,
                                                       SamplingParams(temperature=0.3))
    assert bins >= 3 and pvalue >= 1e-4, (method, pvalue, bins)
    assert accepted > 0 and rejected > 0, (method, accepted, rejected)
