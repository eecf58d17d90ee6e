"""The engine on a CUDA GPU with the trained tiny kit: greedy equality for every method, the first
emitted token's law at temperature 1, every position's law on path graphs, and CPU/GPU agreement; plus EAGLE-3 with
a head trained on the GPU (tests/engine/test_eagle3_proposer.py's checks). Marked ``gpu``: skipped without CUDA.

Models run in float64 on the GPU so batched verification and one-token decoding agree far below any
argmax gap (cuBLAS picks different kernels for different shapes; in float32 an exact near-tie could flip).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.engine.methods import METHOD_NAMES

pytestmark = pytest.mark.gpu

METHODS = METHOD_NAMES  # every registered draft method
RANDOM_HEADS = {"eagle3", "dflash"}
"""Methods whose drafter here has random weights (kit_proposer_inputs); their trained drafters' greedy runs are in
test_eagle3_proposer.py and test_dflash.py."""


@pytest.fixture(scope="module")
def cuda_kit(tiny_kit):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(role: str):
        model = AutoModelForCausalLM.from_pretrained(tiny_kit.path(role), dtype=torch.float64).to("cuda").eval()
        return model, AutoTokenizer.from_pretrained(tiny_kit.path(role))

    return {role: load(role) for role in ("target", "drafter", "drafter_other", "drafter_bytes")}


def _proposer(kit: dict, method: str):
    from tests.engine.conftest import kit_proposer, kit_proposer_inputs

    return kit_proposer(kit, kit_proposer_inputs(kit), method)


def _prompts(tokenizer) -> list[list[int]]:
    from pipeline.data.calibration import encode_prompt
    from pipeline.data.sources import load_humaneval

    return [encode_prompt(tokenizer, c.messages, 64) for c in load_humaneval()[:3]]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_autoregressive_on_cuda(cuda_kit, method: str) -> None:
    from pipeline.engine.loop import generate_autoregressive, generate_speculative
    from pipeline.engine.sampling import SamplingParams

    target, tok = cuda_kit["target"]
    greedy = SamplingParams()
    proposer = _proposer(cuda_kit, method)
    accepted = 0
    for prompt in _prompts(tok):
        for gamma in (1, 4):
            gen = torch.Generator(device="cuda").manual_seed(0)
            ar = generate_autoregressive(target, prompt, 32, greedy, gen, tok.eos_token_id)
            spec = generate_speculative(target, proposer, prompt, 32, gamma, greedy, gen, tok.eos_token_id)
            assert spec.tokens == ar.tokens, (method, gamma)
            accepted += sum(spec.accepted_per_round)
    # drafts were accepted, so the equality covers the accept path too (on the CPU in float64 every method here
    # accepts 14-105 drafts over these six runs), but for the random-weight feature heads, which accept none
    assert accepted > 0 or method in RANDOM_HEADS, (method, accepted)


@pytest.mark.parametrize("method", ("full", "tli", "slem"))
def test_first_token_law_on_cuda(cuda_kit, method: str) -> None:
    """3000 draws of the first emitted token at temperature 1; chi-square over bins with expected count >= 5
    (the rest pooled) must give p >= 1e-4, and no zero-probability token may ever be emitted."""
    from pipeline.engine.loop import generate_speculative
    from pipeline.engine.sampling import SamplingParams, standardise
    from pipeline.evaluation.evaluator import chi_square_first_token

    target, tok = cuda_kit["target"]
    params = SamplingParams(temperature=1.0)
    context = _prompts(tok)[0]
    with torch.no_grad():
        p = standardise(target(torch.tensor([context], device="cuda")).logits[0, -1], params).cpu().numpy()
    proposer = _proposer(cuda_kit, method)
    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = np.zeros(p.size, dtype=np.int64)
    accepted_first = 0
    for _ in range(3000):
        # 4 new tokens leave room for a full round of γ=3 drafts (the loop never drafts past the budget).
        result = generate_speculative(target, proposer, context, 4, 3, params, gen, tok.eos_token_id)
        counts[result.tokens[0]] += 1
        accepted_first += result.accepted_per_round[0] > 0
    assert accepted_first > 0, "the draft path must be exercised, not just sampling from p"
    assert counts[p == 0].sum() == 0
    pvalue, bins = chi_square_first_token(counts, p)
    assert bins >= 3 and pvalue >= 1e-4, (pvalue, bins)


def test_cuda_and_cpu_logits_agree(cuda_kit) -> None:
    """float64 logits on the GPU and on the CPU agree to CPU_GPU_LOGIT_ATOL: above the devices' float32 RoPE noise,
    far below what a wrong weight or position gives (tests/engine/test_logit_tolerance.py shows both on the CPU)."""
    from tests.engine.conftest import CPU_GPU_LOGIT_ATOL

    target, tok = cuda_kit["target"]
    ids = torch.tensor([_prompts(tok)[0]])
    with torch.no_grad():
        gpu = target(ids.cuda()).logits.cpu()
        cpu = target.to("cpu")(ids).logits
    target.to("cuda")
    torch.testing.assert_close(gpu, cpu, atol=CPU_GPU_LOGIT_ATOL, rtol=0)


def test_eagle3_trained_head_on_cuda(target, prompts) -> None:
    """EAGLE-3 with a head trained on the GPU (the random float64 target of conftest.py, copied to CUDA):
    greedy equality for gamma 1, 3, 5 with drafts accepted and rejected, q on the GPU in float64 and
    equal to the law recomputed from scratch. (The registry's eagle3 on the kit, untrained, runs in
    test_greedy_equals_autoregressive_on_cuda.)"""
    import copy

    from tests.engine.eagle3_support import check_on_device

    check_on_device(copy.deepcopy(target).to("cuda"), prompts)


GRAPH_METHODS = ("full", "shortlist", "dynaspec", "pa_fr", "rdk", "eagle3", "dflash", "dflash_draft_head")
"""The methods whose drafts stay on the device: on CUDA they run on path graphs by default (and DFlash with its own
draft-vocabulary head: tests/engine/conftest.py's kit_proposer)."""


@pytest.mark.parametrize("method", GRAPH_METHODS)
def test_every_position_follows_the_targets_law_on_the_graph_path(cuda_kit, method: str) -> None:
    """Sampled generations on path graphs (the path evaluate decodes on with CUDA), every emitted position tested
    against the target's law there (pipeline/evaluation/position_law.py; tests/engine/test_position_law.py does the
    same on the CPU's paths): 24 generations of 32 tokens at temperature 1, family-wise alpha 1e-4."""
    from pipeline.engine.sampling import SamplingParams
    from pipeline.engine.static import DecodeOptions
    from pipeline.evaluation.position_law import position_law, sampled_decodes

    target, tok = cuda_kit["target"]
    params = SamplingParams(temperature=1.0)
    prompts = _prompts(tok) * 8
    decodes = sampled_decodes(target, _proposer(cuda_kit, method), prompts, 32, 4, params,
                              torch.Generator(device="cuda").manual_seed(0), tok.eos_token_id, DecodeOptions("graphs"))
    law = position_law(target, decodes, params)
    assert not law.failures(1e-4) and law.outside_nucleus == 0, (method, law.detail(1e-4))
    assert law.drafted > 0 and law.draft_positions > 0, (method, law.detail(1e-4))


def _strict_rounds(monkeypatch) -> list[int]:
    """Run every round of the loop under ``torch.cuda.set_sync_debug_mode("error")``, switched off only for the
    round's one host read (its ``.tolist()``); returns the list each read appends to."""
    import pipeline.engine.rounds as rounds_module

    round_fn = rounds_module.speculative_round
    reads: list[int] = []

    def strict(*args, **kwargs):
        # the round's one host read is its .tolist(); everything before it must queue without a sync
        torch.cuda.set_sync_debug_mode("error")
        original = torch.Tensor.tolist

        def counted(self):
            reads.append(1)
            torch.cuda.set_sync_debug_mode("default")
            return original(self)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)
        try:
            return round_fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            monkeypatch.setattr(torch.Tensor, "tolist", original)

    monkeypatch.setattr("pipeline.engine.loop.speculative_round", strict)
    return reads


