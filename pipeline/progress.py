"""Progress of the long phases: a bar on a terminal, a plain line at most every 30 s in a log.

Every phase that can take more than a few seconds (kit training, generation, counting, training,
estimation, evaluation) reports through :class:`Progress`: done / total, the rate, an ETA and a few
figures of its own (loss, held-out τ). On a terminal it draws a ``tqdm`` bar (the one progress library of
the command line); when stderr goes to a file, a CI log or a Slurm job's output it writes a plain line
through the phase's ``log`` callable: the first once the phase has run ``grace`` seconds, then at most
every ``interval`` seconds, and a last one, so a log is never silent for long and a short phase adds nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

LOG_INTERVAL_S = 30.0
"""Seconds between two plain progress lines (the README's promise for logs)."""
GRACE_S = 10.0
"""A phase shorter than this writes no progress line at all (its stage's own lines say enough)."""


def log(phase: str, message: str) -> None:
    """A timestamped line on stderr (stdout stays clean for summaries): ``[12:00:40] phase: message``."""
    print(f"[{time.strftime('%H:%M:%S')}] {phase}: {message}", file=sys.stderr, flush=True)


def stamped(stream: TextIO) -> Callable[[str], None]:
    """Where a phase's lines go by default: ``[12:00:40] line`` on ``stream``."""
    return lambda line: print(f"[{time.strftime('%H:%M:%S')}] {line}", file=stream, flush=True)


def silent(_line: str) -> None:
    """The log of a rank that is not rank zero: its pace is rank zero's, which speaks for the job."""


def duration(seconds: float) -> str:
    """``95`` → ``1m35s``; ``4000`` → ``1h06m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class Progress:
    """One phase's progress (use as a context manager, or call :meth:`close`).

    Args:
        what: The phase, e.g. ``"train_drafter"`` or ``"kit target"``.
        total: Units of work in the phase (None when unknown: no percentage, no ETA).
        unit: The unit's name (``"step"``, ``"prompt"``, ``"cell"``).
        log: Where plain lines go (a stage's ``log``); default stderr.
        stream: The stream a bar would draw on; a bar is drawn only when it is a terminal.
        interval: Seconds between plain lines.
        grace: Seconds before the first plain line (a shorter phase writes none).
        bar: Force the bar on or off (None: a bar exactly when ``stream`` is a terminal).
    """

    def __init__(self, what: str, total: int | None, unit: str = "step", *,
                 log: Callable[[str], None] | None = None, stream: TextIO | None = None,
                 interval: float = LOG_INTERVAL_S, grace: float = GRACE_S, bar: bool | None = None) -> None:
        self.what, self.total, self.unit, self.interval, self.grace = what, total, unit, interval, grace
        self.lines = 0
        self.logged_done = -1
        self.stream = stream if stream is not None else sys.stderr
        self.log = log or stamped(self.stream)
        self.done, self.info = 0, {}
        self.start = time.monotonic()
        self.last = self.start - interval + grace  # the first line comes after `grace` seconds
        use_bar = bar if bar is not None else bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, file=self.stream, dynamic_ncols=True,
                             mininterval=0.5, leave=True)

    def update(self, n: int = 1, **info: Any) -> None:
        """``n`` more units done; ``info`` figures (loss=…, tau=…) are shown with the next line or bar."""
        self.done += n
        self.info.update({k: v for k, v in info.items() if v is not None})
        if self._bar is not None:
            if info:
                self._bar.set_postfix({k: _figure(v) for k, v in self.info.items()}, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            self.lines += 1
            self.logged_done = self.done
            self.log(self.line())

    def note(self, **info: Any) -> None:
        """Update the figures without counting work (a held-out τ measured between steps)."""
        self.update(0, **info)

    def line(self) -> str:
        """The plain line: done / total (percent), rate, ETA, figures."""
        elapsed = time.monotonic() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.what}: {self.done}" + (f"/{self.total}" if self.total is not None else "") + f" {self.unit}s"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.0f}%)"
        parts.append(f"{rate:.3g} {self.unit}s/s" if rate >= 1 or rate == 0 else f"{1 / rate:.3g} s/{self.unit}")
        if self.total and 0 < self.done < self.total and rate > 0:
            parts.append(f"ETA {duration((self.total - self.done) / rate)}")
        elif self.total and self.done >= self.total:
            parts.append(f"took {duration(elapsed)}")
        parts += [f"{k} {_figure(v)}" for k, v in self.info.items()]
        return ", ".join(parts)

    def close(self) -> None:
        """Finish the bar, or write the last line (what was done and how long it took)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.total and self.done >= self.total and self.logged_done == self.done:
            return  # the last interval line already said it all
        elif self.lines or time.monotonic() - self.start >= self.grace:
            self.log(self.line() if self.total and self.done >= self.total else
                     self.line() + f", stopped after {duration(time.monotonic() - self.start)}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@contextmanager
def heartbeat(what: str, log: Callable[[str], None] | None = None, *, interval: float = LOG_INTERVAL_S,
              grace: float = GRACE_S) -> Iterator[None]:
    """A line every ``interval`` seconds while one blocking call runs (a FAISS k-means, a download, an upload, a lock
    wait): ``what: still running, 1m30s``, the first once it has run ``grace`` seconds, and ``what: took 2m05s`` at
    the end if any was written. A call that returns sooner writes nothing. ``log`` defaults to stderr, timestamped."""
    say = log or stamped(sys.stderr)
    start, stop, beats = time.monotonic(), threading.Event(), []

    def beat() -> None:
        wait = grace
        while not stop.wait(wait):
            beats.append(None)
            say(f"{what}: still running, {duration(time.monotonic() - start)}")
            wait = interval

    thread = threading.Thread(target=beat, name=f"heartbeat: {what}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if beats:
            say(f"{what}: took {duration(time.monotonic() - start)}")
