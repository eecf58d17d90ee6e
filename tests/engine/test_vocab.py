"""Token byte meanings, the one vocabulary hash, and VocabMap (the token intersection T∩D).

Two kinds of tokenizers: hand-written ones whose every id is known, so the exact map can be asserted
id by id; and real ones trained here on a few KB of text (:mod:`tests.engine.toy_tokenizers`): the
target GPT-2-style byte-level BPE ('Ġthe', 'Ã©'), the drafter SentencePiece-style Metaspace BPE with
byte fallback ('▁the', 'é', '<0xC3>'). On the trained pair, correctness is checked against an oracle
that uses only each tokenizer's own decoder, not the map's spelling rules.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pipeline.errors import DrafterError
from pipeline.vocab.maps import VocabMap
from pipeline.vocab.tokens import Meaning, Spelling, representatives, token_meanings, vocab_hash
from tests.engine.toy_tokenizers import byte_level_tokenizer, greek_tokenizer, metaspace_tokenizer

# --- hand-written vocabularies: every id known ----------------------------------------------------
# Target, GPT-2 byte-level: 'Ġ' is the stand-in for b' ', 'Ċ' for b'\n', 'Ã' for b'\xc3', '©' for b'\xa9'.
HAND_TARGET = ["<|endoftext|>", "Ġthe", "Ċ", "Ã©", "Ã", "e", "Ġ", "</s>", "©"]
# Drafter, Llama/SentencePiece: '▁' space sign, '<0xNN>' byte fallback; '<|endoftext|>' here is
# plain text, not a special token.
HAND_DRAFTER = ["<unk>", "</s>", "<0x0A>", "<0xC3>", "<0x65>", "▁the", "é", "e", "▁", "<|endoftext|>"]
# drafter id -> target id: '</s>' special <-> special; '<0x0A>' <-> 'Ċ'; '<0xC3>' <-> 'Ã'; '<0x65>' loses
# to the learnt 'e'; '▁the' <-> 'Ġthe'; 'é' <-> 'Ã©'; 'e' <-> 'e'; '▁' <-> 'Ġ'; text '<|endoftext|>'
# never matches the target's special of the same content. Target '©' (b'\xa9') has no drafter token.
HAND_DRAFTER_TO_TARGET = [-1, 7, 2, 4, -1, 1, 3, 5, 6, -1]
HAND_TARGET_TO_DRAFTER = [-1, 5, 2, 6, 3, 7, 8, 1, -1]


def hand_byte_level() -> Tokenizer:
    vocab = {token: i for i, token in enumerate(HAND_TARGET)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "</s>"])
    return tokenizer


def hand_metaspace(decoder: str = "metaspace") -> Tokenizer:
    """``decoder="replace"`` spells the space sign the Llama-2 way: a Replace('▁', ' ') decoder only."""
    vocab = {token: i for i, token in enumerate(HAND_DRAFTER)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    if decoder == "metaspace":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Sequence(
            [decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    tokenizer.add_special_tokens(["<unk>", "</s>"])
    return tokenizer


def test_meanings_of_byte_level_spellings() -> None:
    assert Spelling.of(hand_byte_level()) == Spelling(byte_level=True, space_sign=None, byte_fallback=False)
    meanings = token_meanings(hand_byte_level())
    assert meanings[1] == Meaning("text", b" the")  # 'Ġthe'
    assert meanings[2] == Meaning("text", b"\n")  # 'Ċ'
    assert meanings[3] == Meaning("text", "é".encode())  # 'Ã©': the two UTF-8 bytes of 'é'
    assert meanings[4] == Meaning("text", b"\xc3")  # 'Ã': one byte, half a character
    assert meanings[0] == Meaning("special", b"<|endoftext|>")


@pytest.mark.parametrize("decoder", ["metaspace", "replace"])
def test_meanings_of_metaspace_and_byte_fallback_spellings(decoder: str) -> None:
    tokenizer = hand_metaspace(decoder)
    assert Spelling.of(tokenizer) == Spelling(byte_level=False, space_sign="▁", byte_fallback=True)
    meanings = token_meanings(tokenizer)
    assert meanings[5] == Meaning("text", b" the")  # '▁the'
    assert meanings[8] == Meaning("text", b" ")  # '▁'
    assert meanings[6] == Meaning("text", "é".encode())  # 'é'
    assert meanings[2] == Meaning("text", b"\n")  # '<0x0A>'
    assert meanings[3] == Meaning("text", b"\xc3")  # '<0xC3>'
    assert meanings[1] == Meaning("special", b"</s>")
    assert meanings[9] == Meaning("text", b"<|endoftext|>")  # a regular token: text, not special


def test_representative_of_a_byte_is_the_learnt_token_not_the_byte_fallback() -> None:
    tokenizer = hand_metaspace()
    assert token_meanings(tokenizer)[4] == token_meanings(tokenizer)[7] == Meaning("text", b"e")
    assert representatives(tokenizer)[Meaning("text", b"e")] == 7  # 'e', not '<0x65>'


def test_representative_of_an_added_tokens_text_is_the_added_token_the_tokenizer_emits() -> None:
    """A non-special added token whose content a regular token also spells (Phi-2 adds whitespace runs that GPT-2's
    byte-level vocabulary has): the tokenizer splits the added token out of the text before the model sees it, so
    it emits the added id for that text and never the regular one. The map chose the regular id, so a drafter's
    proposal of that text mapped to a target id the target never produces (lower acceptance, still lossless)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "Ġ": 2, "ĠĠ": 3, "Ġb": 4},
                                     merges=[("Ġ", "Ġ"), ("Ġ", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    assert tokenizer.encode("  ").ids == [3]  # before the added token: the regular 'ĠĠ'
    tokenizer.add_tokens([AddedToken("  ", normalized=False)])
    assert token_meanings(tokenizer)[3] == token_meanings(tokenizer)[5] == Meaning("text", b"  ")
    emitted = tokenizer.encode("  ").ids
    assert emitted == [5] and tokenizer.encode("a  b").ids == [0, 5, 1]
    assert representatives(tokenizer)[Meaning("text", b"  ")] == emitted[0]


def test_known_tokens_map_to_their_exact_ids() -> None:
    vocab_map = VocabMap.build(hand_byte_level(), hand_metaspace())
    assert vocab_map.drafter_to_target.tolist() == HAND_DRAFTER_TO_TARGET
    assert vocab_map.target_to_drafter.tolist() == HAND_TARGET_TO_DRAFTER
    assert vocab_map.intersection_ids_drafter.tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert vocab_map.intersection_ids_target.tolist() == [7, 2, 4, 1, 3, 5, 6]


def test_one_vocab_hash_for_artifact_fingerprints_and_vocab_maps(tmp_path) -> None:
    from transformers import PreTrainedTokenizerFast

    from pipeline.models.loading import fingerprint, load_tokenizer

    PreTrainedTokenizerFast(tokenizer_object=hand_byte_level()).save_pretrained(str(tmp_path / "target"))
    loaded = load_tokenizer(str(tmp_path / "target"))
    stamped = fingerprint(str(tmp_path / "target"))["vocab_hash"]
    vocab_map = VocabMap.build(loaded, hand_metaspace())
    assert stamped == vocab_map.target_fingerprint == vocab_hash(loaded) == vocab_hash(hand_byte_level())
    assert len(stamped) == 64 and vocab_map.drafter_fingerprint == vocab_hash(hand_metaspace())


def test_vocab_hash_changes_with_any_id_or_special_flag() -> None:
    base = vocab_hash(hand_byte_level())
    assert vocab_hash(hand_metaspace()) != base
    moved = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(reversed(HAND_TARGET))}, merges=[]))
    moved.add_special_tokens(["<|endoftext|>", "</s>"])
    assert vocab_hash(moved) != base
    fewer_specials = hand_byte_level()
    spec = json.loads(fewer_specials.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "</s>"]
    assert vocab_hash(Tokenizer.from_str(json.dumps(spec))) != base


