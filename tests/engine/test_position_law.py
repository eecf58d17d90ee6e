"""Every emitted position follows the target's law, for every method on the eager path, and on the static path for one
method of each way it drafts (``tests.helpers.STATIC_FAMILIES``).

The first-token tests (``test_every_method.py``, ``test_static_decode.py``) bin one position's draws. These decode
whole sampled generations and test every position through :mod:`pipeline.evaluation.position_law`: each token's
randomised probability integral transform under the target's law at its position must look uniform, per offset in its
round (so a correction or bonus token taken from the wrong row shows at its offset) and in the order of the method's
own ``q`` over ``p`` (so drafts kept too often or too rarely show) and in token-id order (so a correction drawn with a
uniform already used shows). Sample size: :data:`GENERATIONS` generations of
:data:`NEW_TOKENS` tokens a method (1,280 positions, fewer where a generation ends at EOS); bound: family-wise
``alpha`` = :data:`ALPHA` over each method's statistics (|z| within about 4.4 for six to nine of them).

The negative controls break the verifier the way a real fault would (the residual drawn from p instead of
``max(p - q, 0)``; the bonus token drawn from the last draft's row) and require the same check to fail on the same
decodes' settings: without them a check that could not fail would pass here too. Measured on this kit: the lossless
decodes stay within |z| 2.4; the residual fault gives draft-order z -6.7 to -13.4, the bonus fault target-order z
+4.9 (TLI) and +10.0 (full) at the last offset.
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

import pipeline.engine.rounds as rounds_module
from pipeline.engine.inputs import ByteInputs
from pipeline.engine.loop import GenerationResult, generate_autoregressive
from pipeline.engine.methods import METHOD_NAMES
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.static import DecodeOptions
from pipeline.engine.verify import verify_speculative
from pipeline.evaluation.position_law import Decode, _grouped, position_law, round_offsets, sampled_decodes
from tests.engine.conftest import kit_proposer_inputs, kit_proposers
from tests.helpers import STATIC_FAMILIES

GAMMA = 4
GENERATIONS = 40
NEW_TOKENS = 32
ALPHA = 1e-4
T1 = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.9)
ORDINARY = "def add(a, b):\n    return"
EXACT_MATCH = {"slem", "slem_bytes"}
"""Methods that verify by exact match and report no q: their check has no draft-order statistic."""

BYTE_TRIE = {"byte_top_k": 3, "lookahead": 3}
"""The byte drafters' strings here (the registry's default: 4 and 4): SLRS enumerates 27 strings a drafted token
instead of 256 (its decodes take a third of the time), SLEM on bytes drafts 3 bytes a target token. The size changes
no code path: SLRS's psi at this size equals an independent brute force in every pruning mode (``test_slrs.py``),
and test_evaluate.py decodes with the same trie."""

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def proposers(kit) -> dict[str, object]:
    """``tests/engine/conftest.py``'s proposers, the byte drafters' with :data:`BYTE_TRIE`."""
    inputs = {method: dataclasses.replace(parts, **BYTE_TRIE) if isinstance(parts, ByteInputs) else parts
              for method, parts in kit_proposer_inputs(kit).items()}
    return kit_proposers(kit, inputs)


@pytest.fixture(scope="module")
def prompt(kit) -> list[int]:
    _, tokenizer = kit["target"]
    return [tokenizer.bos_token_id] + tokenizer(ORDINARY, add_special_tokens=False).input_ids


def decode(kit, proposer, prompt: list[int], params: SamplingParams, options: DecodeOptions | None = None,
           generations: int = GENERATIONS) -> list[Decode]:
    target, tokenizer = kit["target"]
    return list(sampled_decodes(target, proposer, [prompt] * generations, NEW_TOKENS, GAMMA, params,
                                torch.Generator().manual_seed(0), tokenizer.eos_token_id, options))


def assert_lossless(kit, decodes: list[Decode], params: SamplingParams, method: str) -> None:
    law = position_law(kit["target"][0], decodes, params)
    assert not law.failures(ALPHA) and law.outside_nucleus == 0, (method, law.failures(ALPHA), law.detail(ALPHA))
    # later positions were reached and tested, and every draft row the method reported took part. How many depends on
    # the kit's acceptance, and a kit trained on another CPU is another model (slem_bytes: 15 of 1,214 on one): some
    assert sum(n for label, n, _ in law.groups if label != "0") >= 10, (method, law.detail(ALPHA))
    assert (law.draft_z is None) == (method in EXACT_MATCH), (method, law.detail(ALPHA))
    assert method in EXACT_MATCH or law.draft_positions >= 300, (method, law.detail(ALPHA))


@pytest.mark.parametrize("method", [*METHOD_NAMES, "dflash_draft_head"])
def test_every_position_follows_the_targets_law(method: str, kit, proposers, prompt) -> None:
    assert_lossless(kit, decode(kit, proposers[method], prompt, T1), T1, method)


@pytest.mark.parametrize("method", ["full", "tli", "eagle3", "dflash"])
def test_every_position_follows_the_targets_nucleus_law(method: str, kit, proposers, prompt) -> None:
    """At temperature 0.7 and top-p 0.9, for one method of each family (same vocabulary, another tokenizer, a
    chain head, a block head): truncation applied to p and q alike keeps the law."""
    assert_lossless(kit, decode(kit, proposers[method], prompt, NUCLEUS), NUCLEUS, method)


@pytest.mark.parametrize("method", STATIC_FAMILIES)
def test_every_position_follows_the_targets_law_on_the_static_path(method: str, kit, proposers, prompt) -> None:
    assert_lossless(kit, decode(kit, proposers[method], prompt, T1, DecodeOptions("static")), T1, method)


def _residual_from_p(p, q, tokens, generator, *, strict=True):  # noqa: ANN001, ANN202
    """The fault: on a rejection, a fresh sample of the row's p instead of its residual ``max(p - q, 0)``."""
    n_accepted, _ = verify_speculative(p, q, tokens, generator, strict=strict)
    rows = p if p.dim() == 3 else p.unsqueeze(0)
    at = torch.as_tensor(n_accepted, device=rows.device).reshape(-1)
    token = torch.multinomial(rows[torch.arange(rows.shape[0]), at].double(), 1, generator=generator).squeeze(-1)
    return (n_accepted, token) if isinstance(n_accepted, torch.Tensor) else (n_accepted, int(token[0]))


