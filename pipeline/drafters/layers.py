"""What the EAGLE-3 and DFlash drafters are both built from: the attention shape they copy from the target, Llama's
RMSNorm, RoPE and gated MLP, and a base module whose RoPE frequencies stay float32 whatever dtype its weights take.

**Decoding layout.** The proposers switch a drafter to :meth:`RopeDrafter.stack_for_decoding`: each layer's
projections that read the same input (queries, keys and values; the MLP's gate and up) run as one matrix product over
their weights stacked row-wise, the norms as one fused ``rms_norm``, and RoPE as two row lookups in a table
(:meth:`RopeDrafter.rope`). Fewer, larger operations per forward: on a GPU
fewer kernels, on a CPU fewer dispatches (a block of rows gains most). The stacks are non-persistent buffers, in no
state dict, and each layer's weight becomes a view of its rows, so no weight is held twice and the two cannot part;
training, checkpoints and exports see the separate layers only, and leaving decoding (``.train()``,
``load_state_dict``) gives each layer weights of its own again.
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
    if "type" in rope and "rope_type" not in rope:  # a config object kept from before transformers renamed the key
        rope["rope_type"] = rope.pop("type")
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
    """Llama's RMSNorm (statistics in float32); with :attr:`fused` (decoding) torch's one ``rms_norm`` operation."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            if x.dtype == self.weight.dtype == torch.float32:
                return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def stacked_weights(on: bool, stacked: torch.Tensor | None, *linears: nn.Linear) -> torch.Tensor | None:
    """Decoding (``on``): the weights of bias-free ``linears`` that read one input, stacked row-wise (one product in
    place of one per layer), each layer's weight then a view of its rows, so no weight is held twice. The caller keeps
    the stack in a non-persistent buffer. Not ``on``: None, and each layer gets weights of its own again (copied out of
    ``stacked``, the caller's stack, if it has one)."""
    if on:
        stacked = torch.cat([layer.weight.detach() for layer in linears])
        rows = stacked.split([layer.out_features for layer in linears])
        for layer, own in zip(linears, rows, strict=True):
            layer.weight.data = own
        return stacked
    if stacked is not None:
        for layer in linears:
            layer.weight.data = layer.weight.data.clone()
    return None


def stacked_products(x: torch.Tensor, stacked: torch.Tensor, widths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``x`` through weights stacked by :func:`stacked_weights`, split back into each layer's output (views)."""
    return torch.split(F.linear(x, stacked), widths, dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE (Llama's half-split layout) to ``(B, heads, T, d)`` with ``cos``/``sin`` ``(B, T, d)``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: the factor :func:`rotate_together` multiplies the rolled rows by."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rotate_together(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """:func:`rotate`'s values to the bit, in fewer operations: for queries and keys stacked along the heads (one
    call for both) ``x · cos + roll(x, d/2) · signed`` with ``signed`` = :func:`signed_sin` of ``sin`` (the roll is
    ``[second, first]``, and a negated factor gives the same product as a negated operand). The decoding layout's
    rotation, where the operations, not their size, cost the time: its RoPE table holds the signed ``sin``
    (:meth:`RopeDrafter.rope`), so a step negates nothing."""
    cos, signed = cos.unsqueeze(1), signed.unsqueeze(1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed


class MLP(nn.Module):
    """Llama's gated SiLU MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.register_buffer("gate_up", None, persistent=False)

    def stack(self, on: bool) -> None:
        """Gate and up as one product (decoding) or two (training); see the module doc."""
        self.gate_up = stacked_weights(on, self.gate_up, self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = stacked_products(x, self.gate_up, (self.gate_proj.out_features, self.up_proj.out_features))
            return self.down_proj(F.silu(gate) * up)
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

    decoding = False
    """Whether the layers are in the decoding layout (:meth:`stack_for_decoding`)."""

    _rope_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def rope(self, x: torch.Tensor, positions: torch.Tensor, bound: int | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``(B, T, d)`` of ``positions`` in ``x``'s dtype, as ``rotary_emb`` gives them; in the
        decoding layout ``sin`` comes as :func:`signed_sin` of it, the form :func:`rotate_together` reads.

        Decoding, given ``bound`` (every position is below it, known on the host): two row lookups in a table that
        ``rotary_emb`` computed once (:meth:`reserve_rope`). ``rotary_emb``'s own call costs several operations and a
        Python wrapper per step, about 20 µs on a CPU (an EAGLE-3 chain runs it seven times a round). Without a bound,
        in training, or for a RoPE whose frequencies depend on the sequence length (``dynamic``, ``longrope``):
        ``rotary_emb`` itself.
        """
        if bound is None or not self.decoding or not self.reads_rope_table:
            cos, sin = self.rotary_emb(x, positions)
            return (cos, signed_sin(sin)) if self.decoding else (cos, sin)
        cos, signed = self.reserve_rope(bound, x)
        return F.embedding(positions, cos), F.embedding(positions, signed)

    @property
    def reads_rope_table(self) -> bool:
        """Whether decoding reads RoPE from the table (:meth:`reserve_rope`): not for a RoPE whose frequencies depend
        on the sequence length (``dynamic``, ``longrope``), whose ``rotary_emb`` keeps the longest length it has seen
        (a table of ``2 · bound`` rows built for it would leave it rotating shorter sequences with another set)."""
        return self.rotary_emb.rope_type not in ("dynamic", "longrope")

    def reserve_rope(self, bound: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The RoPE table :meth:`rope` reads, ``cos`` and :func:`signed_sin` of ``sin``, ``(P, d)`` for positions
        ``0 … P − 1`` with ``P ≥ bound``, in ``like``'s dtype and on its device: ``rotary_emb``'s output for those
        positions, computed again (twice ``bound`` rows) only when it is too short or of another dtype or device. A
        decode path that captures a graph reserves its longest position before the capture, so no forward builds it,
        and marks the table's address static, so a CUDA graph reads it in place. Nothing (an empty tuple, and
        ``rotary_emb`` left untouched) where decoding does not read a table (:attr:`reads_rope_table`)."""
        if not self.reads_rope_table:
            return ()
        rows = self._rope_rows
        if rows is None or rows[0].shape[0] < bound or rows[0].dtype != like.dtype or rows[0].device != like.device:
            positions = torch.arange(max(64, 2 * bound), device=like.device).unsqueeze(0)
            cos, sin = self.rotary_emb(like, positions)
            rows = self._rope_rows = (cos[0], signed_sin(sin[0]))
        return rows

    def stack_for_decoding(self, on: bool = True) -> None:
        """Switch every layer to the decoding layout (see the module doc), or back with ``on=False``."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = on
            elif module is not self and callable(getattr(module, "stack", None)):
                module.stack(on)
        self.decoding = on
        self._rope_rows = None

    def train(self, mode: bool = True) -> RopeDrafter:
        if mode:
            self.stack_for_decoding(False)
        return super().train(mode)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        self.stack_for_decoding(False)
        return super().load_state_dict(state_dict, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> RopeDrafter:
        super()._apply(fn, recurse)
        rotary = self._modules.get("rotary_emb")
        if rotary is not None:
            # a copy even on the same device: longrope switches frequencies by writing inv_freq in place, which must
            # not reach the original ones kept here
            exact = self._rope_inv_freq.to(rotary.inv_freq.device, copy=True)
            rotary.inv_freq, rotary.original_inv_freq = exact, exact.clone()
            self._rope_rows = None
        if self.decoding:  # a conversion copies the weights and the stacks apart: stack the converted weights again
            self.stack_for_decoding()
        return self
