"""Tiny real Hugging Face models for the engine tests: a byte-level BPE tokenizer trained in the fixture
on a few KB of inline text, a random ``LlamaForCausalLM`` target and two drafters sharing its vocabulary.

Weights are random (seeded) with a large initialiser range so next-token distributions are peaked. The
main drafter is the target with its last layer skipped (self-speculation style), so drafts are accepted
often enough (greedy agreement ~30 %, overlap sum(min(p, q)) ~0.45) for both the accept and the reject
paths to run; the second is an unrelated tiny model with a tied head. The models run in float64 so that scoring a block of
tokens in one forward and scoring them one by one agree far below any argmax gap; the lead can swap in
the trained tiny kit here without touching the tests.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

_TEXT = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a few tokens with a small model
and asks the large model to check them all at once. When the draft agrees with the target, several tokens
are emitted for the price of one forward pass; when it disagrees, the target's own choice is kept, so the
output is exactly what the large model would have written on its own.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
Tokens that appear often are cheap to predict; rare ones are left to the target. The shortlist of frequent
tokens keeps the drafter's head small while the verifier keeps the output faithful. Numbers like 12, 345
and 6789 appear too, with punctuation: commas, periods; colons: and (parentheses).
"""

VOCAB_SIZE = 300
CPU_GPU_LOGIT_ATOL = 1e-4
"""The kit target's float64 logits on the CPU and on a CUDA GPU agree to this (absolute; logits reach ~14): RoPE's
cos/sin are float32 in Hugging Face's Llama whatever the dtype, and the two devices' float32 math differs by an ulp
or a few. tests/engine/test_logit_tolerance.py shows on the CPU that this noise (four ulps: 5e-6) stays 10× below it
and that a wrong weight or a wrong position moves the logits 10× above it (1 % on one weight row: 6e-3)."""
PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return",
    "Tokens that appear often",
]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """A byte-level BPE tokenizer with exactly :data:`VOCAB_SIZE` entries, ``<s>`` and ``</s>`` special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_TEXT] * 4, trainer=trainer)
    assert backend.get_vocab_size() == VOCAB_SIZE
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def prompts(tokenizer: Any) -> list[list[int]]:
    """Tokenised prompts, each starting with BOS."""
    return [[tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False) for text in PROMPTS]


def _llama(seed: int, hidden: int, layers: int, heads: int, tie: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
        initializer_range=0.5,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    return model.eval()


TARGET_LAYERS = 4


@pytest.fixture(scope="session")
def target() -> torch.nn.Module:
    """Random 4-layer Llama target with an untied head."""
    return _llama(seed=0, hidden=64, layers=TARGET_LAYERS, heads=4, tie=False)


@pytest.fixture(scope="session")
def drafter(target: torch.nn.Module) -> torch.nn.Module:
    """The target without its last decoder layer (same embeddings and head)."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = TARGET_LAYERS - 1
    model = LlamaForCausalLM(config).to(torch.float64)
    skipped = f"layers.{TARGET_LAYERS - 1}."
    model.load_state_dict({k: v for k, v in target.state_dict().items() if skipped not in k})
    return model.eval()


@pytest.fixture(scope="session")
def tied_drafter() -> torch.nn.Module:
    """An unrelated random 1-layer Llama with a tied head (the other head layout from the target's)."""
    return _llama(seed=1, hidden=32, layers=1, heads=2, tie=True)


@pytest.fixture(scope="session")
def shortlist(tokenizer: Any) -> torch.Tensor:
    """The 120 most frequent token ids of the fixture text, plus EOS (sorted)."""
    ids = torch.tensor(tokenizer.encode(_TEXT, add_special_tokens=False))
    counts = torch.bincount(ids, minlength=VOCAB_SIZE)
    top = torch.topk(counts, 120).indices
    return torch.unique(torch.cat([top, torch.tensor([tokenizer.eos_token_id])]))


