"""Progress of long phases: plain lines at most every interval in a log, a bar on a terminal."""

from __future__ import annotations

import io

import pytest

from pipeline import progress as progress_module
from pipeline.progress import Progress, duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", fake)
    return fake


def test_a_log_gets_a_line_after_the_grace_then_one_per_interval_and_a_last_line(clock: Clock) -> None:
    lines: list[str] = []
    with Progress("train_drafter", 300, "step", log=lines.append, interval=30.0, grace=10.0) as bar:
        for _ in range(300):
            clock.now += 0.5  # 2 steps/s: 150 s in all
            bar.update(1, loss=2.5)
    # 150 s: a line at 10 s, then at 40, 70, 100, 130 s, and the last one
    assert len(lines) == 6, lines
    assert lines[0].startswith("train_drafter: 20/300 steps (7%), 2 steps/s, ETA 2m20s, loss 2.5"), lines[0]
    assert lines[1].startswith("train_drafter: 80/300 steps (27%)"), lines[1]
    assert lines[-1].startswith("train_drafter: 300/300 steps (100%), 2 steps/s, took 2m30s"), lines[-1]


def test_a_phase_shorter_than_the_grace_writes_nothing(clock: Clock) -> None:
    lines: list[str] = []
    with Progress("count", 4, "shard", log=lines.append, grace=10.0) as bar:
        for _ in range(4):
            clock.now += 1
            bar.update(1)
    assert lines == []


def test_slow_units_show_seconds_per_unit_and_figures_noted_between_steps(clock: Clock) -> None:
    lines: list[str] = []
    bar = Progress("evaluate: losslessness", 4, "draw", log=lines.append, interval=10.0, grace=10.0)
    clock.now += 12
    bar.update(1)
    assert lines[-1] == "evaluate: losslessness: 1/4 draws (25%), 12 s/draw, ETA 36s"
    bar.note(method="eagle3")  # no line: the interval has not passed since the last
    assert len(lines) == 1
    clock.now += 10
    bar.note(method="eagle3")
    assert lines[-1] == "evaluate: losslessness: 1/4 draws (25%), 22 s/draw, ETA 1m06s, method eagle3"
    bar.close()
    assert lines[-1].endswith("stopped after 22s")


def test_a_terminal_gets_a_bar_and_no_log_lines(clock: Clock) -> None:
    stream, lines = io.StringIO(), []
    with Progress("generate", 10, "prompt", log=lines.append, stream=stream, bar=True) as bar:
        for _ in range(10):
            clock.now += 1
            bar.update(1, tokens_per_s=123.4)
    assert not lines
    out = stream.getvalue()
    assert "generate" in out and "10/10" in out and "tokens_per_s=123" in out


def test_duration_formats_seconds_minutes_and_hours() -> None:
    written = [duration(s) for s in (0, 59.4, 95, 4000)]
    assert written == ["0s", "59s", "1m35s", "1h06m"]


def test_a_heartbeat_speaks_while_one_blocking_call_runs_and_says_nothing_for_a_short_one() -> None:
    """A FAISS k-means, a download or a lock wait is one call: no update() to hang a line on. The heartbeat writes
    one from a thread every interval while the call runs, then how long it took; a call shorter than the grace
    writes nothing."""
    import threading

    from pipeline.progress import heartbeat

    lines: list[str] = []
    two = threading.Event()

    def log(line: str) -> None:
        lines.append(line)
        if len(lines) >= 2:
            two.set()

    with heartbeat("cluster: k-means", log, interval=0.01, grace=0.01):
        assert two.wait(timeout=60)  # the "blocking call" lasts until two beats were written
    assert all(line.startswith("cluster: k-means: still running, ") for line in lines[:-1]), lines
    assert len(lines) >= 3 and lines[-1].startswith("cluster: k-means: took "), lines
    quiet: list[str] = []
    with heartbeat("pull", quiet.append, grace=60.0):
        pass
    assert quiet == []