def _bonus_from_the_last_draft_row(p, q, tokens, generator, *, strict=True):  # noqa: ANN001, ANN202
    """The fault: after every draft is accepted, the bonus token drawn from the last draft's row."""
    drafted = q.shape[-2]
    if drafted:
        p = p.clone()
        p[..., drafted, :] = p[..., drafted - 1, :]
    return verify_speculative(p, q, tokens, generator, strict=strict)


@pytest.mark.parametrize(("fault", "method", "found"), [
    (_residual_from_p, "shortlist", "draft-order"),
    (_residual_from_p, "eagle3", "draft-order"),
    (_residual_from_p, "rdk", "draft-order"),
    (_bonus_from_the_last_draft_row, "full", "target-order z .* at offsets 4 "),
    (_bonus_from_the_last_draft_row, "tli", "target-order z .* at offsets 4 "),
])
def test_a_lossy_verifier_fails_the_check(fault, method: str, found: str, kit, proposers, prompt,
                                          monkeypatch) -> None:
    monkeypatch.setattr(rounds_module, "verify_speculative", fault)
    # EAGLE-3's residual fault at three times the lossless tests' generations: the fault's z grows with their root, and
    # how far it lands past the bound depends on the kit (draft-order z -4.2 at 40 generations on a kit trained on
    # another CPU, inside the bound, so about -7.3 at 120, three of its unit standard deviations past -4.4; -6.7 to
    # -13.4 at 40 on others); the other faults land far past it at 40
    generations = 3 * GENERATIONS if method == "eagle3" else GENERATIONS
    law = position_law(kit["target"][0], decode(kit, proposers[method], prompt, T1, generations=generations), T1)
    assert any(re.search(found, failure) for failure in law.failures(ALPHA)), law.detail(ALPHA)


def test_autoregressive_samples_pass_and_another_temperatures_fail(kit, prompt) -> None:
    """The check on the target's own samples: those drawn at the checked temperature pass; the same check at another
    temperature than the one sampled fails (no draft rows here: the target-order statistics alone)."""
    target, tokenizer = kit["target"]
    generator = torch.Generator().manual_seed(0)

    def sampled(params: SamplingParams) -> list[Decode]:
        return [Decode(prompt, generate_autoregressive(target, prompt, NEW_TOKENS, params, generator,
                                                       tokenizer.eos_token_id)) for _ in range(GENERATIONS)]

    law = position_law(target, sampled(T1), T1)
    assert not law.failures(ALPHA) and law.draft_z is None, law.detail(ALPHA)
    colder = position_law(target, sampled(SamplingParams(temperature=0.8)), T1)
    assert any("target-order" in failure for failure in colder.failures(ALPHA)), colder.detail(ALPHA)
    # samples that ignored the nucleus: tokens outside it (inside the support) come last in target order
    untruncated = position_law(target, sampled(SamplingParams(temperature=0.7)), NUCLEUS)
    assert untruncated.outside_nucleus > 0 and untruncated.impossible == 0, untruncated.detail(ALPHA)
    assert any("target-order" in failure for failure in untruncated.failures(ALPHA)), untruncated.detail(ALPHA)