@pytest.fixture(scope="module")
def kit(tiny_kit) -> dict[str, tuple[torch.nn.Module, Any]]:
    """The trained tiny kit's target and drafters in float64 on the CPU, each with its tokenizer (``{role: (model,
    tokenizer)}``); a module that needs other parts defines its own ``kit``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(role: str) -> tuple[torch.nn.Module, Any]:
        path = tiny_kit.path(role)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval(), AutoTokenizer.from_pretrained(path)

    return {role: load(role) for role in ("target", "drafter", "drafter_other", "drafter_bytes")}


@pytest.fixture(scope="module")
def proposers(kit) -> dict[str, Any]:
    """Every registered method's proposer, built through the registry from :func:`kit_proposer_inputs`; and under
    ``dflash_draft_head`` a DFlash proposer whose drafter has its own head over the kit shortlist (``head: draft``)."""
    return kit_proposers(kit, kit_proposer_inputs(kit))


def kit_proposers(kit: dict[str, tuple[torch.nn.Module, Any]], inputs: dict[str, Any]) -> dict[str, Any]:
    """Every registered method's proposer from ``inputs`` (:func:`kit_proposer_inputs`, or a module's variation of
    them), and ``dflash_draft_head`` (:func:`kit_proposer`)."""
    from pipeline.engine.methods import METHOD_NAMES

    return {method: kit_proposer(kit, inputs, method) for method in (*METHOD_NAMES, "dflash_draft_head")}


def kit_proposer(kit: dict[str, tuple[torch.nn.Module, Any]], inputs: dict[str, Any], method: str) -> Any:
    """A registered method's proposer from :func:`kit_proposer_inputs`; ``dflash_draft_head``: DFlash whose drafter has
    its own head over the kit shortlist (``train_dflash.head: draft``)."""
    from pipeline.engine.methods import build_proposer

    if method != "dflash_draft_head":
        return build_proposer(method, inputs[method])
    drafter = make_dflash(kit["target"][0], draft_ids=inputs["shortlist"].shortlist)
    return build_proposer("dflash", dataclasses.replace(inputs["dflash"], dflash=drafter))


def assert_counts_match(counts: torch.Tensor, probs: torch.Tensor, n: int, what: str) -> None:
    """Assert multinomial counts agree with ``n * probs`` outcome by outcome.

    Bound: Bernstein's inequality for a binomial count with variance ``s^2 = n p (1 - p)`` at failure
    probability ``e^-18`` (about 1.5e-8) per side and outcome gives ``|count - n p| <= 6 + 6 sqrt(1 + s^2)``,
    i.e. 6 sigma for large counts, and stays valid for outcomes expected only a handful of times, where
    a bare 6-sigma normal bound would fail far too often. Outcomes with ``p = 0`` must have count 0.
    """
    probs = probs.to(torch.float64)
    counts = counts.to(torch.float64)
    expected = n * probs
    bound = 6.0 + 6.0 * torch.sqrt(1.0 + n * probs * (1.0 - probs))
    impossible = probs == 0
    assert not bool((counts[impossible] > 0).any()), (
        f"{what}: zero-probability outcome observed: {counts.tolist()}"
    )
    outside = (counts - expected).abs() > bound
    assert not bool(outside.any()), (
        f"{what}: outcomes {outside.nonzero().flatten().tolist()} have counts "
        f"{counts[outside].tolist()}, expected {expected[outside].tolist()} (Bernstein bound)"
    )


def method_inputs(method: str, **parts: Any) -> Any:
    """``method``'s registry inputs (its family's dataclass) from named parts: the fields of that dataclass it
    has a part for (parts other families take are left out; fields with a default may be left out)."""
    from dataclasses import fields

    from pipeline.engine.methods import method_spec

    family = method_spec(method).inputs
    return family(**{f.name: parts[f.name] for f in fields(family) if f.name in parts})


def kit_proposer_inputs(kit: dict[str, tuple[torch.nn.Module, Any]]) -> dict[str, Any]:
    """Registry inputs of every method, by method, from loaded tiny-kit roles (``{role: (model, tokenizer)}``).

    The shortlist is the target's first 256 ids plus EOS; the EAGLE-3 head (untrained, seeded) drafts
    over those ids, on the target's device and in its dtype; the DFlash drafter (untrained, seeded, one layer,
    blocks of 8) likewise; DynaSpec routes over a 16-cluster FAISS
    clustering of the drafter's head with an untrained seeded router; PA-FR ranks ids in id order; SLRS
    and SLEM-on-bytes use the byte drafter with the registry's default byte_top_k and lookahead (4, 4).
    """
    from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from pipeline.engine.methods import METHOD_NAMES
    from pipeline.vocab.counting import eagle3_offset_maps
    from pipeline.vocab.maps import VocabMap

    target, target_tok = kit["target"]
    other, other_tok = kit["drafter_other"]
    vocab = target.get_output_embeddings().weight.shape[0]
    first = torch.arange(min(256, vocab))
    shortlist = torch.unique(torch.cat([first, torch.tensor([target_tok.eos_token_id])]))
    embedding = target.get_input_embeddings()
    config = Eagle3Config.from_target(target.config, draft_vocab_size=int(shortlist.numel()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        eagle3 = Eagle3Drafter(config, embedding)
    eagle3 = eagle3.to(device=embedding.weight.device, dtype=embedding.weight.dtype).eval()
    eagle3.set_vocab_maps(*eagle3_offset_maps(shortlist.numpy(), config.target_vocab_size))
    from pipeline.dynaspec.budget import ClusterBudget, ShortlistPolicy
    from pipeline.dynaspec.clusters import spherical_kmeans
    from pipeline.dynaspec.router import Router

    drafter = kit["drafter"][0]
    head = drafter.get_output_embeddings().weight
    clustering = spherical_kmeans(head, 16, niter=10, seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        router = Router(2 * head.shape[1], 16, 16).to(device=head.device, dtype=head.dtype).eval()
    policy = ShortlistPolicy(keep_ids=(target_tok.eos_token_id,), fixed=ClusterBudget("fixed", 4),
                             pa=ClusterBudget("pa", 4, 8), pa_fr_kmax=256, ranking=torch.arange(head.shape[0]).numpy())
    parts = dict(
        prior=kit_rdk_prior(target, target_tok, VocabMap.build(target_tok, other_tok)),
        level="keep_0.1",
        clustering=clustering,
        router=router,
        policy=policy,
        drafter=drafter,
        shortlist=shortlist,
        drafter_other=other,
        drafter_other_tokenizer=other_tok,
        target_tokenizer=target_tok,
        vocab_map=VocabMap.build(target_tok, other_tok),
        eagle3=eagle3,
        dflash=make_dflash(target),
        drafter_bytes=kit["drafter_bytes"][0],
        drafter_bytes_tokenizer=kit["drafter_bytes"][1],
        target_vocab_size=vocab,
    )
    return {method: method_inputs(method, **parts) for method in METHOD_NAMES}


def make_dflash(target: torch.nn.Module, *, block_size: int = 8, layers: int = 1, seed: int = 0,
                draft_ids: torch.Tensor | None = None) -> Any:
    """A seeded (untrained) DFlash drafter for ``target``, on its device and in its dtype; the mask token is the
    last id of the vocabulary. With ``draft_ids`` (target ids) its own head drafts over those ids only."""
    from pipeline.drafters.dflash import DFlashConfig, DFlashDrafter
    from pipeline.vocab.counting import eagle3_offset_maps

    vocab = int(target.config.vocab_size)
    config = DFlashConfig.from_target(target.config, num_hidden_layers=layers, block_size=block_size,
                                      mask_token_id=vocab - 1,
                                      draft_vocab_size=None if draft_ids is None else int(draft_ids.numel()))
    embedding = target.get_input_embeddings()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DFlashDrafter(config, embedding, target.get_output_embeddings())
    if draft_ids is not None:
        drafter.set_vocab_maps(*eagle3_offset_maps(draft_ids.cpu().numpy(), vocab))
    return drafter.to(device=embedding.weight.device, dtype=embedding.weight.dtype).eval()


def kit_rdk_prior(target: torch.nn.Module, tokenizer: Any, vocab_map: Any) -> Any:
    """An RDK prior from the target's own distributions along one sentence: level ``keep_0.1`` (the 10 % of ids
    with the largest mean, plus EOS) and ``intersection`` (T ∩ D of ``vocab_map``), τ = 1e-3, constant prior weight."""
    ids = tokenizer.encode("The weather today is sunny, and we will walk to the park after lunch.")
    return rdk_prior(target, ids, tokenizer.eos_token_id, vocab_map.intersection_ids_target)


def rdk_prior(target: torch.nn.Module, ids: list[int], eos: int, intersection: torch.Tensor | None = None) -> Any:
    """:func:`kit_rdk_prior` from the target's distributions along ``ids``; no ``intersection`` level without one."""
    from pipeline.rdk.moments import MomentSums
    from pipeline.rdk.prior import INTERSECTION, LevelFit, RDKPrior, pruning_levels

    with torch.no_grad():
        logits = target(torch.tensor([ids], device=target.device)).logits[0]
    sums = MomentSums(logits.shape[-1], 16)
    sums.add(torch.softmax(logits.double(), -1))
    moments = sums.moments()
    levels = pruning_levels(torch.argsort(-moments.mu, stable=True), moments.vocab_size, [0.1], [eos])
    if intersection is not None:
        levels[INTERSECTION] = intersection
    fits = {name: LevelFit(kept=kept, tau=1e-3, prior_weight={"mode": "constant", "weight": None})
            for name, kept in levels.items()}
    return RDKPrior(moments, fits, {"required_ids": [eos], "vocab_hash": ""})


