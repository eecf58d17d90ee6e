"""Tests for pipeline.data.sources: packaged ShareGPT recovery, user files, HumanEval, held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.data.sources import (
    Conversation,
    load_conversations,
    load_humaneval,
    load_sharegpt,
    split_heldout,
)
from pipeline.errors import DrafterError

ROLES = {"system", "user", "assistant"}


def _well_formed(convs: list[Conversation]) -> None:
    for conv in convs:
        assert conv.id
        assert conv.messages and any(m["role"] == "user" for m in conv.messages)
        assert conv.messages[0]["role"] in {"system", "user"}
        for m in conv.messages:
            assert set(m) == {"role", "content"}
            assert m["role"] in ROLES
            assert isinstance(m["content"], str) and m["content"].strip()


def test_packaged_sharegpt_recovers_complete_records() -> None:
    convs, report = load_sharegpt()
    # The wheel's JSON holds 17,671 complete records before its truncated tail; a few hundred have no
    # user turn. The range allows another release of the wheel without hiding a broken parser.
    assert 15_000 <= len(convs) <= 20_000
    assert report.records_kept == len(convs)
    assert report.records_dropped > 0
    assert report.records_read == report.records_kept + report.records_dropped
    assert any("incomplete record" in note for note in report.notes)
    assert len({c.id for c in convs}) == len(convs)
    _well_formed(convs)


def test_packaged_sharegpt_copies_are_independent() -> None:
    first, _ = load_sharegpt()
    first[0].messages[0]["content"] = "mutated"
    second, _ = load_sharegpt()
    assert second[0].messages[0]["content"] != "mutated"


def _records() -> list[dict]:
    return [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no prompt"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "be nice"}, {"from": "user", "value": "q"},
                                      {"from": "chatgpt", "value": ""}, {"from": "bard", "value": "ans"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "last one"}, {"from": "gpt", "value": "yes"}]},
    ]  # fmt: skip


def test_truncated_json_file_is_recovered(tmp_path: Path) -> None:
    text = json.dumps(_records(), indent=2)
    cut = text.index('"last one"') + 5  # mid-string in the last record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    convs, report = load_sharegpt(path)
    assert [c.id for c in convs] == ["a", "c"]
    assert convs[1].messages == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ans"},
    ]
    # read = 3 complete + 1 truncated; dropped = "b" (no user turn) + the truncated tail.
    assert (report.records_read, report.records_kept, report.records_dropped) == (4, 2, 2)
    assert any("incomplete record" in n for n in report.notes)
    assert any("no usable user turn" in n for n in report.notes)
    assert any("empty turns" in n for n in report.notes)


def test_complete_json_file_drops_nothing_but_unusable(tmp_path: Path) -> None:
    path = tmp_path / "full.json"
    path.write_text(json.dumps(_records()))
    convs, report = load_conversations(str(path))
    assert [c.id for c in convs] == ["a", "c", "d"]
    assert report.records_dropped == 1
    assert not any("incomplete" in n for n in report.notes)


def test_jsonl_with_messages_prompt_and_text(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}]},
        {"prompt": "write a poem"},
        {"text": "plain text"},
        {"unrelated": 1},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    convs, report = load_conversations(str(path))
    assert [c.id for c in convs] == ["data-0", "data-1", "data-2"]
    assert convs[1].messages == [{"role": "user", "content": "write a poem"}]
    assert report.records_read == 5 and report.records_kept == 3
    _well_formed(convs)


def test_limit(tmp_path: Path) -> None:
    path = tmp_path / "full.json"
    path.write_text(json.dumps(_records()))
    convs, report = load_conversations(str(path), limit=2)
    assert [c.id for c in convs] == ["a", "c"]
    assert any("limit=2" in n for n in report.notes)


def test_saved_dataset_directory(tmp_path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list([{"id": "x", "messages": [{"role": "user", "content": "hey"}]}])
    ds.save_to_disk(str(tmp_path / "ds"))
    convs, report = load_conversations(str(tmp_path / "ds"))
    assert [(c.id, c.messages) for c in convs] == [("x", [{"role": "user", "content": "hey"}])]
    assert report.records_kept == 1


def test_missing_empty_and_unusable_files(tmp_path: Path) -> None:
    with pytest.raises(DrafterError, match="does not exist") as err:
        load_conversations(str(tmp_path / "nope.json"))
    assert "expected" in str(err.value)
    (tmp_path / "empty.jsonl").write_text("  \n")
    with pytest.raises(DrafterError, match="is empty"):
        load_conversations(str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.json").write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "x"}]}]))
    with pytest.raises(DrafterError, match="No usable conversation"):
        load_conversations(str(tmp_path / "bad.json"))


def test_hub_failure_is_a_drafter_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DrafterError, match="network/hub access") as err:
        load_conversations("someone/some-dataset")
    assert "ConnectionError" in str(err.value)


def test_humaneval() -> None:
    convs = load_humaneval()
    assert len(convs) == 164
    assert convs[0].id == "HumanEval/0"
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in convs)
    assert "def " in convs[0].messages[0]["content"]
    convs2, report = load_conversations("humaneval", limit=10)
    assert len(convs2) == 10 and report.records_read == 164


def test_split_is_deterministic_disjoint_and_order_free() -> None:
    convs, _ = load_sharegpt()
    convs = convs[:3000]
    held = split_heldout(convs, 0.1, heldout=True)
    rest = split_heldout(convs, 0.1, heldout=False)
    assert {c.id for c in held}.isdisjoint({c.id for c in rest})
    assert len(held) + len(rest) == len(convs)
    # 3000 draws at p=0.1 (grouped into ~1,600 chats): 100..500 is far outside any plausible deviation.
    assert 100 < len(held) < 500
    reversed_held = split_heldout(list(reversed(convs)), 0.1, heldout=True)
    assert sorted(c.id for c in reversed_held) == sorted(c.id for c in held)
    smaller = {c.id for c in split_heldout(convs, 0.05, heldout=True)}
    assert smaller <= {c.id for c in held}  # nested: a smaller held-out set never leaks into training


def test_parts_of_one_chat_stay_on_one_side() -> None:
    convs, _ = load_sharegpt()
    held_groups = {c.group for c in split_heldout(convs, 0.1, heldout=True)}
    rest_groups = {c.group for c in split_heldout(convs, 0.1, heldout=False)}
    assert held_groups and held_groups.isdisjoint(rest_groups)


def test_split_rejects_bad_fraction() -> None:
    with pytest.raises(DrafterError, match="heldout_fraction"):
        split_heldout([], 1.5, heldout=True)
