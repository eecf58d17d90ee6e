"""Loading target and drafter models and tokenizers, and fingerprinting them.

One loader serves every kind of reference: a tiny-kit ref (``tiny:<profile>/<role>``, built locally on
demand), a local directory written by ``save_pretrained``, or a hub id (with a pinned revision; it needs
network access, which tests and the embedded default never use). ``trust_remote_code`` is off unless a
config turns it on. A target fingerprint — model name, revision, and a hash of the tokenizer's
vocabulary, what names the weights (a local checkpoint's sha256, a hub model's resolved commit) and a local
directory's other loading files (chat template, generation config) — is stamped on every artifact so nothing
built for one target, or for other weights or templates, is used with another. A hub model loads at the commit
its fingerprint names. A
tiny-kit model's fingerprint comes from its recipe (the kit hash), so computing it builds nothing; its
files are checked against the hashes recorded at build time whenever they are loaded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.cache import default_cache_dir
from pipeline.checksums import StatCache, tree_digest
from pipeline.data.calibration import template_overhead
from pipeline.errors import DrafterError
from pipeline.hub import cached_snapshot, pinned_commit, require_hub, snapshot_dir
from pipeline.progress import heartbeat
from pipeline.tiny import kit_hash, kit_weights, parse_tiny_ref, resolve_tiny_ref
from pipeline.tiny.spec import ROLE_TOKENIZERS
from pipeline.vocab.tokens import vocab_hash

TINY_PREFIX = "tiny:"
GENERATION_CONFIG = "generation_config.json"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


@dataclass(frozen=True)
class ModelRef:
    """A resolved model reference: where ``from_pretrained`` should look, and its identity."""

    name: str
    location: str
    revision: str | None

    @property
    def is_local(self) -> bool:
        return Path(self.location).is_dir()


def resolve_ref(name: str, revision: str | None = None) -> ModelRef:
    """Map a config's model string to a loadable location (building a tiny kit if needed)."""
    if name.startswith(TINY_PREFIX):

        path = resolve_tiny_ref(name)
        profile = name[len(TINY_PREFIX):].split("/", 1)[0]
        return ModelRef(name, str(path), revision or kit_hash(profile))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file() and not (path / "tokenizer.json").is_file():
            raise DrafterError(f"{name!r} is a path but holds no model or tokenizer.",
                               expected="a directory written by save_pretrained (config.json, tokenizer.json)",
                               found=", ".join(sorted(p.name for p in path.iterdir())[:8]) or "an empty directory")
        return ModelRef(name, str(path.resolve()), revision)
    return ModelRef(name, name, revision)


def _load_revision(ref: ModelRef) -> str | None:
    """What ``from_pretrained`` loads: nothing for a local directory or a tiny kit, for a hub model the commit its
    revision resolved to when this process named it (:func:`pinned_commit`), the commit its artifact ids hold. A
    branch that moves on while a stage runs is not loaded under an id that names the commit before."""
    if ref.is_local:
        return None
    return pinned_commit(ref.name, ref.revision)


def _pretrained(load: Callable[..., Any], ref: ModelRef, pinned: str | None, *,
                files: tuple[str, ...] = (), **kwargs: Any) -> Any:
    """``load(location, ...)`` (a ``from_pretrained``): a local directory as it is; a hub model at commit ``pinned``,
    from the local Hugging Face cache without a network call where the cache holds that commit's snapshot, else (or
    where the snapshot lacks a file) from the hub once it has answered (:func:`~pipeline.hub.require_hub`). A cache
    that lacks a file on a machine without the hub raises the cache's own error: a generation config the model never
    had stays absent there too. The snapshot's ``files`` (glob patterns) are checked against their blobs' sha256
    (:func:`check_snapshot_blobs`) before they load."""
    if pinned is None:
        return load(ref.location, **kwargs)
    missing: OSError | None = None
    if cached_snapshot(ref.name, pinned):
        check_snapshot_blobs(ref.name, pinned, files)
        try:
            return load(ref.location, revision=pinned, local_files_only=True, **kwargs)
        except OSError as err:  # a partial download: the rest from the hub
            missing = err
    try:
        require_hub(ref.name, pinned)
    except DrafterError:
        if missing is not None:
            raise missing from None
        raise
    loaded = load(ref.location, revision=pinned, **kwargs)
    check_snapshot_blobs(ref.name, pinned, files)  # what the download left (hashed once: a stat on every later load)
    return loaded


