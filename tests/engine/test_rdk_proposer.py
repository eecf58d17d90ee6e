"""RDK (pipeline.rdk, pipeline.engine.rdk): the sparse affinity against the dense construction, and the RDK
proposers in the lossless decode loop.

Models: the tiny kit's test-profile target, same-tokenizer drafter and other-tokenizer drafter (really trained),
in float64. Moments are estimated from the target's own distributions along its sampled continuations of a
few prompts; pruning levels keep the most frequent of those tokens. Every losslessness property checked here
must hold for any affinity, so none depends on how good the estimate is.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.methods import build_proposer
from pipeline.engine.rdk import RedistributedShortlistProposer, RedistributedTLIProposer
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import TargetState
from pipeline.errors import DrafterError
from pipeline.rdk.affinity import (
    Affinity,
    PriorMix,
    TaylorForm,
    dense_affinity,
    fit_confidence_weights,
    kernel_sum,
    restrict,
    scatter_kept,
)
from pipeline.rdk.moments import MomentSums
from pipeline.rdk.prior import (
    EXACT,
    INTERSECTION,
    PRIOR_MIX,
    PRUNED,
    TAYLOR,
    LevelFit,
    RDKPrior,
    analyse,
    pruning_levels,
    transfer,
)
from pipeline.vocab.maps import VocabMap
from tests.engine.conftest import assert_acceptance_law, assert_counts_match, method_inputs, verify_blocks
from tests.helpers import drafted

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0)
SAME = ("pruned", "rdk", "rdk_taylor", "rdk_prior")
OTHER = ("tli_rdk", "tli_rdk_taylor", "tli_rdk_prior")


@pytest.fixture(scope="module")
def kit(tiny_kit) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    load = lambda role: AutoModelForCausalLM.from_pretrained(tiny_kit.path(role), dtype=torch.float64).eval()  # noqa: E731
    tok = AutoTokenizer.from_pretrained(tiny_kit.path("target"))
    other_tok = AutoTokenizer.from_pretrained(tiny_kit.path("drafter_other"))
    target = load("target")
    texts = ["Hello! Can you tell me how to cook rice?", "def add(a, b):\n    return",
             "The weather today is", "Write a short poem about the sea.", "What is the capital of France?"]
    prompts = [tok.encode(t) for t in texts]
    vocab = target.config.vocab_size
    sums = MomentSums(vocab, top_k=32)
    counts = torch.zeros(vocab)
    rows = []
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            out = generate_autoregressive(target, prompt, 48, SAMPLED, torch.Generator().manual_seed(i)).tokens
            ids = prompt + out
            p = torch.softmax(target(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1], -1)
            sums.add(p)
            rows.append(p)
            counts += torch.bincount(torch.tensor(out), minlength=vocab)
    moments = sums.moments()
    ranking = torch.argsort(-(counts + moments.mu), stable=True)
    eos = [tok.eos_token_id]
    levels = pruning_levels(ranking, vocab, [0.1, 0.025], eos)
    vocab_map = VocabMap.build(tok, other_tok)
    levels[INTERSECTION] = vocab_map.intersection_ids_target
    fits = {name: LevelFit(kept=kept, tau=1e-3, prior_weight={"mode": "constant", "weight": None})
            for name, kept in levels.items()}
    prior = RDKPrior(moments, fits, {"required_ids": eos, "vocab_hash": "x"})
    return {"target": target, "drafter": load("drafter"), "other": load("drafter_other"), "tokenizer": tok,
            "other_tokenizer": other_tok, "prompts": prompts, "moments": moments, "prior": prior,
            "vocab_map": vocab_map, "p_rows": torch.cat(rows), "sums": sums,
            "chats": torch.cat([torch.full((r.shape[0],), i) for i, r in enumerate(rows)])}


def _inputs(kit: dict[str, Any], method: str, level: str = "keep_0.025") -> Any:
    return method_inputs(method, drafter=kit["drafter"], drafter_other=kit["other"],
                         drafter_other_tokenizer=kit["other_tokenizer"], target_tokenizer=kit["tokenizer"],
                         vocab_map=kit["vocab_map"], prior=kit["prior"], level=level,
                         target_vocab_size=kit["target"].config.vocab_size)


def test_kernel_sum_is_exact_for_light_and_heavy_scales() -> None:
    """Σ_i a_i exp(−u_i v_j) by the series + heavy blocks equals the direct sum (max abs error 1e-12)."""
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(400, generator=gen, dtype=torch.float64) ** 3 * 4  # mostly light, some heavy
    v = torch.rand(700, generator=gen, dtype=torch.float64) ** 3 * 4
    a = torch.rand(3, 400, generator=gen, dtype=torch.float64)
    direct = a @ torch.exp(-u[:, None] * v[None])
    assert bool((u > 0.5).any()) and bool((v > 0.5).any()) and bool((u <= 0.5).any())
    torch.testing.assert_close(kernel_sum(a, u, v), direct, rtol=0, atol=1e-12)


def test_kernel_calls_index_with_fixed_vectors_never_with_masks() -> None:
    """A boolean-mask index is a nonzero() under the hood: on CUDA a host sync in every RDK draft step (the H100 run's
    sync-debug test caught it). With light and heavy scales mixed, a call runs no nonzero and indexes with no bool
    tensor; the result is unchanged."""
    from torch.overrides import TorchFunctionMode

    from pipeline.rdk.affinity import SeparableKernel

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            flat = list(args) + list((kwargs or {}).values())
            flat += [x for arg in args if isinstance(arg, tuple) for x in arg]
            masks = any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in flat)
            self.calls.append(getattr(func, "__name__", str(func)) + (" [bool index]" if masks else ""))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(1)
    u = torch.rand(300, generator=gen, dtype=torch.float64) ** 3 * 4
    v = torch.rand(500, generator=gen, dtype=torch.float64) ** 3 * 4
    a = torch.rand(2, 300, generator=gen, dtype=torch.float64)
    kernel = SeparableKernel(u, v)
    assert kernel.any_light and not kernel.all_light and kernel.hu.numel() and kernel.hv.numel()
    with Seen() as seen:
        out = kernel(a)
    assert not [c for c in seen.calls if "nonzero" in c or "bool index" in c], seen.calls
    torch.testing.assert_close(out, a @ torch.exp(-u[:, None] * v[None]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("tau", [1e-1, 1e-2, 1e-3, 1e-4, 1e-6])
def test_sparse_affinity_equals_the_dense_construction(kit, tau: float) -> None:
    """Eq. 2's rows for every kept token over the whole test vocabulary (1,024 tokens, dense S from the same
    moments): max abs error 1e-12, rows sum to 1; and on a 300-token subset of the vocabulary the same."""
    moments, prior = kit["moments"], kit["prior"]
    for name in ("keep_0.1", INTERSECTION):
        kept = prior.level(name).kept
        sparse = Affinity(moments, kept, tau).dense_rows()
        dense = dense_affinity(moments, kept, tau)
        assert float((sparse - dense).abs().max()) < 1e-12, name
        torch.testing.assert_close(sparse.sum(-1), torch.ones(kept.numel(), dtype=torch.float64), rtol=0, atol=1e-12)
    subset = torch.argsort(-moments.mu)[:300]
    sub = restrict(moments, subset)
    kept = torch.arange(0, 300, 7)
    assert float((Affinity(sub, kept, tau).dense_rows() - dense_affinity(sub, kept, tau)).abs().max()) < 1e-12


def test_moments_merge_equals_one_pass_and_survive_a_round_trip(kit, tmp_path) -> None:
    """Shard sums merged (what ranks and resumed shards do) equal one pass; save/load keeps every bit."""
    p = kit["p_rows"]
    whole, a, b = MomentSums(p.shape[1], 32), MomentSums(p.shape[1], 32), MomentSums(p.shape[1], 32)
    whole.add(p)
    a.add(p[:70])
    b.add(p[70:])
    a.save(tmp_path / "a.safetensors")
    merged = MomentSums.load(tmp_path / "a.safetensors").merge(b)
    one, two = whole.moments(), merged.moments()
    assert torch.equal(one.rows, two.rows) and torch.equal(one.cols, two.cols)
    torch.testing.assert_close(one.vals, two.vals, rtol=1e-12, atol=0)
    torch.testing.assert_close(one.mu, two.mu, rtol=1e-12, atol=0)
    assert one.count == two.count == p.shape[0] and 0 < one.covered <= 1
    torch.testing.assert_close(one.mu.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_redistributions_are_distributions_over_the_target(kit) -> None:
    """Each redistribution maps a kept distribution to a distribution on all of T; Taylor with the true p and
    TLI are ordered as Eq. 3 implies only through normalisation, so just the law's shape is asserted."""
    prior, moments = kit["prior"], kit["moments"]
    kept = prior.level("keep_0.025").kept
    q = torch.softmax(torch.randn(4, kept.numel(), dtype=torch.float64), -1)
    for transform in (Affinity(moments, kept, 1e-3), TaylorForm(moments.mu, kept), PriorMix(moments.mu, kept)):
        out = transform.redistribute(q)
        assert out.shape == (4, moments.vocab_size) and float(out.min()) > -1e-15
        torch.testing.assert_close(out.sum(-1), torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
        assert float(out[:, torch.isin(torch.arange(moments.vocab_size), kept, invert=True)].sum()) > 0
    mix = PriorMix(moments.mu, kept)
    torch.testing.assert_close(mix.weight, 1 - float(moments.mu[kept].sum()))


def test_mbsu_charges_the_bytes_a_redistribution_reads_and_writes_per_step(kit) -> None:
    """An RDK configuration's c adds its redistribution's bytes per draft step over the target's weight bytes. The
    exact affinity, at a τ where some tokens are heavy, reads its kernel's index vectors, power series and dense heavy
    blocks, c_i and the sparse correction (offsets, indices, values), and writes two |T|-wide float64 rows; the prior
    forms read their vectors and write two such rows. A proposer without a redistribution adds nothing."""
    from pipeline.evaluation.configurations import redistribution_cost

    prior, moments, target = kit["prior"], kit["moments"], kit["target"]
    kept, width = prior.level("keep_0.025").kept, moments.vocab_size
    affinity = Affinity(moments, kept, 1e-6)
    kernel, csr = affinity.kernel, affinity.correction_t
    assert kernel.heavy_rows.numel() and kernel.heavy_cols.numel() and csr.values().numel()
    read = (kernel.lu, kernel.lv, kernel.hu, kernel.hv, kernel.powers_u, kernel.powers_v, kernel.heavy_cols,
            kernel.heavy_rows, affinity.row_scale, csr.crow_indices(), csr.col_indices(), csr.values())
    assert affinity.step_bytes() == sum(t.numel() * t.element_size() for t in read) + 2 * width * 8
    assert TaylorForm(moments.mu, kept).step_bytes() == (width + kept.numel()) * 8 + 2 * width * 8
    binned = PriorMix(moments.mu, kept, edges=[0.3, 0.6], weights=[0.1, 0.2, 0.3])
    assert binned.step_bytes() == (width + kept.numel() + 2 + 3) * 8 + 2 * width * 8
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    for method in SAME[1:] + OTHER:
        proposer = build_proposer(method, _inputs(kit, method))
        assert redistribution_cost(proposer, target) == proposer.transform.step_bytes() / weight_bytes > 0, method
    assert redistribution_cost(build_proposer(SAME[0], _inputs(kit, SAME[0])), target) == 0.0


def test_analysis_reports_every_method_and_a_tau_curve(kit) -> None:
    """The held-out analysis: one curve entry per τ, τ chosen from the grid, α in [0, 1] for every method,
    and the oracle (true p in Eq. 3) never below the prior form by more than rounding."""
    p = kit["p_rows"]
    kept = kit["prior"].level("keep_0.1").kept
    q_kept = torch.softmax(torch.log(p[:, kept] + 1e-9) + 0.3 * torch.randn(p.shape[0], kept.numel(),
                                                                           dtype=torch.float64), -1)
    fit = analyse(p, q_kept, kit["chats"], kept, kit["moments"], [1e-1, 1e-2, 1e-3], [kit["tokenizer"].eos_token_id])
    assert [c["tau"] for c in fit.figures["tau_curve"]] == [1e-1, 1e-2, 1e-3] and fit.tau in (1e-1, 1e-2, 1e-3)
    assert all(0 <= a <= 1 for a in fit.figures["alpha"].values())
    assert fit.figures["positions"]["fit"] + fit.figures["positions"]["test"] == p.shape[0]


def test_analysis_chooses_on_some_chats_and_scores_on_the_others(kit) -> None:
    """τ and the prior weight were chosen on the even positions and every α reported on the odd positions of the
    same answers, each scored next to the tokens it was chosen on. Now the chats split: here five answers of 48
    positions, chats 0, 2 and 4 choose and chats 1 and 3 score, and TLI's α equals Σ min(p, q) recomputed over
    the scoring chats' positions alone (1e-12)."""
    p, chats = kit["p_rows"], kit["chats"]
    kept = kit["prior"].level("keep_0.1").kept
    q_kept = torch.softmax(torch.log(p[:, kept] + 1e-9) + 0.3 * torch.randn(p.shape[0], kept.numel(),
                                                                           generator=torch.Generator().manual_seed(5),
                                                                           dtype=torch.float64), -1)
    fit = analyse(p, q_kept, chats, kept, kit["moments"], [1e-1, 1e-2, 1e-3], [kit["tokenizer"].eos_token_id])
    assert fit.figures["positions"] == {"fit": 3 * 48, "test": 2 * 48}
    scoring = chats % 2 == 1
    tli = scatter_kept(q_kept[scoring], kept, kit["moments"].vocab_size)
    assert abs(fit.figures["alpha"]["tli"] - float(torch.minimum(p[scoring], tli).sum(-1).mean())) < 1e-12
    with pytest.raises(DrafterError, match=r"at least two held-out chats(.|\n)*from 1 chat"):
        analyse(p[:48], q_kept[:48], chats[:48], kept, kit["moments"], [1e-2], [kit["tokenizer"].eos_token_id])


def test_transfer_scores_the_fitted_choices_on_another_task_without_refitting(kit) -> None:
    """The code column of the α table: τ and both prior weights fitted on one half of the rows, scored on every
    position of the other half. Each α equals Σ min(p, q) recomputed here from the dense affinity (Mᵀq') and the
    fitted weight table (1e-12), so a transfer that refitted anything on the new rows would fail."""
    p = kit["p_rows"]
    eos = [kit["tokenizer"].eos_token_id]
    kept = kit["prior"].level("keep_0.1").kept
    gen = torch.Generator().manual_seed(3)
    q_kept = torch.softmax(torch.log(p[:, kept] + 1e-9) + 0.5 * torch.randn(p.shape[0], kept.numel(), generator=gen,
                                                                           dtype=torch.float64), -1)
    half = p.shape[0] // 2
    taus = [1e-1, 1e-2, 1e-3]
    fit = analyse(p[:half], q_kept[:half], kit["chats"][:half], kept, kit["moments"], taus, eos)
    out = transfer(fit, p[half:], q_kept[half:], kit["moments"], taus, eos)
    target, q = p[half:], q_kept[half:]

    def alpha(draft: torch.Tensor) -> float:
        return float(torch.minimum(target, draft).sum(-1).mean())

    moments = kit["moments"]
    confidence = fit.figures["prior_confidence"]
    binned = PriorMix(moments.mu, kept, edges=confidence["edges"], weights=confidence["weights"])
    constant = PriorMix(moments.mu, kept)
    tli = scatter_kept(q, kept, moments.vocab_size)
    expected = {"tli": alpha(tli), "rdk": alpha(q @ dense_affinity(moments, kept, fit.tau)),
                "rdk_prior_constant": alpha((1 - constant.weight) * tli + constant.weight * constant.oov),
                "rdk_prior_confidence": alpha(binned.redistribute(q))}
    for name, value in expected.items():
        assert abs(out["alpha"][name] - value) < 1e-12, (name, out["alpha"][name], value)
    assert out["tau"] == fit.tau and out["positions"] == p.shape[0] - half
    assert [c["tau"] for c in out["tau_curve"]] == taus
    assert out["best_tau_here"]["alpha"] == max(c["alpha"] for c in out["tau_curve"]) >= out["alpha"]["rdk"] - 1e-15
    refit = fit_confidence_weights(q, 1.0 - target[:, kept].sum(-1))
    assert refit != (confidence["edges"], confidence["weights"])  # the other half would have fitted other weights


@torch.no_grad()
def _law_from_scratch(kit: dict[str, Any], kind: str, context: list[int], tokens: list[int],
                      params: SamplingParams) -> torch.Tensor:
    """q rows recomputed without caches: the pruned drafter's head on the whole prefix, standardised over the
    kept rows, redistributed."""
    drafter, prior = kit["drafter"], kit["prior"]
    transform = prior.transform(kind, "keep_0.025")
    rows = []
    for t in range(len(tokens)):
        logits = drafter(torch.tensor([context + tokens[:t]])).logits[0, -1][transform.kept]
        p = transform.redistribute(standardise(logits, params)).clamp_min(0)
        rows.append(p / p.sum())
    return torch.stack(rows)


@pytest.mark.parametrize(("method", "kind"), [("rdk", EXACT), ("rdk_taylor", TAYLOR), ("rdk_prior", PRIOR_MIX)])
def test_q_is_the_redistributed_law(kit, method: str, kind: str) -> None:
    """Along sampled decodes (accepts and rejects), every reported row equals the from-scratch law of the
    redistribution the registry gives the method."""
    proposer = build_proposer(method, _inputs(kit, method))
    gen = torch.Generator().manual_seed(1)
    seen = 0
    for prompt in kit["prompts"][:2]:
        context = list(prompt)
        for _ in range(3):
            tokens, q = drafted(proposer.propose(context, 3, SAMPLED, gen, TargetState()))
            torch.testing.assert_close(q, _law_from_scratch(kit, kind, context, tokens, SAMPLED), rtol=0, atol=1e-9)
            assert all(q[i, t] > 0 for i, t in enumerate(tokens))
            context = context + tokens[:1]
            seen += len(tokens)
    assert seen >= 12


@pytest.mark.parametrize("method", SAME + OTHER)
def test_greedy_equals_autoregressive(kit, method: str) -> None:
    """Every prompt, 32 new tokens, γ 1 and 3: greedy speculative output is the autoregressive output token for
    token, with drafts accepted and rejected."""
    proposer = build_proposer(method, _inputs(kit, method))
    accepted = rejected = 0
    for gamma in (1, 3):
        for prompt in kit["prompts"]:
            ar = generate_autoregressive(kit["target"], prompt, 32, GREEDY, torch.Generator())
            spec = generate_speculative(kit["target"], proposer, prompt, 32, gamma, GREEDY, torch.Generator())
            assert spec.tokens == ar.tokens, (method, gamma, prompt)
            accepted += sum(spec.accepted_per_round)
            rejected += sum(a < d for a, d in zip(spec.accepted_per_round, spec.drafted_per_round))
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def _real_case(kit: dict[str, Any], method: str, oov: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p (4 rows) and a real γ = 3 proposal's q at the first context along the first prompt's greedy
    continuation where every verifier path runs (each a_i in (0.05, 0.95)) and q_0 puts more than ``oov`` on
    tokens outside the kept set (out-of-vocabulary drafts)."""
    target, prompt = kit["target"], kit["prompts"][0]
    proposer = build_proposer(method, _inputs(kit, method))
    kept = kit["prior"].level(INTERSECTION if method.startswith("tli_") else "keep_0.025").kept
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[kept] = False
    continuation = generate_autoregressive(target, prompt, 30, GREEDY, torch.Generator()).tokens
    for k in range(0, 30, 2):
        context = prompt + continuation[:k]
        proposer.reset()
        drafts, q = drafted(proposer.propose(context, 3, SAMPLED, torch.Generator().manual_seed(k), TargetState()))
        if len(drafts) < 3:
            continue
        with torch.no_grad():
            p = standardise(target(torch.tensor([context + drafts])).logits[0, len(context) - 1 :], SAMPLED)
        a = torch.minimum(p[:3], q).sum(-1)
        if bool(((a > 0.05) & (a < 0.95)).all()) and float(q[0][outside].sum()) > oov:
            return p, q, outside
    raise AssertionError("no context exercises every path of the verifier with out-of-vocabulary drafts")


@pytest.mark.parametrize(("method", "oov"), [("rdk", 0.05), ("rdk_taylor", 0.0), ("tli_rdk_prior", 0.05)])
def test_verify_level_output_law_and_acceptance_law(kit, method: str, oov: float) -> None:
    """Speculative sampling with the real rows of one γ = 3 RDK proposal (temperature 1): over n = 200,000
    blocks (x_i ~ q_i, verified by verify_speculative) the first emitted token follows p_0 and the accepted
    count follows [1-a0, a0(1-a1), a0 a1 (1-a2), a0 a1 a2], a_i = Σ min(p_i, q_i) (Leviathan et al. 2023,
    Thm. 3.5). Bound per outcome: Bernstein at e^-18 per side, |count - nπ| <= 6 + 6 sqrt(1 + nπ(1-π))
    (conftest.assert_counts_match). Out-of-vocabulary drafts must be both drawn and accepted — except for the
    Taylor form, which by Eq. 3 puts only about θ·μ_j/N on each out-of-vocabulary token (positive, too little
    to be drawn in 200,000 blocks)."""
    p, q, outside = _real_case(kit, method, oov)
    gen = torch.Generator().manual_seed(5)
    n = 200_000
    x, n_accepted, next_token = verify_blocks(p, q, n, gen)
    first = torch.where(n_accepted >= 1, x[:, 0], next_token)
    assert_counts_match(torch.bincount(first, minlength=p.shape[1]), p[0], n, "first emitted token")
    if oov > 0:
        assert int((outside[x[:, 0]] & (n_accepted >= 1)).sum()) > 0  # an OOV draft accepted
    assert_acceptance_law(p, q, n_accepted, n)


@pytest.mark.parametrize("method", SAME + OTHER)
def test_drafted_tokens_follow_q(kit, method: str) -> None:
    """3,000 γ = 1 proposals of each method from one context at the sampled settings: every call reports the same
    q row, and the drafted-token counts match it (Bernstein bound as above). For the cross-tokenizer methods
    (TLI + RDK) this is the only check of q against what they draft."""
    proposer = build_proposer(method, _inputs(kit, method))
    context = kit["prompts"][2]
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(kit["target"].config.vocab_size)
    q0 = None
    for _ in range(3000):
        tokens, q = drafted(proposer.propose(context, 1, SAMPLED, gen, TargetState()))
        if q0 is None:
            q0 = q[0]
        torch.testing.assert_close(q[0], q0, rtol=0, atol=0)  # the same context, the same law
        counts[tokens[0]] += 1
    assert int((q0 > 0).sum()) > 1  # a law with a choice to make
    assert_counts_match(counts, q0, 3000, f"{method} drafts")


def test_bad_input_is_refused(kit) -> None:
    """τ ≤ 0, a kept set without EOS, an empty intersection, an affinity for another target or another kept
    set: clear errors naming expected and found."""
    moments, prior = kit["moments"], kit["prior"]
    kept = prior.level("keep_0.025").kept
    eos = kit["tokenizer"].eos_token_id
    for tau in (0.0, -1.0, math.nan):
        with pytest.raises(DrafterError, match="tau > 0"):
            Affinity(moments, kept, tau)
    with pytest.raises(DrafterError, match="drops the end-of-sequence"):
        Affinity(moments, kept[kept != eos], 1e-3, required=[eos])
    with pytest.raises(DrafterError, match="non-empty"):
        Affinity(moments, torch.tensor([], dtype=torch.long), 1e-3)
    empty = VocabMap(drafter_to_target=torch.full((10,), -1), target_to_drafter=torch.full((10,), -1))
    with pytest.raises(DrafterError, match="share no token"):
        RedistributedTLIProposer(kit["other"], kit["other_tokenizer"], kit["tokenizer"], empty,
                                 TaylorForm(moments.mu, kept))
    with pytest.raises(DrafterError, match="another kept-token set"):
        RedistributedTLIProposer(kit["other"], kit["other_tokenizer"], kit["tokenizer"], kit["vocab_map"],
                                 TaylorForm(moments.mu, kept))
    with pytest.raises(DrafterError, match="another target or tokenizer"):
        prior.check_target("y" * 64, moments.vocab_size)
    with pytest.raises(DrafterError, match="no kept set"):
        prior.transform(EXACT, "keep_0.5")
    with pytest.raises(DrafterError, match=r"(?s)Unknown RDK redistribution 'rdk'.*exact"):
        prior.transform("rdk", "keep_0.1")
    assert prior.names(PRUNED) == ["keep_0.1", "keep_0.025"]
    assert isinstance(RedistributedShortlistProposer(kit["drafter"], prior.transform(PRIOR_MIX, "keep_0.1")),
                      RedistributedShortlistProposer)
    scatter_kept(torch.ones(1, kept.numel()), kept, moments.vocab_size)
