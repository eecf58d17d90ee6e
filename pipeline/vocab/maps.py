"""Token-string maps between a target and a drafter vocabulary (heterogeneous speculative decoding).

This module owns :class:`VocabMap`: which drafter token ids stand for exactly the same text as a target
token id, found by comparing what every token *means as bytes* (:mod:`pipeline.vocab.tokens`) rather
than how its tokenizer spells it, so GPT-2's 'Ġthe' and SentencePiece's '▁the' both mean b' the' and
match. Both directions hold *absolute* token ids (``drafter_to_target[d]`` is a target id), unlike
EAGLE-3's ``d2t`` offsets (:func:`pipeline.vocab.counting.eagle3_offset_maps`). TLI (Timor et al., ICML
2025, Alg. 4) restricts the drafter to this intersection; SLEM (Alg. 2) needs no map at all. It also
owns the small tokenizer helpers (``encode_text``, ``decode_ids``, and ``as_backend`` re-exported) the
heterogeneous proposers use, so both accept a ``tokenizers.Tokenizer`` or any Hugging Face fast tokenizer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.checksums import fsync_path, sha256_file, temp_sibling, write_json_atomic
from pipeline.errors import DrafterError
from pipeline.vocab.tokens import as_backend, representatives, vocab_hash

# 2: tensors keyed drafter_to_target / target_to_drafter; fingerprints are pipeline.vocab.tokens.vocab_hash.
SCHEMA_VERSION = 3  # 3: the tensors' sha256 in the metadata
TENSORS_FILE = "vocab_map.safetensors"
META_FILE = "vocab_map.json"
_TENSOR_KEYS = ("drafter_to_target", "target_to_drafter")

__all__ = ["VocabMap", "as_backend", "decode_ids", "encode_text"]


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text`` (through the fast backend, so every tokenizer type behaves the same)."""
    return list(as_backend(tokenizer).encode(text, add_special_tokens=add_special_tokens).ids)


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens dropped (they are control symbols, not text)."""
    return as_backend(tokenizer).decode(list(ids), skip_special_tokens=True)


def _id_span(tokenizer: Any) -> int:
    """Number of token ids a tokenizer uses (max id + 1, added tokens included)."""
    vocab = as_backend(tokenizer).get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


@dataclass(frozen=True, eq=False)  # eq on tensors would be ambiguous; compare the tensors explicitly
class VocabMap:
    """A one-to-one map between the target and drafter tokens that mean the same bytes (T∩D).

    Attributes:
        drafter_to_target: (V_drafter,) int64: the absolute target id of each drafter id, or -1 when
            the target has no such token (or another drafter token represents the same bytes, see
            :func:`pipeline.vocab.tokens.representatives`).
        target_to_drafter: (V_target,) int64: the inverse, absolute drafter ids, -1 outside T∩D.
        target_fingerprint: ``vocab_hash`` of the target tokenizer it was built from.
        drafter_fingerprint: ``vocab_hash`` of the drafter tokenizer it was built from.
    """

    drafter_to_target: torch.Tensor
    target_to_drafter: torch.Tensor
    target_fingerprint: str = ""
    drafter_fingerprint: str = ""

    @classmethod
    def build(cls, target_tokenizer: Any, drafter_tokenizer: Any) -> VocabMap:
        """Match the two vocabularies by the bytes their tokens stand for.

        Args:
            target_tokenizer: the target model's tokenizer (``tokenizers.Tokenizer`` or HF fast tokenizer).
            drafter_tokenizer: the drafter model's tokenizer.

        Returns:
            The map; it may be empty (check with ``require_nonempty`` before TLI).
        """
        target_ids = representatives(target_tokenizer)
        drafter_to_target = torch.full((_id_span(drafter_tokenizer),), -1, dtype=torch.int64)
        target_to_drafter = torch.full((_id_span(target_tokenizer),), -1, dtype=torch.int64)
        for meaning, drafter_id in representatives(drafter_tokenizer).items():
            target_id = target_ids.get(meaning)
            if target_id is not None:
                drafter_to_target[drafter_id] = target_id
                target_to_drafter[target_id] = drafter_id
        return cls(
            drafter_to_target=drafter_to_target,
            target_to_drafter=target_to_drafter,
            target_fingerprint=vocab_hash(target_tokenizer),
            drafter_fingerprint=vocab_hash(drafter_tokenizer),
        )

    @property
    def target_vocab_size(self) -> int:
        """Number of target token ids the map covers (max id + 1)."""
        return int(self.target_to_drafter.numel())

    @property
    def drafter_vocab_size(self) -> int:
        """Number of drafter token ids the map covers (max id + 1)."""
        return int(self.drafter_to_target.numel())

    @property
    def intersection_size(self) -> int:
        """|T∩D|: number of matched (drafter, target) pairs."""
        return int((self.drafter_to_target >= 0).sum())

    @property
    def intersection_ids_drafter(self) -> torch.Tensor:
        """Drafter ids in T∩D, ascending; pairs element-wise with ``intersection_ids_target``."""
        return torch.nonzero(self.drafter_to_target >= 0).flatten()

    @property
    def intersection_ids_target(self) -> torch.Tensor:
        """Target ids of ``intersection_ids_drafter``, in the same order."""
        return self.drafter_to_target[self.intersection_ids_drafter]

    def require_nonempty(self) -> None:
        """Raise if T∩D is empty: TLI has nothing to draft from.

        Raises:
            DrafterError: with the fix (use SLEM, which matches strings, not tokens).
        """
        if self.intersection_size == 0:
            raise DrafterError(
                "the target and drafter vocabularies share no token, so TLI cannot draft anything",
                expected="at least one drafter token with the same text as a target token",
                found=f"0 shared tokens (target {self.target_vocab_size}, drafter {self.drafter_vocab_size} ids)",
                fix="use SLEM (string-level exact match), which needs no shared tokens, or another drafter",
            )

    def save(self, directory: str | Path) -> list[Path]:
        """Write ``vocab_map.safetensors`` (both id maps) and ``vocab_map.json`` (metadata) into ``directory``.

        Returns:
            The two files written.
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors_path, meta_path = directory / TENSORS_FILE, directory / META_FILE
        tensors = (self.drafter_to_target.contiguous(), self.target_to_drafter.contiguous())
        tmp = temp_sibling(tensors_path)  # renamed into place whole: a kill never leaves a cut file
        save_file(dict(zip(_TENSOR_KEYS, tensors, strict=True)), str(tmp))
        fsync_path(tmp)
        os.replace(tmp, tensors_path)
        meta = {
            "schema_version": SCHEMA_VERSION,
            "tensors_sha256": sha256_file(tensors_path),
            "target_fingerprint": self.target_fingerprint,
            "drafter_fingerprint": self.drafter_fingerprint,
            "target_vocab_size": self.target_vocab_size,
            "drafter_vocab_size": self.drafter_vocab_size,
            "intersection_size": self.intersection_size,
        }
        write_json_atomic(meta_path, meta)
        return [tensors_path, meta_path]

    @classmethod
    def load(
        cls, directory: str | Path, *, target_tokenizer: Any = None, drafter_tokenizer: Any = None
    ) -> VocabMap:
        """Read a map written by ``save``; if tokenizers are given, refuse one built for others.

        Raises:
            DrafterError: missing files, a different schema, inconsistent sizes, or a fingerprint mismatch.
        """
        from safetensors.torch import load_file

        directory = Path(directory)
        tensors_path, meta_path = directory / TENSORS_FILE, directory / META_FILE
        for path in (tensors_path, meta_path):
            if not path.is_file():
                raise DrafterError(
                    "vocabulary map file is missing",
                    expected=str(path),
                    found="no such file",
                    fix="rebuild it with VocabMap.build(...).save(directory)",
                )
        try:
            meta = json.loads(meta_path.read_text())
        except (UnicodeDecodeError, ValueError) as err:
            meta = {"schema_version": f"unreadable ({err})"}
        if not isinstance(meta, dict) or meta.get("schema_version") != SCHEMA_VERSION:
            raise DrafterError(
                "vocabulary map has an unknown schema version",
                expected=str(SCHEMA_VERSION),
                found=str(meta.get("schema_version") if isinstance(meta, dict) else type(meta).__name__)[:200],
                fix="rebuild the map with this version of the pipeline",
            )
        if (digest := sha256_file(tensors_path)) != meta.get("tensors_sha256"):
            raise DrafterError(
                f"vocabulary map in {directory}: {TENSORS_FILE} is not the file its metadata names",
                expected=f"sha256 {meta.get('tensors_sha256')}",
                found=f"sha256 {digest}",
                fix="rebuild the map with VocabMap.build(...).save(directory); the file was cut or modified",
            )
        tensors = load_file(str(tensors_path))
        for key in _TENSOR_KEYS:
            tensor = tensors.get(key)
            if tensor is None or tensor.dtype != torch.int64 or tensor.dim() != 1:
                raise DrafterError(
                    f"vocabulary map in {directory} has a malformed '{key}' tensor",
                    expected=f"'{key}': a 1-D int64 tensor",
                    found="missing" if tensor is None else f"{tensor.dtype}, shape {tuple(tensor.shape)}",
                    fix="rebuild the map with VocabMap.build(...).save(directory)",
                )
        vocab_map = cls(
            drafter_to_target=tensors["drafter_to_target"],
            target_to_drafter=tensors["target_to_drafter"],
            target_fingerprint=meta["target_fingerprint"],
            drafter_fingerprint=meta["drafter_fingerprint"],
        )
        found = (vocab_map.target_vocab_size, vocab_map.drafter_vocab_size, vocab_map.intersection_size)
        wanted = (meta["target_vocab_size"], meta["drafter_vocab_size"], meta["intersection_size"])
        if found != wanted:
            raise DrafterError(
                f"vocabulary map in {directory} is inconsistent with its metadata",
                expected=f"(target, drafter, intersection) sizes {wanted}",
                found=str(found),
                fix="rebuild the map; the files were modified or mixed from two builds",
            )
        for side, tokenizer, stored in (
            ("target", target_tokenizer, vocab_map.target_fingerprint),
            ("drafter", drafter_tokenizer, vocab_map.drafter_fingerprint),
        ):
            if tokenizer is not None and vocab_hash(tokenizer) != stored:
                raise DrafterError(
                    f"vocabulary map in {directory} was built for a different {side} tokenizer",
                    expected=f"{side} vocabulary fingerprint {stored}",
                    found=vocab_hash(tokenizer),
                    fix=f"rebuild the map with VocabMap.build for this {side} tokenizer",
                )
        return vocab_map