SHA256_NAME = re.compile(r"[0-9a-f]{64}")
"""A Hugging Face cache blob named by its sha256: a Git LFS file's (every safetensors file; git's own small files are
named by their 40-hex git object id)."""


def check_snapshot_blobs(name: str, commit: str, files: tuple[str, ...], cache: StatCache | None = None) -> None:
    """Refuse a cached snapshot of ``name`` at ``commit`` whose files matching ``files`` do not hash to the names of the
    blobs they link to. Artifact ids name a hub model by its commit alone, so weights changed on disk after the
    download (a flipped bit on shared storage, a file edited or converted in place) still parse and would publish
    every stage's output under the commit's ids. Each blob is hashed once per machine (a stat after: the weights'
    :class:`~pipeline.checksums.StatCache`).

    Raises:
        DrafterError: A blob's bytes do not hash to its name.
    """
    snapshot = snapshot_dir(name, commit)
    linked = sorted({f for pattern in files for f in snapshot.glob(pattern) if f.is_symlink() and f.is_file()})
    blobs = [(f, blob) for f in linked if SHA256_NAME.fullmatch((blob := f.resolve()).name)]
    if not blobs:
        return
    cache = cache or weights_stat_cache()
    with heartbeat(f"checking the sha256 of {name}'s cached files (once; a stat per file after)"):
        for file, blob in blobs:
            if (digest := cache.sha256(blob)) != blob.name:
                raise DrafterError(
                    f"The cached file {file.name} of {name!r} at commit {commit} is not the file the hub served.",
                    expected=f"bytes whose sha256 is {blob.name} (the blob's name: the hub's sha256 of that file)",
                    found=f"sha256 {digest} in {blob} (changed on disk after the download)",
                    fix=f"Download it again: `hf download {name} --revision {commit} --force-download` (or delete "
                        f"{snapshot} and load it again).")


def _hub_error(ref: ModelRef, err: Exception, pinned: str | None = None) -> DrafterError:
    first_line = str(err).splitlines()[0] if str(err) else ""
    if pinned is not None and cached_snapshot(ref.name, pinned):  # downloaded, then cut or changed on disk
        snapshot = snapshot_dir(ref.name, pinned)
        return DrafterError(
            f"Could not load {ref.name!r}: {type(err).__name__}: {first_line}",
            expected=f"the files of {ref.name} at commit {pinned} as the hub serves them",
            found=f"the cached snapshot at {snapshot}, which {type(err).__name__} says is damaged or incomplete "
                  "(a cut download, a full disk, a file changed in place)",
            fix=f"Download it again where the hub is reachable: `hf download {ref.name} --revision {pinned} "
                f"--force-download` (or delete {snapshot} and load it again).",
        )
    if ref.is_local:  # a directory that exists but does not load: damaged or not a transformers checkpoint
        return DrafterError(
            f"Could not load {ref.name!r}: {type(err).__name__}: {first_line}",
            expected="a directory written by save_pretrained: config.json (a JSON object), tokenizer files and "
                     "complete *.safetensors",
            found=f"{ref.location}, which {type(err).__name__} says is damaged or incomplete",
            fix="Save or download the checkpoint again (a tiny-kit model: `drafter tiny --profile <profile> --force`).",
        )
    return DrafterError(
        f"Could not load {ref.name!r}: {type(err).__name__}: {first_line}",
        expected="a local directory with a saved model, a tiny-kit ref like tiny:default/target, or a hub id "
                 "reachable from this machine",
        found=f"{type(err).__name__}: {first_line}"[:300],
        fix="Check the name; without network access download the checkpoint elsewhere and pass its path.",
    )


