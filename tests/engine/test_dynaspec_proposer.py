"""DynaSpec's routed proposer and PA-FR (pipeline.engine.dynaspec) in the lossless decode loop.

Models: the tiny kit's test-profile target and same-tokenizer drafter (really trained, so drafts are both
accepted and rejected), in float64. The clustering is a real FAISS spherical k-means of the drafter's head;
the router is a seeded, untrained MLP — every property checked here (the gathered head is the full head's
rows, q is the law the drafts were drawn from, greedy output equals the target's, the output law is the
target's) must hold for any router.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import Generator

from pipeline.dynaspec.budget import ClusterBudget, ShortlistPolicy
from pipeline.dynaspec.clusters import spherical_kmeans
from pipeline.dynaspec.router import Router
from pipeline.engine.dynaspec import PositionAwareFrequencyProposer, RoutedShortlistProposer
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.methods import build_proposer
from pipeline.engine.proposers import Proposal
from pipeline.engine.routed_head import RoutedHead
from pipeline.engine.sampling import SamplingParams, standardise
from pipeline.engine.session import TargetState
from pipeline.errors import DrafterError
from tests.engine.conftest import assert_acceptance_law, assert_counts_match, method_inputs, verify_blocks
from tests.helpers import drafted, requires_triton

GREEDY = SamplingParams()
CLUSTERS = 24
NEEDS_TRITON = requires_triton()
KERNEL = pytest.param("kernel", marks=NEEDS_TRITON)
"""The routed head's Triton kernel, run by Triton's interpreter on these CPU tensors."""


def kernel_case(method: str) -> Any:
    """``(method, "kernel")``: the method with its routed head computed by the (interpreted) Triton kernel."""
    return pytest.param(method, "kernel", marks=NEEDS_TRITON, id=f"{method}-kernel")


@pytest.fixture(scope="module")
def kit(tiny_kit) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    load = lambda role: AutoModelForCausalLM.from_pretrained(tiny_kit.path(role), dtype=torch.float64).eval()  # noqa: E731
    tok = AutoTokenizer.from_pretrained(tiny_kit.path("target"))
    drafter = load("drafter")
    head = drafter.get_output_embeddings().weight
    clustering = spherical_kmeans(head, CLUSTERS, niter=20, seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        router = Router(2 * head.shape[1], 32, CLUSTERS).double().eval()
    texts = ["Hello! Can you tell me how to cook rice?", "def add(a, b):\n    return",
             "The weather today is", "Write a short poem about the sea."]
    prompts = [tok.encode(t) for t in texts]
    # a frequency ranking from the drafter's own greedy text on the prompts (what count does on calibration data)
    counts = np.zeros(head.shape[0], dtype=np.int64)
    for p in prompts:
        out = generate_autoregressive(drafter, p, 40, GREEDY, torch.Generator()).tokens
        np.add.at(counts, np.asarray(p + out), 1)
    ranking = np.lexsort((np.arange(counts.size), -counts))
    policy = ShortlistPolicy(keep_ids=(tok.eos_token_id,), fixed=ClusterBudget("fixed", 8),
                             pa=ClusterBudget("pa", 8, 14), pa_fr_kmax=256, ranking=ranking)
    return {"target": load("target"), "drafter": drafter, "tokenizer": tok, "clustering": clustering,
            "router": router, "policy": policy, "prompts": prompts}


def _inputs(kit: dict[str, Any], method: str) -> Any:
    return method_inputs(method, drafter=kit["drafter"], clustering=kit["clustering"], router=kit["router"],
                         policy=kit["policy"], target_vocab_size=kit["target"].config.vocab_size)


def _proposer(kit: dict[str, Any], method: str, head: str = "auto") -> Any:
    """The registry's proposer; with ``head`` other than auto, its routed head computed by that path."""
    proposer = build_proposer(method, _inputs(kit, method))
    if head != "auto":
        proposer.routed = RoutedHead(kit["drafter"], kit["clustering"], [kit["tokenizer"].eos_token_id], mode=head)
    return proposer


class Recording:
    """Keeps each round's context, sampling parameters and proposal; with ``shadow``, also asks (and
    records) each round with those parameters first, so q is checked at every cache state greedy decoding
    produced."""

    def __init__(self, inner: Any, shadow: SamplingParams | None = None) -> None:
        self.inner, self.name, self.target_layers, self.shadow = inner, inner.name, inner.target_layers, shadow
        self.generator = torch.Generator().manual_seed(7)
        self.rounds: list[tuple[list[int], SamplingParams, tuple[list[int], torch.Tensor]]] = []

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, context: list[int], gamma: int, params: SamplingParams, generator: Generator,
                state: TargetState) -> Proposal:
        if self.shadow is not None:
            self.rounds.append((list(context), self.shadow,
                                drafted(self.inner.propose(context, gamma, self.shadow, self.generator, state))))
        proposal = self.inner.propose(context, gamma, params, generator, state)
        self.rounds.append((list(context), params, drafted(proposal)))  # host ids for the checks
        return proposal


