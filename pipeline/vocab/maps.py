"""Token-string maps between a target and a drafter vocabulary (heterogeneous speculative decoding).

This module owns :class:`VocabMap`: which drafter token ids stand for exactly the same text as a target
token id, found by comparing what every token *means as bytes* rather than how its tokenizer spells it.
GPT-2 byte-level spellings ('Ġthe', 'Ã©') are mapped back through the byte↔unicode table, SentencePiece
/ Metaspace spellings ('▁the') turn their space sign into a space, and byte-fallback tokens ('<0xC3>')
become the one byte they stand for, so 'Ġthe' and '▁the' both mean b' the' and match. TLI (Timor et
al., ICML 2025, Alg. 4) restricts the drafter to this intersection; SLEM (Alg. 2) needs no map at all.
It also owns the small tokenizer helpers (``as_backend``, ``encode_text``, ``decode_ids``) the
heterogeneous proposers use, so both accept a ``tokenizers.Tokenizer`` or any Hugging Face fast tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import DrafterError

SCHEMA_VERSION = 1
TENSORS_FILE = "vocab_map.safetensors"
META_FILE = "vocab_map.json"

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# When several tokens of one tokenizer mean the same bytes (a byte-fallback '<0x41>' and a regular 'A'),
# the one the tokenizer really emits for that text represents it: regular tokens before added ones
# before byte-fallback ones, then the lowest id.
_RANK_REGULAR, _RANK_ADDED, _RANK_BYTE = 0, 1, 2


def as_backend(tokenizer: Any) -> Any:
    """Return the ``tokenizers.Tokenizer`` behind a tokenizer.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a Hugging Face fast tokenizer (``backend_tokenizer``).

    Raises:
        DrafterError: for a slow (pure-Python) tokenizer, whose vocabulary semantics we cannot read.
    """
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return backend
    raise DrafterError(
        "heterogeneous-vocabulary decoding needs a fast tokenizer",
        expected="a tokenizers.Tokenizer or a transformers fast tokenizer with .backend_tokenizer",
        found=type(tokenizer).__name__,
        fix="load the tokenizer with AutoTokenizer.from_pretrained(..., use_fast=True) or from tokenizer.json",
    )


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text`` (through the fast backend, so every tokenizer type behaves the same)."""
    return list(as_backend(tokenizer).encode(text, add_special_tokens=add_special_tokens).ids)


