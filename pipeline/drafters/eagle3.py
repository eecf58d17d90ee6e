"""The EAGLE-3 draft network: three target layers fused, one decoder layer, a reduced-vocabulary head.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840, §3.1 and Fig. 5) drafts from the target's low, middle and high
layer features ``l, m, h``: concatenated (3H) and fused by ``fc`` (3H → H) into ``g_t``. One decoder
layer attends over ``[input_layernorm(e_{t+1}); hidden_norm(g_t)]`` (2H wide, ``e`` the target's own
frozen token embedding; the residual stream is the un-normed ``g_t``), then a Llama MLP, the final
``norm`` and ``lm_head`` over a reduced draft vocabulary. The hidden state a draft step returns (before
``norm``) replaces ``g`` at the next step. ``d2t``/``t2d`` follow the EAGLE-3 offset convention:
draft id ``i`` is target id ``i + d2t[i]`` (:func:`pipeline.vocab.counting.eagle3_offset_maps`).

Parameter names are the ones the serving loaders read, so an export is a rename-free save of
:meth:`Eagle3Drafter.trainable_state_dict` (``SERVING_KEYS``). Checked, read not copied, in:
SGLang ``python/sglang/srt/models/llama_eagle3.py`` (sgl-project/sglang @03d5a77:
``LlamaForCausalLMEagle3.load_weights`` tries each key bare and under ``model.``; the model holds
``fc``, ``midlayer`` with q/k/v_proj of input 2H stacked into ``qkv_proj``, ``hidden_norm``,
``input_layernorm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, then ``norm`` and
``lm_head``; ``d2t`` becomes ``hot_token_id = d2t + arange``; ``t2d`` is skipped) and vLLM
``vllm/model_executor/models/llama_eagle3.py`` (vllm-project/vllm @00bd149: ``midlayer.`` →
``layers.0.``, every key but ``lm_head`` prefixed ``model.``, ``d2t`` → ``draft_id_to_target_id`` used
as ``arange + d2t``, ``t2d`` skipped, ``embed_tokens`` optional — the target's is shared). Both feed
back the pre-norm residual (the second output of their fused add-norm), as :meth:`Eagle3Drafter.step`.

Attention has three caches (:mod:`pipeline.drafters.caches`). :class:`KVCache` is the ordinary one (inference:
prefill, then draft tokens one at a time); :class:`StaticKVCache` is the same preallocated, for static shapes and
CUDA graphs. :class:`TTTCache` serves the unrolled training-time test (EAGLE-3 §3.2, Fig. 6): at
step ``s`` the query of row ``t`` stands for sequence position ``t+s`` and sees the step-0 keys of rows
``≤ t`` (the verified prefix) plus entry ``t`` of steps ``1..s`` (its own drafts), which are exactly the
keys a chain drafter sees at inference (a test checks it against :class:`KVCache`). The EAGLE-3 and
SpecForge training code also hide step-0 keys ``t-s+1..t``; SafeAILab/EAGLE#247 questions that and we
don't. RoPE positions advance by one per step for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.drafters.caches import KVCache, StaticKVCache, TTTCache
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

# What SGLang's and vLLM's EAGLE-3 Llama loaders read (see the module docstring); the export contract.
SERVING_KEYS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


# --- config ----------------------------------------------------------------------------------------

def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high feature indices into HF ``output_hidden_states`` for a target depth.

    Seven layers or more: EAGLE-3's ``(2, L//2, L-3)`` (the SpecForge and SGLang default; index ``i``
    is the input of layer ``i``, which is what SGLang captures). Shallower targets (the tiny kit's) spread
    the three over the layer inputs ``0..L-1`` — ``(0, 1, 2)`` at L=3, ``(1, 2, 3)`` at L=4, ``(1, 3, 5)``
    at L=6 — and a 2-layer target also takes index 2 (after the final norm in transformers 5, which no
    server can capture). One layer cannot give three features.
    """
    if num_layers >= 7:
        return 2, num_layers // 2, num_layers - 3
    if num_layers < 2:
        raise DrafterError("An EAGLE-3 drafter needs three target feature layers.",
                           expected="a target of at least 2 layers (3 entries of output_hidden_states)",
                           found=f"a target of {num_layers} layer(s)")
    low = 1 if num_layers >= 4 else 0
    high = num_layers - 1 if num_layers >= 3 else num_layers
    return low, (low + high) // 2, high


