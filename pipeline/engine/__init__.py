"""The speculative-decoding engine: sampling, proposers (drafters) and their registry, the model session
with its KV cache, lossless verification, the decode loops and their metrics. Cross-tokenizer
proposers live in :mod:`pipeline.engine.hetero` (TLI, Union), :mod:`pipeline.engine.slem` and
:mod:`pipeline.engine.slrs`, on the text bridge of :mod:`pipeline.engine.bridge`.

Names are re-exported lazily (PEP 562), so importing a light submodule such as
:mod:`pipeline.engine.methods` (which the config layer reads) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FullHeadProposer": "proposers",
    "GenerationResult": "loop",
    "METHODS": "methods",
    "ModelSession": "session",
    "Proposal": "proposers",
    "Proposer": "proposers",
    "SamplingParams": "sampling",
    "ShortlistProposer": "proposers",
    "SpeculationMetrics": "metrics",
    "TargetState": "session",
    "build_proposer": "methods",
    "generate_autoregressive": "loop",
    "generate_speculative": "loop",
    "sample": "sampling",
    "standardise": "sampling",
    "summarize": "metrics",
    "verify_exact": "verify",
    "verify_speculative": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
