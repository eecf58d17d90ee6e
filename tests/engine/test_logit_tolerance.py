"""Why :data:`tests.engine.conftest.CPU_GPU_LOGIT_ATOL` is the tolerance of the CPU/GPU logit comparison
(tests/engine/test_cuda.py), shown on the CPU with the tiny kit's target in float64.

The two devices cannot agree to float64 rounding: Hugging Face's Llama computes RoPE's angles, cos and sin in
float32 whatever the model's dtype, and CUDA's ``cosf``/``sinf`` (up to 2 ulps of error) and the CPU's differ by
an ulp or a few; float64 sums in another order add far less. Modelled here by perturbing every cos/sin entry by a
random relative ±2⁻²¹ (four float32 ulps; max over 5 draws: 5.2e-6 on 2026-11-25, where the old 1e-9 tolerance
fails), that noise must stay ≥ 10× below the tolerance, and the faults the comparison is there to catch — the last
token's position off by one (1.39), one row of one weight matrix 1 % off (5.8e-3), the weights rounded to bfloat16
(3.2e-2) — must each move the logits ≥ 10× above it. (Shifting *every* position by one is no fault for RoPE: it
only moves the logits by rounding, 4e-6.)
"""

from __future__ import annotations

import copy

import torch

from tests.engine.conftest import CPU_GPU_LOGIT_ATOL


def _prompt(tokenizer) -> list[int]:  # noqa: ANN001 - a Hugging Face tokenizer
    from pipeline.data.calibration import encode_prompt
    from pipeline.data.sources import load_humaneval

    return encode_prompt(tokenizer, load_humaneval()[0].messages, 64)  # test_cuda.py's first prompt


@torch.no_grad()
def test_tolerance_sits_between_device_noise_and_a_wrong_weight_or_position(tiny_kit) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_kit.path("target"), dtype=torch.float64).eval()
    ids = torch.tensor([_prompt(AutoTokenizer.from_pretrained(tiny_kit.path("target")))])
    base = target(ids).logits

    rotary = target.model.rotary_emb
    exact = rotary.forward
    gen = torch.Generator().manual_seed(0)

    def four_ulps(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = exact(x, position_ids)
        jitter = lambda t: t * (1 + (torch.rand(t.shape, generator=gen, dtype=t.dtype) * 2 - 1) * 2**-21)  # noqa: E731
        return jitter(cos), jitter(sin)

    rotary.forward = four_ulps
    try:
        noise = max(float((target(ids).logits - base).abs().max()) for _ in range(5))
    finally:
        rotary.forward = exact

    positions = torch.arange(ids.shape[1])[None].clone()
    positions[0, -1] += 1
    one_row = copy.deepcopy(target)
    one_row.model.layers[0].mlp.down_proj.weight[0].mul_(1.01)
    rounded = copy.deepcopy(target)
    for parameter in rounded.parameters():
        parameter.copy_(parameter.to(torch.bfloat16))
    faults = {"last position + 1": float((target(ids, position_ids=positions).logits - base).abs().max()),
              "one weight row 1 % off": float((one_row(ids).logits - base).abs().max()),
              "weights rounded to bfloat16": float((rounded(ids).logits - base).abs().max())}
    assert noise > 0  # the perturbation reached the logits
    assert noise * 10 <= CPU_GPU_LOGIT_ATOL, (noise, CPU_GPU_LOGIT_ATOL)
    assert all(error >= 10 * CPU_GPU_LOGIT_ATOL for error in faults.values()), (faults, CPU_GPU_LOGIT_ATOL)
