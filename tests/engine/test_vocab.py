"""VocabMap: token-string intersection of two real tokenizers trained here on a few KB of text.

The target is GPT-2-style byte-level BPE ('Ġthe', 'Ã©'); the drafter is SentencePiece-style Metaspace
BPE with byte fallback ('▁the', 'é', '<0xC3>'). Correctness is checked against an oracle that uses only
each tokenizer's own decoder, not the map's spelling rules.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.errors import DrafterError
from pipeline.vocab.maps import VocabMap, vocab_fingerprint

_WORDS = (
    "the cat sat on mat and dog ran to park while bird sang in tree near river the café served "
    "naïve résumé über crème brûlée déjà vu to the people of the town who said hello world again "
    "speculative decoding lets a small model draft tokens that the large model verifies in one pass"
).split()


def corpus(seed: int = 0, sentences: int = 300) -> list[str]:
    """About 15 KB of deterministic pseudo-English with accented words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in range(sentences)]


def byte_level_tokenizer(
    vocab_size: int = 400, specials: tuple[str, ...] = ("<|endoftext|>", "</s>")
) -> Tokenizer:
    """GPT-2-style byte-level BPE."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(0), trainer)
    return tokenizer


def metaspace_tokenizer(vocab_size: int = 500) -> Tokenizer:
    """SentencePiece/Llama-style BPE: '▁' space sign, '<0xNN>' byte fallback as ordinary vocab entries."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens], show_progress=False
    )
    tokenizer.train_from_iterator(corpus(1), trainer)
    # The trainer registers the byte tokens as *special* added tokens; in Llama they are plain vocab
    # entries (so decoding keeps them), which is what the map must handle.
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in set(byte_tokens)]
    return Tokenizer.from_str(json.dumps(spec))


