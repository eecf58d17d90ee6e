"""Shared pytest fixtures.

Sections are self-contained; each says who uses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Idle OpenMP threads sleep instead of spinning. libgomp (torch's OpenMP) reads this when torch loads, so it is set
# here, before the xdist workers and every process a test starts are spawned (they inherit it); a value already in
# the environment wins. At the default policy a two-thread process (a job, a rank, a CLI run) spins its idle thread
# at each parallel region's end for up to ~1 ms, on a machine whose cores the other workers want. Measured over
# tests/test_faults.py, test_stages.py and test_dag.py with three workers: 159 s against 167 (two runs each).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Hugging Face tokenizers encode a batch on a thread pool of their own unless this says false (read at each call). The
# xdist workers already fill the cores, and the batches the engine encodes are small (SLEM's and SLRS's drafted
# strings, tens to hundreds of short texts): measured under a running test suite on the 2-core CI machine, a batch of
# ten took 585 us on the pool and 210 us without it. Tests of the encoding's results are unaffected (the same ids).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# --- tiny-model kit --------------------------------------------------------------------------------
# The `test` profile of the tiny-model kit (two tokenizers, a trained tiny target, two distilled
# drafters), built once: about 4 minutes on 2 CPU cores, nothing downloaded. It goes into the kit cache the CLI
# uses, $DRAFTER_CACHE or ~/.cache/drafter-pipeline (content-hashed and verified on every load, like the default
# profile's), so later sessions reuse it; .ci/run points DRAFTER_CACHE at a fresh directory. While the fixture is
# alive DRAFTER_CACHE points at that cache, so code that resolves "tiny:test/<role>" refs itself
# (pipeline.models.loading, jobs) finds the same kit instead of building again.


@pytest.fixture(scope="session")
def tiny_kit() -> Iterator[object]:
    """The built `test`-profile :class:`pipeline.tiny.TinyKit` (use ``tiny_kit.path(role)``)."""
    from pipeline.tiny import build_kit, default_cache_dir

    cache = default_cache_dir()  # xdist workers and the controller's background build share it (the build is locked)
    kit = build_kit("test", cache, log=lambda _line: None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTER_CACHE", str(cache))
        yield kit


# --- end tiny-model kit ----------------------------------------------------------------------------


# --- markers: gpu tests skip, with a reason, where there is no GPU (slurm: tests/slurm_cluster.py) ---
WORKER_NICENESS = 5
"""xdist workers (and what they start) run at this niceness, the controller's background kit build at 0.

