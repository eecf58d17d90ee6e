"""RDK's synthetic acceptance study (Timor et al., §6.2, Figs. 5–7), reproduced with held-out contexts.

A synthetic target over ``vocab`` tokens has logits ``b_j + σ·t_j``: a fixed Zipf-like "frequency" offset
``b_j = −zipf·log(1 + j)`` (token 0 is the most frequent, so the mean distribution is long-tailed like
Figs. 1 and 5) plus per-context Student-t(df) noise (the paper's Fig. 3); ``p = softmax``. The drafter is a
noisy copy, ``q = softmax(logits + drafter_noise·N(0, 1))``, pruned to the ``k`` tokens with the largest
calibration mean ``μ`` (FR pruning). Three independent context sets are drawn: *calibration* (``μ`` and the
top-k sparse ``S`` via :class:`~pipeline.rdk.moments.MomentSums`), *validation* (RDK's ``τ``, picked on a grid
to maximise α) and *held-out* (every α reported). Per kept size the study measures α = Σ min(p, ·) for the
full drafter, the masked drafter (sub-stochastic, not renormalised), TLI (Eq. 1), exact RDK ``Mᵀq'`` (Eq. 2,
:class:`~pipeline.rdk.affinity.Affinity`), Eq. 3 with the prior ``μ`` (a method) and with the true ``p`` (an
oracle: analysis only), and the rank-one prior mixture (:class:`~pipeline.rdk.affinity.PriorMix`); plus two
references that ignore the drafter (``μ`` itself and the uniform distribution), whose α is the same at
every kept size. ``python -m pipeline.rdk.synthetic --out docs/rdk --threads 1`` writes ``synthetic.json`` and a
plot; adding ``--zipf 0 --noise-scale 0.83 --name synthetic_no_frequency`` gives targets with no frequency
structure (i.i.d. t logits, so FR pruning keeps arbitrary tokens), the other reading of the paper's §6.2.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from pipeline.errors import DrafterError
from pipeline.rdk.affinity import LIGHT, Affinity, PriorMix, acceptance, scatter_kept, taylor_redistribute
from pipeline.rdk.moments import Moments, MomentSums

PAPER_RDK_ACCEPTANCE = 0.267
"""The paper's flat RDK acceptance across pruning levels (§6.2, Fig. 7)."""
METHODS = ("full", "masked", "tli", "rdk_exact", "rdk_taylor_prior", "rdk_taylor_oracle", "prior_mix",
           "prior_only", "uniform")
DEFAULT_TAUS = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
MAX_DENSE = 120_000_000
"""Largest dense block (entries; float64, so ≈1 GB) exact RDK may form for its heavy tokens at one τ.

:class:`Affinity` sums tokens with ``μ/√τ > LIGHT`` densely; their number grows like ``1/√τ``, so the smallest
τ of the grid may be skipped at the largest kept sizes (the result says which and why)."""