def load_tokenizer(name: str, revision: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained`` for any reference, with a clear error when it cannot load."""
    from transformers import AutoTokenizer

    ref = resolve_ref(name, revision)
    pinned = _load_revision(ref)  # outside the try: its error says to pin a commit
    try:
        return _pretrained(AutoTokenizer.from_pretrained, ref, pinned, files=LOADING_FILES,
                           trust_remote_code=trust_remote_code)
    except DrafterError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file raises TypeError, KeyError, tokenizers' Exception...
        raise _hub_error(ref, err, pinned) from err


def load_generation_config(name: str, revision: str | None = None) -> Any:
    """The model's ``generation_config.json`` as a ``GenerationConfig`` (None where it has none), without loading its
    weights: what a stage that never runs the model reads of where answers end (:func:`pipeline.vocab.tokens.stop_ids`
    takes any object with a ``generation_config``)."""
    from transformers import GenerationConfig

    ref = resolve_ref(name, revision)
    pinned = _load_revision(ref)
    _refuse_damaged_generation_config(ref, pinned)  # transformers would raise TypeError, or OSError as for none
    try:
        return _pretrained(GenerationConfig.from_pretrained, ref, pinned)
    except OSError as err:  # no generation_config.json: the tokenizer's end-of-sequence id is the only stop
        _refuse_damaged_generation_config(ref, pinned, err)  # one a download has just brought
        return None


def _refuse_damaged_generation_config(ref: ModelRef, pinned: str | None, err: Exception | None = None) -> None:
    """Raise where the checkpoint holds a ``generation_config.json`` that is not a JSON object. transformers takes
    such a file for a missing one (an ``OSError`` from the config reader, an info-level line from the model loader),
    and its end-of-turn ids (Gemma's ``<end_of_turn>``, Llama 3.1's ``<|eom_id|>``) would silently stop ending
    answers and drop out of every shortlist."""
    path = Path(ref.location) / GENERATION_CONFIG if ref.is_local else (
        snapshot_dir(ref.name, pinned) / GENERATION_CONFIG if pinned else None)
    if path is None or not path.is_file():
        return
    try:
        if isinstance(json.loads(path.read_bytes()), dict):
            return
        problem = "holds JSON that is not an object"
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        problem = f"is not valid JSON ({bad})"
    raise DrafterError(f"{ref.name!r}: its {GENERATION_CONFIG} {problem}.",
                       expected=f"{GENERATION_CONFIG} as save_pretrained writes it (a JSON object), or no such file",
                       found=f"{path}" + (f" ({type(err).__name__} from transformers)" if err else ""),
                       fix="Copy or download the checkpoint again: a cut copy (a full disk, an interrupted transfer) "
                           "leaves this. The stop ids it names decide where answers end.")


def load_model_config(name: str, revision: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """The model's ``config.json`` through ``AutoConfig`` (no weights), from the local directory, or the hub commit
    ``revision`` resolves to, read from the local Hugging Face cache where it holds it (as :func:`load_model`).

    Raises:
        OSError, ValueError: As ``AutoConfig.from_pretrained`` (no config, unreachable hub and nothing cached).
        DrafterError: An unpinned hub revision that cannot be resolved here.
    """
    from transformers import AutoConfig

    ref = resolve_ref(name, revision)
    return _pretrained(AutoConfig.from_pretrained, ref, _load_revision(ref), trust_remote_code=trust_remote_code)


def read_model_config(name: str, revision: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """:func:`load_model_config` for the plan-time reads (context, depth, embedding rows, the checkpoint's dtype):
    any failure is a :class:`DrafterError`. A ``config.json`` that is ``null`` or holds a field of the wrong type
    (``"num_hidden_layers": "4"``) raised transformers' own TypeError or validation error."""
    try:
        return load_model_config(name, revision, trust_remote_code=trust_remote_code)
    except DrafterError:
        raise
    except Exception as err:  # noqa: BLE001 - TypeError, huggingface_hub's validation error, OSError, ValueError...
        raise _config_error(name, revision, err) from err


def _config_error(name: str, revision: str | None, err: Exception) -> DrafterError:
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    ref = resolve_ref(name, revision)
    pinned = None if ref.is_local else pinned_commit(ref.name, ref.revision)
    path = Path(ref.location) / "config.json" if ref.is_local else (
        snapshot_dir(ref.name, pinned) / "config.json" if pinned and cached_snapshot(ref.name, pinned) else None)
    if path is None or not path.is_file():
        return DrafterError(
            f"Could not read the config of {name!r} to check its shape: {type(err).__name__}",
            expected="a local directory with config.json, a tiny-kit ref, or a hub id reachable from this machine",
            found=first_line,
            fix="Check the name; without network access download the checkpoint elsewhere and pass its path.")
    again = (f"`hf download {ref.name} --revision {pinned} --force-download`" if pinned
             else "copy or save the checkpoint again")
    return DrafterError(
        f"Could not read the config of {name!r}: its config.json does not load: {type(err).__name__}",
        expected="config.json as save_pretrained writes it: a JSON object with model_type and each field of the "
                 "type transformers expects (num_hidden_layers an integer...)",
        found=f"{path}: {first_line}"[:400],
        fix=f"Restore the file ({again}: a cut copy or a hand edit leaves this), or correct the field named above.")


def load_model(name: str, revision: str | None = None, *, dtype: str = "float32",
               trust_remote_code: bool = False, device: str | None = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode (safetensors only)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    ref = resolve_ref(name, revision)
    pinned = _load_revision(ref)  # outside the try: its error says to pin a commit
    _refuse_damaged_generation_config(ref, pinned)  # transformers would load defaults in its place, or a TypeError
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a weight-loading bar per model is noise in a stage's log
    try:
        # a download (the hub's own bar is off with transformers') or a multi-GB load: a line every 30 s
        with heartbeat(f"loading {name} ({dtype})"):
            model = _pretrained(AutoModelForCausalLM.from_pretrained, ref, pinned, files=WEIGHT_FILES + LOADING_FILES,
                                dtype=getattr(torch, _DTYPES[dtype]), trust_remote_code=trust_remote_code,
                                use_safetensors=True)
    except DrafterError:
        raise
    except Exception as err:  # noqa: BLE001 - a cut safetensors file raises SafetensorError, a bad config TypeError
        raise _hub_error(ref, err, pinned) from err
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    _refuse_damaged_generation_config(ref, pinned)  # one a download has just brought
    model.eval()
    if device is not None:
        model.to(device)
    return model


def _tiny_fingerprint(name: str, revision: str | None, tokenizer_name: str) -> tuple:
    """A tiny-kit model's identity: its recipe (the kit hash, the vocabulary's role) and, once the kit is built,
    the digest of the files it was built into (:func:`~pipeline.tiny.kit_weights`).

    The recipe does not fix the bytes: the kit trains under bfloat16 autocast on a CPU that multiplies bf16
    natively and in float32 elsewhere, with kernels chosen per CPU, so two machines can build two targets from one
    recipe, and every calibration set and drafter downstream would differ. With the digest, each gets its own ids, and
    artifacts built from one kit are never reused or loaded with another. Before the kit is built the id is the
    recipe's alone: ``drafter plan`` and ``drafter status`` still answer at once on a fresh machine, their ids marked
    provisional (nothing can be cached under them), and ``drafter run`` plans again once the kit is built.
    """

    profile, _ = parse_tiny_ref(name)
    tok_profile, tok_role = parse_tiny_ref(tokenizer_name)
    vocab = f"tiny:{tok_profile}-{kit_hash(tok_profile)}/{ROLE_TOKENIZERS[tok_role]}"
    items = [("model", name), ("revision", revision or kit_hash(profile)), ("vocab_hash", vocab)]
    if (weights := kit_weights(name, tokenizer_name)) is not None:
        items.append(("weights", "kit:" + weights))
    return tuple(items)


WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json")
"""What defines a local checkpoint's weights (the loader reads safetensors only)."""
LOADING_FILES = ("*.json", "*.jinja", "additional_chat_templates/*.jinja", "merges.txt", "vocab.txt", "*.model",
                 "*.tiktoken", "*.py")
"""What else ``from_pretrained`` reads from a local directory and what a stage's output depends on: the tokenizer's
files (normaliser, merges, special tokens), the chat template every prompt is rendered with, the generation config
``generate`` applies (``top_k``, ``repetition_penalty``, the end-of-sequence ids), remote code."""


def weights_stat_cache() -> StatCache:
    """The digest cache of local weight files, beside the tiny kits under the drafter cache."""

    return StatCache(default_cache_dir() / "weights-sha256.json")


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def local_weights_digest(directory: Path, cache: StatCache | None = None) -> str | None:
    """sha256 over a local checkpoint's safetensors files (header and data) and its config.json; None for a
    directory that holds no weights at all (a tokenizer saved on its own).

    Files are hashed through a :class:`~pipeline.checksums.StatCache`, so a second plan on an unchanged 16 GB
    checkpoint costs a ``stat`` per file instead of a minute of hashing (``drafter bench fingerprint``).

    Raises:
        DrafterError: The directory holds weights, but only in pickled formats (never loaded).
    """
    cache = cache or weights_stat_cache()
    files = sorted({f for pattern in WEIGHT_FILES for f in directory.glob(pattern) if f.is_file()})
    if not any(f.suffix == ".safetensors" for f in files):
        if not any(f.is_file() for pattern in PICKLED_WEIGHTS for f in directory.glob(pattern)):
            return None  # nothing to load as a model: a tokenizer directory
        raise DrafterError(f"{str(directory)!r} holds no safetensors weights.",
                           expected="model*.safetensors written by save_pretrained (the loader never unpickles "
                                    ".bin files)",
                           found=", ".join(sorted(p.name for p in directory.iterdir())[:8]) or "nothing",
                           fix="Save the model with save_pretrained(safe_serialization=True) or convert its .bin "
                               "weights to safetensors.")
    # the first plan on a 16 GB checkpoint hashes it (about a minute): a line every 30 s while it does
    with heartbeat(f"hashing the weights of {directory} (once; a stat per file after)"):
        return "sha256:" + tree_digest({f.name: cache.sha256(f) for f in files})


def local_files_digest(directory: Path, cache: StatCache | None = None) -> str | None:
    """sha256 over the files of :data:`LOADING_FILES` in a local directory; None where it holds none.

    The weights digest covers only what the model's forward reads. A chat template fixed in place, another
    ``generation_config.json`` or another end-of-sequence token changes every prompt or answer a stage writes
    while the vocabulary and the weights stay the same, so it has to change the ids too.
    """
    cache = cache or weights_stat_cache()
    files = sorted({f for pattern in LOADING_FILES for f in directory.glob(pattern) if f.is_file()})
    if not files:
        return None
    return "sha256:" + tree_digest({f.relative_to(directory).as_posix(): cache.sha256(f) for f in files})


def weights_identity(ref: ModelRef) -> str | None:
    """What names a model's weights in artifact ids: a local checkpoint's digest, a hub model's commit, a built
    tiny-kit model's recorded file digests; None for a directory without weights and for a kit not built yet."""
    if ref.name.startswith(TINY_PREFIX):
        return "kit:" + weights if (weights := kit_weights(ref.name)) else None
    if ref.is_local:
        return local_weights_digest(Path(ref.location))
    return "commit:" + pinned_commit(ref.name, ref.revision)


def files_identity(model: ModelRef, tokenizer: ModelRef) -> str | None:
    """What names the loading files (:data:`LOADING_FILES`) of a model and of its tokenizer where either is a local
    directory, by role and never by path (the same files at another path are the same target), and the commit of a
    hub tokenizer that is not the model's repository, and the recorded digests of a tiny-kit tokenizer beside another
    model; None where there is none of these (a hub model's commit names every file of its repository; a tiny kit's
    digests name its own)."""
    roles = {"model": model} if tokenizer.location == model.location else {"model": model, "tokenizer": tokenizer}
    digests = {role: digest for role, ref in roles.items()
               if ref.is_local and not ref.name.startswith(TINY_PREFIX)
               and (digest := local_files_digest(Path(ref.location))) is not None}
    if "tokenizer" in roles and tokenizer.name.startswith(TINY_PREFIX):
        # a tiny-kit tokenizer beside another model: the digests its build recorded name its chat template and
        # tokenizer config (a kit rebuilt with another template kept the ids); the recipe until it is built
        weights = kit_weights(tokenizer.name)
        digests["tokenizer"] = "kit:" + weights if weights else "recipe:" + kit_hash(parse_tiny_ref(tokenizer.name)[0])
    elif "tokenizer" in roles and not tokenizer.is_local:
        # a tokenizer repository of its own: its commit names its chat template (the model's commit does not)
        digests["tokenizer"] = "commit:" + pinned_commit(tokenizer.name, tokenizer.revision)
    return "sha256:" + tree_digest(digests) if digests else None


def _stat_signature(name: str | None) -> tuple:
    """(file, size, mtime) of a local directory's files: a cached fingerprint is reused only while it holds."""
    if not name or name.startswith(TINY_PREFIX):
        return ()
    path = Path(name).expanduser()
    if not path.is_dir():
        return ()
    files = [*path.iterdir(), *(path / "additional_chat_templates").glob("*")]
    return tuple(sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()))


@lru_cache(maxsize=16)
def _tokenizer_facts(name: str, revision: str | None, trust: bool, _signature: tuple) -> tuple[str, int, int | None]:
    """A tokenizer's vocabulary hash, its size and its chat template's overhead (:func:`template_overhead`), from one
    load a process (``_signature``: its directory's files, for a local one)."""
    tok = load_tokenizer(name, revision, trust_remote_code=trust)
    try:
        overhead = template_overhead(tok)
    except Exception:  # noqa: BLE001 - a template that cannot render one user turn: the stages that render say why
        overhead = None
    return vocab_hash(tok), len(tok), overhead


def prompt_template_overhead(name: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """The chat template overhead of tokenizer ``name`` (:func:`~pipeline.data.calibration.template_overhead`), from
    the load :func:`fingerprint` made already; None for a tiny-kit ref (planning never loads a kit: its stages check
    their prompts themselves) or a tokenizer without a chat template."""
    if name.startswith(TINY_PREFIX):
        return None
    return _tokenizer_facts(name, revision, trust_remote_code, _stat_signature(name))[2]


@lru_cache(maxsize=16)
def _fingerprint_cached(name: str, revision: str | None, tokenizer_name: str | None, trust: bool,
                        _signature: tuple) -> tuple:
    ref = resolve_ref(name, revision)
    vocab, size, _ = _tokenizer_facts(tokenizer_name or name, revision, trust, _stat_signature(tokenizer_name or name))
    items = [("model", ref.name), ("revision", ref.revision), ("vocab_hash", vocab), ("vocab_size", size)]
    if (weights := weights_identity(ref)) is not None:
        items.append(("weights", weights))
    if (files := files_identity(ref, resolve_ref(tokenizer_name or name, revision))) is not None:
        items.append(("files", files))
    if trust:
        # which implementation runs: with it, a checkpoint's own auto_map code; without, transformers' class for its
        # model_type (absent when off, so every id of a run without remote code stays as it was)
        items.append(("remote_code", True))
    return tuple(items)


def fingerprint(name: str, revision: str | None = None, tokenizer: str | None = None,
                trust_remote_code: bool = False) -> dict:
    """The target fingerprint stamped on artifacts: model name, revision, tokenizer vocab hash, what names the
    weights (a local checkpoint's digest, a hub model's commit, a built tiny kit's recorded file digests) and, for a
    local model or tokenizer directory, the digest of its other loading files (:data:`LOADING_FILES`)."""
    if name.startswith(TINY_PREFIX) and (tokenizer or name).startswith(TINY_PREFIX):
        return dict(_tiny_fingerprint(name, revision, tokenizer or name))
    signature = (_stat_signature(name), _stat_signature(tokenizer))
    return dict(_fingerprint_cached(name, revision, tokenizer, trust_remote_code, signature))
