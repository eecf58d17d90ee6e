"""The EAGLE-3 proposer: chain drafting from the target's own low/mid/high features, losslessly verified.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test", arXiv:2503.01840) drafts with a one-layer head,
:class:`~pipeline.drafters.eagle3.Eagle3Drafter`, that reads the target's hidden states at three layers.
At inference (§3.1, Fig. 5) row ``t`` of the drafter pairs token ``x_{t+1}`` with the fused target
feature of position ``t``; the last such row predicts the first draft; each later draft step feeds the
drafted token with the drafter's own previous output in place of a target feature (what the
training-time test of §3.2 trains it for). This module runs that as a chain (one draft per step, no
tree) inside the engine's lossless loop:

* **Target rows are cached; draft rows are not kept.** The proposer keeps a
  :class:`~pipeline.drafters.eagle3.KVCache` whose rows were all computed from *target* features of an
  accepted prefix. Row ``t`` depends only on ``x_0 .. x_{t+1}`` (its token, and the target feature
  ``f_t``, which the causal target computes from ``x_0 .. x_t`` and never revises), so a row stays valid
  exactly as long as the context agrees with the ids it was computed for up to ``x_{t+1}``. Each round
  crops the cache to that common prefix and feeds the missing rows in one :meth:`Eagle3Drafter.step`
  call; draft rows (whose keys came from the drafter's own features) are cropped before returning, so
  the next round re-feeds those positions from the target's features, as EAGLE-3 does after verification.
* **q is the exact law.** Each draft is sampled from :func:`~pipeline.engine.sampling.standardise` of the
  draft-vocabulary logits (temperature, top-k and top-p applied over the draft vocabulary; greedy is the
  one-hot argmax), mapped to a target id through ``d2t``; ``q`` is that same float64 distribution
  scattered into target-id space, zero off the draft vocabulary. That is all
  :func:`~pipeline.engine.verify.verify_speculative` needs for the output to have the target's law
  (Leviathan et al. 2023, Thm. 3.5): target mass outside the draft vocabulary is reached through the
  residual ``max(0, p - q)``.

Everything stays on the drafter's device (which must be the target's: the drafter holds the target's
embedding by reference); the draft loop does not synchronise with the host until its tokens are listed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Generator, Tensor

from pipeline.drafters.caches import KVCache, StaticKVCache
from pipeline.drafters.eagle3 import Eagle3Drafter
from pipeline.engine.proposers import Proposal, require_context
from pipeline.engine.sampling import SamplingParams, draw, standardise
from pipeline.engine.session import TargetState, common_prefix_length
from pipeline.engine.static import Compiled, DecodeOptions, bucket, rounded_capacity, static_addresses
from pipeline.errors import DrafterError


class Eagle3Proposer:
    """A :class:`~pipeline.engine.proposers.Proposer` drafting with an EAGLE-3 head (Li et al. 2025, §3.1).

    Args:
        drafter: The EAGLE-3 drafter for this target (its embedding is the target's, on the same
            device). Its vocabulary maps (``d2t``) are read here, once, and it is switched to its decoding layout
            (:meth:`~pipeline.drafters.layers.RopeDrafter.stack_for_decoding`).
        target_vocab_size: Width of ``q`` (the target's logit width); defaults to the drafter's
            ``config.target_vocab_size`` (the rows of the target embedding).
        name: Label used in metrics and reports.

    Raises:
        DrafterError: If the draft vocabulary names target ids at or beyond ``target_vocab_size``.
    """

    def __init__(
        self, drafter: Eagle3Drafter, *, target_vocab_size: int | None = None, name: str = "eagle3"
    ) -> None:
        config = drafter.config
        self.drafter = drafter
        drafter.stack_for_decoding()
        self.name = name
        self.target_layers: tuple[int, ...] = tuple(int(i) for i in config.aux_layer_ids)
        self.target_vocab_size = int(target_vocab_size or config.target_vocab_size)
        self._depth = config.target_num_layers + 1  # entries of the target's output_hidden_states
        self._draft_ids = drafter.draft_to_target.detach().clone()
        self._options = DecodeOptions()
        self._static: StaticKVCache | None = None
        self._compiled: Any = None
        self._step = drafter.step
        top = int(self._draft_ids.max())
        if top >= self.target_vocab_size:
            raise DrafterError(
                "the EAGLE-3 draft vocabulary names ids the target cannot emit",
                expected=f"draft-to-target ids below the target's logit width {self.target_vocab_size}",
                found=f"target ids up to {top}",
                fix="build d2t/t2d with pipeline.vocab.counting.eagle3_offset_maps for this target's vocabulary",
            )
        self.reset()

    def prepare(self, options: DecodeOptions) -> None:
        """Follow the generation's decode path: on the static paths a :class:`StaticKVCache` (kept across
        generations, so CUDA graphs are captured once) and fixed-shape steps, compiled on path ``graphs``."""
        self._options = options
        if options.graphs and self._compiled is None:
            self._compiled = Compiled(self.drafter.step, "the EAGLE-3 drafter's step")
        self._step = self._compiled if options.graphs else self.drafter.step
        if not options.static:
            return
        config, weight = self.drafter.config, self.drafter.fc.weight
        capacity = rounded_capacity(options.capacity)
        if self._static is None or self._static.capacity < capacity:
            self._static = StaticKVCache(capacity, config.num_key_value_heads, config.head_dim, weight.dtype,
                                         weight.device)
            static_addresses(self._static.key, self._static.value, self._static.position, self._static.slots)
        static_addresses(*self.drafter.reserve_rope(self._static.capacity, weight))  # before any graph is captured

    def reset(self) -> None:
        """Forget the cached rows; see :class:`~pipeline.engine.proposers.Proposer`."""
        if self._options.static and self._static is not None:
            self._static.crop(0)
            self.cache: KVCache | StaticKVCache = self._static
        else:
            self.cache = KVCache()
        # Context ids the cached rows were computed for: rows 0..len-2 pair ids[t+1] with feature t.
        self._ids: list[int] = []
        # The drafter's output at the last cached row (the first draft's hidden state), (1, 1, H).
        self._last: Tensor | None = None

    def _features(self, state: TargetState, context: list[int]) -> list[Tensor]:
        """The state's hidden states at :attr:`target_layers`, checked (:meth:`TargetState.tapped`)."""
        return state.tapped(self.target_layers, self._depth, self.drafter.config.hidden_size, len(context),
                            "EAGLE-3", "its aux_layer_ids", "Eagle3Config.from_target(target.config, ...)")

    def _sync(self, context: list[int], hidden: list[Tensor], state: TargetState) -> Tensor:
        """Bring the cache to one row per target position of ``context``; the last row's output ``(1, 1, H)``."""
        rows = len(context) - 1
        valid = max(0, min(self.cache.length, common_prefix_length(self._ids, context) - 1))
        if valid == rows and self._last is not None and self.cache.length == rows:
            return self._last  # nothing new (the same context asked again)
        start = min(valid, rows - 1)  # at least the last row runs: its output is the first draft's state
        self.cache.crop(start)
        weight = self.drafter.fc.weight
        features = torch.cat([h[start:rows] for h in hidden], dim=-1).to(weight.device, weight.dtype)
        ids = state.ids(start + 1, rows + 1, context).to(weight.device).unsqueeze(0)
        out = self._run(ids, features.unsqueeze(0))
        self._ids = list(context)
        self._last = out[:, -1:]
        return self._last

    def _run(self, ids: Tensor, hidden: Tensor) -> Tensor:
        """One drafter step over ``(1, n)`` ids: as fed on the eager path; on the static paths padded to the bucket
        of ``n`` (the padding's slots lie after the real ones, so no real row sees them) and the position advanced
        by ``n`` on the host. Returns the ``(1, n, H)`` outputs of the real rows."""
        if not isinstance(self.cache, StaticKVCache):
            return self.drafter.step(ids, hidden, cache=self.cache)
        n = ids.shape[1]
        size = bucket(n)
        self.cache.at_length()
        if size is None:  # a long first sync: its own shape, eagerly
            out = self.drafter.step(ids, hidden, cache=self.cache)
        else:
            # fresh buffers of the bucket's shape (and standard strides: a graph is specialised to them too)
            ids = torch.nn.functional.pad(ids, (0, size - n))
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, size - n)) if size > n else \
                hidden.clone(memory_format=torch.contiguous_format)
            if self._options.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self._step(ids, hidden, cache=self.cache)[:, :n].clone()
        self.cache.length += n
        return out

    @torch.no_grad()
    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft a chain of up to ``gamma`` tokens; see :class:`~pipeline.engine.proposers.Proposer`.

        Nothing is drafted (an empty proposal) while the state covers no position, i.e. for a one-token
        prompt's first round: the drafter has no target feature to start from.

        Raises:
            DrafterError: If ``state`` does not hold the target's hidden states at :attr:`target_layers`
                for every position of ``context`` but the newest.
        """
        require_context(context)
        hidden = self._features(state, context)
        device = self.drafter.fc.weight.device
        if gamma <= 0 or len(context) < 2:
            return Proposal(torch.zeros(0, dtype=torch.long, device=device),
                            torch.zeros(0, self.target_vocab_size, dtype=torch.float64, device=device))
        if self._draft_ids.device != device:
            self._draft_ids = self._draft_ids.to(device)
        out = self._sync(context, hidden, state)
        rows = self.cache.length
        tokens: list[Tensor] = []
        dists: list[Tensor] = []
        for step in range(gamma):
            probs = standardise(self.drafter.logits(out[0, -1]), params)  # (V_draft,) float64
            token = self._draft_ids.index_select(0, draw(probs, params, generator).view(1))  # no host sync
            tokens.append(token)
            dists.append(probs)
            if step + 1 < gamma:
                # The drafted token with the drafter's own output in place of a target feature.
                out = self._run(token.view(1, 1), out)
        self.cache.crop(rows)  # draft rows' keys came from drafter features: never reuse them
        q = torch.zeros(len(dists), self.target_vocab_size, dtype=torch.float64, device=device)
        q.index_copy_(1, self._draft_ids, torch.stack(dists))
        return Proposal(torch.cat(tokens), q)  # left on the device: the loop reads the round once