def verify_blocks(p: torch.Tensor, q: torch.Tensor, n: int, generator: torch.Generator,
                  chunk: int = 20_000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative sampling of ``n`` independent blocks with fixed rows: ``x_i ~ q_i`` (``q``: ``(γ, V)``),
    verified against ``p`` (``(γ+1, V)``) by the loop's ``verify_speculative``, in chunks that keep its
    ``(blocks, γ+1, V)`` float64 temporaries small. Returns ``(drafts (n, γ), accepted (n,), next token (n,))``."""
    from pipeline.engine.verify import verify_speculative

    x = torch.multinomial(q, n, replacement=True, generator=generator).T
    accepted, emitted = [], []
    for start in range(0, n, chunk):
        part = x[start : start + chunk]
        k, token = verify_speculative(p.expand(len(part), -1, -1), q.expand(len(part), -1, -1), part, generator)
        accepted.append(k)
        emitted.append(token)
    return x, torch.cat(accepted), torch.cat(emitted)


def assert_acceptance_law(p: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor, n: int) -> None:
    """The accepted count of ``n`` verified γ-blocks follows ``[1-a0, a0(1-a1), …, a0…a_{γ-1}]`` with
    ``a_i = Σ min(p_i, q_i)`` (Leviathan et al. 2023, Thm. 3.5), outcome by outcome (:func:`assert_counts_match`)."""
    gamma = q.shape[0]
    a = torch.minimum(p[:gamma], q).sum(-1)
    law = torch.stack([a[:k].prod() * (1 - a[k]) for k in range(gamma)] + [a.prod()])
    assert_counts_match(torch.bincount(accepted, minlength=gamma + 1), law, n, "accepted count")
