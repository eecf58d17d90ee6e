"""``generate.kind: raw``: calibration rows from a dataset's own assistant turns (no model runs), each turn learnt up to
its end-of-turn id; a tokenizer without a chat template is told a fix that works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import generate
from pipeline.data.calibration import iter_rows
from pipeline.errors import DrafterError
from tests.helpers import small_cfg


def test_raw_calibration_kind(tmp_path: Path, tiny_kit) -> None:
    art = generate.main(small_cfg(tmp_path, "generate.kind=raw", "generate.limit=8", "generate.max_new_tokens=64"))
    rows = list(iter_rows(art.path / "data"))
    assert rows and art.metrics["generated_tokens"] == 0
    assert all(sum(r["loss_mask"]) > 0 and r["loss_mask"][0] == 0 for r in rows)


def test_a_tokenizer_without_a_chat_template_is_told_a_fix_that_works(tiny_kit) -> None:
    """The error advised generate.kind=raw, which renders the dataset's turns with the same chat template and
    fails the same way."""
    from pipeline.data.calibration import raw_row
    from pipeline.data.records import Conversation
    from pipeline.models.loading import load_tokenizer

    tokenizer = load_tokenizer("tiny:test/target")
    tokenizer.chat_template = None
    conv = Conversation("c", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    with pytest.raises(DrafterError, match="has no chat template") as err:
        raw_row(tokenizer, conv, 64)
    assert "give the tokenizer a chat template" in err.value.fix and "kind=raw renders" in err.value.fix


def test_a_raw_rows_turns_are_learnt_up_to_their_end_of_turn_id(tmp_path: Path, tiny_kit) -> None:
    """A raw row's mask covered each assistant turn as the template renders it, so the kit's ChatML "\n" after
    <|im_end|> was learnt and counted: text a generated answer, which stops at the end-of-turn id, never holds.
    Each turn's mask now ends at its end-of-turn id (two-turn chats, every turn whole)."""
    from pipeline.models.loading import load_tokenizer

    chats = [{"id": f"c{c}", "conversations": [
        {"from": "human", "value": f"Name a river {c}."}, {"from": "gpt", "value": f"River {c} flows north."},
        {"from": "human", "value": "And another?"}, {"from": "gpt", "value": f"River {c + 1} flows south."}]}
        for c in range(6)]
    source = tmp_path / "chats.json"
    source.write_text(json.dumps(chats))
    art = generate.main(small_cfg(tmp_path, f"generate.source={source}", "generate.kind=raw", "generate.limit=null",
                                  "generate.max_new_tokens=64"))
    tokenizer = load_tokenizer("tiny:test/target")
    end, newline = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.encode("\n", add_special_tokens=False)
    rows = list(iter_rows(art.path / "data"))
    assert rows
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        learnt = [ids[j] for j in range(len(ids)) if mask[j]]
        assert learnt.count(end) == 2, tokenizer.decode(ids)  # both turns, each to its end
        last = [j for j in range(len(ids)) if mask[j] and (j + 1 == len(ids) or not mask[j + 1])]
        assert len(last) == 2 and all(ids[j] == end for j in last)
        assert ids[last[0] + 1 : last[0] + 1 + len(newline)] == newline  # the template's "\n" is there, unlearnt


def test_raw_rows_of_content_parts_and_the_conversations_dropped_are_counted(tmp_path: Path, tiny_kit) -> None:
    """With kind raw, an assistant turn written as OpenAI content parts ([{"type": "text", ...}]) was read as empty,
    and its conversation, left without an assistant turn, was dropped without a count. The parts are the turn's
    text, and a conversation with no assistant turn is counted (metric raw_conversations_dropped, and the log)."""
    recs = [{"id": f"m{i}", "messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content":
            [{"type": "text", "text": f"answer {i}."}] if i % 2 else f"answer {i}."}]} for i in range(6)]
    source = tmp_path / "parts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [*recs, {"id": "q", "prompt": "Nobody answered."}]))
    art = generate.main(small_cfg(tmp_path, "generate.kind=raw", f"generate.source={source}", "generate.limit=null",
                                  "generate.heldout_fraction=0.0"))
    assert sorted(r["prompt_id"] for r in iter_rows(art.path / "data")) == [f"m{i}" for i in range(6)]
    assert art.metrics["raw_conversations_dropped"] == 1 and art.metrics["source_records_dropped"] == 0
