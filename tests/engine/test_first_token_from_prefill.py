"""``evaluate.first_token=prefill``: the target's prefill emits each generation's first new token and the first
drafting round starts after it, the order of vLLM, SGLang and EAGLE's reference code (whose τ never counts that
token). The engine's original order (``round``) drafts the first token in the first round.

* **Greedy ≡ autoregressive** for every registered method on the eager and static paths, on an ordinary prompt and
  on a one-token prompt.
* **The reference order, exactly**: greedy, the rounds of a prefill-first generation are the rounds of the original
  order on the prompt followed by the target's first token (one token fewer to generate).
* **Same law**: at temperature 1 the first token follows the target's p and the second token (the first drafting
  round's first emission, drafted by the full-head drafter) follows its marginal ``Σ p(x1) p(x2 | x1)``; 2,000
  generations, every outcome within the Bernstein bound of ``conftest.assert_counts_match`` (6σ), and both the
  accept and the residual paths taken.
* **τ counts only the rounds**, and the evaluation records and reports the order.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipeline.engine.loop import GenerationResult, generate_autoregressive, generate_speculative
from pipeline.engine.methods import METHOD_NAMES, build_proposer
from pipeline.engine.metrics import summarize
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.static import DecodeOptions
from pipeline.errors import DrafterError
from tests.engine.conftest import assert_counts_match, method_inputs

GREEDY = SamplingParams()
NEW_TOKENS = 12
GAMMA = 4
PREFILL = {"eager": DecodeOptions("eager", first_token="prefill"), "static": DecodeOptions("static", first_token="prefill")}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def kit_prompts(kit) -> dict[str, list[int]]:
    _, tokenizer = kit["target"]
    return {"ordinary": [tokenizer.bos_token_id] + tokenizer("def add(a, b):\n    return", add_special_tokens=False).input_ids,
            "one_token": tokenizer("The", add_special_tokens=False).input_ids[:1]}


@pytest.fixture(scope="module")
def reference(kit, kit_prompts) -> dict[str, list[int]]:
    target, tokenizer = kit["target"]
    return {case: generate_autoregressive(target, prompt, NEW_TOKENS, GREEDY, torch.Generator(),
                                          tokenizer.eos_token_id).tokens
            for case, prompt in kit_prompts.items()}


@pytest.mark.parametrize("path", list(PREFILL))
@pytest.mark.parametrize("case", ["ordinary", "one_token"])
@pytest.mark.parametrize("method", METHOD_NAMES)
def test_every_method_is_greedy_equal_with_the_first_token_from_the_prefill(method: str, case: str, path: str, kit,
                                                                           proposers, kit_prompts, reference) -> None:
    target, tokenizer = kit["target"]
    result = generate_speculative(target, proposers[method], kit_prompts[case], NEW_TOKENS, GAMMA, GREEDY,
                                  torch.Generator().manual_seed(0), tokenizer.eos_token_id, PREFILL[path])
    assert result.tokens == reference[case]
    assert result.prefill_tokens == 1
    # every token but the prefill's came out of a round: its accepted drafts and the target's own token
    assert sum(result.accepted_per_round) + len(result.accepted_per_round) == len(result.tokens) - 1


@pytest.mark.parametrize("method", ["full", "eagle3", "dflash", "tli", "slrs"])
def test_the_rounds_are_the_original_orders_rounds_after_the_targets_first_token(method: str, kit, proposers,
                                                                                 kit_prompts) -> None:
    """What the first-round table of docs/DFLASH.md measured by hand: decoding the prompt followed by
    the target's greedy first token, one token fewer, in the original order, is the same generation round for
    round."""
    target, tokenizer = kit["target"]
    prompt, eos = kit_prompts["ordinary"], tokenizer.eos_token_id
    prefill = generate_speculative(target, proposers[method], prompt, NEW_TOKENS, GAMMA, GREEDY,
                                   torch.Generator().manual_seed(0), eos, PREFILL["eager"])
    first = prefill.tokens[0]
    original = generate_speculative(target, proposers[method], prompt + [first], NEW_TOKENS - 1, GAMMA, GREEDY,
                                    torch.Generator().manual_seed(0), eos, DecodeOptions("eager"))
    assert [first] + original.tokens == prefill.tokens
    assert original.drafted_per_round == prefill.drafted_per_round
    assert original.accepted_per_round == prefill.accepted_per_round
    assert original.position_accepts == prefill.position_accepts
    assert summarize([prefill]).mean_accepted_length == summarize([original]).mean_accepted_length


def test_the_first_and_second_tokens_follow_the_targets_law(target, drafter, shortlist, prompts) -> None:
    """Temperature 1, the full-head drafter, γ = 1, 3 new tokens: the first token is the prefill's, the second the
    first drafting round's first emission (its accepted draft or the residual sample)."""
    samples, params = 2_000, SamplingParams(temperature=1.0)
    prompt = prompts[2]
    proposer = build_proposer("full", method_inputs("full", drafter=drafter, shortlist=shortlist))
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = standardise(target(torch.tensor([prompt])).logits[0, -1].double(), params)
        # p(x2 | x1) for every x1 in one batched forward
        batch = torch.tensor([prompt + [x] for x in range(vocab)])
        p2 = standardise(target(batch).logits[:, -1].double(), params)
    marginal = p1 @ p2
    first, second = torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)
    generator, accepted, rejected = torch.Generator().manual_seed(3), 0, 0
    for _ in range(samples):
        result = generate_speculative(target, proposer, prompt, 3, 1, params, generator,
                                      options=DecodeOptions(first_token="prefill"))
        assert result.prefill_tokens == 1 and result.drafted_per_round[0] == 1
        first[result.tokens[0]] += 1
        second[result.tokens[1]] += 1
        accepted += result.accepted_per_round[0] == 1
        rejected += result.accepted_per_round[0] == 0
    assert_counts_match(first, p1, samples, "first token (the prefill's)")
    assert_counts_match(second, marginal, samples, "second token (the first round's)")
    assert accepted > 0 and rejected > 0


