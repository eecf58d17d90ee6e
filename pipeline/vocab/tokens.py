"""What each vocabulary token means as bytes, and the one hash that identifies a vocabulary.

Tokenizers spell the same text differently: GPT-2 byte-level BPEs write every byte as a printable
stand-in character ('Ġthe' is b' the', 'Ċ' is b'\\n', 'Ã©' is the two UTF-8 bytes of 'é'),
SentencePiece / Metaspace BPEs write a space as '▁' ('▁the' is b' the'), and byte-fallback
vocabularies hold one token per byte ('<0x0A>' is b'\\n'). This module reads a tokenizer's
``tokenizer.json`` to learn which scheme it uses and gives every token its :class:`Meaning`: the bytes
it stands for, or, for a special (control) token, its content, which only ever matches another special.
Cross-vocabulary code (:class:`~pipeline.vocab.maps.VocabMap` for TLI, the tiny kit's aligned
distillation in :mod:`pipeline.tiny.crossvocab`) matches tokens by these meanings. It also owns
:func:`vocab_hash`, stamped as ``vocab_hash`` in every artifact's target fingerprint and on every
saved ``VocabMap``: equal hashes mean the same token ↔ id table.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.errors import DrafterError

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# When several tokens of one tokenizer mean the same bytes (a byte-fallback '<0x41>' and a regular 'A'),
# the one the tokenizer really emits for that text represents it: added tokens (split out of the text before the
# model sees it, so their content never reaches a regular token: Phi-2's whitespace runs) before regular ones
# before byte-fallback ones, then the lowest id.
_RANK_ADDED, _RANK_REGULAR, _RANK_BYTE = 0, 1, 2


@dataclass(frozen=True)
class Meaning:
    """What one vocabulary token stands for.

    Attributes:
        kind: ``"text"`` (the token decodes to ``data``) or ``"special"`` (a control symbol such as
            EOS or a chat marker, identified by its content ``data``; it never matches text).
        data: The bytes of the text, or the UTF-8 content of the special token.
    """

    kind: Literal["text", "special"]
    data: bytes


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
        "reading a vocabulary needs a fast tokenizer",
        expected="a tokenizers.Tokenizer or a transformers fast tokenizer with .backend_tokenizer",
        found=type(tokenizer).__name__,
        fix="load the tokenizer with AutoTokenizer.from_pretrained(..., use_fast=True) or from tokenizer.json",
    )


def vocab_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's token ↔ id table, added tokens and their special flags included.

    The one vocabulary hash: the artifact fingerprint's ``vocab_hash`` and ``VocabMap``'s fingerprints.
    A Hugging Face fast tokenizer and its ``backend_tokenizer`` hash alike.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a Hugging Face tokenizer (a slow one, which only
            remote code may bring, is read through ``get_vocab`` and ``all_special_ids``).

    Returns:
        64 hex digits; equal hashes mean token ids are interchangeable between the two tokenizers.
    """
    try:
        backend = as_backend(tokenizer)
    except DrafterError:
        vocab, special = tokenizer.get_vocab(), sorted(set(tokenizer.all_special_ids))
    else:
        vocab = backend.get_vocab(with_added_tokens=True)
        special = sorted(idx for idx, added in backend.get_added_tokens_decoder().items() if added.special)
    payload = json.dumps(
        {"vocab": sorted(vocab.items(), key=lambda item: item[1]), "special_ids": special}, ensure_ascii=False
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def bytes_to_unicode() -> dict[int, str]:
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


_UNICODE_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}


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
class Spelling:
    """How one tokenizer spells text in its vocabulary.

    Attributes:
        byte_level: GPT-2 byte-level: every character of a token is a stand-in for one byte.
        space_sign: The character written for a space ('▁' for Metaspace/SentencePiece), or None.
        byte_fallback: ``<0xNN>`` tokens stand for the single byte ``NN``.
    """

    byte_level: bool
    space_sign: str | None
    byte_fallback: bool

    @classmethod
    def of(cls, tokenizer: Any) -> Spelling:
        """Read the spelling scheme from the tokenizer's model, normalizer, pre-tokenizer and decoder.

        Raises:
            DrafterError: for a WordPiece vocabulary, whose tokens have no text of their own.
        """
        spec = json.loads(as_backend(tokenizer).to_str())
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

    def text_bytes(self, token: str) -> tuple[bytes, int] | None:
        """The bytes a regular vocabulary token stands for and its rank, or None if it cannot be read."""
        if self.byte_fallback and (match := _BYTE_FALLBACK.match(token)):
            return bytes([int(match.group(1), 16)]), _RANK_BYTE
        if self.byte_level:
            if all(char in _UNICODE_TO_BYTE for char in token):
                return bytes(_UNICODE_TO_BYTE[char] for char in token), _RANK_REGULAR
            return None
        if self.space_sign:
            token = token.replace(self.space_sign, " ")
        return token.encode("utf-8"), _RANK_REGULAR