def decode_ids(tokenizer: Any, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens dropped (they are control symbols, not text)."""
    return as_backend(tokenizer).decode(list(ids), skip_special_tokens=True)


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's (token, id) pairs, added tokens included."""
    vocab = as_backend(tokenizer).get_vocab(with_added_tokens=True)
    payload = json.dumps(sorted(vocab.items(), key=lambda item: item[1]), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (bytes that print as themselves keep their
    character; the rest are shifted past 255 so no byte maps to whitespace or a control character)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {byte: chr(byte) for byte in printable}
    shift = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shift)
            shift += 1
    return table


_UNICODE_TO_BYTE = {char: byte for byte, char in _bytes_to_unicode().items()}


def _components(node: Any) -> list[dict[str, Any]]:
    """Flatten a tokenizer.json pre-tokenizer/decoder/normalizer (Sequences included) into its parts."""
    if not isinstance(node, dict):
        return []
    parts = [node]
    for key in ("pretokenizers", "decoders", "normalizers"):
        for child in node.get(key) or []:
            parts.extend(_components(child))
    return parts


@dataclass(frozen=True)
class _Spelling:
    """How one tokenizer spells text in its vocabulary."""

    byte_level: bool
    space_sign: str | None
    byte_fallback: bool

    @classmethod
    def of(cls, backend: Any) -> _Spelling:
        spec = json.loads(backend.to_str())
        model_type = (spec.get("model") or {}).get("type")
        if model_type == "WordPiece":
            # A WordPiece token's text depends on its neighbours ('the' gets a space unless the next
            # token is a '##' continuation), so no per-token byte meaning exists to match on.
            raise DrafterError(
                "a WordPiece (BERT-style) vocabulary cannot be matched token by token",
                expected="a BPE or Unigram tokenizer (byte-level, Metaspace/SentencePiece or plain)",
                found=f"model type {model_type}",
                fix="use SLEM (string-level exact match), which needs no token map",
            )
        parts = [
            part for key in ("normalizer", "pre_tokenizer", "decoder") for part in _components(spec.get(key))
        ]
        byte_level = any(part.get("type") == "ByteLevel" for part in parts)
        space_sign = None
        for part in parts:
            if part.get("type") == "Metaspace":
                space_sign = part.get("replacement", "▁")
            elif part.get("type") == "Replace" and part.get("content") == " ":
                # Llama-2-style tokenizer.json: a decoder Replace('▁' → ' ') instead of Metaspace.
                pattern = (part.get("pattern") or {}).get("String")
                if isinstance(pattern, str) and len(pattern) == 1:
                    space_sign = pattern
            elif part.get("type") == "Replace" and (part.get("pattern") or {}).get("String") == " ":
                space_sign = space_sign or part.get("content")
        byte_fallback = bool((spec.get("model") or {}).get("byte_fallback")) or any(
            part.get("type") == "ByteFallback" for part in parts
        )
        return cls(byte_level=byte_level, space_sign=space_sign, byte_fallback=byte_fallback)

    def meaning(self, token: str) -> tuple[bytes, int] | None:
        """The bytes a vocabulary token stands for and its rank, or None if it cannot be read."""
        if self.byte_fallback and (match := _BYTE_FALLBACK.match(token)):
            return bytes([int(match.group(1), 16)]), _RANK_BYTE
        if self.byte_level:
            if all(char in _UNICODE_TO_BYTE for char in token):
                return bytes(_UNICODE_TO_BYTE[char] for char in token), _RANK_REGULAR
            return None
        if self.space_sign:
            token = token.replace(self.space_sign, " ")
        return token.encode("utf-8"), _RANK_REGULAR


def _meanings(tokenizer: Any) -> tuple[dict[tuple[str, bytes], int], int]:
    """Map each meaning ('text' bytes or 'special' content) to its representative id; and vocab size.

    Special tokens are matched by exact content, and only with another special token: they are control
    symbols (EOS, BOS, chat markers) whose bytes do not occur in text, so '</s>' on one side and the
    text '</s>' on the other must not match, while two '<|endoftext|>' specials do.
    """
    backend = as_backend(tokenizer)
    spelling = _Spelling.of(backend)
    added = backend.get_added_tokens_decoder()
    vocab = backend.get_vocab(with_added_tokens=True)
    best: dict[tuple[str, bytes], tuple[int, int]] = {}
    for token, token_id in vocab.items():
        added_token = added.get(token_id)
        if spelling.byte_fallback and _BYTE_FALLBACK.match(token):
            meaning = spelling.meaning(token)
            key_kind = "text"
        elif added_token is not None and added_token.special:
            meaning, key_kind = (token.encode("utf-8"), _RANK_REGULAR), "special"
        elif added_token is not None:
            # Non-special added tokens are split out of raw text literally, before pre-tokenization.
            meaning, key_kind = (token.encode("utf-8"), _RANK_ADDED), "text"
        else:
            meaning, key_kind = spelling.meaning(token), "text"
        if meaning is None or not meaning[0]:
            continue
        key = (key_kind, meaning[0])
        candidate = (meaning[1], token_id)
        if key not in best or candidate < best[key]:
            best[key] = candidate
    size = max(vocab.values()) + 1 if vocab else 0
    return {key: token_id for key, (_, token_id) in best.items()}, size


@dataclass(frozen=True, eq=False)  # eq on tensors would be ambiguous; compare d2t/t2d explicitly
class VocabMap:
    """A one-to-one map between the target and drafter tokens that mean the same bytes (T∩D).

    Attributes:
        d2t: (V_drafter,) int64: target id of each drafter id, or -1 when the target has no such token
            (or another drafter token represents the same bytes, see ``_RANK_*``).
        t2d: (V_target,) int64: the inverse, -1 outside the intersection.
        target_fingerprint: ``vocab_fingerprint`` of the target tokenizer it was built from.
        drafter_fingerprint: ``vocab_fingerprint`` of the drafter tokenizer it was built from.
    """

    d2t: torch.Tensor
    t2d: torch.Tensor
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
        target_meanings, target_size = _meanings(target_tokenizer)
        drafter_meanings, drafter_size = _meanings(drafter_tokenizer)
        d2t = torch.full((drafter_size,), -1, dtype=torch.int64)
        t2d = torch.full((target_size,), -1, dtype=torch.int64)
        for key, drafter_id in drafter_meanings.items():
            target_id = target_meanings.get(key)
            if target_id is not None:
                d2t[drafter_id] = target_id
                t2d[target_id] = drafter_id
        return cls(
            d2t=d2t,
            t2d=t2d,
            target_fingerprint=vocab_fingerprint(target_tokenizer),
            drafter_fingerprint=vocab_fingerprint(drafter_tokenizer),
        )

    @property
    def target_vocab_size(self) -> int:
        """Number of target token ids the map covers (max id + 1)."""
        return int(self.t2d.numel())

    @property
    def drafter_vocab_size(self) -> int:
        """Number of drafter token ids the map covers (max id + 1)."""
        return int(self.d2t.numel())

    @property
    def intersection_size(self) -> int:
        """|T∩D|: number of matched (drafter, target) pairs."""
        return int((self.d2t >= 0).sum())

    @property
    def intersection_ids_drafter(self) -> torch.Tensor:
        """Drafter ids in T∩D, ascending; pairs element-wise with ``intersection_ids_target``."""
        return torch.nonzero(self.d2t >= 0).flatten()

    @property
    def intersection_ids_target(self) -> torch.Tensor:
        """Target ids of ``intersection_ids_drafter``, in the same order."""
        return self.d2t[self.intersection_ids_drafter]

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
        """Write ``vocab_map.safetensors`` (d2t, t2d) and ``vocab_map.json`` (metadata) into ``directory``.

        Returns:
            The two files written.
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors_path, meta_path = directory / TENSORS_FILE, directory / META_FILE
        save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous()}, str(tensors_path))
        meta = {
            "schema_version": SCHEMA_VERSION,
            "target_fingerprint": self.target_fingerprint,
            "drafter_fingerprint": self.drafter_fingerprint,
            "target_vocab_size": self.target_vocab_size,
            "drafter_vocab_size": self.drafter_vocab_size,
            "intersection_size": self.intersection_size,
        }
        meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
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
        meta = json.loads(meta_path.read_text())
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise DrafterError(
                "vocabulary map has an unknown schema version",
                expected=str(SCHEMA_VERSION),
                found=str(meta.get("schema_version")),
                fix="rebuild the map with this version of the pipeline",
            )
        tensors = load_file(str(tensors_path))
        for key in ("d2t", "t2d"):
            tensor = tensors.get(key)
            if tensor is None or tensor.dtype != torch.int64 or tensor.dim() != 1:
                raise DrafterError(
                    f"vocabulary map in {directory} has a malformed '{key}' tensor",
                    expected=f"'{key}': a 1-D int64 tensor",
                    found="missing" if tensor is None else f"{tensor.dtype}, shape {tuple(tensor.shape)}",
                    fix="rebuild the map with VocabMap.build(...).save(directory)",
                )
        vocab_map = cls(
            d2t=tensors["d2t"],
            t2d=tensors["t2d"],
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
            if tokenizer is not None and vocab_fingerprint(tokenizer) != stored:
                raise DrafterError(
                    f"vocabulary map in {directory} was built for a different {side} tokenizer",
                    expected=f"{side} vocabulary fingerprint {stored}",
                    found=vocab_fingerprint(tokenizer),
                    fix=f"rebuild the map with VocabMap.build for this {side} tokenizer",
                )
        return vocab_map
