"""One model's incremental view of a token sequence: its KV cache, and the target state proposers read.

:class:`ModelSession` is the single place that runs a Hugging Face causal LM step by step. It owns a
``transformers.DynamicCache`` and the token ids whose keys/values that cache holds, moves to a new id
sequence by keeping the longest common prefix and running only the rest (so a rejected draft costs a
crop, not a recompute), counts and times forwards (with a CUDA sync, since kernels run asynchronously),
and can optionally capture hidden states at chosen layers, cropped together with the cache. The target
in both decode loops, the same-tokenizer drafters and the cross-tokenizer drafters all use it.
:class:`TargetState` is what the verify pass hands proposers each round: the target's hidden states at
the layers a proposer asked for, for every position the target has accepted, and its last distribution
(what EAGLE-3 drafters and the DynaSpec router read).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipeline.errors import DrafterError


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Called every round on the whole context, so the comparison runs in C, not a Python loop over every position:
    either one extends the other, or (a session that holds rejected drafts, or positions fed from the device and
    listed as ``-1``) they part a few positions before their ends. Prefixes ending 8, 64, 512, … positions before
    the end are compared until one agrees, then only the positions after it are scanned.
    """
    n = min(len(a), len(b))
    if _head(a, n) == _head(b, n):
        return n
    agreed, back = 0, 8
    while back < n:
        if _head(a, n - back) == _head(b, n - back):
            agreed = n - back
            break
        back *= 8
    for i in range(agreed, n):
        if a[i] != b[i]:
            return i
    return n


def _head(ids: Sequence[int], length: int) -> list[int]:
    """The first ``length`` ids as a list (a list that long is itself, not a copy)."""
    if isinstance(ids, list):
        return ids if len(ids) == length else ids[:length]
    return list(ids[:length])


