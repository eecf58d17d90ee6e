"""Which commit a Hugging Face hub reference names (a model's or a dataset's revision resolved to a commit sha), and
whether its files can be had here.

Artifact ids hold the commit, not the branch, so weights or data pushed to ``main`` change them; and the loaders
load that commit, resolved once a process (:func:`pinned_commit`), so what a stage reads is what its id names even
when a download moves ``main`` while it runs. The local Hugging Face cache answers first (``refs/<revision>``, as a
download leaves it), the hub second; with neither, the caller is told to pin a commit.

A commit whose snapshot is in the local cache loads from there without a network call (:func:`cached_snapshot`); one
that is not is fetched only after the hub has answered once (:func:`require_hub`). A dataset's snapshot is read as it
is when the hub does not answer, and only once the hub has listed no file it lacks when it does
(:func:`snapshot_gaps`): a snapshot holds no record of being whole. A dataset the cache lacks goes to ``datasets``
offline when the hub gave no answer (:func:`hub_silence`). Left to themselves, the loaders ask
an unreachable hub for each file five times with backoff, twice over for a tokenizer: about 45 s of retry warnings
on a node without network before the same error, and minutes where a firewall drops the connection instead.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.errors import DrafterError

COMMIT = re.compile(r"[0-9a-f]{40}")
PIN = {"model": "target.revision (the target's; a drafter has no revision setting: download it or pass its path)",
       "dataset": "generate.source_revision"}
"""The setting that pins each kind of hub repository, for the error that asks for it."""


def _repo_dir(name: str, repo_type: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{name.replace('/', '--')}"


def _repo_info(name: str, revision: str | None, repo_type: str) -> Any:
    """The hub's answer about a repository at ``revision``: one question, a 10 s timeout, no retries. Raises whatever
    ``huggingface_hub`` raises (offline mode, unreachable, unknown, gated)."""
    from huggingface_hub import HfApi

    api = HfApi()
    return (api.model_info if repo_type == "model" else api.dataset_info)(name, revision=revision, timeout=10)


def _first_line(err: Exception) -> str:
    """``"<error type>: <first line of its message>"``, for a message that names what the hub said."""
    text = str(err)
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


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
    ref = _repo_dir(name, repo_type) / "refs" / (revision or "main")
    if ref.is_file() and COMMIT.fullmatch(commit := ref.read_text().strip()):
        return commit
    try:
        sha = _repo_info(name, revision, repo_type).sha
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


def cached_snapshot(name: str, commit: str, repo_type: str = "model") -> bool:
    """Whether the local Hugging Face cache holds a snapshot of ``commit`` (a download left it; it may be partial)."""
    return snapshot_dir(name, commit, repo_type).is_dir()


def snapshot_dir(name: str, commit: str, repo_type: str = "model") -> Path:
    """Where the local Hugging Face cache keeps the files of ``name`` at ``commit``."""
    return _repo_dir(name, repo_type) / "snapshots" / commit


def snapshot_gaps(name: str, commit: str, repo_type: str = "model") -> list[str] | None:
    """The files of ``name`` at ``commit`` that its cached snapshot lacks, as the hub lists them (one question, 10 s
    timeout, no retries); None when the hub gives no list (unreachable, refused, or the process is offline:
    ``HF_HUB_OFFLINE``)."""
    try:
        info = _repo_info(name, commit, repo_type)
    except Exception:  # noqa: BLE001 - offline, unreachable, refused: the hub gives no list
        return None
    snapshot = snapshot_dir(name, commit, repo_type)
    return sorted(f.rfilename for f in info.siblings or [] if not (snapshot / f.rfilename).is_file())


RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)
"""The HTTP statuses ``huggingface_hub`` retries with backoff: a hub answering one is not serving."""


def hub_silence(name: str, revision: str | None, repo_type: str = "model") -> str | None:
    """Why the hub gave no answer about ``name`` at ``revision`` (one question, 10 s timeout, no retries), as
    ``"<error>: <first line>"``: unreachable, timed out, overloaded or failing (:data:`RETRIED_STATUSES`), or the
    process is offline (``HF_HUB_OFFLINE``). None when it answered, a refusal included (unknown repository or commit,
    gated): a loader asking it again is answered at once, while one asking a silent hub retries each request with
    backoff."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        _repo_info(name, revision, repo_type)
    except Exception as err:  # noqa: BLE001 - connection refused or reset, timeout, offline mode: no answer
        status = getattr(getattr(err, "response", None), "status_code", None)
        if isinstance(err, HfHubHTTPError) and status not in RETRIED_STATUSES:
            return None
        return _first_line(err)
    return None


@lru_cache(maxsize=64)
def require_hub(name: str, commit: str, repo_type: str = "model") -> None:
    """Ask the hub once, with a 10 s timeout and no retries, for ``name`` at ``commit``: before a loader downloads
    what the local cache lacks. Once a process.

    Raises:
        DrafterError: The hub did not answer, or refused (unknown repository, commit or gated without credentials).
    """
    try:
        _repo_info(name, commit, repo_type)
    except Exception as err:  # noqa: BLE001 - offline, unknown repo or commit, auth: the same answer
        raise DrafterError(
            f"{name!r} at commit {commit[:12]} is not in the local Hugging Face cache, and the hub did not give it "
            f"({type(err).__name__}).",
            expected=f"the {repo_type}'s snapshot in the Hugging Face cache this machine reads, or a hub that answers",
            found=f"no snapshot under {_repo_dir(name, repo_type)}; the hub: {_first_line(err)}"[:400],
            fix=f"Download it where the hub is reachable (`hf download {name} --revision {commit}"
                f"{' --repo-type dataset' if repo_type == 'dataset' else ''}`) into this machine's HF_HUB_CACHE, "
                "or pass a local path; a gated repository needs HF_TOKEN in the environment.") from err
