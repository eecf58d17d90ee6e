"""Shared pytest fixtures.

Sections are self-contained; each says who uses it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# --- tiny-model kit --------------------------------------------------------------------------------
# The `test` profile of the tiny-model kit (two tokenizers, a trained tiny target, two distilled
# drafters), built once per pytest session: about 1–2 minutes on 2 CPU cores, nothing downloaded.
# It goes into $DRAFTER_CACHE when that is set (so repeated sessions reuse it), else into a session
# temp dir. While the fixture is alive DRAFTER_CACHE points at that cache, so code that resolves
# "tiny:test/<role>" refs itself (pipeline.models.loading, jobs) finds the same kit instead of building again.


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The built `test`-profile :class:`pipeline.tiny.TinyKit` (use ``tiny_kit.path(role)``)."""
    from pipeline.tiny import build_kit

    preset = os.environ.get("DRAFTER_CACHE")
    if preset:
        cache = Path(preset)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist workers share their session's temp root: one kit, built once (the build is locked).
        cache = tmp_path_factory.getbasetemp().parent / "drafter-cache"
    else:
        cache = tmp_path_factory.mktemp("drafter-cache")
    kit = build_kit("test", cache, log=lambda _line: None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DRAFTER_CACHE", str(cache))
        yield kit


# --- end tiny-model kit ----------------------------------------------------------------------------


# --- markers: gpu tests skip, with a reason, where there is no GPU (slurm: tests/slurm_cluster.py) ---
def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, each worker's torch uses its share of the cores (two workers on two cores: one thread each;
    oversubscribed intra-op threads made some CPU tests many times slower)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [i for i in items if i.get_closest_marker("gpu")]
    if gpu:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU (none here): run `pytest -m gpu` on a GPU machine; README Measured → GPU says what ran on one")
            for item in gpu:
                item.add_marker(skip)



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
