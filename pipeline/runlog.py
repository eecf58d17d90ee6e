"""How run records read in MLflow and in logs: configs flattened into parameters (credentials are cut from URIs by
:func:`pipeline.errors.redact`).

A leaf every layer may import (training logs its per-step runs, orchestration its stage runs, the CLI prints
tracking URIs).
"""

from __future__ import annotations

from typing import Any


def flatten(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"generate.max_new_tokens": "96", ...}`` for MLflow params (values ≤ 6000 chars)."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): str(data)[:6000]}