def greek_tokenizer() -> Tokenizer:
    """A tokenizer whose alphabet (Greek letters, no bytes, no space sign) shares nothing with the others."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    rng = random.Random(2)
    words = ["αβγ", "δεζ", "ηθι", "κλμ", "νξο", "πρσ", "τυφ", "χψω"]
    text = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(200)]
    tokenizer.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"], show_progress=False)
    )
    return tokenizer


@pytest.fixture(scope="module")
def target_tok() -> Tokenizer:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def drafter_tok() -> Tokenizer:
    return metaspace_tokenizer()


@pytest.fixture(scope="module")
def vocab_map(target_tok: Tokenizer, drafter_tok: Tokenizer) -> VocabMap:
    return VocabMap.build(target_tok, drafter_tok)


def _text_of(tokenizer: Tokenizer, anchor: int, token_id: int) -> str | None:
    """What ``token_id`` adds after an anchor token, by the tokenizer's own decoder (None: special or
    a partial UTF-8 sequence, which decodes to U+FFFD)."""
    if tokenizer.get_added_tokens_decoder().get(token_id, None) is not None:
        added = tokenizer.get_added_tokens_decoder()[token_id]
        if added.special:
            return None
    before = tokenizer.decode([anchor])
    after = tokenizer.decode([anchor, token_id], skip_special_tokens=False)
    if "\ufffd" in after or not after.startswith(before):
        return None
    return after[len(before) :]


def test_space_signs_and_non_ascii_are_matched(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    pairs = {
        "Ġthe": "▁the",  # space sign: GPT-2 'Ġ' and SentencePiece '▁' both mean b' '
        "e": "e",
        "Ġ": "▁",
        "Ã©": "é",  # byte-level spelling of the two UTF-8 bytes of 'é'
        "Ã": "<0xC3>",  # one byte: byte-level character vs byte-fallback token
    }
    for target_token, drafter_token in pairs.items():
        target_id, drafter_id = target_tok.token_to_id(target_token), drafter_tok.token_to_id(drafter_token)
        assert target_id is not None and drafter_id is not None, (target_token, drafter_token)
        assert int(vocab_map.d2t[drafter_id]) == target_id, (target_token, drafter_token)
        assert int(vocab_map.t2d[target_id]) == drafter_id, (target_token, drafter_token)
    # '<0x65>' means b'e' like the regular 'e': the regular token represents it, the other maps to -1.
    if drafter_tok.token_to_id("e") is not None:
        assert int(vocab_map.d2t[drafter_tok.token_to_id("<0x65>")]) == -1


def test_intersection_agrees_with_each_tokenizers_decoder(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    """Every matched pair decodes to the same text, and no decodable shared text is left unmatched."""
    assert 100 < vocab_map.intersection_size < min(vocab_map.target_vocab_size, vocab_map.drafter_vocab_size)
    inter_d, inter_t = vocab_map.intersection_ids_drafter, vocab_map.intersection_ids_target
    assert inter_d.shape == inter_t.shape == (vocab_map.intersection_size,)
    assert torch.equal(vocab_map.t2d[inter_t], inter_d)  # one-to-one
    target_anchor, drafter_anchor = target_tok.token_to_id("a"), drafter_tok.token_to_id("a")
    checked = 0
    for d, t in zip(inter_d.tolist(), inter_t.tolist(), strict=True):
        target_text, drafter_text = (
            _text_of(target_tok, target_anchor, t),
            _text_of(drafter_tok, drafter_anchor, d),
        )
        if target_text is not None and drafter_text is not None:
            assert target_text == drafter_text, (target_tok.id_to_token(t), drafter_tok.id_to_token(d))
            checked += 1
    assert checked > 100
    target_texts = {}
    for t in range(target_tok.get_vocab_size()):
        text = _text_of(target_tok, target_anchor, t)
        if text:
            target_texts[text] = t
    matched_texts = {_text_of(drafter_tok, drafter_anchor, d) for d in inter_d.tolist()}
    for d in range(drafter_tok.get_vocab_size()):
        text = _text_of(drafter_tok, drafter_anchor, d)
        if text and text in target_texts:
            # Unmatched only if another drafter token (e.g. 'A' for '<0x41>') already stands for it.
            assert int(vocab_map.d2t[d]) == target_texts[text] or text in matched_texts, (
                drafter_tok.id_to_token(d)
            )


def test_special_tokens_match_only_specials_with_the_same_content(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    assert int(vocab_map.d2t[drafter_tok.token_to_id("</s>")]) == target_tok.token_to_id("</s>")
    assert int(vocab_map.d2t[drafter_tok.token_to_id("<s>")]) == -1
    assert int(vocab_map.d2t[drafter_tok.token_to_id("<unk>")]) == -1
    assert int(vocab_map.t2d[target_tok.token_to_id("<|endoftext|>")]) == -1
    # A special on one side never matches the same characters as plain text on the other: a
    # byte-level target has no token spelled '</s>', and a drafter that learned '</s>' as text
    # would map to nothing.
    plain = Tokenizer(models.WordLevel({"</s>": 0, "x": 1}, unk_token="x"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    assert int(VocabMap.build(target_tok, plain).d2t[0]) == -1


def test_hugging_face_fast_tokenizer_gives_the_same_map(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = VocabMap.build(
        PreTrainedTokenizerFast(tokenizer_object=target_tok),
        PreTrainedTokenizerFast(tokenizer_object=drafter_tok),
    )
    assert torch.equal(wrapped.d2t, vocab_map.d2t) and torch.equal(wrapped.t2d, vocab_map.t2d)


def test_disjoint_alphabets_give_an_empty_map_that_tli_refuses(target_tok: Tokenizer) -> None:
    empty = VocabMap.build(target_tok, greek_tokenizer())
    assert empty.intersection_size == 0
    assert empty.intersection_ids_drafter.numel() == 0
    with pytest.raises(DrafterError, match="SLEM"):
        empty.require_nonempty()


def test_nonempty_map_passes_require_nonempty(vocab_map: VocabMap) -> None:
    vocab_map.require_nonempty()


def test_save_load_round_trip(
    tmp_path, target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    written = vocab_map.save(tmp_path / "map")
    assert sorted(p.name for p in written) == ["vocab_map.json", "vocab_map.safetensors"]
    loaded = VocabMap.load(tmp_path / "map", target_tokenizer=target_tok, drafter_tokenizer=drafter_tok)
    assert torch.equal(loaded.d2t, vocab_map.d2t) and torch.equal(loaded.t2d, vocab_map.t2d)
    assert loaded.target_fingerprint == vocab_fingerprint(target_tok)
    assert loaded.intersection_size == vocab_map.intersection_size
    meta = json.loads((tmp_path / "map" / "vocab_map.json").read_text())
    assert meta["intersection_size"] == vocab_map.intersection_size


def test_load_refuses_other_tokenizers_and_missing_files(
    tmp_path, target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    vocab_map.save(tmp_path)
    with pytest.raises(DrafterError, match="different target tokenizer"):
        VocabMap.load(tmp_path, target_tokenizer=drafter_tok)
    with pytest.raises(DrafterError, match="different drafter tokenizer"):
        VocabMap.load(tmp_path, drafter_tokenizer=target_tok)
    (tmp_path / "vocab_map.safetensors").unlink()
    with pytest.raises(DrafterError, match="missing"):
        VocabMap.load(tmp_path)


def test_wordpiece_vocabulary_is_refused_with_a_pointer_to_slem(target_tok: Tokenizer) -> None:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "the": 1, "##s": 2}, unk_token="[UNK]"))
    with pytest.raises(DrafterError, match="SLEM"):
        VocabMap.build(target_tok, wordpiece)