@torch.no_grad()
def routed_law_from_scratch(kit: dict[str, Any], budget: ClusterBudget, context: list[int], tokens: list[int],
                            params: SamplingParams) -> torch.Tensor:
    """q rows recomputed without caches: the drafter on the whole prefix, the router on
    [E(x_t), h_{t-1}], the union of the top-k_c(t) clusters plus EOS, the head's rows of that union."""
    drafter, clustering, router = kit["drafter"], kit["clustering"], kit["router"]
    eos = kit["tokenizer"].eos_token_id
    vocab = kit["target"].config.vocab_size
    rows = []
    for t in range(len(tokens)):
        prefix = context + tokens[:t]
        hidden = drafter.base_model(torch.tensor([prefix])).last_hidden_state[0]
        previous = hidden[-2] if len(prefix) > 1 else torch.zeros_like(hidden[-1])
        feature = torch.cat([drafter.get_input_embeddings()(torch.tensor(prefix[-1])), previous])
        chosen = torch.topk(router(feature), budget.at(t)).indices.tolist()
        ids = sorted(set(np.flatnonzero(np.isin(clustering.assignment, chosen)).tolist()) | {eos})
        logits = drafter.get_output_embeddings()(hidden[-1])[ids]
        q = torch.zeros(vocab, dtype=torch.float64)
        q[ids] = standardise(logits, params)
        rows.append(q)
    return torch.stack(rows)


def _accepts_and_rejects(results: list[Any]) -> tuple[int, int]:
    accepted = sum(sum(r.accepted_per_round) for r in results)
    rejected = sum(sum(a < d for a, d in zip(r.accepted_per_round, r.drafted_per_round)) for r in results)
    return accepted, rejected


