"""The order the test files run in under xdist (tests/conftest.py): the files that never touch the tiny kit first,
while the kit builds beside them (one group when it is built already); within each group the longest
first, by the seconds last recorded for each file (tests/file_seconds.json), a file without a record estimated from
its tests."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest


def item(path: str, kit: bool = False, slow: bool = False) -> SimpleNamespace:
    return SimpleNamespace(nodeid=f"{path}::test_x", fixturenames=["tiny_kit"] if kit else [],
                           get_closest_marker=lambda name: object() if slow and name == "slow" else None)


def files(items: list[SimpleNamespace]) -> list[str]:
    return list(dict.fromkeys(i.nodeid.split("::", 1)[0] for i in items))


def test_kit_free_files_first_then_the_longest_recorded_first() -> None:
    items = [item("a.py", kit=True), item("b.py"), item("c.py"), item("d.py", kit=True), item("e.py"),
             item("e.py"), item("e.py"), item("f.py", slow=True)]
    recorded = {"a.py": 30.0, "b.py": 5.0, "c.py": 200.0, "d.py": 90.0}

    def order(seconds: dict[str, float], kit_built: bool) -> list[str]:
        return files(conftest._files_in_run_order(items, seconds, kit_built))

    # e.py has no record (three ordinary tests: 3 s), f.py neither (one slow test: the heavy estimate, 50 s)
    assert order(recorded, False) == ["c.py", "f.py", "b.py", "e.py", "d.py", "a.py"]
    # without a record every file is estimated: e.py's three tests now outweigh b.py's and c.py's one
    assert order({}, False) == ["f.py", "e.py", "b.py", "c.py", "a.py", "d.py"]
    assert sorted(map(id, conftest._files_in_run_order(items, recorded, False))) == sorted(map(id, items))  # all, once
    # with the kit already built nothing waits for it: one group, longest first
    assert order(recorded, True) == ["c.py", "d.py", "f.py", "a.py", "b.py", "e.py"]


def test_the_record_is_read_and_an_unreadable_one_orders_by_estimate(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    record = tmp_path / "file_seconds.json"
    monkeypatch.setattr(conftest, "FILE_SECONDS", record)
    assert conftest._recorded_seconds() == {}  # none yet
    record.write_text(json.dumps({"tests/test_a.py": 12.5}))
    assert conftest._recorded_seconds() == {"tests/test_a.py": 12.5}
    record.write_text("{not json")
    assert conftest._recorded_seconds() == {}


def test_the_checked_in_record_names_test_files_that_exist() -> None:
    """A record of files since renamed or removed would order nothing: every name in it is a test file here."""
    recorded = conftest._recorded_seconds()
    root = Path(conftest.__file__).resolve().parent.parent
    assert recorded and all((root / name).is_file() and Path(name).name.startswith("test_") for name in recorded)
