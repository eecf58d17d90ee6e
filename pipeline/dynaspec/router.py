"""The DynaSpec router: features, labels, the MLP, its training task and its held-out routing curves.

DynaSpec §4.2 ("Low-cost router", "Training the router"): at each position ``t`` the router reads
``[E(x_t), h_{t-1}]`` — the drafter's embedding of the current token and the drafter's hidden state at
the previous position (here the final, normed hidden state of a small causal-LM drafter, the state its LM
head reads; zeros at ``t = 0``) — and scores the ``M`` clusters with a two-layer ReLU MLP. It is
trained as a multi-label classifier with binary cross-entropy: cluster ``m`` is positive when it holds
one of the top-``L`` tokens of the *full-vocabulary* drafter's distribution at ``t`` (the distribution
its hidden state ``h_t`` gives for ``x_{t+1}``).

:class:`RouterTask` is the module the shared harness (:func:`pipeline.training.harness.fit`) trains:
the frozen drafter computes features and labels online in each step. :func:`routing_curves` measures,
on held-out rows and for every budget ``k = 1..M``, the routed shortlist's mean size and what it keeps
of the full drafter's top-L mass and of the *target's* next-token mass, beside a static frequency
shortlist (FR-Spec) of the same mean size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from pipeline.errors import DrafterError

ROUTER_WEIGHTS = "router.safetensors"
ROUTER_CONFIG = "router_config.json"


class Router(nn.Module):
    """``r_θ``: Linear(2d → hidden) → ReLU → Linear(hidden → M) on ``[E(x_t), h_{t-1}]``."""

    def __init__(self, input_size: int, hidden_size: int, num_clusters: int) -> None:
        super().__init__()
        self.input_size, self.hidden_size, self.num_clusters = input_size, hidden_size, num_clusters
        self.net = nn.Sequential(nn.Linear(input_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, num_clusters))

    def forward(self, features: Tensor) -> Tensor:
        """Cluster logits ``s`` (``σ(s)`` is the probability a cluster holds a plausible next token)."""
        return self.net(features)


def drafter_parts(drafter: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(body returning final normed hidden states, input embedding, LM head) of a Hugging Face causal LM."""
    return drafter.base_model, drafter.get_input_embeddings(), drafter.get_output_embeddings()


@torch.no_grad()
def router_features(drafter: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None
                    ) -> tuple[Tensor, Tensor]:
    """``([E(x_t), h_{t-1}]  (B, T, 2d), full-head logits (B, T, V))`` of a batch, drafter frozen.

    Row ``t`` of the logits is the drafter's distribution for ``x_{t+1}`` (from ``h_t``), which is what the
    router at position ``t`` is trained to cover.
    """
    body, embed, head = drafter_parts(drafter)
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    previous = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
    return torch.cat([embed(input_ids), previous], dim=-1), head(hidden)


def cluster_labels(logits: Tensor, assignment: Tensor, top_l: int, num_clusters: int) -> Tensor:
    """Multi-hot ``(…, M)`` float: cluster ``m`` is 1 when it holds one of the top-``L`` tokens of ``logits``."""
    top = torch.topk(logits, min(top_l, logits.shape[-1]), dim=-1).indices
    labels = torch.zeros(*logits.shape[:-1], num_clusters, dtype=torch.float32, device=logits.device)
    return labels.scatter_(-1, assignment[top], 1.0)


def predict_mask(loss_mask: Tensor, attention_mask: Tensor) -> Tensor:
    """Positions whose *next* token is an assistant token (what drafting predicts), ``(B, T)`` bool."""
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:, :-1] = loss_mask[:, 1:].bool()
    return nxt & attention_mask.bool()