def test_tau_leaves_the_prefills_token_out() -> None:
    prefill = GenerationResult(tokens=list(range(9)), prompt_length=4, method="full", gamma=4, prefill_tokens=1,
                               drafted_per_round=[4, 4], accepted_per_round=[3, 3])
    assert summarize([prefill]).mean_accepted_length == 4.0  # (9 - 1) tokens over 2 rounds
    original = replace(prefill, prefill_tokens=0, tokens=list(range(8)))
    assert summarize([original]).mean_accepted_length == 4.0


def test_an_unknown_first_token_order_is_refused_naming_the_key() -> None:
    from pipeline.config.sections import load_config

    with pytest.raises(DrafterError, match=r"evaluate.first_token(.|\n)*round or prefill(.|\n)*draft"):
        load_config(None, ["evaluate.first_token=draft"])
    with pytest.raises(DrafterError, match=r"first-token order(.|\n)*evaluate.first_token"):
        DecodeOptions(first_token="draft")
    assert load_config(None, ["evaluate.first_token=prefill"]).evaluate.first_token == "prefill"


def test_an_evaluation_records_and_reports_the_prefill_order(tiny_kit, tmp_path: Path) -> None:
    """The evaluator decodes in the configured order: each row's τ is the rounds' alone, as the engine gives it for the
    same prompts and proposer, and every row is greedy-equal; the report says so, and a report of the original order
    says nothing about it."""
    from pipeline.evaluation.report import PREFILL_NOTE, write_report
    from tests.helpers import kit_evaluator, typed_results

    prompts = {"chat": [[5, 6, 7], [8, 9, 10, 11]], "code": [[12, 13]]}
    evaluator = kit_evaluator(tmp_path, "eager", "evaluate.max_new_tokens=8", "evaluate.first_token=prefill")(prompts)
    assert evaluator.options.first_token == "prefill"
    rows, checks = evaluator.run()
    assert checks and all(check.passed for check in checks)
    full = next(config.proposer for config in evaluator.proposers() if config.method == "full")
    spec = [row for row in rows if row.method == "full"]
    assert {(row.task, row.gamma) for row in spec} == {(task, gamma) for task in prompts for gamma in (2, 3)}
    for row in spec:
        results = [generate_speculative(evaluator.target, full, prompt, 8, row.gamma, GREEDY,
                                        torch.Generator().manual_seed(0), evaluator.eos, evaluator.options)
                   for prompt in prompts[row.task]]
        assert all(result.prefill_tokens == 1 for result in results)
        assert row.tau == pytest.approx(summarize(results).mean_accepted_length), (row.task, row.gamma)
    results = typed_results()
    results.first_token = "prefill"
    _, html_path, md_path = write_report(results, tmp_path / "report")
    assert PREFILL_NOTE in md_path.read_text() and "evaluate.first_token=prefill" in html_path.read_text()
    _, html_path, md_path = write_report(typed_results(), tmp_path / "original")
    assert "first_token" not in md_path.read_text() + html_path.read_text()
