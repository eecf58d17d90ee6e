"""Where tests keep tool environments: virtualenvs for tools whose pins conflict with ours (speculators).

They live apart from the artifact cache (``$DRAFTER_CACHE``, the tiny kits): a venv is over a gigabyte of
someone else's packages, not an artifact, and clearing one must not cost the other. The directory is
``$DRAFTER_TOOLS`` if set, else ``~/.cache/drafter-pipeline-tools``; ``rm -rf`` it to reclaim the space
(the next interop run rebuilds what it needs).
"""

from __future__ import annotations

import os
from pathlib import Path


def tools_dir() -> Path:
    """``$DRAFTER_TOOLS`` if set, else ``~/.cache/drafter-pipeline-tools``."""
    env = os.environ.get("DRAFTER_TOOLS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "drafter-pipeline-tools"


def tool_env_dir(name: str) -> Path:
    """The directory of tool environment ``name`` (e.g. ``speculators-0.9.0``)."""
    return tools_dir() / name