class RouterTask(nn.Module):
    """The harness module: a trainable :class:`Router` on a frozen drafter and a fixed clustering.

    Args:
        router: The router (trained).
        drafter: The frozen same-tokenizer drafter whose head was clustered.
        assignment: ``(V,)`` int64 token → cluster.
        heldout: Rows scored by :meth:`evaluate` (held-out BCE, label recall at the mean label count).
        top_l: ``L`` of the labels.
        pad_id: Token id that pads batches.
    """

    selection_metric = "neg_loss"

    def __init__(self, router: Router, drafter: nn.Module, assignment: Tensor, heldout: Sequence[Any], *,
                 top_l: int, pad_id: int = 0, eval_batch_size: int = 16) -> None:
        super().__init__()
        self.router, self.drafter = router, drafter.eval().requires_grad_(False)
        self.register_buffer("assignment", torch.as_tensor(assignment, dtype=torch.long), persistent=False)
        self.heldout_rows, self.top_l, self.pad_id, self.eval_batch_size = list(heldout), top_l, pad_id, eval_batch_size

    def train(self, mode: bool = True) -> RouterTask:
        super().train(mode)
        self.drafter.eval()
        return self

    def collate(self, rows: Sequence[Any]) -> dict[str, Tensor]:
        from pipeline.data.rows import pad_batch  # deferred: pulls in torch

        return pad_batch(rows, self.pad_id)

    def count_tokens(self, batch: dict[str, Tensor]) -> int:
        return int(batch["attention_mask"].sum())

    def _loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        features, logits = router_features(self.drafter, batch["input_ids"], batch["attention_mask"])
        labels = cluster_labels(logits, self.assignment, self.top_l, self.router.num_clusters)
        mask = predict_mask(batch["loss_mask"], batch["attention_mask"])
        scores = self.router(features.to(next(self.router.parameters()).dtype)).float()
        bce = nn.functional.binary_cross_entropy_with_logits(scores, labels, reduction="none").sum(-1)  # Σ_m
        per_example = (bce * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean over the example's positions
        return per_example.mean(), scores, labels, mask

    def training_step(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
        loss, scores, labels, mask = self._loss(batch)
        with torch.no_grad():  # counts, summed over the step by the harness: no host read per micro-batch
            return loss, {"count.positives": labels[mask].sum(), "count.positions": mask.sum()}

    def step_figures(self, counts: dict[str, float]) -> dict[str, float]:
        """The mean number of positive clusters a predicted position has, over the step's positions."""
        return {"positive_clusters": counts["positives"] / max(1.0, counts["positions"])}

    forward = training_step

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out BCE (``neg_loss`` = −BCE selects the checkpoint) and the share of positive clusters
        found among the router's top ``k`` for k = the mean number of positives."""
        from pipeline.data.rows import pad_batch  # deferred: pulls in torch

        device = next(self.router.parameters()).device
        loss = hits = positives = positions = 0.0
        for start in range(0, len(self.heldout_rows), self.eval_batch_size):
            rows = self.heldout_rows[start : start + self.eval_batch_size]
            batch = {k: v.to(device) for k, v in pad_batch(rows, self.pad_id).items()}
            value, scores, labels, mask = self._loss(batch)
            loss += float(value) * len(rows)
            s, y = scores[mask], labels[mask]
            k = max(1, round(float(y.sum(-1).mean()))) if len(y) else 1
            top = torch.topk(s, k, dim=-1).indices
            hits += float(y.gather(-1, top).sum())
            positives += float(y.sum())
            positions += len(y)
        loss /= max(1, len(self.heldout_rows))
        return {"neg_loss": -loss, "loss": loss, "label_recall_at_mean": hits / max(positives, 1.0),
                "positives_per_position": positives / max(positions, 1.0)}


def save_router(router: Router, out: str | Path, meta: dict) -> None:
    """``router.safetensors`` + ``router_config.json`` (sizes, and what it was trained for: ``meta``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in router.state_dict().items()}, str(out / ROUTER_WEIGHTS))
    config = {"input_size": router.input_size, "hidden_size": router.hidden_size,
              "num_clusters": router.num_clusters, **meta}
    (out / ROUTER_CONFIG).write_text(json.dumps(config, indent=2))


def load_router(directory: str | Path, clustering: Any, drafter_head: Tensor | None = None,
                drafter_weights: str | None = None) -> tuple[Router, dict]:
    """Load a ``train_router`` artifact's router and refuse it for another clustering or drafter.

    Args:
        directory: The artifact directory.
        clustering: The :class:`~pipeline.dynaspec.clusters.Clustering` it will route over.
        drafter_head: The drafter's LM-head weight, checked against the head the router was trained on.
        drafter_weights: What names the drafter's weights (its fingerprint's ``weights``), checked against the
            drafter the router was trained on: the router reads the drafter's hidden states, so a drafter with the
            same head and another body (a fine-tune with its head frozen) is another drafter to it.

    Raises:
        DrafterError: Missing files, another clustering (content hash), another drafter head or drafter.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / ROUTER_WEIGHTS).is_file() or not (directory / ROUTER_CONFIG).is_file():
        raise DrafterError(f"No DynaSpec router at {directory}.",
                           expected=f"{ROUTER_WEIGHTS} and {ROUTER_CONFIG} (a train_router artifact)",
                           found="missing", fix="Point at a `drafter train_router` artifact directory.")
    config = json.loads((directory / ROUTER_CONFIG).read_text())
    expected = clustering.content_sha256()
    if config.get("clustering_sha256") != expected or config.get("num_clusters") != clustering.num_clusters:
        raise DrafterError("The DynaSpec router was trained for another token clustering.",
                           expected=f"a router for clustering {expected[:16]}… ({clustering.num_clusters} clusters)",
                           found=f"router for clustering {str(config.get('clustering_sha256'))[:16]}… "
                                 f"({config.get('num_clusters')} clusters, cluster artifact {config.get('clusters')})",
                           fix="Train the router on this clustering (`drafter train_router`), or use the cluster "
                               "artifact it names.")
    if drafter_head is not None:
        from pipeline.dynaspec.clusters import head_dtype, head_sha256  # deferred: pulls in numpy

        rounding = head_dtype(drafter_head)  # a float16 load is compared with the float16 digest
        key = "drafter_head_sha256_float16" if rounding == "float16" else "drafter_head_sha256"
        found = head_sha256(drafter_head, rounding)
        if config.get(key) != found:
            raise DrafterError("The DynaSpec router was trained on another drafter." + (
                                   " It records no float16 digest of its drafter's head (trained before "
                                   "2026-11-28): retrain it, or load the drafter in bfloat16 or float32."
                                   if key not in config else ""),
                               expected=f"drafter head {found[:16]}… ({rounding})",
                               found=f"router trained with head {str(config.get(key))[:16]}…",
                               fix="Use the drafter the router and clustering were made for.")
    trained_on = config.get("drafter_weights")
    if drafter_weights is not None and trained_on is not None and trained_on != drafter_weights:
        raise DrafterError("The DynaSpec router was trained on the hidden states of another drafter (same LM head, "
                           "other weights).", expected=f"a router trained on drafter weights {drafter_weights}",
                           found=f"router trained on {config.get('drafter')!r}, weights {trained_on}",
                           fix="Train the router with cluster.drafter set to this drafter (`drafter train_router`), "
                               "or evaluate the drafter it was trained on.")
    router = Router(config["input_size"], config["hidden_size"], config["num_clusters"])
    router.load_state_dict(load_file(str(directory / ROUTER_WEIGHTS)), strict=True)
    return router.eval(), config


