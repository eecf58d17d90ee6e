"""The evaluation's greedy-equality check on the test kit: a configuration's greedy output that differs from
autoregressive decoding passes only where every difference is a floating-point tie, the target's two logits at the
first differing token within ``evaluate.tie_tolerance`` of each other (relative to the largest logit)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from pipeline.evaluation.evaluator import GREEDY
from pipeline.progress import Progress
from tests.helpers import kit_evaluator

PROMPT = [5, 6, 7]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory: pytest.TempPathFactory, tiny_kit) -> Any:
    """An evaluator over the test kit (full drafts at γ 2, 6 greedy tokens, tie tolerance 1e-4) on one prompt."""
    return kit_evaluator(tmp_path_factory.mktemp("greedy-check"), "eager", "evaluate.max_new_tokens=6",
                         "evaluate.gammas=[2]", f"evaluate.tie_tolerance={TOLERANCE}")({"chat": [PROMPT]})


class RunnerUpPulled(torch.nn.Module):
    """The target with its runner-up token's logit set to ``gap`` below its top token's, at every position."""

    def __init__(self, inner: torch.nn.Module, top: int, runner_up: int, gap: float) -> None:
        super().__init__()
        self.inner, self.top, self.runner_up, self.gap = inner, top, runner_up, gap

    def forward(self, *args: object, **kwargs: object) -> object:
        out = self.inner(*args, **kwargs)
        out.logits[..., self.runner_up] = out.logits[..., self.top] - self.gap
        return out


def test_a_divergence_within_the_tie_tolerance_is_a_tie_and_one_beyond_it_is_not(
        evaluator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A greedy divergence to the runner-up token whose logit is within tie_tolerance × max(1, largest logit) of the
    top one is a tie (half the tolerance here); at twice the tolerance it is not. Nothing showed that a tie is ever
    recognised: a check that called nothing a tie passed every test of _is_tie."""
    with torch.no_grad():
        logits = evaluator.target(torch.tensor([PROMPT])).logits[0, -1].double()
    top, runner_up = logits.topk(2).indices.tolist()
    scale = max(1.0, abs(float(logits.max())))
    real = evaluator.target
    for share, tie in ((0.5, True), (2.0, False)):
        monkeypatch.setattr(evaluator, "target", RunnerUpPulled(real, top, runner_up, share * TOLERANCE * scale))
        assert evaluator._is_tie(PROMPT, [top], [runner_up]) is tie, share


def test_a_greedy_mismatch_that_is_no_tie_fails_the_check(evaluator: Any) -> None:
    """The configuration's greedy output compared with an autoregressive one whose third token is the target's least
    likely there (so the two differ, and by no tie): the cell's greedy check fails and says 0 of 1 mismatches are
    ties. Against the true autoregressive output the same cell passes."""
    config = next(evaluator.proposers())
    ar = evaluator._decode_all([PROMPT], None, 0, GREEDY, 0)
    assert len(ar[0].tokens) == 6
    with torch.no_grad():
        logits = evaluator.target(torch.tensor([PROMPT + ar[0].tokens[:2]])).logits[0, -1]
    far = int(logits.argmin())
    assert far != ar[0].tokens[2]
    other = [dataclasses.replace(ar[0], tokens=[*ar[0].tokens[:2], far, *ar[0].tokens[3:]])]
    with Progress("greedy check", 2, "generation") as decoding:
        row, check = evaluator._cell("chat", [PROMPT], config, 2, other, other, decoding)
        same_row, same = evaluator._cell("chat", [PROMPT], config, 2, ar, ar, decoding)
    assert not check.passed and not row.greedy_equal and row.greedy_ties is None, check
    assert "0/1 prompts token-for-token equal" in check.detail and "0 of 1 mismatches are" in check.detail, check
    assert same.passed and same_row.greedy_equal, same
