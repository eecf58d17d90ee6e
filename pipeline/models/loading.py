"""Loading target and drafter models and tokenizers, and fingerprinting them.

One loader serves every kind of reference: a tiny-kit ref (``tiny:<profile>/<role>``, built locally on
demand), a local directory written by ``save_pretrained``, or a hub id (with a pinned revision; it needs
network access, which tests and the embedded default never use). ``trust_remote_code`` is off unless a
config turns it on. A target fingerprint — model name, revision, and a hash of the tokenizer's
vocabulary — is stamped on every artifact so nothing built for one target is used with another. A
tiny-kit model's fingerprint comes from its recipe (the kit hash), so computing it builds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.errors import DrafterError
from pipeline.vocab.tokens import vocab_hash

TINY_PREFIX = "tiny:"
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
        from pipeline.tiny import kit_hash, resolve_tiny_ref

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


def _hub_error(ref: ModelRef, err: Exception) -> DrafterError:
    return DrafterError(
        f"Could not load {ref.name!r}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        expected="a local directory with a saved model, a tiny-kit ref like tiny:default/target, or a hub id "
                 "reachable from this machine",
        fix="Check the name; without network access download the checkpoint elsewhere and pass its path.",
    )


def load_tokenizer(name: str, revision: str | None = None, *, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained`` for any reference, with a clear error when it cannot load."""
    from transformers import AutoTokenizer

    ref = resolve_ref(name, revision)
    try:
        return AutoTokenizer.from_pretrained(ref.location, revision=None if ref.is_local else ref.revision,
                                             trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _hub_error(ref, err) from err


def load_model(name: str, revision: str | None = None, *, dtype: str = "float32",
               trust_remote_code: bool = False, device: str | None = None) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` in eval mode (safetensors only)."""
    import torch
    from transformers import AutoModelForCausalLM

    ref = resolve_ref(name, revision)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ref.location, revision=None if ref.is_local else ref.revision, dtype=getattr(torch, _DTYPES[dtype]),
            trust_remote_code=trust_remote_code, use_safetensors=True)
    except (OSError, ValueError) as err:
        raise _hub_error(ref, err) from err
    model.eval()
    if device is not None:
        model.to(device)
    return model


def _tiny_fingerprint(name: str, revision: str | None, tokenizer_name: str) -> tuple:
    """A tiny-kit model's identity from its recipe alone: the kit hash names its weights and vocabulary.

    The kit is a pure function of (profile spec, kit code version, packaged data), so nothing needs to be
    built to know it: ``drafter plan`` and ``drafter status`` stay instant on a fresh machine.
    """
    from pipeline.tiny import kit_hash, parse_tiny_ref
    from pipeline.tiny.spec import ROLE_TOKENIZERS

    profile, _ = parse_tiny_ref(name)
    tok_profile, tok_role = parse_tiny_ref(tokenizer_name)
    vocab = f"tiny:{tok_profile}-{kit_hash(tok_profile)}/{ROLE_TOKENIZERS[tok_role]}"
    return (("model", name), ("revision", revision or kit_hash(profile)), ("vocab_hash", vocab))


@lru_cache(maxsize=16)
def _fingerprint_cached(name: str, revision: str | None, tokenizer_name: str | None, trust: bool) -> tuple:
    if name.startswith(TINY_PREFIX) and (tokenizer_name or name).startswith(TINY_PREFIX):
        return _tiny_fingerprint(name, revision, tokenizer_name or name)
    ref = resolve_ref(name, revision)
    tok = load_tokenizer(tokenizer_name or name, revision, trust_remote_code=trust)
    return (("model", ref.name), ("revision", ref.revision), ("vocab_hash", vocab_hash(tok)),
            ("vocab_size", len(tok)))


def fingerprint(name: str, revision: str | None = None, tokenizer: str | None = None,
                trust_remote_code: bool = False) -> dict:
    """The target fingerprint stamped on artifacts: model name, revision, tokenizer vocab hash."""
    return dict(_fingerprint_cached(name, revision, tokenizer, trust_remote_code))