def check_aux_layer_ids(ids: Any, num_layers: int) -> None:
    """Raise :class:`DrafterError` unless ``ids`` are three ascending indices in ``[0, num_layers]``.

    Ascending, because the servers concatenate the captured layers in layer order and ``fc`` must
    see them in that order.
    """
    ok = (isinstance(ids, (tuple, list)) and len(ids) == 3 and all(isinstance(i, int) for i in ids)
          and all(0 <= i <= num_layers for i in ids) and ids[0] < ids[1] < ids[2])
    if not ok:
        raise DrafterError(
            "EAGLE-3 aux_layer_ids do not name three target feature layers.",
            expected=f"three distinct ascending indices into output_hidden_states, each in [0, {num_layers}] "
                     f"(0 = embedding output; the target has {num_layers} layers)",
            found=f"aux_layer_ids={ids!r}",
            fix="Leave aux_layer_ids unset for the default, or pick three increasing layer indices.",
        )


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 drafter; :meth:`from_target` copies it from the target's config."""

    hidden_size: int
    """Width of the target's residual stream (the drafter shares the target's embedding, so the same)."""
    intermediate_size: int
    """Width of the Llama MLP (SGLang and vLLM take the target's)."""
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    """Rows of the target's embedding (``t2d`` has this length)."""
    draft_vocab_size: int
    """Rows of ``lm_head`` (``d2t`` has this length); at most ``target_vocab_size``."""
    aux_layer_ids: tuple[int, int, int]
    """Low, middle, high indices into HF ``output_hidden_states`` (element 0 is the embedding output, ``i``
    the input of layer ``i``). SGLang's ``eagle_aux_hidden_state_layer_ids`` names layer outputs: ``i - 1``."""
    target_num_layers: int
    """Depth of the target, for checking ``aux_layer_ids``."""
    rope_scaling: dict | None = None
    """The target's non-default RoPE parameters (e.g. Llama-3.1's ``llama3`` scaling), else None."""

    def __post_init__(self) -> None:
        check_shape(self, ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                           "max_position_embeddings", "target_vocab_size", "draft_vocab_size", "target_num_layers"))
        if self.draft_vocab_size > self.target_vocab_size:
            raise DrafterError("Eagle3Config: the draft vocabulary is larger than the target's.",
                               expected=f"draft_vocab_size <= {self.target_vocab_size}",
                               found=f"draft_vocab_size={self.draft_vocab_size}")
        check_aux_layer_ids(self.aux_layer_ids, self.target_num_layers)
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))  # lists from YAML

    @classmethod
    def from_target(cls, target_config: Any, draft_vocab_size: int,
                    aux_layer_ids: tuple[int, int, int] | None = None) -> Eagle3Config:
        """The drafter for a Llama-style target config (heads, head dim, RoPE and eps copied).

        Args:
            target_config: the target's ``transformers`` config.
            draft_vocab_size: size of the reduced draft vocabulary.
            aux_layer_ids: feature indices; None picks :func:`default_aux_layer_ids`.
        """
        num_layers = int(target_config.num_hidden_layers)
        if aux_layer_ids is None:
            aux_layer_ids = default_aux_layer_ids(num_layers)
        return cls(
            **target_shape(target_config),
            target_vocab_size=int(target_config.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=tuple(aux_layer_ids),
            target_num_layers=num_layers,
        )


# --- the decoder layer -----------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal self-attention whose queries, keys and values are projected from the 2H-wide input."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.head_dim)
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.register_buffer("qkv", None, persistent=False)

    def stack(self, on: bool) -> None:
        """Queries, keys and values as one product (decoding) or three (training)."""
        self.qkv = stacked_weights(on, self.qkv, self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | StaticKVCache | TTTCache | None) -> torch.Tensor:
        batch, length, _ = x.shape
        if self.qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.reshape(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k = k.reshape(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        else:  # decoding: queries and keys from one product, reshaped and rotated together (sin arrives signed)
            qk, v = stacked_products(x, self.qkv, (self.q_proj.out_features + self.k_proj.out_features,
                                                   self.v_proj.out_features))
            qk = rotate_together(qk.reshape(batch, length, self.heads + self.kv_heads, self.head_dim).transpose(1, 2),
                                 cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = v.reshape(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        out = (cache if cache is not None else KVCache()).attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


class DecoderLayer(nn.Module):
    """EAGLE-3's one layer: attention over ``[norm(embedding); norm(feature)]``, residual = feature."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | StaticKVCache | TTTCache | None) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# --- the drafter -----------------------------------------------------------------------------------

class Eagle3Drafter(RopeDrafter):
    """EAGLE-3 draft head over a frozen target embedding.

    Args:
        config: the drafter's shape (:meth:`Eagle3Config.from_target`).
        target_embedding: the target's token embedding. It is frozen and held by reference, outside
            this module's parameters and state dict (the servers share the target's), so it does not
            move with ``.to()``: keep the drafter on the target's device.
    """

    def __init__(self, config: Eagle3Config, target_embedding: nn.Embedding) -> None:
        super().__init__()
        expected = (config.target_vocab_size, config.hidden_size)
        if tuple(target_embedding.weight.shape) != expected:
            raise DrafterError("The target embedding does not match the EAGLE-3 config.",
                               expected=f"an embedding of shape {expected}",
                               found=f"shape {tuple(target_embedding.weight.shape)}",
                               fix="Build the config with Eagle3Config.from_target(target.config, ...).")
        self.config = config
        target_embedding.weight.requires_grad_(False)
        object.__setattr__(self, "embed_tokens", target_embedding)  # a reference, not a submodule

        self.fc = nn.Linear(3 * config.hidden_size, config.hidden_size, bias=False)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.init_rotary(config)
        # Until set_vocab_maps: the draft vocabulary is the first draft_vocab_size target ids.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- vocabulary ---------------------------------------------------------------------------------

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft id, ``(draft_vocab_size,)`` int64 (``arange + d2t``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab_maps(self, d2t_offsets: Any, t2d_mask: Any) -> None:
        """Install EAGLE-3 vocabulary maps (numpy or torch), e.g. from
        :func:`pipeline.vocab.counting.eagle3_offset_maps`.

        Args:
            d2t_offsets: ``(draft_vocab_size,)`` integer offsets: draft id ``i`` is target id ``i + d2t[i]``,
                target ids strictly increasing (draft id ``i`` is the ``i``-th smallest).
            t2d_mask: ``(target_vocab_size,)`` bool, true exactly at those target ids.
        """
        d2t, t2d = check_vocab_maps(d2t_offsets, t2d_mask, self.config.draft_vocab_size,
                                    self.config.target_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_head_from(self, target: nn.Module) -> None:
        """Start ``lm_head`` from the target's output rows of the draft vocabulary (set the maps first) and ``norm``
        from the target's final norm, so logits of a target-like hidden state are the target's own."""
        rows = target.get_output_embeddings().weight
        if rows.shape[1] != self.config.hidden_size:
            raise DrafterError("The target's output rows are not as wide as the head.",
                               expected=f"hidden size {self.config.hidden_size}", found=f"{rows.shape[1]}")
        self.lm_head.weight.copy_(rows[self.draft_to_target.to(rows.device)].to(self.lm_head.weight))
        final_norm = getattr(getattr(target, "model", None), "norm", None)
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            self.norm.weight.copy_(final_norm.weight.to(self.norm.weight))

    # -- the network --------------------------------------------------------------------------------

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over concatenated low/mid/high target features (3H → H); H-wide input passes through."""
        width = target_hidden.shape[-1]
        if width == 3 * self.config.hidden_size:
            return self.fc(target_hidden)
        if width == self.config.hidden_size:
            return target_hidden
        raise DrafterError("Hidden states of the wrong width for this EAGLE-3 drafter.",
                           expected=f"{3 * self.config.hidden_size} (three target layers) or "
                                    f"{self.config.hidden_size} (fused / fed back)",
                           found=f"last dimension {width}")

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
             cache: KVCache | StaticKVCache | TTTCache | None = None) -> torch.Tensor:
        """One draft step; returns the pre-norm hidden state ``(B, T, H)`` to feed back as the next ``hidden``.

        Args:
            input_ids: ``(B, T)`` tokens; row ``t`` pairs token ``x_{t+1}`` with the feature of position ``t``.
            hidden: ``(B, T, 3H)`` target features, or ``(B, T, H)`` fused or fed back.
            position_ids: ``(B, T)``; by default continues the cache (``KVCache``: after its length;
                ``TTTCache``: ``arange(T)`` plus the step index).
            cache: None (plain causal), a :class:`KVCache`, a :class:`StaticKVCache` (positions from its device
                position) or a :class:`TTTCache`; updated in place.
        """
        hidden = self.fuse(hidden)
        batch, length = input_ids.shape
        bound = None  # every position is below it, when the host knows one (decoding reads RoPE from a table then)
        if position_ids is None and isinstance(cache, StaticKVCache):
            position_ids = (cache.position + torch.arange(length, device=input_ids.device)).expand(batch, length)
            bound = cache.capacity
        if position_ids is None:
            start = cache.length if isinstance(cache, KVCache) else cache.steps if cache is not None else 0
            position_ids = torch.arange(start, start + length, device=input_ids.device).expand(batch, length)
            bound = start + length
        with torch.no_grad():
            embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rope(hidden, position_ids, bound)
        return self.midlayer(embeds, hidden, cos, sin, cache)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``(..., draft_vocab_size)`` of a step's output."""
        return self.lm_head(self.norm(hidden_out))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor | None = None,
                past_key_values: KVCache | TTTCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step` then :meth:`logits`: ``(logits (B, T, draft_vocab_size), hidden_out (B, T, H))``."""
        hidden_out = self.step(input_ids, hidden, position_ids, past_key_values)
        return self.logits(hidden_out), hidden_out

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything an export saves: the trained weights plus ``d2t``/``t2d``, keyed as SGLang and vLLM
        read them (``SERVING_KEYS``); the target embedding and RoPE tables are not in it."""
        return {name: tensor.detach() for name, tensor in self.state_dict().items()}