def _read(tokenizer: Any) -> Iterator[tuple[int, Meaning, int]]:
    """Yield ``(token_id, meaning, rank)`` for every token with a non-empty meaning.

    Special tokens mean their exact content, as kind ``"special"``: they are control symbols (EOS, BOS,
    chat markers) whose bytes do not occur in text, so '</s>' on one side and the text '</s>' on the
    other must not match, while two '<|endoftext|>' specials do. Non-special added tokens are split out
    of raw text literally, before pre-tokenization, so they mean their content as text.
    """
    backend = as_backend(tokenizer)
    spelling = Spelling.of(backend)
    added = backend.get_added_tokens_decoder()
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        added_token = added.get(token_id)
        if spelling.byte_fallback and _BYTE_FALLBACK.match(token):
            read, kind = spelling.text_bytes(token), "text"
        elif added_token is not None and added_token.special:
            read, kind = (token.encode("utf-8"), _RANK_REGULAR), "special"
        elif added_token is not None:
            read, kind = (token.encode("utf-8"), _RANK_ADDED), "text"
        else:
            read, kind = spelling.text_bytes(token), "text"
        if read is not None and read[0]:
            yield token_id, Meaning(kind, read[0]), read[1]


def token_meanings(tokenizer: Any) -> dict[int, Meaning]:
    """The meaning of every token id that has one (undecodable or empty tokens are left out).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a Hugging Face fast tokenizer.

    Raises:
        DrafterError: for a slow tokenizer or a WordPiece vocabulary.
    """
    return {token_id: meaning for token_id, meaning, _ in _read(tokenizer)}


def representatives(tokenizer: Any) -> dict[Meaning, int]:
    """One token id per meaning: the token the tokenizer emits for that text.

    Several tokens can mean the same bytes (byte-fallback '<0x41>' and a learnt 'A'; a non-special added token
    and a regular one); added tokens win over regular ones (the tokenizer splits them out of the text first),
    regular over byte-fallback ones, then the lowest id wins.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a Hugging Face fast tokenizer.

    Raises:
        DrafterError: for a slow tokenizer or a WordPiece vocabulary.
    """
    best: dict[Meaning, tuple[int, int]] = {}
    for token_id, meaning, rank in _read(tokenizer):
        if meaning not in best or (rank, token_id) < best[meaning]:
            best[meaning] = (rank, token_id)
    return {meaning: token_id for meaning, (_, token_id) in best.items()}


def stop_ids(tokenizer: Any, model: Any) -> list[int]:
    """Where an answer ends: the tokenizer's end-of-sequence id(s) and those of the model's generation config (an
    instruct model's end-of-turn token, e.g. Llama-3's ``<|eot_id|>`` or Gemma's ``<end_of_turn>``, is often only
    there). Passing the tokenizer's alone to ``generate`` replaced the config's list, and answers ran past the end of
    their turn to ``max_new_tokens``, every extra token marked as the assistant's."""
    config = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [] if config is None else ([config] if isinstance(config, int) else list(config))
    return sorted({*eos_ids(tokenizer), *(int(e) for e in extra)})


def eos_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's end-of-sequence id(s), which every draft shortlist must contain.

    Raises:
        DrafterError: The tokenizer has none.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if not ids:
        raise DrafterError("The target's tokenizer has no EOS token, which every draft shortlist must keep.",
                           expected="tokenizer.eos_token_id set", found="None",
                           fix="Use a tokenizer with an end-of-sequence token.")
    return ids