@pytest.mark.parametrize("mode", [KERNEL, "torch", "blocks"])
def test_routed_head_is_the_full_heads_rows(kit, mode: str) -> None:
    """For any chosen clusters the routed head's logits equal the full head's logits at the shortlist ids
    (float64, to 1e-12: a smaller matmul may sum in another order), the ids are the chosen clusters' members plus
    EOS, each once, and the rest of the fixed-capacity buffer is padding (id -1, logit -inf)."""
    eos = kit["tokenizer"].eos_token_id
    head = RoutedHead(kit["drafter"], kit["clustering"], [eos], mode=mode)
    hidden = torch.randn(kit["drafter"].config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = kit["drafter"].get_output_embeddings()(hidden).detach()
    eos_cluster = int(kit["clustering"].assignment[eos])
    for chosen in ([0], [3, 1, 7], list(range(CLUSTERS)), [c for c in range(5) if c != eos_cluster]):
        out = head.shortlist(hidden, torch.tensor(chosen))
        n = int(out.count)
        ids = out.ids[:n]
        members = set(np.flatnonzero(np.isin(kit["clustering"].assignment, chosen)).tolist())
        assert sorted(ids.tolist()) == sorted(members | {eos})
        assert ids.unique().numel() == ids.numel()
        assert out.ids.shape == out.logits.shape == (head.capacity(len(chosen)),)
        assert (out.ids[n:] == -1).all() and torch.isneginf(out.logits[n:]).all()
        torch.testing.assert_close(out.logits[:n], full[ids], rtol=0, atol=1e-12)
        rows, count = head.select(torch.tensor(chosen))  # the torch path's rows: the same set
        assert int(count[0]) == n and sorted(head.token_ids(rows[0, :n]).tolist()) == sorted(ids.tolist())


@pytest.mark.parametrize(("method", "head"), [("dynaspec", "auto"), ("dynaspec_pa", "auto"), ("dynaspec_pa", "torch"),
                                             kernel_case("dynaspec_pa")])
def test_q_is_the_routed_law_from_scratch(kit, method: str, head: str) -> None:
    """Every q row equals the law recomputed from scratch (atol 1e-9): over a sampled generation
    (temperature 0.8, top-p 0.95, γ 4) and over a greedy one (γ 5) whose rounds are each also asked with
    those sampling parameters first, so re-synced caches after accepts and rejects are covered. Through the
    interpreted kernel (slow) the sampled generation alone: what the kernel computes is a round's head rows, whatever
    the caches before it; the re-syncs are the proposer's, the same under every head, and the other cases cover them."""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    budget = kit["policy"].fixed if method == "dynaspec" else kit["policy"].pa
    sampled = Recording(_proposer(kit, method, head))
    results = [generate_speculative(kit["target"], sampled, kit["prompts"][0], 30, 4, params, torch.Generator().manual_seed(0))]
    rounds = list(sampled.rounds)
    if head != "kernel":
        greedy = Recording(_proposer(kit, method, head), shadow=params)
        results.append(generate_speculative(kit["target"], greedy, kit["prompts"][1], 30, 5, GREEDY, torch.Generator()))
        rounds += greedy.rounds
    accepted, rejected = _accepts_and_rejects(results)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    assert len(rounds) >= (8 if head == "kernel" else 20)
    for context, round_params, (tokens, q) in rounds:
        assert q.dtype == torch.float64 and q.shape == (len(tokens), kit["target"].config.vocab_size)
        assert all(q[i, t] > 0 for i, t in enumerate(tokens))
        torch.testing.assert_close(q, routed_law_from_scratch(kit, budget, context, tokens, round_params),
                                   rtol=0, atol=1e-9)


@pytest.mark.parametrize(("method", "head"), [("dynaspec", "auto"), ("dynaspec_pa", "auto"), ("pa_fr", "auto"),
                                             ("dynaspec", "torch"), kernel_case("dynaspec_pa")])
def test_greedy_equals_autoregressive(kit, method: str, head: str) -> None:
    """Every prompt, 40 new tokens, γ 1, 3 and 5: greedy speculative output is the autoregressive output
    token for token, with drafts accepted and rejected; shortlist sizes follow the budget per position.
    Through the interpreted kernel (slow): DynaSpec-PA, whose budget changes k at every position, γ 5 on one
    prompt (``test_q_is_the_routed_law_from_scratch`` checks the kernel's every q row over two more generations)."""
    proposer = _proposer(kit, method, head)
    results = []
    for gamma in (5,) if head == "kernel" else (1, 3, 5):
        for prompt in kit["prompts"][:1] if head == "kernel" else kit["prompts"]:
            ar = generate_autoregressive(kit["target"], prompt, 40, GREEDY, torch.Generator())
            spec = generate_speculative(kit["target"], proposer, prompt, 40, gamma, GREEDY, torch.Generator())
            assert spec.tokens == ar.tokens, (method, gamma, prompt)
            results.append(spec)
    accepted, rejected = _accepts_and_rejects(results)
    assert accepted > 0 and rejected > 0, (accepted, rejected)
    sizes = proposer.head_stats.per_position()
    assert len(sizes) == 5 and proposer.head_stats.ms_per_step() > 0
    if head == "kernel":  # the shortlist sizes are the valid lengths the kernel left on the device
        auto = _proposer(kit, method)
        for prompt in kit["prompts"][:1]:
            generate_speculative(kit["target"], auto, prompt, 40, 5, GREEDY, torch.Generator())
        assert sizes == auto.head_stats.per_position()
    if method == "pa_fr":  # K_fr = 256, 256, 85, 64, 51 (+ EOS when it ranks below)
        assert [round(s) for s in sizes][:2] == [256, 256] or sizes[0] == 257
        assert sizes[2] < sizes[1] and sizes[4] < sizes[3]
    if method == "dynaspec_pa":  # Eq. 3 with k0=14, k1=8: 14, 8, 2, 1, 1 clusters
        assert sizes[0] > sizes[1] > sizes[2] >= sizes[3]


def _real_case(kit: dict[str, Any], proposer: Any, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's laws p (4 rows) and a real γ = 3 proposal's q at the first context along the first
    prompt's greedy continuation where every verifier path runs (each a_i in (0.05, 0.95)) and p_0 puts
    at least 1 % outside the first shortlist (reachable only through the residual)."""
    target, prompt = kit["target"], kit["prompts"][0]
    continuation = generate_autoregressive(target, prompt, 30, GREEDY, torch.Generator()).tokens
    for k in range(0, 30, 2):
        context = prompt + continuation[:k]
        proposer.reset()
        drafts, q = drafted(proposer.propose(context, 3, params, torch.Generator().manual_seed(k), TargetState()))
        with torch.no_grad():
            p = standardise(target(torch.tensor([context + drafts])).logits[0, len(context) - 1 :], params)
        a = torch.minimum(p[:3], q).sum(-1)
        outside = float(p[0][q[0] == 0].sum())
        if bool(((a > 0.05) & (a < 0.95)).all()) and outside > 0.01:
            return p, q
    raise AssertionError("no context exercises every path of the verifier")


@pytest.mark.parametrize("method", ["dynaspec_pa", "pa_fr"])
def test_verify_level_output_law_and_acceptance_law(kit, method: str) -> None:
    """Speculative sampling with the real rows of one γ = 3 proposal (temperature 1): over n = 200,000
    blocks (x_i ~ q_i, verified by verify_speculative), the first emitted token follows p_0 — including the
    tokens off the routed shortlist, emitted only through the residual — and the accepted count k follows
    [1-a0, a0(1-a1), a0 a1 (1-a2), a0 a1 a2], a_i = Σ min(p_i, q_i) (Leviathan et al. 2023, Thm. 3.5).
    Bound per outcome: Bernstein at e^-18 per side, |count - nπ| <= 6 + 6 sqrt(1 + nπ(1-π))
    (conftest.assert_counts_match); a zero-probability outcome must never occur. The law given (p, q) does not
    depend on how q was computed: the interpreted kernel's rows are the torch path's to 1e-9 in
    ``test_q_is_the_routed_law_from_scratch``, so the kernel does not run these 200,000 blocks again."""
    p, q = _real_case(kit, _proposer(kit, method), SamplingParams(temperature=1.0))
    gen = torch.Generator().manual_seed(5)
    n = 200_000
    x, n_accepted, next_token = verify_blocks(p, q, n, gen)  # x_i ~ q_i, verified block by block
    first = torch.where(n_accepted >= 1, x[:, 0], next_token)
    assert_counts_match(torch.bincount(first, minlength=p.shape[1]), p[0], n, "first emitted token")
    assert int((q[0][first] == 0).sum()) > 0  # emitted off the shortlist, through the residual
    assert_acceptance_law(p, q, n_accepted, n)


@pytest.mark.parametrize("method", ["dynaspec", "dynaspec_pa", "pa_fr"])
def test_drafted_tokens_follow_q(kit, method: str) -> None:
    """3,000 γ = 1 proposals from one context at temperature 1: the drafted token's counts match the q the
    proposer reported (Bernstein bound as above): q is the law the drafts are drawn from."""
    proposer = build_proposer(method, _inputs(kit, method))
    context = kit["prompts"][2]
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(kit["target"].config.vocab_size)
    q0 = None
    for _ in range(3000):
        tokens, q = drafted(proposer.propose(context, 1, params, gen, TargetState()))
        q0 = q[0] if q0 is None else q0
        torch.testing.assert_close(q[0], q0, rtol=0, atol=1e-12)  # same context, same law
        counts[tokens[0]] += 1
    assert_counts_match(counts, q0, 3000, f"{method} drafts")


def test_bad_input_is_refused(kit, tmp_path) -> None:
    """A clustering of another head, a router for another number of clusters, budgets Eq. 3 forbids or the
    clustering cannot meet, shortlists that would drop EOS, a ranking of foreign ids: clear errors."""
    drafter, clustering, router = kit["drafter"], kit["clustering"], kit["router"]
    other = spherical_kmeans(kit["target"].get_output_embeddings().weight, CLUSTERS, seed=0)
    eos = (kit["tokenizer"].eos_token_id,)
    with pytest.raises(DrafterError, match="computed from another LM head|another size"):
        RoutedShortlistProposer(drafter, other, router, ClusterBudget("fixed", 4), keep_ids=eos)
    with pytest.raises(DrafterError, match="another number of clusters"):
        RoutedShortlistProposer(drafter, clustering, Router(router.input_size, 8, CLUSTERS + 1),
                                ClusterBudget("fixed", 4), keep_ids=eos)
    with pytest.raises(DrafterError, match="k0 > k1"):
        RoutedShortlistProposer(drafter, clustering, router, ClusterBudget("pa", 8, 8), keep_ids=eos)
    with pytest.raises(DrafterError, match="more clusters than exist"):
        RoutedShortlistProposer(drafter, clustering, router, ClusterBudget("pa", 8, CLUSTERS + 1), keep_ids=eos)
    with pytest.raises(DrafterError, match="exclude the end-of-sequence"):
        RoutedShortlistProposer(drafter, clustering, router, ClusterBudget("fixed", 4), keep_ids=())
    with pytest.raises(DrafterError, match="exclude the end-of-sequence"):
        PositionAwareFrequencyProposer(drafter, kit["policy"].ranking, 64, keep_ids=())
    with pytest.raises(DrafterError, match="distinct token ids"):
        PositionAwareFrequencyProposer(drafter, np.array([1, 1, 2]), 2, keep_ids=eos)
    with pytest.raises(DrafterError, match="does not fit"):
        PositionAwareFrequencyProposer(drafter, kit["policy"].ranking, 10**6, keep_ids=eos)
