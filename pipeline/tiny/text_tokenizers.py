"""The two byte-complete BPE tokenizers of the tiny-model kit, trained with the ``tokenizers`` library.

Two deliberately different schemes, so heterogeneous-vocabulary code paths run on real differences:

* ``"bytelevel"`` (GPT-2 / Qwen style): ByteLevel pre-tokenizer and decoder, so a leading space shows
  as ``'Ġ'`` and every byte has a printable stand-in symbol; ChatML-style chat template
  (``<|im_start|>role\\n…<|im_end|>``) whose turn end ``<|im_end|>`` is the eos token.
* ``"metaspace"`` (Llama-2 / SentencePiece style): Metaspace pre-tokenizer, so a space shows as
  ``'▁'``, with ``byte_fallback``: any character outside the learnt alphabet is spelt as ``<0xNN>``
  UTF-8 byte tokens, which keeps it byte-complete. Zephyr-style template (``<|user|>\\n…</s>``) whose
  turn end ``</s>`` is the eos token. ``prepend_scheme="never"`` (no space is invented before the
  first word) keeps ``decode(encode(s)) == s`` exact; the one text that does not round-trip is a
  literal ``'▁'`` (U+2581), which decodes as a space, as in every SentencePiece tokenizer.

A third, :func:`byte_tokenizer`, is not trained: its vocabulary is the 256 single bytes (a ByteLevel
BPE with no merges) plus the specials and chat template of a scheme, for the byte-level drafter that
string-level rejection sampling (:mod:`pipeline.engine.slrs`) needs.

None normalises text, and all save as Hugging Face fast tokenizers that
``AutoTokenizer.from_pretrained`` loads, chat template included.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.vocab.tokens import bytes_to_unicode

SCHEMES = ("bytelevel", "metaspace")

_BYTELEVEL_SPECIALS = {
    "bos_token": "<|endoftext|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|pad|>",
}
_BYTELEVEL_EXTRA = ["<|im_start|>"]
_BYTELEVEL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_METASPACE_SPECIALS = {
    "unk_token": "<unk>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
}
_METASPACE_EXTRA = ["<|system|>", "<|user|>", "<|assistant|>"]
_METASPACE_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _specials(scheme: str) -> tuple[dict[str, str], list[str], str]:
    if scheme == "bytelevel":
        return _BYTELEVEL_SPECIALS, _BYTELEVEL_EXTRA, _BYTELEVEL_TEMPLATE
    if scheme == "metaspace":
        return _METASPACE_SPECIALS, _METASPACE_EXTRA, _METASPACE_TEMPLATE
    raise ValueError(f"unknown tokenizer scheme {scheme!r}; expected one of {SCHEMES}")


def train_tokenizer(scheme: str, texts: Iterable[str], vocab_size: int, *, limit_alphabet: int = 160) -> Any:
    """Train one byte-complete BPE tokenizer and wrap it as a Hugging Face fast tokenizer.

    Args:
        scheme: ``"bytelevel"`` ('Ġ' space sign) or ``"metaspace"`` ('▁' space sign, byte fallback).
        texts: Training text (message contents, without chat markup).
        vocab_size: Total vocabulary size, special and byte tokens included.
        limit_alphabet: Metaspace only: characters kept as symbols; rarer ones fall back to bytes.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with special tokens and a chat template set.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    named, extra, template = _specials(scheme)
    specials = list(dict.fromkeys([*named.values(), *extra]))
    texts = list(texts)
    if scheme == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        tok = _train_metaspace(texts, vocab_size, specials, limit_alphabet)
    return _wrap(tok, named, extra, template)


def byte_tokenizer(scheme: str = "bytelevel") -> Any:
    """A tokenizer whose text tokens are the 256 single bytes, with ``scheme``'s specials and template.

    A ByteLevel pre-tokenizer and decoder around a BPE with an empty merge list: every byte of the UTF-8
    text is one token, so ``decode(encode(s)) == s`` for any text. Specials come first (ids 0, 1, …, in
    the order the trained ``scheme`` tokenizer gives them), then byte ``b`` at id ``len(specials) + b``.

    Args:
        scheme: Whose special tokens and chat template to copy (see :data:`SCHEMES`).

    Returns:
        A ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers


    named, extra, template = _specials(scheme)
    specials = list(dict.fromkeys([*named.values(), *extra]))
    symbols = bytes_to_unicode()
    vocab = {token: i for i, token in enumerate([*specials, *(symbols[b] for b in range(256))])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges it could not change the tokens, only cost time.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return _wrap(tok, named, extra, template)


def _train_metaspace(texts: list[str], vocab_size: int, specials: list[str], limit_alphabet: int) -> Any:
    """Train a Metaspace BPE, then rebuild it with the 256 ``<0xNN>`` byte tokens in its model vocab.

    The byte tokens must live in the BPE model's vocabulary (not as added tokens), or the text
    ``"<0x41>"`` would be matched as a token and decoding with ``skip_special_tokens`` would drop bytes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    draft = Tokenizer(models.BPE())
    draft.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials) - len(byte_tokens), show_progress=False
    )
    draft.train_from_iterator(_keep_alphabet(texts, limit_alphabet), trainer=trainer)
    learnt = draft.get_vocab()
    merges = draft.model.get_merges() if hasattr(draft.model, "get_merges") else _merges_of(draft)
    ordered = [*specials, *byte_tokens, *sorted(learnt, key=learnt.__getitem__)]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(ordered))}
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    return tok


def _keep_alphabet(texts: list[str], size: int) -> list[str]:
    """Delete characters outside the ``size`` most frequent ones (ties broken by code point).

    ``BpeTrainer(limit_alphabet=...)`` breaks frequency ties in hash order, so two builds could learn
    different alphabets; choosing the alphabet here keeps the build deterministic. Deleted characters
    are later spelt with byte tokens.
    """
    counts = Counter(ch for text in texts for ch in text)
    keep = {ch for ch, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]}
    drop = {ord(ch): None for ch in counts if ch not in keep}
    return [text.translate(drop) for text in texts] if drop else texts


def _merges_of(tok: Any) -> list[tuple[str, str]]:
    """Read merges from the serialised model (``tokenizers`` versions without ``get_merges``)."""
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def _wrap(tok: Any, named: dict[str, str], extra: list[str], template: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        clean_up_tokenization_spaces=False,  # cleanup would rewrite " ." and break round trips
        model_max_length=1 << 16,
        additional_special_tokens=extra,
        **named,
    )
    fast.chat_template = template
    return fast


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Save a tokenizer with ``save_pretrained`` so ``AutoTokenizer.from_pretrained`` loads it."""
    tokenizer.save_pretrained(str(out_dir))
