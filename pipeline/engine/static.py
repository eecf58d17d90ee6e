"""Static-shape decoding: a preallocated KV cache, fixed-shape forwards, CUDA graphs, and clocks that need no sync.

The eager decode path (:class:`~pipeline.engine.session.ModelSession`) grows a ``DynamicCache`` and slices it on
rejection, and every forward has the shape of what it feeds: fine on a CPU, but on a GPU each new shape is a new
kernel configuration, and nothing can be captured in a CUDA graph. :class:`StaticSession` is the GPU-shaped twin:

* **A static KV cache** (``transformers.StaticCache``) preallocated to :attr:`DecodeOptions.capacity` positions.
  Rejection *rolls the position back*; stale keys beyond it are never read, because the attention mask of every
  forward admits only keys at or before each query's position (a 4-D boolean mask built on the device from a
  position tensor, so no host value enters it).
* **Fixed shapes.** A feed of ``n ≤`` :data:`MAX_BUCKET` tokens runs padded to the next power of two (the
  target's verify forward of ``γ + 1`` tokens, a drafter's one-token step, its catch-up of the accepted tokens);
  the padding lands after the real tokens, so causality keeps it out of their rows, and the position rolls back
  over it. Longer feeds (a prompt's prefill) run eagerly at their own length.
* **CUDA graphs** (path ``graphs``): each bucket's forward is compiled with :data:`GRAPH_COMPILE`
  (``torch.compile(mode="reduce-overhead", fullgraph=True)``: one CUDA graph per bucket, replayed); the cache
  tensors have static addresses, and the only inputs are the fed ids and the device position.

Which path a decode takes is :func:`resolve_path` of ``evaluate.decode_path``: ``graphs`` on CUDA by default,
``eager`` on a CPU (where a static cache only adds attention over empty slots), ``static`` to run the static
shapes without graphs anywhere (the CPU tests run it, and the graph path with a tracing backend that fails on any
graph break). Sessions are kept per model (:func:`session_for`) so graphs are captured once per run, not per prompt.

:class:`EventClock` times phases with CUDA events (read once, after a generation) or ``perf_counter`` on a CPU, so
timing a round costs no host synchronisation.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pipeline.engine.session import (
    ModelSession,
    SessionBase,
    device_tokens,
)
from pipeline.errors import DrafterError
from pipeline.progress import GRACE_S, heartbeat

PATHS = ("eager", "static", "graphs")
"""Decode paths: ``eager`` (dynamic cache, shapes as fed), ``static`` (static cache, bucketed shapes),
``graphs`` (static, each bucket's forward a CUDA graph)."""

FIRST_TOKEN = ("round", "prefill")
"""Where a speculative generation's first new token comes from: ``round`` (the first drafting round drafts and
verifies it, this engine's original order) or ``prefill`` (the target's prefill emits it and the first round drafts
after it: the order of vLLM, SGLang and EAGLE's reference code, whose τ never counts that token)."""

MAX_BUCKET = 64
"""Feeds of at most this many tokens run at a fixed, power-of-two shape (γ + 1 ≤ 65 since γ ≤ 64 is checked at
plan time, so every verify forward is bucketed); longer ones (prefills) at their own length, eagerly."""

GRAPH_COMPILE: dict[str, Any] = {"mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
"""How path ``graphs`` compiles a bucket's forward: inductor with CUDA graphs, failing on any graph break (a host
read inside the forward would break the graph)."""

CAPACITY_STEP = 128
"""Static caches are sized in multiples of this, so a slightly longer prompt reuses the buffers (and graphs)."""


@dataclass(frozen=True)
class DecodeOptions:
    """How one generation decodes.

    Attributes:
        path: One of :data:`PATHS`.
        capacity: Positions the longest session of the generation must hold (prompt + new tokens + γ + 1, plus a
            drafter's block where it has one).
        first_token: One of :data:`FIRST_TOKEN` (speculative decoding only; autoregressive decoding always takes
            its first token from the prefill).
    """

    path: str = "eager"
    capacity: int = 0
    first_token: str = "round"

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise DrafterError(f"unknown decode path {self.path!r}", expected=f"one of {list(PATHS)}",
                               found=repr(self.path), fix="set evaluate.decode_path to auto, eager, static or graphs")
        if self.first_token not in FIRST_TOKEN:
            raise DrafterError(f"unknown first-token order {self.first_token!r}", expected=f"one of {list(FIRST_TOKEN)}",
                               found=repr(self.first_token), fix="set evaluate.first_token to round or prefill")

    @property
    def static(self) -> bool:
        return self.path != "eager"

    @property
    def graphs(self) -> bool:
        return self.path == "graphs"


def resolve_path(setting: str, device: torch.device | str) -> str:
    """The decode path for ``evaluate.decode_path`` (``auto``, or one of :data:`PATHS`) on ``device``.

    Raises:
        DrafterError: For ``graphs`` on a device that is not CUDA.
    """
    kind = torch.device(device).type
    if setting == "auto":
        return "graphs" if kind == "cuda" else "eager"
    if setting == "graphs" and kind != "cuda":
        raise DrafterError("CUDA graphs need a CUDA device", expected="evaluate.decode_path graphs with a CUDA device",
                           found=f"device {kind}", fix="use evaluate.decode_path=auto (eager on a CPU) or static")
    DecodeOptions(setting)  # validates the name
    return setting


def decode_capacity(prompt: int, new_tokens: int, gamma: int, extra: int = 0) -> int:
    """Positions a session of one generation may write: the prompt, the new tokens, a verify forward's γ + 1 and
    its padding to the bucket, twice over (a drafter's catch-up then its drafts), plus ``extra`` (a block)."""
    return prompt + new_tokens + 2 * (bucket(gamma + 1) or gamma + 1) + extra


def rounded_capacity(positions: int) -> int:
    """``positions`` rounded up to :data:`CAPACITY_STEP` (buffers, and the graphs that read them, get reused)."""
    return -(-max(1, positions) // CAPACITY_STEP) * CAPACITY_STEP


def bucket(n: int) -> int | None:
    """The fixed length a feed of ``n`` tokens runs at (the next power of two), or None past :data:`MAX_BUCKET`."""
    if n > MAX_BUCKET:
        return None
    size = 1
    while size < n:
        size *= 2
    return size


class EventClock:
    """Adds up the time of timed phases without synchronising: CUDA events on a GPU (resolved by :meth:`seconds`,
    once, after the work), ``perf_counter`` on a CPU (where work is synchronous anyway)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pairs: list[tuple[Any, Any]] = []
        self._host = 0.0
        self._start: Any = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._start, end))
        else:
            self._host += time.perf_counter() - self._start

    def seconds(self) -> float:
        """Total timed seconds (on CUDA this waits for the recorded work: call it after the generation)."""
        if self.cuda and self._pairs:
            self._pairs[-1][1].synchronize()
            self._host += sum(a.elapsed_time(b) for a, b in self._pairs) / 1e3
            self._pairs.clear()
        return self._host


class StaticSession(SessionBase):
    """A causal LM over a static KV cache: the same interface as :class:`~pipeline.engine.session.ModelSession`
    (``feed``, ``move_to``, ``crop``, ``commit``, ``hidden``, ``ids``), with fixed-shape feeds and optional CUDA graphs.

    ``ids`` lists the token of every cached position; a position fed from a device tensor (a draft the host has not
    seen) holds ``-1`` until :meth:`commit` names it, so a common prefix never runs past it.

    Args:
        model: A Hugging Face causal LM.
        capacity: Positions to preallocate (rounded up to :data:`CAPACITY_STEP`).
        body_only: Run ``model.base_model`` and return final hidden states instead of logits.
        layers: ``output_hidden_states`` indices to capture for every fed position.
        graphs: Compile each bucket's forward with :data:`GRAPH_COMPILE`.
    """

    def __init__(self, model: torch.nn.Module, capacity: int, *, body_only: bool = False, layers: Sequence[int] = (),
                 graphs: bool = False) -> None:
        from transformers import StaticCache  # deferred: pulls in transformers

        self._bind(model, body_only, layers)
        embeddings = model.get_input_embeddings().weight
        # Rounded up, and never cut to the model's context: a padded feed's slots may lie past it (never attended).
        self.capacity = rounded_capacity(capacity)
        self.cache = StaticCache(config=model.config, max_cache_len=self.capacity)
        self._position = torch.zeros((), dtype=torch.long, device=self.device)
        self._keys = torch.arange(self.capacity, device=self.device)
        # one (capacity, H) buffer per captured layer, written in place
        self._rows = [torch.zeros(self.capacity, embeddings.shape[1], dtype=embeddings.dtype, device=self.device)
                      for _ in self.layers]
        if graphs:
            static_addresses(self._position, self._keys)  # read by every graph: one address, updated in place
        self.graphs = graphs
        self.ids: list[int] = []
        # One eager forward first: transformers allocates the cache tensors (marking their addresses static) and
        # installs its hidden-state hooks on a model's first call, neither of which may happen inside a graph.
        with torch.no_grad():
            self._forward(torch.zeros(1, 1, dtype=torch.long, device=self.device), 1)
        roll_back(self.cache, 1)
        what = "a draft model's forward" if body_only else "the target's forward"
        self._compiled = Compiled(self._bucket_forward, what) if graphs else None

    # -- the interface ModelSession shares --------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the sequence (the buffers stay allocated; their stale contents are masked)."""
        self.crop(0)

    def hidden(self) -> tuple[Tensor, ...]:
        """Captured hidden states, one ``(len(ids), H)`` view per layer."""
        return tuple(rows[: len(self.ids)] for rows in self._rows)

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions: the position rolls back, nothing is freed or copied."""
        excess = len(self.ids) - length
        if excess > 0:
            if self.cache.is_initialized:
                roll_back(self.cache, excess)
            del self.ids[length:]

    @torch.no_grad()
    def feed(self, new_ids: Sequence[int] | Tensor, keep: int = 1, *, device_ids: Tensor | None = None) -> Tensor:
        """Append ``new_ids`` (host ids, or a 1-D device tensor whose values the host does not know) in one forward
        (``device_ids``: host ids already on the device, fed from there).

        Returns:
            ``(keep, V)`` logits (or ``(keep, H)`` hidden states when ``body_only``) of the last ``keep`` fed
            positions.
        """
        ids, known = device_tokens(new_ids, device_ids, self.device)
        n, start = ids.shape[0], len(self.ids)
        size = bucket(n)
        if start + (size or n) > self.capacity:
            raise DrafterError("the static KV cache is full", expected=f"at most {self.capacity} positions",
                               found=f"{start + (size or n)} positions (padding included)",
                               fix="size DecodeOptions.capacity with decode_capacity()")
        self._position.fill_(start)
        if size is None:  # a long prefill: its own shape, eagerly
            rows, hidden = self._forward(ids.unsqueeze(0), n)
        else:
            padded = torch.nn.functional.pad(ids, (0, size - n)) if size > n else ids
            if self._compiled is not None:
                torch.compiler.cudagraph_mark_step_begin()  # this replay may overwrite the last one's outputs
                rows, hidden = self._compiled(padded.unsqueeze(0))
            else:
                rows, hidden = self._bucket_forward(padded.unsqueeze(0))
            if size > n:
                roll_back(self.cache, size - n)  # the padding's keys: rolled back over, never attended to
        self.forwards += 1
        for buffer, states in zip(self._rows, hidden, strict=True):
            buffer[start : start + n] = states[0, :n]
        self.ids.extend(known)
        return rows[0, n - keep : n].clone()

    # -- the forwards -----------------------------------------------------------------------------------------

    def _bucket_forward(self, ids: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One fixed-shape forward at the device position (what a CUDA graph captures: no host value inside)."""
        return self._forward(ids, ids.shape[1])

    def _forward(self, ids: Tensor, length: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        positions = self._position + torch.arange(length, device=self.device)
        # Every query sees the keys at or before its own position; the slots after it (stale or empty) never.
        mask = (self._keys.unsqueeze(0) <= positions.unsqueeze(1)).view(1, 1, length, self.capacity)
        kwargs: dict[str, Any] = {self._cache_arg: self.cache, "position_ids": positions.unsqueeze(0),
                                  "attention_mask": mask, "use_cache": True}
        if not self.body_only:
            kwargs["logits_to_keep"] = length
        if self.layers:
            kwargs["output_hidden_states"] = True
        out = self._module(input_ids=ids, **kwargs)  # the static cache is updated in place
        rows = out.last_hidden_state if self.body_only else out.logits
        hidden = tuple(out.hidden_states[layer] for layer in self.layers) if self.layers else ()
        return rows, hidden


def roll_back(cache: Any, positions: int) -> None:
    """Move a ``transformers.StaticCache``'s write position back by ``positions`` (the next forward overwrites them).

    Each static layer keeps that position as a device scalar, ``cumulative_length``, which transformers 5.2x's
    ``StaticLayer.crop`` decrements in place; earlier 5.x releases have the same scalar but no ``crop`` on static
    layers, so it is decremented here directly (in place either way: a CUDA graph reads it at its address).
    """
    for layer in cache.layers:
        if hasattr(layer, "crop"):
            layer.crop(-positions)
        elif getattr(layer, "is_sliding", False):  # its window's bookkeeping is not ours to roll back
            raise DrafterError("This transformers release cannot roll back a sliding-window static cache.",
                               expected="transformers with StaticLayer.crop (5.2x)", found=type(layer).__name__,
                               fix="Upgrade transformers, or use evaluate.decode_path=eager.")
        else:
            layer.cumulative_length.sub_(positions)


GRAPHS_PER_FUNCTION = 64
"""Graphs one compiled function may hold: one per bucket for each session or drafter that runs it (dynamo's
default of 8 would fall back to eager code after the eighth)."""


def static_addresses(*tensors: Tensor) -> None:
    """Tell the compiler these buffers keep their address (they are updated in place), so a CUDA graph reads them
    where they are instead of copying them in, or skipping the graph for a mutated input."""
    import torch._dynamo

    for tensor in tensors:
        torch._dynamo.mark_static_address(tensor)


COMPILE_NOTICE_S = GRACE_S
"""Seconds a first call at a new shape may compile before :class:`Compiled` says so (then every 30 s)."""


class Compiled:
    """``fn`` compiled for path ``graphs`` (:data:`GRAPH_COMPILE`), with room for a graph per bucket.

    The first call at each shape of its tensor arguments compiles that shape (inductor: tens of seconds on a GPU,
    for each bucket of each model), under a :func:`~pipeline.progress.heartbeat` naming ``what`` and the shapes, so
    a first decode's compiles are never silent; later calls at that shape replay it. The shapes are host metadata:
    the check costs no device synchronisation.
    """

    def __init__(self, fn: Any, what: str) -> None:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS_PER_FUNCTION)
        self.what = what
        self.shapes: set[tuple[tuple[int, ...], ...]] = set()
        """Shapes already compiled."""
        self._fn = torch.compile(fn, **GRAPH_COMPILE)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shape = tuple(tuple(value.shape) for value in (*args, *kwargs.values()) if isinstance(value, Tensor))
        if shape in self.shapes:
            return self._fn(*args, **kwargs)
        sizes = ", ".join("x".join(map(str, dims)) or "scalar" for dims in shape)
        with heartbeat(f"compiling {self.what} for inputs {sizes}", grace=COMPILE_NOTICE_S):
            out = self._fn(*args, **kwargs)
        self.shapes.add(shape)
        return out


_SESSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def session_for(model: torch.nn.Module, options: DecodeOptions, *, body_only: bool = False,
                layers: Sequence[int] = ()) -> ModelSession | StaticSession:
    """The session a generation runs ``model`` in: a fresh :class:`ModelSession` on the eager path; on the static
    paths the model's kept :class:`StaticSession` for these settings (reset, so graphs captured by earlier
    generations are replayed), a new one when none is kept or the kept one is too small."""
    if not options.static:
        return ModelSession(model, body_only=body_only, layers=layers)
    kept = _SESSIONS.setdefault(model, {})
    key = (body_only, tuple(int(layer) for layer in layers), options.graphs)
    session = kept.get(key)
    if session is None or session.capacity < options.capacity:
        session = StaticSession(model, options.capacity, body_only=body_only, layers=layers, graphs=options.graphs)
        kept[key] = session
    session.reset()
    return session
