"""Build profiles of the tiny-model kit, its content hash, and where kits are cached.

A profile fixes everything a build does (data, tokenizer sizes, model sizes, step counts, seeds), so a
kit is a pure function of (profile spec, the kit's code, packaged data identity); :func:`kit_hash`
hashes exactly that, and kits live under ``<cache>/tiny/<profile>-<hash>``. The code enters as a digest of
:data:`KIT_CODE_MODULES` without their docstrings and comments (:func:`kit_code_digest`): any change to what a
build runs names another kit, so a kit cached by older code is never taken for the new one, and an edit to the
prose alone keeps the cached kit.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.sources import SHAREGPT_PACKAGE, SHAREGPT_RESOURCE
from pipeline.errors import DrafterError

KIT_CODE_MODULES = ("pipeline.data.records", "pipeline.data.sources", "pipeline.tiny.corpus",
                    "pipeline.tiny.crossvocab", "pipeline.tiny.recipe", "pipeline.tiny.spec",
                    "pipeline.tiny.text_tokenizers", "pipeline.tiny.train", "pipeline.vocab.tokens")
"""The code a build runs: the recipe and the modules it draws data, tokenizers, training and token meanings from
(not the cache's bookkeeping in :mod:`pipeline.tiny.build`)."""
ROLES = ("target", "drafter", "drafter_other", "drafter_bytes")
ROLE_TOKENIZERS = {"target": "bytelevel", "drafter": "bytelevel", "drafter_other": "metaspace",
                   "drafter_bytes": "bytes"}
"""The tokenizer each role uses: target and drafter share the 'Ġ' byte-level one."""
# Minutes a build into an empty cache takes on a quiet 2-core machine (a busy one is slower: builds share
# CPU badly). `drafter tiny --help` prints these; update them when a profile's build time changes.
# default (kit v4): 5 min 57 s on a quiet 2-core machine with native bf16 (2026-11-25; v3 took 12 min, up to
# 42 on a busy machine); test: ~2.5 min (v3: 208 s on 2 idle cores, bf16 makes steps ~1.5x cheaper).
BUILD_MINUTES: dict[str, float] = {"default": 6, "test": 2.5}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one tiny Llama (tied input/output embeddings)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


@dataclass(frozen=True)
class ProfileSpec:
    """Everything one kit build does; two builds of the same spec give the same kit."""

    name: str
    train_conversations: int
    """Training conversations taken from the non-held-out ShareGPT split (in source order)."""
    eval_conversations: int
    """Held-out conversations used to measure the models."""
    max_turns: int
    """Messages kept per conversation."""
    max_chars: int
    """Characters kept per message (cut at a paragraph or sentence end where possible)."""
    vocab_target: int
    """Vocabulary of the 'Ġ' byte-level tokenizer shared by target and drafter."""
    vocab_other: int
    """Vocabulary of the '▁' Metaspace + byte-fallback tokenizer of drafter_other."""
    context: int
    """Training row length in tokens; also the models' max_position_embeddings."""
    batch_size: int
    target: ModelSpec
    target_steps: int
    target_lr: float
    drafter: ModelSpec
    drafter_steps: int
    drafter_lr: float
    other: ModelSpec
    other_steps: int
    other_lr: float
    byte_drafter: ModelSpec
    """Shape of drafter_bytes (256 byte tokens + the target's specials)."""
    byte_context: int
    """drafter_bytes' training row length in bytes; also its max_position_embeddings. A byte model needs
    ~2.4 positions per target token on the kit's chats, so this sets how long a conversation it drafts
    well in."""
    byte_steps: int
    byte_lr: float
    gen_prompts: int
    """Training prompts the target answers (sampled at T=1) to make distillation text."""
    gen_new_tokens: int
    mixed_precision: bool = True
    """Train under bfloat16 autocast when the CPU multiplies bf16 natively (AVX512-BF16/AMX: ~1.5x faster);
    float32 elsewhere, and everywhere under ``DRAFTER_KIT_PRECISION=float32``. The report records which ran."""
    seed: int = 0


PROFILES: dict[str, ProfileSpec] = {
    # The embedded default's target and drafters: 356 s on 2 quiet cores with bf16 (kit v4, 2026-11-25).
    "default": ProfileSpec(
        name="default",
        train_conversations=6000,
        eval_conversations=100,
        max_turns=4,
        max_chars=700,
        vocab_target=2048,
        vocab_other=1536,
        context=256,
        batch_size=8,
        target=ModelSpec(hidden=192, layers=4, heads=6, kv_heads=2, intermediate=512),
        target_steps=800,
        target_lr=2e-3,
        drafter=ModelSpec(hidden=96, layers=2, heads=3, kv_heads=1, intermediate=256),
        drafter_steps=400,
        drafter_lr=3e-3,
        other=ModelSpec(hidden=96, layers=2, heads=3, kv_heads=1, intermediate=256),
        other_steps=600,
        other_lr=3e-3,
        byte_drafter=ModelSpec(hidden=96, layers=3, heads=3, kv_heads=1, intermediate=256),
        byte_context=512,
        byte_steps=400,
        byte_lr=3e-3,
        gen_prompts=512,
        gen_new_tokens=128,
    ),
    # What pytest builds once per session: ~2.5 min with bf16.
    "test": ProfileSpec(
        name="test",
        train_conversations=1500,
        eval_conversations=60,
        max_turns=4,
        max_chars=500,
        vocab_target=1024,
        vocab_other=768,
        context=128,
        batch_size=8,
        target=ModelSpec(hidden=128, layers=3, heads=4, kv_heads=2, intermediate=352),
        target_steps=800,
        target_lr=2e-3,
        drafter=ModelSpec(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=192),
        drafter_steps=500,
        drafter_lr=3e-3,
        other=ModelSpec(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=192),
        other_steps=800,
        other_lr=3e-3,
        byte_drafter=ModelSpec(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=192),
        byte_context=384,
        byte_steps=500,
        byte_lr=3e-3,
        gen_prompts=128,
        gen_new_tokens=64,
    ),
}


PRECISION_ENV = "DRAFTER_KIT_PRECISION"
"""``auto`` (unset): bfloat16 autocast where the CPU multiplies bf16 natively, float32 elsewhere. ``float32``:
float32 on every CPU, as a machine without native bf16 builds it. Either way the spec, so the kit hash, names it."""


def get_profile(profile: str) -> ProfileSpec:
    """The spec of a named profile, under the precision :data:`PRECISION_ENV` asks for.

    Raises:
        DrafterError: The profile is not one of :data:`PROFILES`, or the precision is neither ``auto`` nor
            ``float32``.
    """
    if profile not in PROFILES:
        raise DrafterError(
            f"Unknown tiny-kit profile '{profile}'.",
            expected="one of " + ", ".join(sorted(PROFILES)),
            found=repr(profile),
            fix="use tiny:default/<role> for the embedded default or tiny:test/<role> in tests",
        )
    precision = os.environ.get(PRECISION_ENV, "auto") or "auto"
    if precision not in ("auto", "float32"):
        raise DrafterError(
            f"{PRECISION_ENV} names no precision the tiny kit builds in.",
            expected="auto (bf16 autocast where the CPU multiplies bf16 natively) or float32",
            found=repr(precision),
            fix=f"unset {PRECISION_ENV}, or set it to float32",
        )
    spec = PROFILES[profile]
    return dataclasses.replace(spec, mixed_precision=False) if precision == "float32" else spec


def data_identity() -> dict[str, str | int]:
    """Identity of the packaged text the kit is built from (versions and file sizes; no hashing of 125 MB)."""
    import importlib.metadata
    import importlib.resources


    identity: dict[str, str | int] = {}
    try:
        identity["sharegpt_version"] = importlib.metadata.version(SHAREGPT_PACKAGE)
        package, resource = SHAREGPT_RESOURCE
        with importlib.resources.as_file(importlib.resources.files(package).joinpath(resource)) as path:
            identity["sharegpt_bytes"] = path.stat().st_size
    except (importlib.metadata.PackageNotFoundError, ModuleNotFoundError, FileNotFoundError):
        identity["sharegpt_version"] = "missing"  # the build itself reports the missing package
    return identity


class _NoProse(ast.NodeTransformer):
    """Drops every statement that is a bare string (docstrings, attribute notes); comments never reach the tree."""

    def visit_Expr(self, node: ast.Expr) -> ast.Expr | None:
        return None if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) else node


def code_without_prose(source: str) -> str:
    """The syntax tree of ``source`` without its docstrings and comments, as text: equal for two sources that differ
    in prose and layout alone."""
    return ast.dump(_NoProse().visit(ast.parse(source)))


@functools.cache
def kit_code_digest() -> str:
    """sha256 of :data:`KIT_CODE_MODULES`' code without prose (:func:`code_without_prose`), read from their files
    (nothing is imported: the recipe pulls in torch)."""
    digest = hashlib.sha256()
    for name in KIT_CODE_MODULES:
        origin = importlib.util.find_spec(name).origin
        digest.update(name.encode() + b"\0" + code_without_prose(Path(origin).read_text(encoding="utf-8")).encode())
    return digest.hexdigest()


def kit_hash(profile: str) -> str:
    """Content hash of (profile spec, the kit's code digest, packaged data identity), 12 hex characters.

    Raises:
        DrafterError: Unknown profile.
    """
    spec = get_profile(profile)
    payload = {"spec": dataclasses.asdict(spec), "code": kit_code_digest(), "data": data_identity()}
    blob = json.dumps(payload, sort_keys=True).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:12]
