"""The DFlash draft network: a few Qwen3-style layers that draft a whole block in one forward.

DFlash (block diffusion for flash speculative decoding, z-lab; the layout read here from the installable
code: ``speculators`` 0.9.0 ``speculators/models/dflash/``, vLLM 0.33.0 ``qwen3_dflash.py``, SGLang 0.5.23
``srt/models/dflash.py`` — read, not copied) conditions on the target's hidden states at several layers and
denoises a block ``[x_n, MASK × (B − 1)]`` in a single pass:

* **Context.** The tapped target layers are concatenated (``len(target_layer_ids) × H``) and projected by
  ``fc`` (no bias) then ``hidden_norm`` into one ``H``-wide feature per verified position. Each draft layer
  projects that feature with its *own* ``k_proj``/``v_proj`` (and ``k_norm``): the keys and values a layer
  attends over are the context's, followed by the block's. The context never runs through the layers.
* **Block.** Its rows are the target's (frozen) token embeddings of the last verified token and ``B − 1`` mask
  tokens, at positions ``n .. n + B − 1``. Attention inside the block is bidirectional (no causal mask), and
  every block row sees the whole context. The final ``norm`` and then the target's own (frozen) LM head give
  a distribution at each block row; row ``k ≥ 1`` drafts the token at position ``n + k``, so one forward
  gives ``B − 1`` drafts, each from its own distribution (none depends on the others' samples).
* **Draft vocabulary (optional).** With ``draft_vocab_size`` set, the head is the drafter's own ``lm_head`` over
  that many target ids (started from the target's rows, trained), with EAGLE-3's ``d2t``/``t2d`` maps: the
  reduced-vocabulary DFlash that ``speculators`` saves (``draft_vocab_size``, ``lm_head``, ``d2t``, ``t2d``) and
  vLLM's DFlash loader reads (``lm_head`` + ``d2t``). It drafts only those ids; verification stays lossless.
* **Layer numbering.** ``target_layer_ids`` use the *reference* numbering (the DFlash code and SGLang): id
  ``i`` is the output of target layer ``i``, i.e. HF ``output_hidden_states[i + 1]``. ``speculators`` stores
  ``i + 1`` (``aux_hidden_state_layer_ids``) and vLLM converts back; :mod:`pipeline.drafters.dflash_export`
  writes both and a test round-trips them to the same ``hidden_states`` indices.

The state dict of :class:`DFlashDrafter` *is* the reference layout: ``layers.N.self_attn.{q,k,v,o}_proj``,
``layers.N.self_attn.{q,k}_norm``, ``layers.N.mlp.{gate,up,down}_proj``, ``layers.N.{input,post_attention}
_layernorm``, ``fc``, ``hidden_norm``, ``norm`` (:data:`reference_keys`) — and nothing else: the embedding
and LM head are the target's, held by reference, and RoPE tables are non-persistent. A drafter with its own
draft-vocabulary head adds ``lm_head.weight``, ``d2t`` and ``t2d``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config.dflash import check_target_layer_ids
from pipeline.drafters.caches import reserve
from pipeline.drafters.layers import (
    MLP,
    RMSNorm,
    RopeDrafter,
    check_shape,
    check_vocab_maps,
    rotate,
    rotate_together,
    stacked_products,
    stacked_weights,
    target_shape,
)
from pipeline.errors import DrafterError

# --- config ----------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Tapped target layers (reference numbering: layer outputs) for a target and drafter depth.

    Deep targets (``L ≥ num_draft_layers + 4``): the reference spread, ``num_draft_layers`` ids from 1 to
    ``L − 3`` evenly, rounded (Qwen3-8B, 36 layers, 5 draft layers: ``[1, 9, 17, 25, 33]``); one draft layer
    taps the middle layer ``L // 2`` (at most ``L − 2``). Shallower targets (the tiny kit's) spread the ids over ``0 .. L − 2``
    (the last layer's output is the one before the final norm no server hands over twice), duplicates dropped.
    """
    if num_target_layers < 2:
        raise DrafterError("A DFlash drafter needs at least two target layers to tap.",
                           expected="a target of at least 2 layers", found=f"{num_target_layers} layer(s)")
    if num_draft_layers == 1:
        return (min(num_target_layers // 2, num_target_layers - 2),)
    if num_target_layers >= num_draft_layers + 4:
        start, end = 1, num_target_layers - 3
        return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))
    top = num_target_layers - 2
    spread = [int(round(i * top / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    return tuple(sorted(set(spread)))


@dataclass(frozen=True)
class DFlashConfig:
    """Shape of a DFlash drafter; :meth:`from_target` copies the attention shape from the target's config."""

    hidden_size: int
    """Width of the target's residual stream (the block rows are its embeddings)."""
    intermediate_size: int
    """Width of each layer's gated MLP (the target's)."""
    num_hidden_layers: int
    """Draft layers (the published Qwen3-8B drafter: 5)."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    """Rows of the target's embedding and LM head."""
    block_size: int
    """``B``: rows of a block (the verified token and ``B − 1`` masks); ``B − 1`` drafts per forward."""
    target_layer_ids: tuple[int, ...]
    """Tapped target layers, reference numbering (id ``i`` = output of layer ``i`` = ``hidden_states[i + 1]``)."""
    num_target_layers: int
    """Depth of the target."""
    mask_token_id: int
    """The token whose (frozen, target) embedding fills the block's masked rows."""
    rope_scaling: dict | None = None
    """The target's non-default RoPE parameters, else None."""
    draft_vocab_size: int | None = None
    """None: the target's frozen LM head over the whole vocabulary. Else the rows of the drafter's own head (fewer than
    ``vocab_size``), one per target id of its draft vocabulary (``d2t``/``t2d``)."""

    def __post_init__(self) -> None:
        check_shape(self, ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                           "num_target_layers"))
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise DrafterError("DFlashConfig: a block must hold the verified token and at least one mask.",
                               expected="block_size >= 2", found=f"block_size={self.block_size!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise DrafterError("DFlashConfig: the mask token is not a row of the target's embedding.",
                               expected=f"mask_token_id in [0, {self.vocab_size})", found=f"{self.mask_token_id!r}")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        if self.draft_vocab_size is not None and (not isinstance(self.draft_vocab_size, int)
                                                  or not 0 < self.draft_vocab_size < self.vocab_size):
            raise DrafterError("DFlashConfig: a draft vocabulary must be smaller than the target's.",
                               expected=f"draft_vocab_size null or in [1, {self.vocab_size})",
                               found=f"draft_vocab_size={self.draft_vocab_size!r}")
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))  # lists from JSON

    @property
    def hidden_state_indices(self) -> tuple[int, ...]:
        """Indices into HF ``output_hidden_states`` of the tapped layers (``id + 1``)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config: Any, *, num_hidden_layers: int, block_size: int, mask_token_id: int,
                    target_layer_ids: tuple[int, ...] | None = None, num_key_value_heads: int | None = None,
                    intermediate_size: int | None = None, num_attention_heads: int | None = None,
                    draft_vocab_size: int | None = None) -> DFlashConfig:
        """The drafter for a Llama/Qwen3-style target config (heads, head dim, MLP width, RoPE and eps copied).

        Args:
            target_config: the target's ``transformers`` config.
            num_hidden_layers: draft layers.
            block_size: ``B``.
            mask_token_id: the mask token (a row of the target's embedding).
            target_layer_ids: tapped layers (reference numbering); None picks :func:`default_target_layer_ids`.
            num_key_value_heads: the draft layers' key/value heads; None copies the target's. Every block row reads
                the context only through them, so more heads (up to one per query head) widen what a row can read.
            intermediate_size: the draft layers' MLP width; None copies the target's.
            num_attention_heads: the draft layers' query heads (each ``head_dim`` wide); None copies the target's.
            draft_vocab_size: rows of the drafter's own head; None uses the target's head (full vocabulary).
        """
        depth = int(target_config.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(depth, num_hidden_layers)
        shape = target_shape(target_config)
        shape["num_attention_heads"] = int(num_attention_heads or shape["num_attention_heads"])
        shape["num_key_value_heads"] = int(num_key_value_heads or shape["num_key_value_heads"])
        shape["intermediate_size"] = int(intermediate_size or shape["intermediate_size"])
        return cls(
            **shape,
            num_hidden_layers=int(num_hidden_layers),
            vocab_size=int(target_config.vocab_size),
            block_size=int(block_size),
            target_layer_ids=tuple(int(i) for i in target_layer_ids),
            num_target_layers=depth,
            mask_token_id=int(mask_token_id),
            draft_vocab_size=None if draft_vocab_size is None else int(draft_vocab_size),
        )


def reference_keys(config: DFlashConfig) -> tuple[str, ...]:
    """Every weight name of the reference layout (what vLLM's and SGLang's DFlash loaders read), in order."""
    per_layer = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
    layers = tuple(f"layers.{n}.{key}" for n in range(config.num_hidden_layers) for key in per_layer)
    head = () if config.draft_vocab_size is None else ("lm_head.weight", "d2t", "t2d")
    return (*layers, "fc.weight", "hidden_norm.weight", "norm.weight", *head)


# --- the context cache -----------------------------------------------------------------------------


class ContextCache:
    """Per draft layer, the keys and values of the context positions seen so far, ``(B, kv_heads, P, d)``.

    Only context rows are kept (they depend on the target's features of an accepted prefix, which never
    change); block rows are recomputed every forward. :meth:`crop` drops positions after a rejection. The rows
    live in buffers that double when full, with the block's rows written after the context's, so a round writes
    only its new rows and its block (no copy of the whole context per round) and hands the layer a view.
    """

    def __init__(self, num_layers: int) -> None:
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers

    @property
    def length(self) -> int:
        return self._lengths[0]

    def crop(self, length: int) -> None:
        self._lengths = [min(n, length) for n in self._lengths]

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor, block_key: torch.Tensor,
               block_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a layer's new context keys/values and place the block's after them (not kept: the next forward
        overwrites them); the layer's keys/values to attend over, context then block, as views of its buffers."""
        start = self._lengths[layer]
        end = start + key.shape[2]
        total = end + block_key.shape[2]
        keys = self._keys[layer] = reserve(self._keys[layer], start, total, key)
        values = self._values[layer] = reserve(self._values[layer], start, total, value)
        keys[:, :, start:end], keys[:, :, end:total] = key, block_key
        values[:, :, start:end], values[:, :, end:total] = value, block_value
        self._lengths[layer] = end
        return keys[:, :, :total], values[:, :, :total]


class StaticContextCache:
    """:class:`ContextCache` preallocated to ``capacity`` context positions per layer, then ``block_rows`` slots for
    the block, for static shapes and CUDA graphs.

    New context rows are written from the device position :attr:`position` on (a feed may be padded: its extra slots
    lie past :attr:`end`); a block sees exactly the slots before :attr:`end`, the context's length, and its own rows,
    written into the block slots. Every forward hands each layer the same whole buffers (no copy of the context).
    The host keeps the length (:attr:`length`) and sets both device scalars from it before a forward (:meth:`at`),
    so nothing inside the forward reads a host value.
    """

    def __init__(self, num_layers: int, capacity: int, block_rows: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.capacity, self.block_rows = capacity, block_rows
        self.keys = [torch.zeros(1, kv_heads, capacity + block_rows, head_dim, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.end = torch.zeros((), dtype=torch.long, device=device)
        # A context slot's index, and -1 for a block slot: `slots < end` is the mask of what a block row sees.
        self.slots = torch.cat([torch.arange(capacity, device=device),
                                torch.full((block_rows,), -1, dtype=torch.long, device=device)])
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def at(self, new_rows: int) -> None:
        """Before a forward that appends ``new_rows`` context rows at the host length."""
        self.position.fill_(self.length)
        self.end.fill_(self.length + new_rows)

    def extend(self, layer: int, key: torch.Tensor, value: torch.Tensor, block_key: torch.Tensor,
               block_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new context keys/values at the position and the block's into the block slots; the
        layer's whole buffers (masked by :meth:`mask`)."""
        keys, values = self.keys[layer], self.values[layer]
        slots = self.position + torch.arange(key.shape[2], device=key.device)
        keys.index_copy_(2, slots, key)
        values.index_copy_(2, slots, value)
        keys[:, :, self.capacity:].copy_(block_key)
        values[:, :, self.capacity:].copy_(block_value)
        return keys, values

    def mask(self, block_rows: int) -> torch.Tensor:
        """``(1, 1, 1, capacity + block_rows)``: the context slots before :attr:`end`, then every block row."""
        if block_rows != self.block_rows:
            raise DrafterError("A block of the wrong length for this static context cache.",
                               expected=f"{self.block_rows} rows (the drafter's block_size)",
                               found=f"{block_rows} rows", fix="Draft whole blocks on the static paths.")
        return (self.slots < self.end).view(1, 1, 1, -1)


# --- one draft layer -------------------------------------------------------------------------------


class Attention(nn.Module):
    """Qwen3 attention (per-head ``q_norm``/``k_norm`` before RoPE) whose keys/values are context then block."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        width = config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.register_buffer("qkv", None, persistent=False)

    def stack(self, on: bool) -> None:
        """Queries, keys and values as one product over context and block (decoding: the context rows' queries are
        computed and dropped, cheaper than two more products) or three (training)."""
        self.qkv = stacked_weights(on, self.qkv, self.q_proj, self.k_proj, self.v_proj)

    def _norm_together(self, qk: torch.Tensor) -> torch.Tensor:
        """``q_norm`` on the first ``heads`` and ``k_norm`` on the rest of ``(B, T, heads + kv_heads, d)``: one
        unweighted norm, then each weight on its heads (the fused norm's values to the bit, with no weight copied)."""
        out = F.rms_norm(qk.float(), (self.head_dim,), eps=self.q_norm.eps).to(qk.dtype)  # float32 statistics
        out[..., : self.heads, :] *= self.q_norm.weight
        out[..., self.heads :, :] *= self.k_norm.weight
        return out

    def forward(self, block: torch.Tensor, context: torch.Tensor, rope: tuple, mask: torch.Tensor | None,
                cache: ContextCache | StaticContextCache | None, layer: int) -> torch.Tensor:
        """``rope``: cos/sin ``(B, C + L, d)`` of the context's positions, then the block's."""
        batch, length, _ = block.shape
        rows = context.shape[1]
        cos, sin = rope
        # The context's keys/values and the block's in one projection each (one matmul, one norm, one rotation).
        both = torch.cat([context, block], dim=1)
        if self.qkv is None:
            q, k, v = self.q_proj(block), self.k_proj(both), self.v_proj(both)
            q = self.q_norm(q.reshape(batch, length, self.heads, self.head_dim)).transpose(1, 2)
            q = rotate(q, cos[:, rows:], sin[:, rows:])
            k = self.k_norm(k.reshape(batch, rows + length, self.kv_heads, self.head_dim)).transpose(1, 2)
            k = rotate(k, cos, sin)
        else:  # decoding: queries (of every row; the context's are dropped) and keys normed and rotated together
            # (sin arrives signed, the decoding layout's form: RopeDrafter.rope)
            qk, v = stacked_products(both, self.qkv, (self.q_proj.out_features + self.k_proj.out_features,
                                                      self.v_proj.out_features))
            qk = self._norm_together(qk.reshape(batch, rows + length, self.heads + self.kv_heads, self.head_dim))
            qk = rotate_together(qk.transpose(1, 2), cos, sin)
            q, k = qk[:, : self.heads, rows:], qk[:, self.heads :]
        v = v.reshape(batch, rows + length, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.extend(layer, k[:, :, :rows], v[:, :, :rows], k[:, :, rows:], v[:, :, rows:])
        # No causal mask: a block row sees every context key and every row of its block (both directions).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    """A Qwen3 decoder layer over the block; the (already normed) context enters only as keys and values."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, block: torch.Tensor, context: torch.Tensor, rope: tuple, mask: torch.Tensor | None,
                cache: ContextCache | StaticContextCache | None, layer: int) -> torch.Tensor:
        block = block + self.self_attn(self.input_layernorm(block), context, rope, mask, cache, layer)
        return block + self.mlp(self.post_attention_layernorm(block))


# --- the drafter -----------------------------------------------------------------------------------


class DFlashDrafter(RopeDrafter):
    """DFlash over a frozen target embedding and, unless the config names a draft vocabulary, LM head.

    Args:
        config: the drafter's shape (:meth:`DFlashConfig.from_target`).
        target_embedding: the target's token embedding (block rows), frozen and held by reference.
        target_head: the target's LM head, frozen and held by reference (neither is in the state dict nor
            moves with ``.to()``: keep the drafter on the target's device). With ``config.draft_vocab_size`` the
            drafter has its own ``lm_head`` (a submodule, saved), started from these rows by :meth:`set_vocab_maps`.
    """

    def __init__(self, config: DFlashConfig, target_embedding: nn.Module, target_head: nn.Module) -> None:
        super().__init__()
        for what, module in (("embedding", target_embedding), ("LM head", target_head)):
            if tuple(module.weight.shape) != (config.vocab_size, config.hidden_size):
                raise DrafterError(f"The target {what} does not match the DFlash config.",
                                   expected=f"shape {(config.vocab_size, config.hidden_size)}",
                                   found=f"shape {tuple(module.weight.shape)}",
                                   fix="Build the config with DFlashConfig.from_target(target.config, ...).")
            module.weight.requires_grad_(False)
        self.config = config
        object.__setattr__(self, "embed_tokens", target_embedding)  # references, not submodules
        object.__setattr__(self, "target_head", target_head)
        if config.draft_vocab_size is None:
            object.__setattr__(self, "lm_head", target_head)

        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.init_rotary(config)
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            # Until set_vocab_maps: the draft vocabulary is the first draft_vocab_size target ids.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
            self.set_vocab_maps(self.d2t, self.t2d)

    # -- the draft vocabulary -------------------------------------------------------------------------

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """Target id of each row of the head, ``(draft_vocab_size,)`` int64 (``arange + d2t``); None when the head is
        the target's (row ``i`` is target id ``i``)."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab_maps(self, d2t_offsets: Any, t2d_mask: Any) -> None:
        """Install the draft vocabulary (EAGLE-3's ``d2t`` offsets and ``t2d`` mask, e.g. from
        :func:`pipeline.vocab.counting.eagle3_offset_maps`) and start ``lm_head`` from the target's rows of it."""
        if self.config.draft_vocab_size is None:
            raise DrafterError("This DFlash drafter drafts over the target's whole vocabulary: it has no vocabulary maps.",
                               expected="a config with draft_vocab_size", found="draft_vocab_size=None")
        d2t, t2d = check_vocab_maps(d2t_offsets, t2d_mask, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        rows = self.target_head.weight
        self.lm_head.weight.copy_(rows[self.draft_to_target.to(rows.device)].to(self.lm_head.weight))

    # -- the network --------------------------------------------------------------------------------

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(·))`` of the concatenated tapped layers ``(B, C, n·H)`` → ``(B, C, H)``."""
        expected = len(self.config.target_layer_ids) * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise DrafterError("Target features of the wrong width for this DFlash drafter.",
                               expected=f"{expected} ({len(self.config.target_layer_ids)} layers × "
                                        f"{self.config.hidden_size})",
                               found=f"last dimension {target_hidden.shape[-1]}")
        return self.hidden_norm(self.fc(target_hidden))

    def block_ids(self, first: torch.Tensor) -> torch.Tensor:
        """Blocks ``[first, MASK × (B − 1)]`` for first tokens ``(N,)`` → ``(N, B)``."""
        masks = torch.full((first.shape[0], self.config.block_size - 1), self.config.mask_token_id,
                           dtype=first.dtype, device=first.device)
        return torch.cat([first.unsqueeze(1), masks], dim=1)

    def forward(self, block_ids: torch.Tensor, target_hidden: torch.Tensor, block_positions: torch.Tensor,
                context_positions: torch.Tensor, mask: torch.Tensor | None = None,
                cache: ContextCache | StaticContextCache | None = None, bound: int | None = None) -> torch.Tensor:
        """The final-normed hidden state of every block row, ``(B, L, H)``; :meth:`logits` turns it into logits.

        Args:
            block_ids: ``(B, L)`` block tokens (one or several blocks side by side).
            target_hidden: ``(B, C, n·H)`` the tapped layers at the (new) context positions; ``C`` may be 0.
            block_positions: ``(B, L)`` RoPE positions of the block rows.
            context_positions: ``(B, C)`` RoPE positions of the context rows.
            mask: None (every row sees every key: one block at inference) or a boolean ``(B, 1, L, K)`` over
                keys ``[context (cache + new); block]`` (training: each block sees its own prefix and itself).
            cache: a :class:`ContextCache` (inference); the new context rows are appended to it. Or a
                :class:`StaticContextCache` (static shapes): the new rows are written at its position and the block
                sees the slots before its end (``mask`` must then be None).
            bound: a host bound every position is below, if the caller knows one (a static cache's is its slots);
                decoding then reads RoPE from a table (:meth:`~pipeline.drafters.layers.RopeDrafter.rope`).
        """
        context = self.project_context(target_hidden)
        if isinstance(cache, StaticContextCache):
            mask = cache.mask(block_ids.shape[1])
            bound = cache.capacity + cache.block_rows
        with torch.no_grad():
            block = self.embed_tokens(block_ids).to(context.dtype)
        rope = self.rope(block, torch.cat([context_positions, block_positions], dim=1), bound)
        for index, layer in enumerate(self.layers):
            block = layer(block, context, rope, mask, cache, index)
        return self.norm(block)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on the drafter's normed output: the target's (full vocabulary) or, with a draft vocabulary, the
        drafter's own (``draft_vocab_size`` wide; :attr:`draft_to_target` names the target id of each)."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The reference layout's tensors (:func:`reference_keys`; with a draft vocabulary, its head and maps too):
        what every export saves."""
        return {name: tensor.detach() for name, tensor in self.state_dict().items()}

