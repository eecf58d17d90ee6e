"""Context-dependent draft shortlists: DynaSpec's routed head and the position-aware frequency shortlist.

:class:`RoutedShortlistProposer` (DynaSpec, Zhang et al., §4.2–4.3 and Alg. 1): at draft position ``t``
the router scores the ``M`` token clusters from ``[E(x_t), h_{t-1}]``, the top ``k_c(t)`` clusters
(a fixed ``k`` — DynaSpec-F — or Eq. 3's position-aware budget — DynaSpec-PA) form the shortlist, and
the drafter's head is evaluated on those rows only (:class:`~pipeline.engine.routed_head.RoutedHead`: rows
stored by cluster, so a shortlist is a few contiguous ranges — on CUDA one Triton kernel reading them in place
into a fixed-capacity buffer, on CPU one matmul per range on views) — never the full head then a mask. Tokens
the caller must always be able to draft (EOS) are added when their cluster is not chosen. ``q`` is the softmax over the shortlist (after the sampling transforms)
scattered into target ids — exactly the law the drafts are drawn from, so verification over the full
vocabulary keeps decoding lossless. On CUDA the router runs on a side stream while the drafter body
computes ``h_t`` (§4.3, Fig. 1); on CPU they run one after the other.

:class:`PositionAwareFrequencyProposer` (App. A.3, PA-FR): the ``K_fr(t)`` most frequent tokens of the
calibration set, a prefix of the frequency ranking, so the head's rows are stored once in ranking order
and each position's head is a zero-copy slice.

Both record the head's time and the shortlist size per draft position (:class:`HeadStats`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Generator, Tensor

from pipeline.dynaspec.budget import ClusterBudget, pa_fr
from pipeline.engine.proposers import (
    HeadStats,
    LinearHead,
    Proposal,
    SessionProposer,
    require_context,
    timed_call,
)
from pipeline.engine.routed_head import RoutedHead, keep_tensor
from pipeline.engine.sampling import SamplingParams, draw, standardise
from pipeline.engine.session import ModelSession, TargetState
from pipeline.errors import DrafterError


def _per_gamma(value: Any, gamma: int, what: str) -> Any:
    """``value`` itself, or the budget matched for draft length ``gamma`` when budgets are per γ.

    The decode loop drafts fewer than its γ near ``max_new_tokens``; such a round uses the budget of the
    smallest matched γ above it (its first positions' budgets, which is what that round drafts)."""
    if not isinstance(value, Mapping):
        return value
    if not value:
        raise DrafterError(f"No {what} given.", expected="at least one γ", found="none",
                           fix="Match budgets for the γ the decoder uses.")
    if gamma in value:
        return value[gamma]
    above = [g for g in value if g >= gamma]
    return value[min(above)] if above else value[max(value)]


def _require_keep(keep_ids: Sequence[int], what: str) -> None:
    if not list(keep_ids):
        raise DrafterError(f"The {what} would exclude the end-of-sequence token.",
                           expected="keep_ids holding the target's EOS id(s)", found="no ids to keep",
                           fix="Pass keep_ids=[tokenizer.eos_token_id] (evaluate does this).")


def _draw(ids: Tensor, logits: Tensor, params: SamplingParams, generator: Generator, width: int
          ) -> tuple[Tensor, Tensor]:
    """Sample a token from a shortlist's logits: the token id ``(1,)`` on the device (no host read), and the law
    (over the shortlist, after the sampling transforms) scattered into a ``width``-wide target-id row (ids beyond
    it carry no target mass)."""
    probs = standardise(logits, params)
    token = ids.index_select(0, draw(probs, params, generator).reshape(1))
    inside = (ids >= 0) & (ids < width)  # -1: a padding slot of a fixed-capacity shortlist (probability 0)
    # scattered without a boolean index (whose size the host would read): outside slots add 0 to row 0
    row = torch.zeros(width, dtype=torch.float64, device=logits.device)
    row.index_add_(0, torch.where(inside, ids, 0), torch.where(inside, probs, 0.0))
    return token, row


def _proposal(tokens: list[Tensor], rows: list[Tensor], width: int, device: torch.device) -> Proposal:
    """Drafted tokens (``-1`` for one with no target id: always rejected) and their q rows."""
    if not rows:
        return Proposal(torch.zeros(0, dtype=torch.long, device=device),
                        torch.zeros(0, width, dtype=torch.float64, device=device))
    drafted = torch.cat(tokens)
    return Proposal(torch.where(drafted < width, drafted, -1), torch.stack(rows))


class RoutedShortlistProposer(SessionProposer):
    """DynaSpec: a same-tokenizer drafter whose head is evaluated on router-chosen clusters.

    Args:
        model: The drafter (a Hugging Face causal LM sharing the target's tokenizer).
        clustering: Its head's clustering.
        router: A :class:`~pipeline.dynaspec.router.Router` trained for that clustering and drafter.
        budget: A :class:`ClusterBudget`, or one per draft length γ (budgets matched to a size per γ).
        keep_ids: Tokens every shortlist contains (the target's EOS): required.
        target_vocab_size: Width of ``q`` (defaults to the head's rows).
        name: Label in metrics and reports.
        overlap: On CUDA, run the router on a side stream overlapping the drafter body.
    """

    def __init__(self, model: torch.nn.Module, clustering: Any, router: torch.nn.Module,
                 budget: ClusterBudget | Mapping[int, ClusterBudget], *, keep_ids: Sequence[int],
                 target_vocab_size: int | None = None, name: str = "dynaspec", overlap: bool = True) -> None:
        _require_keep(keep_ids, "routed shortlist")
        for b in (budget.values() if isinstance(budget, Mapping) else [budget]):
            b.check(clustering.num_clusters)
        if getattr(router, "num_clusters", clustering.num_clusters) != clustering.num_clusters:
            raise DrafterError("The router scores another number of clusters than the clustering has.",
                               expected=f"{clustering.num_clusters} clusters", found=f"{router.num_clusters}",
                               fix="Train the router for this clustering (`drafter train_router`).")
        self._model = model
        self.session = ModelSession(model, body_only=True)
        self.routed = RoutedHead(model, clustering, keep_ids)
        self.embed = model.get_input_embeddings()
        device = self.session.device
        self.router = router.to(device=device, dtype=self.embed.weight.dtype).eval()
        self.budget = budget
        self.name, self.target_layers = name, ()
        self.target_vocab_size = target_vocab_size or clustering.vocab_size
        self.head_stats = HeadStats()
        self._side = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None

    @torch.no_grad()
    def _route(self, token: int | Tensor, previous: Tensor, k: int) -> Tensor:
        """Top-``k`` clusters for ``[E(x_t), h_{t-1}]`` (``x_t`` a host id — a view of its embedding row, nothing
        copied to the device — or a ``(1,)`` device tensor)."""
        weight = self.embed.weight
        x = weight[token] if isinstance(token, int) else weight.index_select(0, token)[0]
        scores = self.router(torch.cat([x, previous]).unsqueeze(0))[0]
        return torch.topk(scores, k).indices

    def _route_and_step(self, token: int | Tensor, previous: Tensor, k: int, advance: bool
                        ) -> tuple[Tensor, Tensor | None]:
        """Route for position ``t`` and, when ``advance``, feed ``token`` to the body (its ``h_t``) at the same
        time: on a CUDA side stream the router overlaps the body (DynaSpec Fig. 1)."""
        import time

        if self._side is None:
            start = time.perf_counter()
            clusters = self._route(token, previous, k)
            self.head_stats.router_seconds += time.perf_counter() - start
            return clusters, (self.session.feed(token)[-1] if advance else None)
        main = torch.cuda.current_stream(previous.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            clusters = self._route(token, previous, k)
        hidden = self.session.feed(token)[-1] if advance else None
        main.wait_stream(self._side)
        clusters.record_stream(main)
        return clusters, hidden

    @torch.no_grad()
    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft ``gamma`` tokens from routed shortlists; see :class:`~pipeline.engine.proposers.Proposer`."""
        require_context(context)
        budget = _per_gamma(self.budget, gamma, "DynaSpec cluster budget")
        rows = self.session.move_to(context, keep=min(2, len(context)), device_ids=state.token_ids)
        hidden = rows[-1]
        previous = rows[-2] if rows.shape[0] == 2 else torch.zeros_like(hidden)  # h_{t-1}; none before t = 0
        token: int | Tensor = context[-1]
        tokens: list[Tensor] = []
        dists: list[Tensor] = []
        for t in range(gamma):
            if t > 0:  # route for x_t while the body computes h_t
                clusters, hidden_next = self._route_and_step(token, hidden, budget.at(t), advance=True)
                previous, hidden = hidden, hidden_next
            else:
                clusters, _ = self._route_and_step(token, previous, budget.at(t), advance=False)
            routed = timed_call(self.head_stats, hidden.device, self.routed.shortlist, hidden, clusters)
            self.head_stats.add(t, routed.count)
            token, row = _draw(routed.ids, routed.logits, params, generator, self.target_vocab_size)
            tokens.append(token)
            dists.append(row)
        # the last drafted token was never fed: the session holds context + tokens[:-1]
        return _proposal(tokens, dists, self.target_vocab_size, hidden.device)


class PositionAwareFrequencyProposer(SessionProposer):
    """PA-FR (DynaSpec App. A.3): the ``K_fr(t)`` most frequent tokens at draft position ``t``.

    Args:
        model: The drafter (shares the target's tokenizer).
        ranking: Token ids, most frequent first (from the ``count`` artifact's counts).
        kmax: ``K_fr(0) = K_fr(1)``; an int, or one per draft length γ.
        keep_ids: Tokens every shortlist contains (EOS): required.
        k_min: Floor of the decay.
        target_vocab_size: Width of ``q``.
        name: Label in metrics and reports.
    """

    def __init__(self, model: torch.nn.Module, ranking: Sequence[int] | np.ndarray, kmax: int | Mapping[int, int],
                 *, keep_ids: Sequence[int], k_min: int = 1, target_vocab_size: int | None = None,
                 name: str = "pa_fr") -> None:
        _require_keep(keep_ids, "position-aware frequency shortlist")
        weight = model.get_output_embeddings().weight
        vocab = weight.shape[0]
        ranking = torch.as_tensor(np.asarray(ranking), dtype=torch.long)
        if ranking.numel() == 0 or torch.unique(ranking).numel() != ranking.numel() or int(ranking.max()) >= vocab \
                or int(ranking.min()) < 0:
            raise DrafterError("The frequency ranking is not a list of distinct token ids of this drafter.",
                               expected=f"distinct ids in [0, {vocab})", found=f"{ranking.numel()} ids",
                               fix="Take the ranking from this target's count artifact.")
        for k in (kmax.values() if isinstance(kmax, Mapping) else [kmax]):
            if not 1 <= k <= ranking.numel():
                raise DrafterError("The PA-FR budget does not fit the ranking.",
                                   expected=f"kmax in [1, {ranking.numel()}]", found=str(k),
                                   fix="Lower kmax (evaluate.dynaspec_match picks it).")
        self._model = model
        self.session = ModelSession(model, body_only=True)
        device = self.session.device
        self.ranking = ranking.to(device)
        self.head = LinearHead(model, self.ranking)  # rows in ranking order: K_fr(t) rows are a prefix
        keep = keep_tensor(keep_ids, vocab, device)
        rank_of = torch.full((vocab,), vocab, dtype=torch.long, device=device)
        rank_of[self.ranking] = torch.arange(self.ranking.numel(), device=device)
        self._keep, self._keep_rank = keep, rank_of[keep]
        self._keep_head = LinearHead(model, keep)
        self._extra: dict[int, tuple[Tensor, Tensor | None, Tensor] | None] = {}
        self.kmax, self.k_min = kmax, k_min
        self.name, self.target_layers = name, ()
        self.target_vocab_size = target_vocab_size or vocab
        self.head_stats = HeadStats()

    def _logits(self, hidden: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """(logits, token ids) of the first ``k`` ranked rows (a slice: no copy) plus missing kept tokens."""
        if k not in self._extra:  # kept tokens ranked below k: their rows are appended (decided once per k)
            missing = self._keep_rank >= k
            keep = self._keep_head
            self._extra[k] = None if not bool(missing.any()) else (
                keep.weight[missing], None if keep.bias is None else keep.bias[missing], self._keep[missing])
        bias = None if self.head.bias is None else self.head.bias[:k]
        logits = torch.nn.functional.linear(hidden, self.head.weight[:k], bias)  # a view: no copy
        ids = self.ranking[:k]
        if self._extra[k] is not None:
            weight, extra_bias, extra_ids = self._extra[k]
            logits = torch.cat([logits, torch.nn.functional.linear(hidden, weight, extra_bias)])
            ids = torch.cat([ids, extra_ids])
        return self.head.finish(logits), ids

    @torch.no_grad()
    def propose(
        self, context: list[int], gamma: int, params: SamplingParams, generator: Generator, state: TargetState
    ) -> Proposal:
        """Draft ``gamma`` tokens, position ``t`` from the ``K_fr(t)`` most frequent tokens."""
        require_context(context)
        kmax = _per_gamma(self.kmax, gamma, "PA-FR budget")
        hidden = self.session.move_to(context, device_ids=state.token_ids)[-1]
        tokens: list[Tensor] = []
        dists: list[Tensor] = []
        for t in range(gamma):
            if t > 0:
                hidden = self.session.feed(tokens[-1])[-1]
            k = pa_fr(kmax, t, self.k_min)
            logits, ids = timed_call(self.head_stats, hidden.device, self._logits, hidden, k)
            self.head_stats.add(t, int(ids.numel()))
            token, row = _draw(ids, logits, params, generator, self.target_vocab_size)
            tokens.append(token)
            dists.append(row)
        return _proposal(tokens, dists, self.target_vocab_size, hidden.device)