@pytest.mark.parametrize("method", GRAPH_METHODS)
def test_graph_path_is_greedy_equal_and_never_synchronises_inside_a_round(cuda_kit, method: str, monkeypatch) -> None:
    """Path graphs on CUDA (CUDA graphs captured for real): greedy output equal to eager autoregressive decoding, and
    after a warm-up generation no round synchronises the host but for its one read of the accepted tokens
    (``torch.cuda.set_sync_debug_mode("error")`` inside every round raises on any other synchronising call)."""
    from pipeline.engine.loop import generate_autoregressive, generate_speculative
    from pipeline.engine.sampling import SamplingParams
    from pipeline.engine.static import DecodeOptions

    target, tok = cuda_kit["target"]
    greedy, graphs = SamplingParams(), DecodeOptions("graphs")
    proposer = _proposer(cuda_kit, method)
    prompt = _prompts(tok)[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    want = generate_autoregressive(target, prompt, 32, greedy, gen, tok.eos_token_id).tokens
    assert generate_speculative(target, proposer, prompt, 32, 4, greedy, gen, tok.eos_token_id, graphs).tokens == want
    reads = _strict_rounds(monkeypatch)
    result = generate_speculative(target, proposer, prompt, 32, 4, greedy, gen, tok.eos_token_id, graphs)
    assert result.tokens == want and len(reads) == len(result.accepted_per_round)


@pytest.mark.parametrize("method", ("eagle3", "dflash"))
def test_graph_path_with_the_first_token_from_the_prefill(cuda_kit, method: str, monkeypatch) -> None:
    """``evaluate.first_token=prefill`` on path graphs: greedy-equal to autoregressive decoding, and the prefill's
    round without drafts reads the host once like every round, and synchronises nowhere else."""
    from pipeline.engine.loop import generate_autoregressive, generate_speculative
    from pipeline.engine.sampling import SamplingParams
    from pipeline.engine.static import DecodeOptions

    target, tok = cuda_kit["target"]
    greedy, graphs = SamplingParams(), DecodeOptions("graphs", first_token="prefill")
    proposer = _proposer(cuda_kit, method)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for prompt in _prompts(tok):
        want = generate_autoregressive(target, prompt, 32, greedy, gen, tok.eos_token_id).tokens
        assert generate_speculative(target, proposer, prompt, 32, 7, greedy, gen, tok.eos_token_id,
                                    graphs).tokens == want
    reads = _strict_rounds(monkeypatch)
    result = generate_speculative(target, proposer, prompt, 32, 7, greedy, gen, tok.eos_token_id, graphs)
    assert result.tokens == want and result.prefill_tokens == 1
    assert len(reads) == len(result.accepted_per_round) + 1
