"""What the EAGLE-3 and DFlash drafters are both built from: the attention shape they copy from the target, Llama's
RMSNorm, RoPE and gated MLP, and a base module whose RoPE frequencies stay float32 whatever dtype its weights take.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import DrafterError


def target_shape(target_config: Any) -> dict[str, Any]:
    """The layer shape a drafter copies from a Llama/Qwen3-style ``transformers`` config: widths, heads, head dim,
    norm epsilon, RoPE theta, context and the non-default RoPE parameters (else None)."""
    rope = dict(getattr(target_config, "rope_parameters", None) or getattr(target_config, "rope_scaling", None) or {})
    theta = float(rope.pop("rope_theta", getattr(target_config, "rope_theta", 10000.0)))
    heads = int(target_config.num_attention_heads)
    return {
        "hidden_size": int(target_config.hidden_size),
        "intermediate_size": int(target_config.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(target_config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(target_config, "head_dim", None) or target_config.hidden_size // heads),
        "rms_norm_eps": float(target_config.rms_norm_eps),
        "rope_theta": theta,
        "max_position_embeddings": int(target_config.max_position_embeddings),
        "rope_scaling": rope if rope.get("rope_type", "default") != "default" else None,
    }


def check_shape(config: Any, sizes: tuple[str, ...]) -> None:
    """Raise :class:`DrafterError` unless each named field of ``config`` is a positive integer and the attention heads
    are a multiple of the key/value heads."""
    what = type(config).__name__
    bad = {name: getattr(config, name) for name in sizes
           if not isinstance(getattr(config, name), int) or getattr(config, name) <= 0}
    if bad:
        raise DrafterError(f"{what} has sizes that are not positive integers.", expected="positive integers",
                           found=repr(bad))
    if config.num_attention_heads % config.num_key_value_heads:
        raise DrafterError(f"{what}: attention heads are not a multiple of key/value heads.",
                           expected="num_attention_heads % num_key_value_heads == 0",
                           found=f"{config.num_attention_heads} heads, {config.num_key_value_heads} kv heads")


def check_vocab_maps(d2t_offsets: Any, t2d_mask: Any, draft_vocab_size: int,
                     target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3-convention vocabulary maps (numpy or torch, e.g. from
    :func:`pipeline.vocab.counting.eagle3_offset_maps`) checked, as ``(int64 d2t, bool t2d)`` tensors on the CPU.

    ``d2t`` holds offsets: draft id ``i`` is target id ``i + d2t[i]``, target ids strictly increasing; ``t2d`` is
    true exactly at those target ids. Raises :class:`DrafterError` otherwise.
    """
    d2t, t2d = torch.as_tensor(d2t_offsets), torch.as_tensor(t2d_mask)
    vd, v = draft_vocab_size, target_vocab_size
    if tuple(d2t.shape) != (vd,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise DrafterError("d2t is not an integer offset vector over the draft vocabulary.",
                           expected=f"integer shape ({vd},)", found=f"{d2t.dtype} shape {tuple(d2t.shape)}")
    if tuple(t2d.shape) != (v,) or t2d.dtype != torch.bool:
        raise DrafterError("t2d is not a bool mask over the target vocabulary.",
                           expected=f"bool shape ({v},)", found=f"{t2d.dtype} shape {tuple(t2d.shape)}")
    d2t, t2d = d2t.long().cpu(), t2d.cpu()
    ids = torch.arange(vd) + d2t
    if ids.min() < 0 or ids.max() >= v or (vd > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise DrafterError("d2t offsets do not map draft ids to distinct increasing target ids.",
                           expected=f"arange({vd}) + d2t strictly increasing, within [0, {v})",
                           found=f"target ids from {int(ids.min())} to {int(ids.max())}, "
                                 f"{int(ids.unique().numel())} distinct",
                           fix="Build the maps with pipeline.vocab.counting.eagle3_offset_maps.")
    if int(t2d.sum()) != vd or not bool(t2d[ids].all()):
        raise DrafterError("t2d does not mark exactly the target ids d2t maps to.",
                           expected=f"{vd} true entries, at arange + d2t",
                           found=f"{int(t2d.sum())} true entries, {int((~t2d[ids]).sum())} d2t targets unmarked")
    return d2t, t2d


class RMSNorm(nn.Module):
    """Llama's RMSNorm (statistics in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (Llama's half-split layout) to ``(B, heads, T, d)`` with ``cos``/``sin`` ``(B, T, d)``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class MLP(nn.Module):
    """Llama's gated SiLU MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RopeDrafter(nn.Module):
    """A drafter with ``rotary_emb``: transformers' Llama RoPE for the target's parameters (so scaled variants match
    the target), whose frequencies stay float32 whatever dtype the weights are cast to (rounded to bf16 they would
    turn positions a few thousand tokens in by whole radians). Its tables are non-persistent: not in the state dict.
    """

    def init_rotary(self, config: Any) -> None:
        """Build ``rotary_emb`` from a config with the fields of :func:`target_shape`."""
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
        llama = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                            head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
                            rope_parameters=rope)
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        object.__setattr__(self, "_rope_inv_freq", self.rotary_emb.inv_freq.clone())

    def _apply(self, fn: Any, recurse: bool = True) -> RopeDrafter:
        super()._apply(fn, recurse)
        rotary = self._modules.get("rotary_emb")
        if rotary is not None:
            exact = self._rope_inv_freq.to(rotary.inv_freq.device)
            rotary.inv_freq, rotary.original_inv_freq = exact, exact.clone()
        return self