def test_a_token_outside_the_targets_support_fails_the_check_outright() -> None:
    """A target whose logits rule token 3 out (``-inf``, as a model masking padded vocabulary rows does): a decode that
    emitted it fails whatever the statistics say, and one that did not passes."""

    class NoThree(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, ids: torch.Tensor) -> SimpleNamespace:
            logits = torch.zeros(*ids.shape, 8) * self.scale
            logits[..., 3] = float("-inf")
            return SimpleNamespace(logits=logits)

    def law(tokens: list[int]) -> list[str]:
        result = GenerationResult(tokens=tokens, prompt_length=1, method="autoregressive")
        return position_law(NoThree(), [Decode([0], result)], T1).failures(ALPHA)

    assert law([1, 2, 4, 5]) == []
    assert law([1, 3, 4, 5]) == ["1 emitted tokens outside the target's support"]


def test_offsets_follow_the_rounds() -> None:
    """A prefill token is a round of its own; each round's tokens count from 0; a last round cut by EOS or the length
    budget keeps only the tokens emitted."""
    result = GenerationResult(tokens=[5, 6, 7, 8, 9, 10, 11], prompt_length=3, method="m", gamma=4, prefill_tokens=1,
                              accepted_per_round=[2, 0, 3])
    assert round_offsets(result) == [0, 0, 1, 2, 0, 0, 1]


def test_sparse_offsets_are_merged_with_their_neighbours() -> None:
    groups = _grouped({0: [0.5] * 40, 1: [0.5] * 35, 2: [0.5] * 4, 3: [0.5] * 7, 4: [0.5] * 12, 5: [0.5] * 3})
    assert [(label, len(values)) for label, values in groups] == [("0", 40), ("1", 35), ("2-3", 11), ("4-5", 15)]
    assert [label for label, _ in _grouped({0: [0.5] * 40, 1: [0.5] * 5})] == ["0-1"]


def test_generations_are_decoded_as_the_check_reads_them(kit, proposers, prompt) -> None:
    """``sampled_decodes`` decodes a generation only when the check asks for it, so the check holds one generation's
    q rows at a time (γ rows of the target's vocabulary a round: gigabytes over an evaluation's generations at 128k)."""
    target, tokenizer = kit["target"]
    decoded: list[GenerationResult] = []
    decodes = sampled_decodes(target, proposers["full"], [prompt] * 3, 4, GAMMA, T1, torch.Generator().manual_seed(0),
                              tokenizer.eos_token_id, on_decode=decoded.append)
    first = next(decodes)
    assert len(decoded) == 1 and first.result is decoded[0] and first.q_rows
    assert len(list(decodes)) == 2 and len(decoded) == 3


def test_a_q_narrower_than_the_targets_vocabulary_counts_as_zero_beyond_it(kit, prompt) -> None:
    """A proposer may report q over the ids it knows, fewer than the target's (the loop pads the rest with 0): the
    check reads it the same way, and a lossless one passes with its drafted positions in the draft-order statistic."""
    from pipeline.engine.proposers import Proposal

    target, _ = kit["target"]
    known = target.get_output_embeddings().weight.shape[0] // 2

    class FirstHalf:
        name, target_layers = "first_half", ()

        def reset(self) -> None:
            pass

        def propose(self, context, gamma, params, generator, state) -> Proposal:  # noqa: ANN001
            tokens = torch.randint(known, (gamma,), generator=generator).tolist()
            return Proposal(tokens, torch.full((gamma, known), 1.0 / known, dtype=torch.float64))

    law = position_law(target, decode(kit, FirstHalf(), prompt, T1, generations=12), T1)
    # every position but the bonus tokens after a full acceptance (rare here) had a drafted q
    assert not law.failures(ALPHA) and law.draft_positions > 0.9 * law.positions, law.detail(ALPHA)


class Table(torch.nn.Module):
    """A target whose next-token logits depend on the last token alone: a ``vocab`` × ``vocab`` table."""

    def __init__(self, vocab: int, scale: float) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(scale * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(3)))

    def forward(self, ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits[ids])


