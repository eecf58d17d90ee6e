"""The EAGLE-3 head's attention caches: keys and values of the positions fed so far, in three shapes.

:class:`KVCache` grows as positions are fed (inference on the eager path: prefill, then draft tokens one at a time;
:meth:`KVCache.crop` drops rejected ones). :class:`StaticKVCache` is the same preallocated, for static shapes and CUDA
graphs: the position is a device value and stale slots are masked, never freed. :class:`TTTCache` serves the
unrolled training-time test (EAGLE-3 §3.2): at step ``s`` the query of row ``t`` sees the step-0 keys of rows ``≤ t``
plus entry ``t`` of steps ``1..s``, the keys a chain drafter sees at inference (see :mod:`pipeline.drafters.eagle3`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def reserve(buffer: torch.Tensor | None, kept: int, needed: int, like: torch.Tensor) -> torch.Tensor:
    """A ``(B, heads, ·, d)`` buffer of at least ``needed`` positions along dim 2, shaped and typed like ``like``:
    ``buffer`` itself when it is long enough, else a new one of twice ``needed`` (at least 64) holding its first
    ``kept`` positions. A cache that grows by doubling copies each position O(1) times over a generation, where
    concatenating every feed copied the whole cache each time (seven times a round for an EAGLE-3 chain). A buffer of
    another batch, head shape, dtype or device is not reused (its kept rows are converted into the new one)."""
    if buffer is not None and buffer.shape[2] >= needed and buffer.dtype == like.dtype and \
            buffer.device == like.device and buffer.shape[:2] == like.shape[:2] and buffer.shape[3] == like.shape[3]:
        return buffer
    grown = like.new_empty(*like.shape[:2], max(64, 2 * needed), like.shape[3])
    if buffer is not None and kept:
        grown[:, :, :kept] = buffer[:, :, :kept]
    return grown


class KVCache:
    """Keys and values of every position fed so far, ``(B, kv_heads, P, head_dim)``, RoPE applied.

    Inference: prefill with the verified prefix, then feed draft tokens; :meth:`crop` drops rejected ones. The rows
    live in buffers that double when full (:func:`reserve`): a feed writes only its own rows, and attention reads
    views of the buffers.
    """

    def __init__(self) -> None:
        self._key: torch.Tensor | None = None
        self._value: torch.Tensor | None = None
        self.length = 0

    @property
    def key(self) -> torch.Tensor | None:
        return None if self._key is None else self._key[:, :, : self.length]

    @property
    def value(self) -> torch.Tensor | None:
        return None if self._value is None else self._value[:, :, : self.length]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past, end = self.length, self.length + k.shape[2]
        self._key, self._value = reserve(self._key, past, end, k), reserve(self._value, past, end, v)
        self._key[:, :, past:end], self._value[:, :, past:end] = k, v
        self.length = end
        # New queries see every cached position and, among themselves, only earlier ones: one query sees everything.
        visible = None if q.shape[2] == 1 else torch.ones(q.shape[2], end, dtype=torch.bool,
                                                               device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, self.key, self.value, attn_mask=visible, enable_gqa=True)


class StaticKVCache:
    """:class:`KVCache` preallocated to ``capacity`` positions, for static shapes and CUDA graphs.

    Keys are written at the device position :attr:`position` onwards and every query sees the slots at or before
    its own position, so stale slots after a rollback (or after a padded feed) are never read. The host keeps the
    length (:attr:`length`): a caller sets ``position`` from it before a step (:meth:`at_length`) and advances it
    after, outside any captured graph, so nothing inside a step reads a host value.
    """

    def __init__(self, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.capacity = capacity
        self.key = torch.zeros(1, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.value = torch.zeros_like(self.key)
        self.position = torch.zeros((), dtype=torch.long, device=device)
        self.slots = torch.arange(capacity, device=device)
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def at_length(self) -> None:
        """Point the device position at the host length (before a step)."""
        self.position.fill_(self.length)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        slots = self.position + torch.arange(q.shape[2], device=q.device)
        self.key.index_copy_(2, slots, k)
        self.value.index_copy_(2, slots, v)
        visible = self.slots.unsqueeze(0) <= slots.unsqueeze(1)
        return F.scaled_dot_product_attention(q, self.key, self.value, attn_mask=visible, enable_gqa=True)


@dataclass
class TTTCache:
    """Keys and values of each unrolled training-time-test step so far (step 0 first), all
    ``(B, kv_heads, T, head_dim)``: causal over step 0, one diagonal entry per later step."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.keys)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        groups = q.shape[1] // k.shape[1]
        keys = [x.repeat_interleave(groups, dim=1) for x in self.keys]
        values = [x.repeat_interleave(groups, dim=1) for x in self.values]
        length = q.shape[2]
        scale = q.shape[-1] ** -0.5
        # Row t: step-0 keys of rows <= t (B, h, T, T), then entry t of each later step (B, h, T, s).
        prefix = (q @ keys[0].transpose(-1, -2)) * scale
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        scores = [prefix.masked_fill(~causal, float("-inf"))]
        if len(keys) > 1:
            scores.append((q.unsqueeze(-2) * torch.stack(keys[1:], dim=-2)).sum(-1) * scale)
        weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = weights[..., :length] @ values[0]
        if len(values) > 1:
            out = out + (weights[..., length:].unsqueeze(-1) * torch.stack(values[1:], dim=-2)).sum(-2)
        return out
