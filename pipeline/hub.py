"""Which commit a Hugging Face hub reference names: a model's or a dataset's revision resolved to a commit sha.

Artifact ids hold the commit, not the branch, so weights or data pushed to ``main`` change them; and the loaders
load that commit, resolved once a process (:func:`pinned_commit`), so what a stage reads is what its id names even
when a download moves ``main`` while it runs. The local Hugging Face cache answers first (``refs/<revision>``, as a
download leaves it), the hub second; with neither, the caller is told to pin a commit.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from pipeline.errors import DrafterError

COMMIT = re.compile(r"[0-9a-f]{40}")
PIN = {"model": "target.revision (the target's; a drafter has no revision setting: download it or pass its path)",
       "dataset": "generate.source_revision"}
"""The setting that pins each kind of hub repository, for the error that asks for it."""


def hub_commit(name: str, revision: str | None, repo_type: str = "model") -> str:
    """The commit a hub reference resolves to: the revision itself when it is a commit sha, else the commit
    the local Hugging Face cache recorded for it, else the hub's answer.

    Args:
        repo_type: ``"model"`` or ``"dataset"``.

    Raises:
        DrafterError: The commit cannot be resolved offline and the hub is unreachable.
    """
    if revision and COMMIT.fullmatch(revision):
        return revision
    from huggingface_hub import constants

    ref = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{name.replace('/', '--')}" / "refs" / (revision or "main")
    if ref.is_file() and COMMIT.fullmatch(commit := ref.read_text().strip()):
        return commit
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        info = api.model_info if repo_type == "model" else api.dataset_info
        sha = info(name, revision=revision, timeout=10).sha
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, auth: one answer for all
        raise DrafterError(
            f"Cannot tell which commit {name!r}@{revision or 'main'} is: it is not in the local Hugging Face "
            f"cache and the hub did not answer ({type(err).__name__}).",
            expected=f"a revision that resolves to a commit (artifact ids hold the {repo_type}'s commit)",
            found=f"revision {revision!r}",
            fix=f"Pin {PIN[repo_type]} to a 40-character commit sha, download the {repo_type} into the Hugging Face "
                "cache, or pass a local path.") from err
    if not sha:
        raise DrafterError(f"The hub gave no commit for {name!r}@{revision or 'main'}.",
                           fix=f"Pin {PIN[repo_type]} to a commit sha.")
    return sha


@lru_cache(maxsize=64)
def pinned_commit(name: str, revision: str | None, repo_type: str = "model") -> str:
    """:func:`hub_commit`, resolved once a process: the artifact ids a process plans and what it loads name the
    same commit."""
    return hub_commit(name, revision, repo_type)
