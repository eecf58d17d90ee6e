"""``drafter bench``'s catalogue: what each benchmark measures, against what, and the function that runs it.

Each function is imported only when its bench runs (they import torch, FAISS, the models), so ``drafter --help``
and the parser stay fast.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bench:
    """One ``drafter bench`` subcommand.

    Attributes:
        description: What it measures against what (its line in ``drafter bench --help``).
        target: ``module:function`` returning the printed result; imported only when it runs (heavy imports).
        options: Its keyword arguments, each the CLI option of that name (``--steps`` → ``steps``);
            ``cfg`` is the loaded config.
    """

    description: str
    target: str
    options: tuple[str, ...] = ()


BENCHES: dict[str, Bench] = {
    "count": Bench("vectorised counting vs collections.Counter", "pipeline.evaluation.bench:bench_count",
                   ("tokens", "calibration")),
    "eval": Bench("every speculative method vs autoregressive decoding on this device (no MLflow needed)",
                  "pipeline.evaluation.bench:bench_eval", ("cfg", "counts", "out")),
    "train": Bench("one EAGLE-3 training step vs the frozen target's forward on its batch (needs count built)",
                   "jobs.train_drafter:bench", ("cfg", "steps")),
    "head": Bench("one draft step's LM head, full vs static 32k vs DynaSpec-routed (Triton kernel, torch path,\n"
                  "              per-block views), at 128k x 4096 and the tiny kit's size",
                  "pipeline.engine.bench:bench_heads", ("steps",)),
    "cluster": Bench("FAISS spherical k-means vs scikit-learn KMeans", "pipeline.engine.bench:bench_cluster"),
    "decode": Bench("a round's draft/verify/rest vs its bare forwards, AR decoding and Leviathan",
                    "jobs.evaluate:bench_decode", ("cfg", "shape", "steps", "methods", "cold")),
    "draft": Bench("a round's drafting, EAGLE-3 vs DFlash by depth and head, and the weights each reads",
                   "pipeline.evaluation.draft_bench:bench_draft", ("cfg", "steps")),
    "rdk": Bench("moment estimation vs a dense |T|^2 matrix; one draft step of TLI vs the RDK variants at 128k",
                 "pipeline.rdk.bench:bench_rdk", ("steps",)),
    "fingerprint": Bench("a large checkpoint's weight fingerprint: hashing every byte vs the next plans' stat cache",
                         "pipeline.models.bench:bench_fingerprint"),
}
"""``drafter bench NAME``: what each benchmark measures and the function that runs it."""


def run_bench(what: str, option: Callable[[str], Any]) -> str:
    """Run ``drafter bench WHAT``: its function from :data:`BENCHES`, each keyword from ``option(name)``."""
    bench = BENCHES[what]
    module, _, function = bench.target.partition(":")
    run = getattr(importlib.import_module(module), function)
    return run(**{name: option(name) for name in bench.options})