def _table_decode(table: torch.Tensor, generator: torch.Generator, reuse_uniform: bool) -> Decode:
    """64 tokens of speculative decoding against ``table``'s law at temperature 1 (γ = 4; each draft from a sharpened,
    noisy copy of its row), verified by hand: accept draft d when ``U · q(d) < p(d)``, else draw the residual
    ``max(p − q, 0)`` by inverse CDF in id order, with a fresh uniform or (``reuse_uniform``, the fault) with ``U``
    itself, which a rejection has already placed in ``[p(d)/q(d), 1)``."""
    probs = torch.softmax(table, dim=-1)
    tokens, accepted, rows = [int(torch.multinomial(probs[0], 1, generator=generator))], [], {}
    while len(tokens) < 64:
        drafts, q, last = [], [], tokens[-1]
        for _ in range(min(GAMMA, 63 - len(tokens))):
            q.append(torch.softmax(1.3 * table[last] + 0.5 * torch.randn(table.shape[1], generator=generator,
                                                                         dtype=table.dtype), dim=-1))
            drafts.append(last := int(torch.multinomial(q[-1], 1, generator=generator)))
        if q:
            rows[1 + len(tokens)] = torch.stack(q).float()
        p = probs[[tokens[-1], *drafts]]
        n = next((i for i, d in enumerate(drafts) if (u := float(torch.rand((), generator=generator))) * q[i][d]
                  >= p[i, d]), len(drafts))
        if n < len(drafts):
            residual = (p[n] - q[n]).clamp(min=0)
            v = u if reuse_uniform else float(torch.rand((), generator=generator))
            cdf = torch.cumsum(residual / residual.sum(), 0)
            nxt = min(int(torch.searchsorted(cdf, torch.tensor(v, dtype=cdf.dtype), right=True)), len(cdf) - 1)
        else:
            nxt = int(torch.multinomial(p[n], 1, generator=generator))
        tokens += [*drafts[:n], nxt]
        accepted.append(n)
    result = GenerationResult(tokens=tokens, prompt_length=1, method="m", gamma=GAMMA, prefill_tokens=1,
                              accepted_per_round=accepted, drafted_per_round=[GAMMA] * len(accepted))
    return Decode([0], result, rows)


def test_a_residual_drawn_with_the_acceptance_uniform_fails_only_in_id_order() -> None:
    """The fault moves mass between tokens that sit together by ``p`` and by ``q/p`` but apart by id (corrections lean
    to high ids: 0.09 in total variation from the target's law on average over this table's rows), so the target- and
    draft-order statistics and the Kolmogorov-Smirnov test pass it; the id-order statistic fails it. The same decodes
    verified correctly pass every statistic. 80 generations of 64 tokens (5,120 positions), alpha 1e-4."""
    target = Table(32, 2.5)
    table = target.logits.detach().double()

    def law(reuse_uniform: bool):  # noqa: ANN202
        generator = torch.Generator().manual_seed(5)
        return position_law(target, [_table_decode(table, generator, reuse_uniform) for _ in range(80)], T1)

    lossless, faulty = law(False), law(True)
    assert not lossless.failures(ALPHA), lossless.detail(ALPHA)
    assert [f for f in faulty.failures(ALPHA) if f.startswith("id-order z +")], faulty.detail(ALPHA)
    assert len(faulty.failures(ALPHA)) == 1, faulty.detail(ALPHA)  # what the other orders cannot see


def test_the_check_fails_a_lossless_decode_at_most_alpha_of_the_time() -> None:
    """Calibration: 300 independent sets of exact samples of a small target's law (each token drawn from p given the
    previous one; 6 sequences of 20 tokens, cut into rounds of random lengths with random q rows, which a lossless
    decode's law does not depend on) fail the check at alpha 0.2 in at most 0.2 of the sets, within 3 binomial
    standard deviations (the Bonferroni split makes it conservative: 44 of 300 here, each set with its own randomising
    seed); the same samples checked at another temperature fail it almost always (50 of 50)."""

    target, rng = Table(16, 2.0), torch.Generator().manual_seed(0)
    probs = torch.softmax(target.logits.detach().double(), dim=-1)

    def decodes() -> list[Decode]:
        out = []
        for _ in range(6):
            tokens, last = [], 0
            for _ in range(20):
                last = int(torch.multinomial(probs[last], 1, generator=rng))
                tokens.append(last)
            accepted = []
            while sum(a + 1 for a in accepted) < len(tokens):
                accepted.append(int(torch.randint(4, (1,), generator=rng)))
            q_rows, start = {}, 1
            for a in accepted:
                q_rows[start] = torch.rand(3, 16, generator=rng)  # rows for the round's first three offsets
                start += a + 1
            result = GenerationResult(tokens=tokens, prompt_length=1, method="m", gamma=3, accepted_per_round=accepted)
            out.append(Decode([0], result, q_rows))
        return out

    sets = [decodes() for _ in range(300)]
    # each set its own randomising uniforms (seed i): sets sharing one stream would share that part of every z, and
    # their failures would not be the independent trials the binomial bound counts
    failed = sum(bool(position_law(target, d, T1, seed=i).failures(0.2)) for i, d in enumerate(sets))
    assert failed <= 300 * (0.2 + 3 * (0.2 * 0.8 / 300) ** 0.5), failed
    colder = sum(bool(position_law(target, d, SamplingParams(temperature=0.5), seed=i).failures(0.2))
                 for i, d in enumerate(sets[:50]))
    assert colder >= 45, colder
