"""Where the pipeline keeps what it builds once per machine: the tiny-model kits (``<cache>/tiny``), the weights'
sha256 stat cache, and the empty MLflow store new local stores start from (``<cache>/mlflow``)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """``$DRAFTER_CACHE`` if set, else ``~/.cache/drafter-pipeline``."""
    env = os.environ.get("DRAFTER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "drafter-pipeline"
