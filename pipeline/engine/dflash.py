"""The DFlash proposer: one drafter forward per round drafts a whole block, losslessly verified.

DFlash (:mod:`pipeline.drafters.dflash`) denoises the block ``[x_n, MASK × (B − 1)]`` conditioned on the
target's features of every verified position before ``x_n`` — exactly what
:class:`~pipeline.engine.session.TargetState` holds (every position of the context but the newest). Block row
``k ≥ 1`` gives a distribution over the token at position ``n + k``; this proposer samples each of the first
``min(γ, B − 1)`` rows from its own standardised distribution (temperature, top-k, top-p; greedy: the argmax)
and reports that distribution as ``q``. A drafter with its own draft-vocabulary head draws a draft id, maps it to
its target id (``d2t``) and reports ``q`` scattered into target-id space, zero off the draft vocabulary (as
EAGLE-3 does).

**Why that is lossless.** The rows are computed in one forward from the context alone, and each draft is
drawn independently from its row, so the law of draft ``k`` given the drafts before it is exactly its row
``q_k``: what :func:`~pipeline.engine.verify.verify_speculative` needs (Leviathan et al. 2023, Thm. 3.5;
their proof conditions each position on the earlier drafts, and here ``q_k`` does not depend on them).
Drafting fewer than ``B − 1`` tokens (γ < B − 1) still runs the whole block the drafter was trained on and
keeps its first γ rows.

**The context cache.** Context keys/values (per draft layer, from the target's features of an accepted
prefix, :class:`~pipeline.drafters.dflash.ContextCache`) stay valid while the context agrees with the ids they
were computed for; each round crops the cache to the common prefix and projects only the new positions. Block
rows are never cached.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Generator, Tensor

from pipeline.drafters.dflash import ContextCache, DFlashDrafter, StaticContextCache
from pipeline.engine.proposers import Proposal, require_context
from pipeline.engine.sampling import SamplingParams, draw, standardise
from pipeline.engine.session import TargetState, common_prefix_length
from pipeline.engine.static import Compiled, DecodeOptions, bucket, rounded_capacity, static_addresses
from pipeline.errors import DrafterError


class DFlashProposer:
    """A :class:`~pipeline.engine.proposers.Proposer` drafting a block per forward with a DFlash drafter.

    Args:
        drafter: The DFlash drafter for this target (its embedding is the target's; its head the target's or its
            own over a draft vocabulary, whose map is read here, once). It is switched to its decoding layout
            (:meth:`~pipeline.drafters.layers.RopeDrafter.stack_for_decoding`).
        target_vocab_size: Width of ``q``; defaults to the drafter's ``config.vocab_size`` (the target's head).
        name: Label used in metrics and reports.

    Attributes:
        drafter_calls: Drafter forwards run so far (one per round that drafts; the evaluator reads the count).
    """

    def __init__(self, drafter: DFlashDrafter, *, target_vocab_size: int | None = None, name: str = "dflash") -> None:
        config = drafter.config
        self.drafter = drafter
        drafter.stack_for_decoding()
        self.name = name
        self.block_size = config.block_size
        self.target_layers: tuple[int, ...] = config.hidden_state_indices
        self.target_vocab_size = int(target_vocab_size or config.vocab_size)
        if self.target_vocab_size < config.vocab_size:
            raise DrafterError("The DFlash drafter's head is wider than the target's logits.",
                               expected=f"target_vocab_size >= {config.vocab_size}",
                               found=f"target_vocab_size={self.target_vocab_size}",
                               fix="Leave target_vocab_size unset (the drafter's head is the target's).")
        self._depth = config.num_target_layers + 1
        ids = drafter.draft_to_target
        self._draft_ids: Tensor | None = None if ids is None else ids.detach().clone()
        self.drafter_calls = 0
        self._options = DecodeOptions()
        self._static: StaticContextCache | None = None
        self._compiled: Any = None
        self._forward = drafter.forward
        self.reset()

    def prepare(self, options: DecodeOptions) -> None:
        """Follow the generation's decode path: on the static paths a :class:`StaticContextCache` (kept across
        generations, so CUDA graphs are captured once) and bucketed context rows, compiled on path ``graphs``."""
        self._options = options
        if options.graphs and self._compiled is None:
            self._compiled = Compiled(self.drafter.forward, "the DFlash drafter's forward")
        self._forward = self._compiled if options.graphs else self.drafter.forward
        if not options.static:
            return
        config, weight = self.drafter.config, self.drafter.fc.weight
        capacity = rounded_capacity(options.capacity)
        if self._static is None or self._static.capacity < capacity:
            self._static = StaticContextCache(config.num_hidden_layers, capacity, config.block_size,
                                              config.num_key_value_heads, config.head_dim, weight.dtype,
                                              weight.device)
            cache = self._static
            static_addresses(*cache.keys, *cache.values, cache.position, cache.end, cache.slots)
        static_addresses(*self.drafter.reserve_rope(self._static.capacity + self._static.block_rows, weight))

    def reset(self) -> None:
        """Forget the cached context; see :class:`~pipeline.engine.proposers.Proposer`."""
        if self._options.static and self._static is not None:
            self._static.crop(0)
            self.cache: ContextCache | StaticContextCache = self._static
        else:
            self.cache = ContextCache(self.drafter.config.num_hidden_layers)
        self._ids: list[int] = []  # the ids whose features the cached context rows were computed from

    def _features(self, state: TargetState, context: list[int]) -> list[Tensor]:
        """The state's hidden states at :attr:`target_layers`, checked (:meth:`TargetState.tapped`)."""
        return state.tapped(self.target_layers, self._depth, self.drafter.config.hidden_size, len(context),
                            "DFlash", "target_layer_ids + 1", "DFlashConfig.from_target(target.config, ...)")

    def block_distributions(self, context: list[int], hidden: list[Tensor], params: SamplingParams,
                            state: TargetState | None = None, drafts: int | None = None) -> Tensor:
        """One drafter forward: the standardised distributions of block rows ``1 .. drafts`` (default ``B − 1``),
        ``(drafts, V)`` float64 over the head's rows (the target's vocabulary, or the draft vocabulary);
        :meth:`block_logits`, standardised."""
        return standardise(self.block_logits(context, hidden, state, drafts), params)

    def block_logits(self, context: list[int], hidden: list[Tensor], state: TargetState | None = None,
                     drafts: int | None = None) -> Tensor:
        """One drafter forward and its head: the logits of block rows ``1 .. drafts`` (default ``B − 1``),
        ``(drafts, V)`` in the head's dtype, over the head's rows. The whole block runs (its rows attend to each other,
        as in training), and so does the head; the rows drafted are sliced from its output.

        The context cache is brought to every position of ``context`` but the newest (whose token opens the block).
        On the static paths the new context rows are padded to their bucket and every position is a device value,
        so the forward has one shape per bucket (a CUDA graph on path ``graphs``).
        """
        state = state or TargetState()
        rows = len(context) - 1
        valid = min(self.cache.length, common_prefix_length(self._ids, context[:rows]))
        self.cache.crop(valid)
        weight = self.drafter.fc.weight
        features = torch.cat([h[valid:rows] for h in hidden], dim=-1).to(weight.device, weight.dtype).unsqueeze(0)
        first = state.ids(rows, rows + 1, context).to(weight.device)
        block = self.drafter.block_ids(first)
        steps = torch.arange(self.block_size, device=weight.device)
        if isinstance(self.cache, StaticContextCache):
            n = rows - valid
            size = bucket(n) or n
            features = torch.nn.functional.pad(features, (0, 0, 0, size - n))
            self.cache.at(n)
            context_positions = (self.cache.position + torch.arange(size, device=weight.device)).unsqueeze(0)
            block_positions = (self.cache.end + steps).unsqueeze(0)
            if self._options.graphs and bucket(n) is not None:
                torch.compiler.cudagraph_mark_step_begin()
                out = self._forward(block, features, block_positions, context_positions, cache=self.cache).clone()
            else:
                out = self.drafter(block, features, block_positions, context_positions, cache=self.cache)
            self.cache.length = rows
        else:
            context_positions = torch.arange(valid, rows, device=weight.device).unsqueeze(0)
            block_positions = (rows + steps).unsqueeze(0)
            out = self.drafter(block, features, block_positions, context_positions, cache=self.cache,
                               bound=rows + self.block_size)
        self._ids = list(context[:rows])
        self.drafter_calls += 1
        # the head over the whole block, then the drafted rows: one shape whatever ``drafts`` is (on the CPU, MKL's
        # product of the kit's 2,048-id head by 8 rows also takes 0.7× its time by 7; docs/DFLASH.md)
        return self.drafter.logits(out[0])[1 : 1 + (self.block_size - 1 if drafts is None else drafts)]

    @torch.no_grad()
    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft up to ``min(gamma, B − 1)`` tokens in one forward; see :class:`~pipeline.engine.proposers.Proposer`.

        Nothing is drafted (an empty proposal) while the state covers no position, i.e. for a one-token
        prompt's first round: there is no target feature to condition on.
        """
        require_context(context)
        hidden = self._features(state, context)
        device = self.drafter.fc.weight.device
        drafts = min(gamma, self.block_size - 1)
        if drafts <= 0 or len(context) < 2:
            return Proposal(torch.zeros(0, dtype=torch.long, device=device),
                            torch.zeros(0, self.target_vocab_size, dtype=torch.float64, device=device))
        probs = self.block_distributions(context, hidden, params, state, drafts)
        tokens = draw(probs, params, generator)  # each row on its own: draft k's law is row k whatever came before
        if self._draft_ids is not None:
            if self._draft_ids.device != device:
                self._draft_ids = self._draft_ids.to(device)
            q = probs.new_zeros(probs.shape[0], self.target_vocab_size).index_copy_(1, self._draft_ids, probs)
            return Proposal(self._draft_ids.index_select(0, tokens), q)  # target ids, no host sync
        q = probs
        if q.shape[-1] < self.target_vocab_size:
            q = torch.nn.functional.pad(q, (0, self.target_vocab_size - q.shape[-1]))
        return Proposal(tokens, q)  # left on the device: the loop reads the round once
