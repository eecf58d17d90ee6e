"""Calibration sets: chat-template prompts, loss masks, and the Arrow shards they are stored in.

A calibration row is one conversation turn as the target would see it: ``input_ids`` (prompt under
the chat template, then the assistant's tokens), ``loss_mask`` (1 on assistant tokens only — the ones
a drafter must predict and the ones the ``count`` stage counts), the source conversation id and
lengths. Rows are written in shards, each one Arrow IPC stream file (the format ``datasets`` memory-maps)
published by rename, so a shard on disk is always complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.checksums import temp_sibling
from pipeline.data.records import Conversation
from pipeline.errors import DrafterError

SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("prompt_id", pa.string()),
    ("prompt_len", pa.int32()),
    ("response_len", pa.int32()),
    ("finished", pa.bool_()),
    ("group", pa.string()),
])
"""A calibration row. ``group`` is the chat its prompt came from (the split group of :class:`Conversation`: the
record's id unless it is one part of a longer chat), so the trainers' held-out rows keep a chat's parts together;
shards written before it have no such column and group by ``prompt_id``."""


def first_prompt(conv: Conversation) -> list[dict[str, str]] | None:
    """The messages up to and including the first user turn (system prompt kept), or None."""
    out = []
    for msg in conv.messages:
        out.append(msg)
        if msg["role"] == "user":
            return out
    return None


PROMPT_DIGESTS = "prompt_digests.json"
"""A calibration set's payload beside its ``data/``: ``{"digests": [...]}``, the :func:`prompt_digest` of the first
prompt of every conversation the set was built from, sorted. An evaluation leaves out the prompts any calibration set
behind its artifacts holds, however that set's source was named or has grown since (its split can move)."""


def prompt_digest(messages: list[dict[str, str]]) -> str:
    """A prompt's identity by content: 16 hex digits of the sha256 of its messages (role, content) as canonical JSON."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def prompt_digests(convs: Iterable[Conversation]) -> list[str]:
    """The sorted :func:`prompt_digest` of each conversation's :func:`first_prompt` (those with one), each once."""
    return sorted({prompt_digest(m) for c in convs if (m := first_prompt(c)) is not None})


def template_overhead(tokenizer: Any) -> int | None:
    """Tokens the chat template puts around one user turn of one token, generation prompt and any default system
    prompt included: a ``max_prompt_tokens`` at or below it leaves no room for the user's text
    (:func:`encode_prompt` refuses it when it meets a prompt; ``plan`` before any stage runs). None where the
    tokenizer has no chat template (the stage that renders prompts says so)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    text = "x"
    rendered = _template(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True)
    return len(rendered) - len(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]], max_tokens: int,
                  setting: str = "max_prompt_tokens") -> list[int]:
    """Token ids of ``messages`` under the chat template with the generation prompt, at most
    ``max_tokens`` long: an overlong user turn is cut (its start kept) so the template stays intact, and where the
    turns before it (a system prompt) leave no room, they are dropped.

    Raises:
        DrafterError: ``max_tokens`` (the config key ``setting``) leaves no room for one token of the user's text
            under the template.
    """
    ids = _template(tokenizer, messages, add_generation_prompt=True)
    if len(ids) <= max_tokens:
        return ids
    content_ids = tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
    overhead = len(ids) - len(content_ids)
    budget = max_tokens - overhead - 2
    while True:
        cut = [*messages[:-1], {"role": "user", "content": tokenizer.decode(content_ids[:max(budget, 1)])}]
        ids = _template(tokenizer, cut, add_generation_prompt=True)
        if len(ids) <= max_tokens:
            return ids
        if len(messages) > 1:
            # the turns before the user's (a system prompt) leave no room: the prompt keeps the user's turn under an
            # intact template rather than lose its start (BOS, the system header) to a cut from the left
            return encode_prompt(tokenizer, messages[-1:], max_tokens, setting)
        if budget <= 1:  # a cut from the left would keep the template's tail and no user text
            raise DrafterError(
                f"{setting}={max_tokens} leaves no room for the user's text under the chat template.",
                expected=f"{setting} of at least {overhead + 1}: the template's {overhead} tokens around a user turn "
                         "and one token of its text",
                found=f"a template overhead of {overhead} tokens ({len(ids)} tokens with one token of text)",
                fix=f"Raise {setting} to well above {overhead} (the default is 128).")
        budget -= len(ids) - max_tokens


def _template(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise DrafterError("The tokenizer has no chat template.",
                           expected="a tokenizer with chat_template set (instruction-tuned checkpoints have one)",
                           fix="Use the chat model's tokenizer (target.tokenizer: its instruct checkpoint's), or give "
                               "the tokenizer a chat template (its tokenizer_config.json's chat_template); "
                               "generate.kind=raw renders the dataset's turns with it too.")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


def raw_row(tokenizer: Any, conv: Conversation, max_tokens: int, stops: Collection[int] = ()) -> dict | None:
    """A row from the conversation's own turns: loss mask on every assistant turn's tokens.

    The mask is found by templating growing prefixes, which works for any chat template whose
    rendering of a prefix is a prefix of the rendering of the whole (true of all common templates). A turn's mask
    ends at its last end-of-turn id in ``stops``: what the template writes after it (ChatML's ``\n`` after
    ``<|im_end|>``) is the template's, never generated (a generated answer stops at that id), so it is not learnt
    or counted.
    """
    ids: list[int] = []
    mask: list[int] = []
    for i, msg in enumerate(conv.messages):
        if msg["role"] != "assistant":
            continue
        before = _template(tokenizer, conv.messages[:i], add_generation_prompt=True)
        after = _template(tokenizer, conv.messages[: i + 1], add_generation_prompt=False)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            break  # the template does not render prefixes as prefixes from here on; stop honestly
        turn = after[len(before):]
        ends = [j for j, t in enumerate(turn) if t in stops]
        learnt = ends[-1] + 1 if ends else len(turn)
        mask += [0] * (len(before) - len(ids)) + [1] * learnt + [0] * (len(turn) - learnt)
        ids = after
        if len(ids) >= max_tokens:
            break
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    if sum(mask) == 0:
        return None
    prompt_len = mask.index(1)
    return {"input_ids": ids, "loss_mask": mask, "prompt_id": conv.id, "prompt_len": prompt_len,
            "response_len": len(ids) - prompt_len, "finished": True, "group": conv.split_key}


def write_shard(path: Path, rows: list[dict]) -> None:
    """Write rows as one Arrow IPC stream file, atomically (temp file + fsync + rename)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    tmp = temp_sibling(path)
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        writer.write_table(table)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_shard(path: Path) -> pa.Table:
    """Memory-map one shard (zero-copy).

    Raises:
        DrafterError: the file is missing, truncated or not an Arrow stream (naming it, not Arrow's message alone).
    """
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as err:
        raise DrafterError(f"Calibration shard {path} cannot be read: it is missing, truncated or not an Arrow "
                           f"stream.", expected="an Arrow IPC stream file written by the generate stage",
                           found=f"{type(err).__name__}: {err}",
                           fix="If it is in an artifact, delete the artifact's directory and rerun `drafter "
                               "generate`; a staged shard is checked and redone by the rerun itself.") from err


def shard_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("shard-*.arrow"))


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrow"


def iter_rows(directory: Path) -> Iterator[dict]:
    for path in shard_files(directory):
        yield from read_shard(path).to_pylist()


def load_dataset_dir(directory: Path) -> Any:
    """The calibration set as a ``datasets.Dataset`` (memory-mapped, concatenated over shards)."""
    import datasets

    files = shard_files(directory)
    if not files:
        raise DrafterError(f"No calibration shards under {directory}.")
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in files])


def flat_arrays(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Zero-copy flat views of a shard's token ids and loss mask (the list columns' value buffers)."""
    ids = table.column("input_ids").combine_chunks()
    mask = table.column("loss_mask").combine_chunks()
    return (ids.flatten().to_numpy(zero_copy_only=False), mask.flatten().to_numpy(zero_copy_only=False))


def chunks(items: list, size: int) -> Iterable[tuple[int, list]]:
    for start in range(0, len(items), size):
        yield start // size, items[start : start + size]