def _contexts(rng: np.random.Generator, n: int, base: Tensor, noise_scale: float, df: float,
              drafter_noise: float, chunk: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``(p, q)`` float32 chunks of ``n`` contexts: target and drafter distributions over the vocabulary."""
    for start in range(0, n, chunk):
        shape = (min(chunk, n - start), base.numel())
        # Student-t as N(0,1)/sqrt(χ²_df/df), χ²_df = 2·Gamma(df/2): float32 throughout, one seeded generator.
        chi2 = 2.0 * rng.standard_gamma(df / 2.0, size=shape, dtype=np.float32)
        t = rng.standard_normal(size=shape, dtype=np.float32) / np.sqrt(chi2 / df)
        logits = base + noise_scale * torch.from_numpy(t)
        p = torch.softmax(logits, -1)
        eta = torch.from_numpy(rng.standard_normal(size=shape, dtype=np.float32))
        q = torch.softmax(logits + drafter_noise * eta, -1)
        yield p, q


def _tli(q: Tensor, kept: Tensor) -> Tensor:
    """Eq. 1: the drafter restricted to ``kept`` and renormalised (float64, ``(n, |I|)``)."""
    q_kept = q[:, kept].to(torch.float64)
    return q_kept / q_kept.sum(-1, keepdim=True)


def _heavy_entries(mu: Tensor, kept: Tensor, tau: float) -> int:
    """Entries of the dense blocks :class:`Affinity` forms for tokens with ``μ/√τ > LIGHT`` (per context row)."""
    heavy = mu / math.sqrt(tau) > LIGHT
    return int(heavy[kept].sum()) * mu.numel() + int(heavy.sum()) * kept.numel()


def _evaluate(p: Tensor, q: Tensor, kept: Tensor, mu: Tensor, affinity: Affinity | None, mix: PriorMix,
              seconds: dict[str, float]) -> dict[str, tuple[Tensor, float, Tensor]]:
    """Per method at one kept set: α per context, the worst |Σq − 1| or negativity, and the draft's mass off I."""
    vocab = p.shape[-1]
    q_tli, p_kept = _tli(q, kept), p[:, kept]  # p is float64 here, so acceptance does not convert it again
    none = q_tli.new_zeros(q_tli.shape[0])
    out = {"masked": (acceptance(p_kept, q[:, kept]), 0.0, none),
           "tli": (acceptance(p_kept, q_tli), _error(q_tli), none)}
    makers = {"rdk_taylor_prior": lambda: taylor_redistribute(scatter_kept(q_tli, kept, vocab), mu),
              "rdk_taylor_oracle": lambda: taylor_redistribute(scatter_kept(q_tli, kept, vocab), p),
              "prior_mix": lambda: mix.redistribute(q_tli)}
    if affinity is not None:
        makers["rdk_exact"] = lambda: affinity.redistribute(q_tli)
    for name, make in makers.items():
        start = time.perf_counter()
        draft = make()
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start
        out[name] = (acceptance(p, draft), _error(draft), 1.0 - draft[:, kept].sum(-1))
    return out


def _error(q: Tensor) -> float:
    """How far rows of ``q`` are from distributions: max of |Σq − 1| and of the most negative entry."""
    return max(float((q.sum(-1) - 1.0).abs().max()), float((-q).max().clamp_min(0.0)))


def _choose_tau(moments: Moments, kept: Tensor, taus: Sequence[float],
                val: list[tuple[Tensor, Tensor]]) -> tuple[list[dict], Affinity | None]:
    """Exact RDK's α on the validation contexts per τ (skipping τ past the dense budget) and the best affinity."""
    curve, best, best_alpha = [], None, -1.0
    for tau in taus:
        dense = _heavy_entries(moments.mu, kept, tau)
        if dense > MAX_DENSE:
            curve.append({"tau": tau, "skipped": f"dense heavy-token block of {dense:,} entries > {MAX_DENSE:,}"})
            continue
        affinity = Affinity(moments, kept, tau)
        alpha = float(torch.cat([acceptance(p, affinity.redistribute(_tli(q, kept))) for p, q in val]).mean())
        curve.append({"tau": tau, "alpha_validation": alpha})
        if alpha > best_alpha:
            best, best_alpha = affinity, alpha
    return curve, best


def _summary(alpha: Tensor, tli: Tensor | None) -> dict[str, float]:
    n = alpha.numel()
    row = {"alpha": float(alpha.mean()), "stderr": float(alpha.std() / math.sqrt(n)) if n > 1 else 0.0}
    if tli is not None:
        gain = alpha - tli
        row["gain_vs_tli"] = float(gain.mean())
        row["gain_stderr"] = float(gain.std() / math.sqrt(n)) if n > 1 else 0.0
    return row


def synthetic_study(vocab: int = 200_000, kept_sizes: Sequence[int] = (50_000, 20_000, 5_000, 500),
                    contexts: int = 128, calibration: int = 1024, validation: int = 32, df: float = 5.0,
                    seed: int = 0, taus: Sequence[float] = DEFAULT_TAUS, top_k: int = 16, zipf: float = 1.25,
                    noise_scale: float = 0.5, drafter_noise: float = 0.5, chunk: int = 64) -> dict:
    """Run the study; every number it reports is measured on the ``contexts`` held-out contexts.

    Args:
        vocab: ``|T|``, the target (and unpruned drafter) vocabulary.
        kept_sizes: Drafter vocabularies after FR pruning (each ``≤ vocab``).
        contexts: Held-out contexts α is averaged over.
        calibration: Contexts ``μ`` and the sparse ``S`` are estimated from.
        validation: Contexts RDK's ``τ`` is chosen on.
        df: Degrees of freedom of the Student-t logit noise.
        seed: Seeds the three context sets (independent streams).
        taus: RDK temperatures tried; a τ whose heavy-token dense block exceeds ``MAX_DENSE`` is skipped.
        top_k: Entries per calibration distribution kept for ``S``.
        zipf: Slope of the frequency offset ``b_j = −zipf·log(1 + j)``.
        noise_scale: σ, the scale of the per-context t noise on the target logits.
        drafter_noise: Standard deviation of the Gaussian noise the drafter adds to the target logits.
        chunk: Contexts processed at once (memory: a few ``chunk × vocab`` float64 arrays).

    Returns:
        A JSON-ready dict: ``settings``, ``target`` statistics, ``references``, one entry per kept size
        under ``kept`` (α, standard error and paired gain over TLI per method; the τ curve) and ``seconds``.
    """
    sizes = sorted({int(k) for k in kept_sizes}, reverse=True)
    if not sizes or sizes[-1] < 1 or sizes[0] > vocab or min(contexts, calibration, validation) < 1:
        raise DrafterError("The synthetic RDK study got impossible sizes.",
                           expected="1 <= kept size <= vocab and at least one context per set",
                           found=f"vocab={vocab}, kept_sizes={list(kept_sizes)}, contexts={contexts}, "
                                 f"calibration={calibration}, validation={validation}",
                           fix="Pass kept sizes within the vocabulary and positive context counts.")
    clock = time.perf_counter()
    seconds: dict[str, float] = {}
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3)]
    base = -zipf * torch.log1p(torch.arange(vocab, dtype=torch.float32))
    draw = {"noise_scale": noise_scale, "df": df, "drafter_noise": drafter_noise, "chunk": chunk}

    sums = MomentSums(vocab, top_k)
    for p, _ in _contexts(streams[0], calibration, base, **draw):
        sums.add(p)
    moments = sums.moments()
    mu = moments.mu
    order = torch.argsort(mu, descending=True, stable=True)
    kept_sets = {k: order[:k].sort().values for k in sizes}
    seconds["calibration"] = time.perf_counter() - clock

    start = time.perf_counter()
    val = [(p.to(torch.float64), q) for p, q in _contexts(streams[1], validation, base, **draw)]
    curves, chosen = {}, {}
    for k, kept in kept_sets.items():
        curves[k], chosen[k] = _choose_tau(moments, kept, taus, val)
    del val
    seconds["validation"] = time.perf_counter() - start

    start = time.perf_counter()
    mixes = {k: PriorMix(mu, kept) for k, kept in kept_sets.items()}
    method_seconds: dict[int, dict[str, float]] = {k: {} for k in sizes}
    per_context: dict[str, list[Tensor]] = {}
    outside: dict[str, list[Tensor]] = {}
    max_p, quarter, top_mass, errors = [], [], {k: [] for k in sizes}, {}
    uniform = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for p, q in _contexts(streams[2], contexts, base, **draw):
        p = p.to(torch.float64)
        max_p.append(p.amax(-1))
        quarter.append(p.topk(max(1, vocab // 4), dim=-1).values.sum(-1))  # Fig. 5's statistic
        for name, ref in (("full", q), ("prior_only", mu), ("uniform", uniform)):
            per_context.setdefault(name, []).append(acceptance(p, ref))
        for k, kept in kept_sets.items():
            top_mass[k].append(p[:, kept].sum(-1))
            rows = _evaluate(p, q, kept, mu, chosen[k], mixes[k], method_seconds[k])
            for name, (alpha, error, off) in rows.items():
                per_context.setdefault(f"{name}@{k}", []).append(alpha)
                outside.setdefault(f"{name}@{k}", []).append(off)
                errors[f"{name}@{k}"] = max(errors.get(f"{name}@{k}", 0.0), error)
    seconds["held_out"] = time.perf_counter() - start
    alpha = {name: torch.cat(chunks) for name, chunks in per_context.items()}

    kept_rows = []
    for k in sizes:
        tli = alpha[f"tli@{k}"]
        methods = {}
        for name in METHODS[1:7]:
            key = f"{name}@{k}"
            if key not in alpha:
                methods[name] = {"skipped": "no τ in the grid fits the dense-block budget"}
                continue
            methods[name] = _summary(alpha[key], None if name == "tli" else tli) | {
                "mass_error": errors[key], "draft_mass_outside_kept": float(torch.cat(outside[key]).mean())}
        kept_rows.append({"kept": k, "fraction": k / vocab,
                          "target_mass_kept": float(torch.cat(top_mass[k]).mean()),
                          "prior_mass_outside": mixes[k].weight, "methods": methods,
                          "tau_chosen": None if chosen[k] is None else chosen[k].tau, "tau_curve": curves[k],
                          "seconds_per_context": {m: s / contexts for m, s in method_seconds[k].items()}})
    seconds["total"] = time.perf_counter() - clock
    machine = {"torch_threads": torch.get_num_threads(), "load_average_1_5_15min": list(os.getloadavg())}
    return {
        "paper": {"rdk_acceptance": PAPER_RDK_ACCEPTANCE, "section": "6.2, Fig. 7"},
        "settings": {"vocab": vocab, "kept_sizes": sizes, "df": df, "seed": seed, "taus": list(taus),
                     "top_k": top_k, "zipf": zipf, "noise_scale": noise_scale, "drafter_noise": drafter_noise,
                     "chunk": chunk, "max_dense": MAX_DENSE, "pruning": "top-k by calibration mean μ (FR)"},
        "sample_sizes": {"calibration": calibration, "validation": validation, "held_out": contexts},
        "target": {"mean_max_p": float(torch.cat(max_p).mean()), "median_max_p": float(torch.cat(max_p).median()),
                   "mass_in_own_top_quarter": float(torch.cat(quarter).mean()),
                   "moments_covered": moments.covered, "moments_nnz": moments.nnz},
        "references": {name: _summary(alpha[name], None) for name in ("full", "prior_only", "uniform")},
        "kept": kept_rows,
        "seconds": seconds,
        "machine": machine,
    }


CLI_FIELDS = ("vocab", "contexts", "calibration", "validation", "seed", "df", "zipf", "noise_scale",
              "drafter_noise", "top_k", "chunk")
LABELS = {"full": "full drafter", "masked": "pruned, masked only", "tli": "TLI (Eq. 1)",
          "rdk_exact": "RDK exact (Eq. 2, τ on validation)", "rdk_taylor_prior": "RDK Taylor, p:=μ (Eq. 3)",
          "rdk_taylor_oracle": "RDK Taylor, true p (oracle)", "prior_mix": "prior mix (rank-one)",
          "prior_only": "μ alone", "uniform": "uniform"}


def plot(result: dict, path: str | Path) -> None:
    """α against the kept fraction (log x) per method, with the paper's 26.7 % line; PNG via matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["kept"]
    x = [r["fraction"] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    # Eq. 3 lies on TLI at this scale (it moves α by at most 2/N): dashed lines and small markers keep TLI visible.
    styles = {"rdk_taylor_prior": ("--", "s", 4), "rdk_taylor_oracle": (":", "x", 6)}
    for name in METHODS[1:7]:
        pts = [(f, r["methods"][name]["alpha"]) for f, r in zip(x, rows) if "alpha" in r["methods"][name]]
        if pts:
            line, marker, size = styles.get(name, ("-", "o", 6))
            ax.plot(*zip(*pts), linestyle=line, marker=marker, markersize=size, label=LABELS[name])
    for name, style in (("full", "-"), ("prior_only", "-."), ("uniform", ":")):
        ax.axhline(result["references"][name]["alpha"], color="grey", linestyle=style, lw=1, label=LABELS[name])
    ax.axhline(PAPER_RDK_ACCEPTANCE, color="black", linestyle="--", lw=1, label="paper's RDK (26.7 %)")
    ax.set_xscale("log")
    ax.set_xlabel(f"kept fraction of the vocabulary ({result['settings']['vocab']:,} tokens)")
    ax.set_ylabel("acceptance α (held-out mean)")
    ax.set_ylim(0, 1)
    n = result["sample_sizes"]
    s = result["settings"]
    ax.set_title(f"Synthetic targets: zipf={s['zipf']:g}, σ={s['noise_scale']:g}·t(df={s['df']:g}); "
                 f"{n['held_out']} held-out contexts", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    """``python -m pipeline.rdk.synthetic --out docs/rdk``: run the study; write ``<name>.json`` and ``.png``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/rdk"), help="folder the files are written to")
    parser.add_argument("--name", default="synthetic", help="stem of the files written")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (a run setting: 1 is faster on a shared, busy machine)")
    defaults = inspect.signature(synthetic_study).parameters  # flags and defaults cannot drift from the function
    parser.add_argument("--kept", type=int, nargs="+", default=list(defaults["kept_sizes"].default))
    parser.add_argument("--taus", type=float, nargs="+", default=list(defaults["taus"].default))
    for name in CLI_FIELDS:
        default = defaults[name].default
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    fields = {name: getattr(args, name) for name in CLI_FIELDS}
    result = synthetic_study(kept_sizes=args.kept, taus=args.taus, **fields)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / f"{args.name}.png")
    return result


if __name__ == "__main__":
    main()