def _cumulative_by_cluster(x: Tensor, assignment: Tensor, order: Tensor, m: int) -> Tensor:
    """``(N, M)``: row n's mass of ``x`` in its first k clusters of ``order``, for every k."""
    out = torch.zeros(x.shape[0], m, dtype=torch.float64, device=x.device)
    return out.index_add_(1, assignment, x).gather(1, order).cumsum(1)


@torch.no_grad()
def routing_curves(router: Router, drafter: nn.Module, target: nn.Module, rows: Sequence[Any],
                   clustering: Any, ranking: np.ndarray, *, top_l: int, keep_ids: Sequence[int] = (),
                   pad_id: int = 0, batch_size: int = 16) -> dict:
    """What routed shortlists keep on held-out rows, for every budget ``k = 1..M``, against FR-Spec.

    At every predicted position (next token an assistant token) the router ranks the clusters; the
    shortlist of budget ``k`` is the union of the top ``k`` plus ``keep_ids`` (EOS). Reported per ``k``
    (means over positions): ``size``; ``drafter_top_l_recall``, the share of the full drafter's top-L mass
    inside the shortlist; ``drafter_mass`` and ``target_mass``, the full drafter's and the target's
    next-token probability inside it; and the same for the static frequency shortlist (``ranking``'s
    first ``round(size)`` ids plus ``keep_ids``) of that mean size: ``static_*``.
    """
    from pipeline.data.rows import pad_batch  # deferred: pulls in torch

    device = next(router.parameters()).device
    m = clustering.num_clusters
    assignment = torch.as_tensor(clustering.assignment, device=device)
    sizes = torch.bincount(assignment, minlength=m).double()
    vocab = clustering.vocab_size
    keep = torch.as_tensor(sorted(set(int(t) for t in keep_ids)), dtype=torch.long, device=device)
    # a head may have more rows than the tokenizer has tokens (padding rows, which no count ranks): they rank last,
    # in id order
    ranked = torch.as_tensor(ranking[:vocab], device=device)
    unranked = torch.ones(vocab, dtype=torch.bool, device=device)
    unranked[ranked] = False
    order = torch.cat([ranked, torch.nonzero(unranked).flatten()])
    rank_of = torch.empty(vocab, dtype=torch.long, device=device)
    rank_of[order] = torch.arange(vocab, device=device)
    totals = {key: torch.zeros(m, dtype=torch.float64) for key in
              ("size", "drafter_top_l_recall", "drafter_mass", "target_mass")}
    # The static shortlist's figures are sums over its members of per-token means over positions, so running sums
    # over positions of q, p and the top-L share (each a vocabulary-long vector) give them exactly; keeping every
    # position's distributions took 3 × V × 8 bytes a position (~3 MB at 128k: hundreds of GB at scale).
    columns = {key: torch.zeros(vocab, dtype=torch.float64) for key in ("q", "p", "topl")}
    positions = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batch = {k: v.to(device) for k, v in pad_batch(chunk, pad_id).items()}
        features, logits = router_features(drafter, batch["input_ids"], batch["attention_mask"])
        mask = predict_mask(batch["loss_mask"], batch["attention_mask"])
        if not mask.any():
            continue
        scores = router(features[mask].to(next(router.parameters()).dtype))
        q = torch.softmax(logits[mask].double(), -1)[:, :vocab]
        p_logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        p = torch.softmax(p_logits[mask].double(), -1)[:, :vocab]
        top = torch.topk(q, min(top_l, vocab), dim=-1).indices
        topl = torch.zeros_like(q).scatter_(-1, top, q.gather(-1, top))
        # Per cluster: mass of q, p, top-L q; then accumulate along the router's order.
        order = torch.argsort(scores, dim=-1, descending=True)  # (N, M)
        qc, pc, lc = (_cumulative_by_cluster(x, assignment, order, m) for x in (q, p, topl))
        sc = sizes[order].cumsum(1)
        if keep.numel():  # keep_ids join every shortlist: add them where their cluster is not yet chosen
            rank = torch.argsort(order, dim=1)  # rank[n, c] = position of cluster c in row n's order
            for tok in keep.tolist():
                # column j holds the first j + 1 clusters: the token's cluster is missing iff its rank is beyond j
                missing = rank[:, int(assignment[tok])].unsqueeze(1) > torch.arange(m, device=device)  # (N, M)
                qc += missing * q[:, tok : tok + 1]
                pc += missing * p[:, tok : tok + 1]
                lc += missing * topl[:, tok : tok + 1]
                sc = sc + missing
        totals["size"] += sc.sum(0).cpu()
        totals["drafter_mass"] += qc.sum(0).cpu()
        totals["target_mass"] += pc.sum(0).cpu()
        totals["drafter_top_l_recall"] += (lc / topl.sum(-1, keepdim=True)).sum(0).cpu()
        positions += int(q.shape[0])
        columns["q"] += q.sum(0).cpu()
        columns["p"] += p.sum(0).cpu()
        columns["topl"] += (topl / topl.sum(-1, keepdim=True)).sum(0).cpu()
    if positions == 0:
        raise DrafterError("No held-out position to measure routing on.",
                           expected="held-out rows with assistant tokens", found="none",
                           fix="Raise train_router.eval_fraction or generate more calibration data.")
    curves = {key: (value / positions).tolist() for key, value in totals.items()}
    # The static frequency shortlist of the same mean size, for each k.
    q_mean, p_mean, l_mean = (columns[k] / positions for k in ("q", "p", "topl"))
    static = {"static_size": [], "static_drafter_top_l_recall": [], "static_drafter_mass": [], "static_target_mass": []}
    rank_cpu = rank_of.cpu()
    keep_cpu = keep.cpu()
    for size in curves["size"]:
        members = rank_cpu < max(1, round(size) - int((rank_cpu[keep_cpu] >= round(size)).sum()))
        members[keep_cpu] = True
        static["static_size"].append(int(members.sum()))
        static["static_drafter_mass"].append(float(q_mean[members].sum()))
        static["static_target_mass"].append(float(p_mean[members].sum()))
        static["static_drafter_top_l_recall"].append(float(l_mean[members].sum()))
    return {"positions": positions, "top_l": top_l, "k": list(range(1, m + 1)), **curves, **static}