def cache_argument(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` (transformers >= 5.2x), else
    ``past_key_values`` (older releases; deprecated in newer ones)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output: Any) -> Any:
    """The KV cache a forward returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def crop_cache(cache: Any, length: int) -> None:
    """Drop cached positions beyond ``length`` from a Hugging Face cache, in place.

    transformers 5.x ``Cache.crop`` takes the (negative) number of positions to remove and rejects a
    positive argument; a negative argument means the same in 4.x, so this form works in both.
    """
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


@dataclass(frozen=True)
class TargetState:
    """What the target has computed for the sequence so far, handed to a proposer each round.

    The newest token of the context is never fed to the target before the verify forward that scores
    the drafts after it, so the state covers every position but that one: ``length == len(context) - 1``.
    On the first round it covers the prompt (a prefill forward over all prompt tokens but the last runs
    when layers are asked for).

    Attributes:
        layers: Indices into Hugging Face's ``output_hidden_states`` tuple as the proposer declared them
            (``0`` = embedding output, ``-1`` = last layer; negative indices allowed).
        hidden: One ``(length, H)`` tensor per entry of ``layers``; row ``i`` is the target's hidden state
            at position ``i``. Views into buffers the loop reuses: clone what must outlive the call.
        last_p: ``(V,)`` float64, the target's standardised distribution at position ``length - 1``, from
            which the newest token was drawn (or, after a rejection, from which the residual was built);
            ``None`` before the target has emitted a token.
        length: Number of positions covered.
        token_ids: The context's token ids on the target's device (at least ``length + 1`` of them; entries after
            the context are scratch), so a proposer can feed them without copying from the host; None outside the
            decode loop.
    """

    layers: tuple[int, ...] = ()
    hidden: tuple[Tensor, ...] = ()
    last_p: Tensor | None = None
    length: int = 0
    token_ids: Tensor | None = None

    def tapped(self, layers: Sequence[int], depth: int, width: int, context_length: int, drafter: str,
               named: str, build: str) -> list[Tensor]:
        """The hidden states at ``layers`` (in that order) for a feature drafter continuing a context of
        ``context_length`` tokens, checked.

        Args:
            layers: ``output_hidden_states`` indices the drafter reads (negative ones count from the last).
            depth: Entries of the target's ``output_hidden_states`` (its layers + 1).
            width: The drafter's hidden size.
            drafter: Its name in messages (``EAGLE-3``, ``DFlash``).
            named: What its config calls the layers (for the message).
            build: How to build a drafter that fits this target (for the message).

        Raises:
            DrafterError: If the state does not cover every context position but the newest, lacks one of the
                layers, or holds states of another width.
        """
        if self.length != context_length - 1:
            raise DrafterError(
                f"the target state does not cover the context the {drafter} drafter is asked to continue",
                expected=f"target hidden states for every position but the newest: length {context_length - 1}",
                found=f"state length {self.length}",
                fix="call the proposer from the speculative loop (generate_speculative), which captures "
                "the target's states at proposer.target_layers",
            )
        available = {int(layer) % depth: index for index, layer in enumerate(self.layers)}
        missing = [layer for layer in layers if layer not in available]
        if missing:
            raise DrafterError(
                f"the target state lacks layers the {drafter} drafter reads",
                expected=f"hidden states at layers {list(layers)} ({named})",
                found=f"layers {list(self.layers)}",
                fix="capture the target at proposer.target_layers",
            )
        hidden = [self.hidden[available[layer]] for layer in layers]
        bad = [tuple(h.shape) for h in hidden if h.dim() != 2 or h.shape[0] != self.length or h.shape[1] != width]
        if bad:
            raise DrafterError(
                f"the target state's hidden states do not fit the {drafter} drafter",
                expected=f"({self.length}, {width}) per layer",
                found=f"shapes {bad}",
                fix=f"build the drafter with {build} for this target",
            )
        return hidden

    def ids(self, start: int, stop: int, host: Sequence[int]) -> Tensor:
        """Context ids ``[start, stop)`` as a 1-D device tensor: a view of :attr:`token_ids` when the loop gave them,
        else built from ``host`` (the same ids) on the device of the hidden states."""
        if self.token_ids is not None:
            return self.token_ids[start:stop]
        device = self.hidden[0].device if self.hidden else None
        return torch.tensor(list(host[start:stop]), dtype=torch.long, device=device)


class _Rows:
    """A growable ``(n, H)`` buffer: appending is amortised O(new rows), cropping is free."""

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self._data = torch.empty((0, width), dtype=dtype, device=device)
        self.length = 0

    def append(self, rows: Tensor) -> None:
        if self.length == 0 and rows.shape[1:] != self._data.shape[1:]:
            self._data = rows.new_empty((0, *rows.shape[1:]))  # a model whose states are not embedding-wide
        need = self.length + rows.shape[0]
        if need > self._data.shape[0]:
            grown = self._data.new_empty((max(need, 2 * self._data.shape[0], 64), *self._data.shape[1:]))
            grown[: self.length] = self._data[: self.length]
            self._data = grown
        self._data[self.length : need] = rows
        self.length = need

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def view(self) -> Tensor:
        return self._data[: self.length]


def device_tokens(new_ids: Sequence[int] | Tensor, device_ids: Tensor | None, device: torch.device
                  ) -> tuple[Tensor, list[int]]:
    """What a session feeds: the ids as a 1-D tensor on ``device`` and what the host knows of them (``-1`` for a
    device tensor's entries, which the host has not read)."""
    if isinstance(new_ids, Tensor):
        ids = new_ids.reshape(-1).to(device)
        return ids, [-1] * ids.shape[0]
    known = [int(t) for t in new_ids]
    if device_ids is not None:
        return device_ids.reshape(-1).to(device), known
    return torch.tensor(known, dtype=torch.long, device=device), known


class SessionBase:
    """What both sessions share (:class:`ModelSession` here, :class:`~pipeline.engine.static.StaticSession`):
    the model they run, forward counts and seconds, the synchronisation that charges queued kernels to a timer,
    and moving to a new sequence by common prefix. A subclass provides ``feed`` and ``crop``."""

    device: torch.device
    seconds: float
    ids: list[int]

    def _bind(self, model: torch.nn.Module, body_only: bool, layers: Sequence[int]) -> None:
        self.model = model
        self.body_only = body_only
        self.layers = tuple(int(layer) for layer in layers)
        self.device = model.get_input_embeddings().weight.device
        ModelSession.check_layers(model, self.layers)
        self._module = model.base_model if body_only else model
        self._cache_arg = cache_argument(self._module)
        self.forwards = 0
        self.seconds = 0.0

    def feed(self, new_ids: Sequence[int] | Tensor, keep: int = 1, *, device_ids: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def crop(self, length: int) -> None:
        raise NotImplementedError

    def hidden(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def sync(self) -> None:
        """Wait for queued CUDA kernels, so a timer charges them to the step that launched them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Add the wall time of the ``with`` block (synchronised) to :attr:`seconds`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds += time.perf_counter() - start

    def move_to(self, ids: Sequence[int], keep: int = 1, device_ids: Tensor | None = None) -> Tensor:
        """Make the session hold ``ids``: crop to the common prefix with :attr:`ids`, run the rest.

        At least the last ``keep`` ids are re-run even when cached, since their forward is what yields
        the rows asked for. ``device_ids``: the same ids on the device (fed from there).

        Returns:
            As :meth:`feed`, for the last ``keep`` positions of ``ids``.

        Raises:
            DrafterError: If ``ids`` has fewer than ``keep`` (or no) tokens.
        """
        keep = max(1, keep)
        if len(ids) < keep:
            raise DrafterError(
                "cannot run a model on a context shorter than the rows asked for",
                expected=f"at least {keep} token(s)",
                found=f"{len(ids)} tokens",
                fix="pass a non-empty prompt",
            )
        start = min(common_prefix_length(self.ids, ids), len(ids) - keep)
        self.crop(start)
        on_device = None if device_ids is None else device_ids[start : len(ids)]
        return self.feed(list(ids[start:]), keep, device_ids=on_device)

    def commit(self, ids: Sequence[int]) -> None:
        """Declare that the first ``len(ids)`` positions hold ``ids`` (drafts fed from the device and since
        verified) and drop every position after them."""
        if len(ids) > len(self.ids):
            raise DrafterError("cannot commit more positions than were fed", expected=f"<= {len(self.ids)} ids",
                               found=f"{len(ids)} ids")
        self.crop(len(ids))
        start = common_prefix_length(self.ids, ids)  # only the positions after it change (a round's drafts)
        self.ids[start:] = [int(t) for t in ids[start:]]


class ModelSession(SessionBase):
    """A causal LM, its KV cache, and the token ids whose keys/values the cache holds.

    Invariant: the cache holds keys/values for exactly :attr:`ids`, and each captured layer holds one
    hidden-state row per id. A position fed from a device tensor (a draft whose value the host has not read)
    is listed as ``-1`` until :meth:`commit` names it, so no common prefix runs past it.

    Args:
        model: A Hugging Face causal LM (eval mode is the caller's business).
        body_only: Run ``model.base_model`` and return final hidden states instead of logits, for a
            caller that applies its own (e.g. cut-down) head.
        layers: Indices into ``output_hidden_states`` to capture for every fed position (empty: no
            capture and no ``output_hidden_states`` cost).

    Raises:
        DrafterError: If a layer index is outside the model's ``num_hidden_layers + 1`` hidden states.
    """

    def __init__(
        self, model: torch.nn.Module, *, body_only: bool = False, layers: Sequence[int] = ()
    ) -> None:
        self._bind(model, body_only, layers)
        self._keep_arg = not body_only and "logits_to_keep" in inspect.signature(model.forward).parameters
        embeddings = model.get_input_embeddings().weight
        self._row_spec = (embeddings.shape[1], embeddings.dtype, embeddings.device)
        self.reset()

    @staticmethod
    def check_layers(model: torch.nn.Module, layers: Sequence[int]) -> None:
        """Raise :class:`DrafterError` unless every index is one of ``model``'s ``output_hidden_states``."""
        depth = int(model.config.num_hidden_layers) + 1 if layers else 0
        bad = [layer for layer in layers if not -depth <= layer < depth]
        if bad:
            raise DrafterError(
                "a proposer asked for target hidden states at layers the target does not have",
                expected=f"indices into its {depth} hidden states (0 = embeddings, -1 = last layer)",
                found=f"layers {bad}",
                fix="set the proposer's target layers for this target's depth",
            )

    def reset(self) -> None:
        """Forget the sequence (cache, ids, captured states); forward counts and seconds are kept."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.ids: list[int] = []
        self._rows = [_Rows(*self._row_spec) for _ in self.layers]

    @torch.no_grad()
    def feed(self, new_ids: Sequence[int] | Tensor, keep: int = 1, *, device_ids: Tensor | None = None) -> Tensor:
        """Append ``new_ids`` to the cached sequence in one forward.

        Args:
            new_ids: Token ids to run (at least ``keep``): host ids, or a 1-D tensor on the model's device (drafts
                the host has not read; listed as ``-1`` in :attr:`ids` until :meth:`commit`).
            keep: How many output rows to return, counted from the last fed position.
            device_ids: The same host ids already on the device (fed from there, nothing copied).

        Returns:
            ``(keep, V)`` logits, or ``(keep, H)`` final hidden states when ``body_only``; row ``-1``
            predicts the token after ``new_ids``.
        """
        input_ids, known = device_tokens(new_ids, device_ids, self.device)
        input_ids = input_ids.unsqueeze(0)
        kwargs: dict[str, Any] = {"logits_to_keep": keep} if self._keep_arg else {}
        if self.layers:
            kwargs["output_hidden_states"] = True
        kwargs[self._cache_arg] = self.cache
        out = self._module(input_ids=input_ids, use_cache=True, **kwargs)
        self.cache = returned_cache(out)
        self.ids.extend(known)
        self.forwards += 1
        for rows, layer in zip(self._rows, self.layers, strict=True):
            rows.append(out.hidden_states[layer][0])
        rows_out = out.last_hidden_state if self.body_only else out.logits
        return rows_out[0, -keep:]

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions (cache, ids and captured states together)."""
        crop_cache(self.cache, length)
        del self.ids[length:]
        for rows in self._rows:
            rows.crop(length)

    def hidden(self) -> tuple[Tensor, ...]:
        """Captured hidden states, one ``(len(ids), H)`` view per layer (valid until the next feed)."""
        return tuple(rows.view() for rows in self._rows)
