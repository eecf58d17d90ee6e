"""Training text for the tiny-model kit: short chats cut from the packaged ShareGPT, and their packing.

The kit trains on conversations rendered with each tokenizer's own chat template, so the models learn
the role markers and learn to end an assistant turn with eos (the generate stage relies on both).
Messages are cut to a few hundred characters, at a paragraph or sentence end where one is near, so
that turns (and turn ends) are frequent in a small token budget. Only conversations outside the
held-out split (:data:`pipeline.data.sources.DEFAULT_HELDOUT_FRACTION`) are trained on; held-out ones
measure the models.
"""

from __future__ import annotations

from typing import Any

import torch

from pipeline.data.records import Conversation

Chat = list[dict[str, str]]


def shorten(text: str, max_chars: int) -> str:
    """Cut ``text`` to at most ``max_chars``, preferring a paragraph, line or sentence end."""
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for mark in ("\n\n", "\n", ". ", " "):
        cut = head.rfind(mark)
        if cut >= max_chars // 2:
            return head[: cut + (1 if mark == ". " else 0)].rstrip()
    return head


def make_chats(convs: list[Conversation], max_turns: int, max_chars: int) -> list[Chat]:
    """Shorten conversations to their first ``max_turns`` messages of at most ``max_chars`` each."""
    chats = []
    for conv in convs:
        chat = [{"role": m["role"], "content": shorten(m["content"], max_chars)} for m in conv.messages]
        chat = [m for m in chat[:max_turns] if m["content"].strip()]
        if any(m["role"] == "user" for m in chat):
            chats.append(chat)
    return chats


def first_user_prompts(chats: list[Chat]) -> list[Chat]:
    """Each chat up to and including its first user message: the prompts the target answers."""
    prompts = []
    for chat in chats:
        end = next(i for i, m in enumerate(chat) if m["role"] == "user")
        prompts.append(chat[: end + 1])
    return prompts


def render_ids(tokenizer: Any, chats: list[Chat]) -> list[list[int]]:
    """Token ids of each chat under the tokenizer's chat template (bos first, eos after every turn)."""
    texts = [tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def pack(sequences: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate token sequences and cut the stream into ``[n, seq_len]`` rows (the tail is dropped).

    Packing across conversation boundaries is standard for LM pretraining: every row is full, and each
    conversation starts with bos, so the model sees where one ends and the next begins.
    """
    stream = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long)
    rows = stream.numel() // seq_len
    if rows == 0:
        raise ValueError(f"only {stream.numel()} tokens: fewer than one row of {seq_len}")
    return stream[: rows * seq_len].view(rows, seq_len)


def text_of(chats: list[Chat]) -> list[str]:
    """The message contents (no markup): what the tokenizers are trained on."""
    return [m["content"] for chat in chats for m in chat]