# --- trained vocabularies -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_tok() -> Tokenizer:
    return byte_level_tokenizer(specials=("<|endoftext|>", "</s>"))


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
        assert int(vocab_map.drafter_to_target[drafter_id]) == target_id, (target_token, drafter_token)
        assert int(vocab_map.target_to_drafter[target_id]) == drafter_id, (target_token, drafter_token)
    # '<0x65>' means b'e' like the regular 'e': the regular token represents it, the other maps to -1.
    assert drafter_tok.token_to_id("e") is not None
    assert int(vocab_map.drafter_to_target[drafter_tok.token_to_id("<0x65>")]) == -1


def test_intersection_agrees_with_each_tokenizers_decoder(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    """Every matched pair decodes to the same text, and no decodable shared text is left unmatched."""
    assert 100 < vocab_map.intersection_size < min(vocab_map.target_vocab_size, vocab_map.drafter_vocab_size)
    inter_d, inter_t = vocab_map.intersection_ids_drafter, vocab_map.intersection_ids_target
    assert inter_d.shape == inter_t.shape == (vocab_map.intersection_size,)
    assert torch.equal(vocab_map.target_to_drafter[inter_t], inter_d)  # one-to-one
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
            assert int(vocab_map.drafter_to_target[d]) == target_texts[text] or text in matched_texts, (
                drafter_tok.id_to_token(d)
            )


def test_special_tokens_match_only_specials_with_the_same_content(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    assert int(vocab_map.drafter_to_target[drafter_tok.token_to_id("</s>")]) == target_tok.token_to_id("</s>")
    assert int(vocab_map.drafter_to_target[drafter_tok.token_to_id("<s>")]) == -1
    assert int(vocab_map.drafter_to_target[drafter_tok.token_to_id("<unk>")]) == -1
    assert int(vocab_map.target_to_drafter[target_tok.token_to_id("<|endoftext|>")]) == -1
    # A special on one side never matches the same characters as plain text on the other: a
    # byte-level target has no token spelled '</s>', and a drafter that learned '</s>' as text
    # would map to nothing.
    plain = Tokenizer(models.WordLevel({"</s>": 0, "x": 1}, unk_token="x"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    assert int(VocabMap.build(target_tok, plain).drafter_to_target[0]) == -1


def test_hugging_face_fast_tokenizer_gives_the_same_map(
    target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    from transformers import PreTrainedTokenizerFast

    wrapped = VocabMap.build(
        PreTrainedTokenizerFast(tokenizer_object=target_tok),
        PreTrainedTokenizerFast(tokenizer_object=drafter_tok),
    )
    assert torch.equal(wrapped.drafter_to_target, vocab_map.drafter_to_target)
    assert torch.equal(wrapped.target_to_drafter, vocab_map.target_to_drafter)
    assert (wrapped.target_fingerprint, wrapped.drafter_fingerprint) == (
        vocab_map.target_fingerprint,
        vocab_map.drafter_fingerprint,
    )


def test_disjoint_alphabets_give_an_empty_map_that_tli_refuses(target_tok: Tokenizer) -> None:
    empty = VocabMap.build(target_tok, greek_tokenizer())
    assert empty.intersection_size == 0
    assert empty.intersection_ids_drafter.numel() == 0
    with pytest.raises(DrafterError, match="0 shared tokens") as err:
        empty.require_nonempty()
    assert "SLEM" in str(err.value)


def test_require_nonempty_accepts_a_single_shared_token() -> None:
    """The boundary: one matched pair is enough for TLI, none is refused."""
    one = VocabMap(drafter_to_target=torch.tensor([-1, 0, -1]), target_to_drafter=torch.tensor([1, -1]))
    assert one.intersection_size == 1 and one.intersection_ids_target.tolist() == [0]
    assert one.require_nonempty() is None
    none = VocabMap(drafter_to_target=torch.full((3,), -1), target_to_drafter=torch.full((2,), -1))
    with pytest.raises(DrafterError, match="share no token"):
        none.require_nonempty()


def test_save_load_round_trip(
    tmp_path, target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    written = vocab_map.save(tmp_path / "map")
    assert sorted(p.name for p in written) == ["vocab_map.json", "vocab_map.safetensors"]
    loaded = VocabMap.load(tmp_path / "map", target_tokenizer=target_tok, drafter_tokenizer=drafter_tok)
    assert torch.equal(loaded.drafter_to_target, vocab_map.drafter_to_target)
    assert torch.equal(loaded.target_to_drafter, vocab_map.target_to_drafter)
    assert loaded.target_fingerprint == vocab_hash(target_tok)
    assert loaded.drafter_fingerprint == vocab_hash(drafter_tok)
    assert loaded.intersection_size == vocab_map.intersection_size
    meta = json.loads((tmp_path / "map" / "vocab_map.json").read_text())
    assert meta["intersection_size"] == vocab_map.intersection_size


def test_load_refuses_other_tokenizers_and_missing_files(
    tmp_path, target_tok: Tokenizer, drafter_tok: Tokenizer, vocab_map: VocabMap
) -> None:
    vocab_map.save(tmp_path)
    with pytest.raises(DrafterError, match="different target tokenizer") as err:
        VocabMap.load(tmp_path, target_tokenizer=drafter_tok)
    assert vocab_hash(drafter_tok) in str(err.value) and vocab_hash(target_tok) in str(err.value)
    with pytest.raises(DrafterError, match="different drafter tokenizer"):
        VocabMap.load(tmp_path, drafter_tokenizer=target_tok)
    meta = json.loads((tmp_path / "vocab_map.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vocab_map.json", "vocab_map.safetensors"]  # no temp
    # the tensors cut short or edited (written in place before, with no checksum: read as they were)
    tensors = (tmp_path / "vocab_map.safetensors").read_bytes()
    for damaged in (tensors[: len(tensors) // 2], tensors[:-1] + bytes([tensors[-1] ^ 1])):
        (tmp_path / "vocab_map.safetensors").write_bytes(damaged)
        with pytest.raises(DrafterError, match="vocab_map.safetensors is not the file its metadata names"):
            VocabMap.load(tmp_path)
    (tmp_path / "vocab_map.safetensors").write_bytes(tensors)
    VocabMap.load(tmp_path)
    for text in ("{not json", "[1]", json.dumps({**meta, "schema_version": 1})):  # a JSONDecodeError before
        (tmp_path / "vocab_map.json").write_text(text)
        with pytest.raises(DrafterError, match="unknown schema version"):
            VocabMap.load(tmp_path)
    (tmp_path / "vocab_map.safetensors").unlink()
    with pytest.raises(DrafterError, match="missing"):
        VocabMap.load(tmp_path)


def test_wordpiece_vocabulary_is_refused_with_a_pointer_to_slem(target_tok: Tokenizer) -> None:
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "the": 1, "##s": 2}, unk_token="[UNK]"))
    with pytest.raises(DrafterError, match="SLEM"):
        VocabMap.build(target_tok, wordpiece)
