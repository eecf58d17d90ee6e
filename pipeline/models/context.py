"""How many positions a model was built for, known without loading its weights.

The plan-time checks (:mod:`pipeline.orchestration.limits`) compare prompt and generation lengths with
each model's context. A tiny-kit ref's context comes from its recipe (:data:`pipeline.tiny.spec.PROFILES`:
``context`` tokens, ``byte_context`` bytes for ``drafter_bytes``; the build writes them as
``max_position_embeddings``), so planning never builds the kit. Any other model's comes from its
``config.json`` (``max_position_embeddings``, which Hugging Face maps from ``n_positions`` and the like),
read through ``AutoConfig`` from the local directory or the hub revision the config pins.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from pipeline.errors import DrafterError
from pipeline.models.loading import TINY_PREFIX, read_model_config
from pipeline.tiny import parse_tiny_ref
from pipeline.tiny.spec import get_profile


@lru_cache(maxsize=32)
def _text_config(name: str, revision: str | None, trust_remote_code: bool) -> Any:
    """The text config of a local directory or hub id (its text part for a multimodal one), read as the loaders read
    it: a hub model's from the local Hugging Face cache without a network call where it holds the commit."""
    config = read_model_config(name, revision, trust_remote_code=trust_remote_code)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_length(name: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """Positions ``name`` was built for (its ``max_position_embeddings``); None when its config names none.

    Args:
        name: A tiny-kit ref, a local directory or a hub id, as a config names it.
        revision: Hub revision (ignored for local directories and tiny refs).
        trust_remote_code: Allow a checkpoint's own config class to run.

    Raises:
        DrafterError: The model's config cannot be read (a missing directory, no network for a hub id).
    """
    if name.startswith(TINY_PREFIX):
        profile, role = parse_tiny_ref(name)
        spec = get_profile(profile)
        return spec.byte_context if role == "drafter_bytes" else spec.context
    value = getattr(_text_config(name, revision, trust_remote_code), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def embedding_rows(name: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """Token ids ``name``'s embedding holds (its config's ``vocab_size``); None for a tiny-kit ref (built with its
    own tokenizer) or a config that names none. Raises as :func:`context_length`."""
    if name.startswith(TINY_PREFIX):
        return None
    value = getattr(_text_config(name, revision, trust_remote_code), "vocab_size", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def tokenizer_too_large(tokenizer: str, model: str, ids: int, rows: int) -> DrafterError:
    """The error for a ``target.tokenizer`` of ``ids`` ids beside a model of ``rows`` embedding rows."""
    return DrafterError(
        f"target.tokenizer {tokenizer!r} has more token ids than the target model has embeddings.",
        expected=f"at most {rows} ids (the vocab_size of {model!r})",
        found=f"{ids} ids",
        fix="Name the tokenizer the target was trained with (or leave target.tokenizer unset to use the model's own).")


_SPEC_OF_ROLE = {"target": "target", "drafter": "drafter", "drafter_other": "other", "drafter_bytes": "byte_drafter"}


def depth(name: str, revision: str | None = None, trust_remote_code: bool = False) -> int | None:
    """Decoder layers of ``name`` (its config's ``num_hidden_layers``; a tiny-kit ref's from its recipe); None for a
    config that names none. Raises as :func:`context_length`."""
    if name.startswith(TINY_PREFIX):
        profile, role = parse_tiny_ref(name)
        return getattr(get_profile(profile), _SPEC_OF_ROLE[role]).layers
    value = getattr(_text_config(name, revision, trust_remote_code), "num_hidden_layers", None)
    return int(value) if isinstance(value, int) and value > 0 else None
