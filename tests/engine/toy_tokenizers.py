"""Real tokenizers trained in a test on a few KB of pseudo-English, one per spelling scheme.

Shared by the vocabulary-map and heterogeneous-decoding tests: a GPT-2-style byte-level BPE ('Ġthe',
'Ã©'), a SentencePiece/Llama-style Metaspace BPE with byte fallback ('▁the', 'é', '<0xC3>'), and a
Greek-only tokenizer that shares no token with either. Training is deterministic.
"""

from __future__ import annotations

import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

WORDS = (
    "the cat sat on mat and dog ran to park while bird sang in tree near river the café served "
    "naïve résumé über crème brûlée déjà vu to the people of the town who said hello world again "
    "speculative decoding lets a small model draft tokens that the large model verifies in one pass"
).split()


def corpus(seed: int, sentences: int = 300) -> list[str]:
    """About 15 KB of deterministic pseudo-English with accented words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in range(sentences)]


def byte_level_tokenizer(specials: tuple[str, ...] = ("<|endoftext|>",), vocab_size: int = 400) -> Tokenizer:
    """GPT-2-style byte-level BPE: ``specials`` first, then the 256 byte symbols, then merges."""
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
    # entries (so decoding keeps them), which is what a vocabulary map must handle.
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in set(byte_tokens)]
    return Tokenizer.from_str(json.dumps(spec))


def greek_tokenizer() -> Tokenizer:
    """Greek letters only, no byte tokens, no space sign; adds a BOS like many real tokenizers."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    rng = random.Random(2)
    words = ["αβγ", "δεζ", "ηθι", "κλμ", "νξο", "πρσ", "τυφ", "χψω"]
    text = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(200)]
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "[BOS]"], show_progress=False)
    tokenizer.train_from_iterator(text, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", tokenizer.token_to_id("[BOS]"))]
    )
    return tokenizer