The build (one thread) is the start of a run's critical path: the kit's users wait for it. At equal priority it got
a quarter of the 2-core CI machine beside three workers and took 7.5–10 min, and the workers, out of kit-free files
after about 7.5, waited up to 3 min on it with a core idle. At niceness 5 the scheduler weighs a worker at a third of
the build, so the build has about a core to itself and the workers share the other. Once it is built every process
of the run has the same niceness again."""


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's torch uses its share of the cores, at least one thread (two or three workers on two
    cores: one thread each; oversubscribed intra-op threads made some CPU tests many times slower), and the worker
    yields to the kit's build (:data:`WORKER_NICENESS`)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(_threads_per_worker(int(workers)))
        os.nice(WORKER_NICENESS)


def _threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // workers)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [i for i in items if i.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU (none here): run `pytest -m gpu` on a GPU machine; README Measured → GPU says what ran on one")
            for item in gpu:
                item.add_marker(skip)
    items[:] = _files_in_run_order(items)


# --- order of the test files, and the kit built beside them under xdist ----------------------------
# Under xdist (--dist loadfile --no-loadscope-reorder, pyproject.toml) the workers take whole files in the
# order below: first the files that never touch the tiny kit, while the controller builds the kit in a
# background process (pytest_sessionstart), then the kit's users (one group when the kit is already built).
# Before, both workers reached a kit test first and one waited the whole build (~4 min) on the other.
# Within each group the longest files go first (their seconds in the last recorded run, FILE_SECONDS), so
# the last files handed out are short and no worker idles at the end while another finishes a long one: ordered by test count instead, a worker
# finished a 4-minute file alone. A file the record lacks is estimated from its tests (slow or slurm ones
# at _HEAVY seconds, others at one). Record again after adding or much changing tests:
#     DRAFTER_RECORD_FILE_SECONDS=1 make test
FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
_HEAVY = 50
_PREBUILD = pytest.StashKey[subprocess.Popen]()


def _recorded_seconds() -> dict[str, float]:
    import json

    try:
        return {str(k): float(v) for k, v in json.loads(FILE_SECONDS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no record (or not one we can read): the estimate orders every file


def _files_in_run_order(items: list[pytest.Item], recorded: dict[str, float] | None = None,
                        kit_built: bool | None = None) -> list[pytest.Item]:
    """``items`` file by file in run order; ``recorded`` (default: FILE_SECONDS) and ``kit_built`` (default: whether
    the `test` kit is in the cache; then nothing waits for it and the kit's users need not go last) for tests."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    seconds = _recorded_seconds() if recorded is None else recorded
    if kit_built is None:
        from pipeline.tiny import kit_status  # deferred: pulls in the kit's code

        kit_built = kit_status("test")[2]

    def key(name: str) -> tuple[bool, float, str]:
        tests = by_file[name]
        kit = any("tiny_kit" in getattr(t, "fixturenames", ()) for t in tests)
        estimate = sum(_HEAVY if t.get_closest_marker("slow") or t.get_closest_marker("slurm") else 1 for t in tests)
        return kit and not kit_built, -seconds.get(name, estimate), name

    return [item for name in sorted(by_file, key=key) for item in by_file[name]]


_RECORDED: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With DRAFTER_RECORD_FILE_SECONDS set, sum each file's setup, call and teardown seconds (under xdist the
    controller gets every worker's reports and writes the sums)."""
    if os.environ.get("DRAFTER_RECORD_FILE_SECONDS"):
        name = report.nodeid.split("::", 1)[0]
        _RECORDED[name] = _RECORDED.get(name, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the recorded sums into FILE_SECONDS (atomically; files this run did not run keep their record) when the
    whole run passed; a worker writes nothing."""
    import json

    if _RECORDED and exitstatus == 0 and not hasattr(session.config, "workerinput"):
        merged = _recorded_seconds() | {k: round(v, 1) for k, v in _RECORDED.items()}
        part = FILE_SECONDS.with_suffix(".json.partial")
        part.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
        part.replace(FILE_SECONDS)


def pytest_sessionstart(session: pytest.Session) -> None:
    """On the xdist controller, start building the `test` kit in the background (a no-op when it is cached);
    the workers' ``tiny_kit`` fixture then waits on the build's lock, or finds the kit built."""
    config = session.config
    workers = getattr(config.option, "numprocesses", None) or 0
    if hasattr(config, "workerinput") or not isinstance(workers, int) or workers < 1:
        return
    # The workers' cache (default_cache_dir, from the same environment) and the torch thread count they would build
    # with: the kit's weights depend on it.
    script = ("import sys, torch; from pipeline.tiny import build_kit, default_cache_dir; "
              "torch.set_num_threads(int(sys.argv[1])); build_kit('test', default_cache_dir(), log=lambda _l: None)")
    config.stash[_PREBUILD] = subprocess.Popen(  # noqa: S603 - our own interpreter and a fixed script
        [sys.executable, "-c", script, str(_threads_per_worker(workers))],
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stop a background build still running (an interrupted session): the build writes atomically."""
    build = config.stash.get(_PREBUILD, None)
    if build is not None and build.poll() is None:
        build.terminate()
        build.wait(timeout=60)


# --- no pickle: loaders must never unpickle (the fault-table row "pickle.load raises") ---------------
@pytest.fixture
def pickle_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every entry point of :mod:`pickle` raise for the test's duration (``torch.load`` included)."""
    import pickle

    import torch

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("pickle was called while loading an artifact")

    for name in ("load", "loads", "_load", "_loads", "Unpickler", "_Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (the CI machine has 2 cores shared with the other xdist worker)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
