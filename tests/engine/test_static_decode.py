"""The static decode paths (issue 23, part 2): a preallocated KV cache, fixed-shape forwards, CUDA graphs, and one
device → host read per round — checked on the CPU with the trained tiny kit.

* **Same outputs.** Every registered method decodes greedily to exactly the autoregressive tokens on path
  ``static`` (static caches and bucketed shapes, eager), and the device-drafting methods on path ``graphs`` too,
  compiled with :data:`~pipeline.engine.static.GRAPH_COMPILE` swapped to a tracing backend that runs on a CPU
  (``backend="eager"``, ``fullgraph=True``: any graph break — a host read inside a forward — raises).
* **No recompiles as positions move.** A second generation at other positions adds no graph.
* **Compiles speak.** The first call at each new shape (a bucket's compile: tens of seconds on a GPU) runs under a
  heartbeat naming the function and the shapes; a later call at that shape says nothing.
* **One host read per round.** A ``TorchFunctionMode`` counts every call that reads a tensor on the host
  (``tolist``, ``item``, ``bool``, ``int``, ``float``, ``index``, ``numpy``) inside each round: exactly one for every
  method whose drafts stay on the device, on both paths.
* **Same law.** ``first_rounds`` on the static path emits the target's p at temperature 1 (chi-square over 300
  draws per method, pooled tail, at least three bins, fails below p = 1e-4), with first
  drafts both accepted and rejected (a round that drafted nothing counts as neither), for one method of each way the
  static path drafts (``tests.helpers.STATIC_FAMILIES``, which says why that covers the rest); every emitted position
  of those on the static path: ``test_position_law.py``.

The CUDA half (graphs captured for real, ``torch.cuda.set_sync_debug_mode("error")`` around the rounds) is in
``tests/engine/test_cuda.py``.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pipeline.engine.rounds as rounds_module
from pipeline.engine import static
from pipeline.engine.loop import generate_autoregressive, generate_speculative
from pipeline.engine.methods import METHOD_NAMES
from pipeline.engine.sampling import SamplingParams
from pipeline.engine.static import GRAPH_COMPILE, Compiled, DecodeOptions, StaticSession, resolve_path
from pipeline.errors import DrafterError
from tests.helpers import DEVICE_METHODS, STATIC_FAMILIES, compiled_shapes, first_token_law

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9)
GAMMA = 4
NEW_TOKENS = 20
GRAPH_METHODS = STATIC_FAMILIES
"""Traced whole on path graphs: one method per way of drafting (tracing every method would take minutes)."""
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def prompts(kit) -> list[list[int]]:
    _, tokenizer = kit["target"]
    texts = ("def add(a, b):\n    return", "The quick brown fox jumps over the lazy dog and then")
    return [[tokenizer.bos_token_id] + tokenizer(t, add_special_tokens=False).input_ids for t in texts]


@pytest.fixture(scope="module")
def reference(kit, prompts) -> list[list[int]]:
    target, tokenizer = kit["target"]
    return [generate_autoregressive(target, p, NEW_TOKENS, GREEDY, torch.Generator(), tokenizer.eos_token_id).tokens
            for p in prompts]


@pytest.fixture
def traced(monkeypatch) -> Iterator[list[str]]:
    """Path graphs on the CPU: the same torch.compile call with a backend that runs here (fullgraph stays, and a
    function that ran out of graphs fails instead of falling back); yields dynamo's recompile messages."""
    monkeypatch.delitem(GRAPH_COMPILE, "mode")
    monkeypatch.setitem(GRAPH_COMPILE, "backend", "eager")
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield messages
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


@pytest.mark.parametrize("method", (*METHOD_NAMES, "dflash_draft_head"))
def test_static_path_equals_autoregressive(method: str, kit, proposers, prompts, reference) -> None:
    target, tokenizer = kit["target"]
    for prompt, want in zip(prompts, reference, strict=True):
        for gamma in (1, GAMMA):
            got = generate_speculative(target, proposers[method], prompt, NEW_TOKENS, gamma, GREEDY, torch.Generator(),
                                       tokenizer.eos_token_id, DecodeOptions("static"))
            assert got.tokens == want, (method, gamma)


@pytest.mark.slow
@pytest.mark.parametrize("method", GRAPH_METHODS)
def test_graph_path_traces_whole_and_equals_autoregressive(method: str, kit, proposers, prompts, reference,
                                                           traced, monkeypatch, capsys) -> None:
    """Greedy equality on path graphs; then a sampled generation at other positions, whose recompiles (a new
    bucket's shape, or another session's forward) never come from a value or a layout: no guard on a position, a
    length or a stride."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(static, "COMPILE_NOTICE_S", 0.0)
    before = compiled_shapes()
    target, tokenizer = kit["target"]
    proposer = proposers[method]
    options = DecodeOptions("graphs")
    ar = generate_autoregressive(target, prompts[0], NEW_TOKENS, GREEDY, torch.Generator(), tokenizer.eos_token_id,
                                 options)
    assert ar.tokens == reference[0]
    first = generate_speculative(target, proposer, prompts[0], NEW_TOKENS, GAMMA, GREEDY, torch.Generator(),
                                 tokenizer.eos_token_id, options)
    assert first.tokens == reference[0] and counters["stats"]["unique_graphs"] > 0
    # every shape a compiled function saw first in this test said so, once (an earlier method's kept session has
    # compiled some already): the target's, and the drafter's unless it shares an earlier method's model
    compiles = capsys.readouterr().err
    fresh = sorted(f"compiling {c.what} for inputs {', '.join('x'.join(map(str, d)) or 'scalar' for d in shape)}"
                   for c, shapes in compiled_shapes().items() for shape in shapes - before.get(c, frozenset()))
    # every fresh shape announced once, none announced that is not fresh; a method whose every shape an earlier
    # method's kept session compiled (dynaspec after full, on some kits' lengths) announces nothing
    assert sorted(re.findall(r"\] (compiling .+): still running", compiles)) == fresh, (fresh, compiles)
    assert "the target's forward" in compiles or any(c.what == "the target's forward" for c in before)
    traced.clear()
    assert len(prompts[1]) != len(prompts[0])  # every round of the second generation is at other positions
    again = generate_speculative(target, proposer, prompts[1], NEW_TOKENS, GAMMA, SAMPLED,
                                 torch.Generator().manual_seed(5), tokenizer.eos_token_id, options)
    assert len(again.tokens) > 0
    reasons = [line.strip() for message in traced for line in message.splitlines()
               if re.match(r"- \d+/\d+: ", line.strip())]  # "- 0/3: <the guard that failed>"
    # a new bucket's shape, or a guard on another session object's structure (`self.layers`, `len(self.cache…)`):
    # never a stride (a graph per layout) nor a host value such as a position or a length
    allowed = ("size mismatch", "self.", "check_obj_id", "check_type_id")
    assert not [r for r in reasons if not any(a in r for a in allowed)], (method, reasons)


def test_each_new_shape_compiles_under_a_heartbeat_and_a_compiled_shape_replays_silently(traced, monkeypatch,
                                                                                          capsys) -> None:
    monkeypatch.setattr(static, "COMPILE_NOTICE_S", 0.0)  # a line at once: the CPU's tracing backend is quick
    function = Compiled(lambda x, scale: (x * scale).sum(-1), "the test function")
    first, again = function(torch.ones(2, 3), torch.tensor(2.0)), function(torch.ones(2, 3), torch.tensor(3.0))
    assert first.tolist() == [6.0, 6.0] and again.tolist() == [9.0, 9.0]
    err = capsys.readouterr().err
    assert err.count("compiling the test function for inputs 2x3, scalar: still running") == 1, err
    assert err.count("compiling the test function for inputs 2x3, scalar: took") == 1, err
    assert function(torch.ones(4, 3), scale=torch.tensor(1.0)).tolist() == [3.0] * 4
    assert "compiling the test function for inputs 4x3, scalar: took" in capsys.readouterr().err
    assert function.shapes == {((2, 3), ()), ((4, 3), ())}


class HostReads(TorchFunctionMode):
    """Counts calls that read a tensor's value on the host, with where they came from."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/pipeline/" in f.filename]
            self.reads.append((name, f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["eager", "static"])
@pytest.mark.parametrize("method", DEVICE_METHODS)
def test_one_host_read_per_round(method: str, path: str, kit, proposers, prompts, monkeypatch) -> None:
    target, tokenizer = kit["target"]
    per_round: list[list[tuple[str, str]]] = []
    round_fn = rounds_module.speculative_round

    def counted(*args: Any, **kwargs: Any) -> Any:
        with HostReads() as mode:
            step = round_fn(*args, **kwargs)
        per_round.append(mode.reads)
        return step

    monkeypatch.setattr("pipeline.engine.loop.speculative_round", counted)
    routed = getattr(proposers[method], "routed", None)
    if routed is not None:
        # the routed head's CPU default (per-block views) reads the chosen clusters on the host by design; a GPU
        # runs the kernel or the torch path, which reads nothing
        monkeypatch.setattr(routed, "mode", "torch")
    # no stop id: a sampled generation that met EOS within a few tokens (3 on a kit trained on another CPU) ran too few
    # rounds to count
    result = generate_speculative(target, proposers[method], prompts[1], NEW_TOKENS, GAMMA, SAMPLED,
                                  torch.Generator().manual_seed(2), None, DecodeOptions(path))
    assert len(per_round) == len(result.accepted_per_round) > 3
    # the first round may warm up per-budget caches (PA-FR decides its kept rows once per budget)
    assert all(len(reads) == 1 for reads in per_round[1:]), [r for r in per_round if len(r) != 1][:2]
    assert all(reads[0][0] == "tolist" and "/engine/rounds.py:" in reads[0][1] for reads in per_round[1:])


def test_autoregressive_reads_the_host_once_per_token_and_once_for_its_checks(kit, prompts, monkeypatch) -> None:
    """One read a token (the token), and one at the end: whether every target forward's logits were finite."""
    target, _ = kit["target"]
    with HostReads() as mode:
        result = generate_autoregressive(target, prompts[0], 12, SAMPLED, torch.Generator().manual_seed(0), None,
                                         DecodeOptions("static"))
    assert len(result.tokens) == 12 and len(mode.reads) == 12 + 1


@pytest.mark.parametrize("method", STATIC_FAMILIES)
def test_first_token_law_on_the_static_path(method: str, kit, proposers, prompts) -> None:
    target, _ = kit["target"]
    pvalue, bins, accepted, rejected = first_token_law(target, proposers[method], prompts[0], GAMMA,
                                                       SamplingParams(temperature=1.0),
                                                       options=DecodeOptions("static"))
    # three bins or more (one tests nothing), and both verification branches taken: accepted and rejected drafts
    assert bins >= 3 and pvalue >= 1e-4, (method, pvalue, bins)
    assert 0 < accepted and rejected > 0, (method, accepted, rejected)


def test_static_session_rolls_back_and_pads_like_a_dynamic_cache(kit) -> None:
    """Feeds of every bucket size, device-fed drafts, commits and rollbacks: the logits and captured hidden states
    of a static session equal a fresh dynamic-cache forward over the same ids (float64, 1e-10)."""
    from pipeline.engine.session import ModelSession

    target, _ = kit["target"]
    ids = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    static = StaticSession(target, 120, layers=(1, -1))
    dynamic = ModelSession(target, layers=(1, -1))
    steps = [("list", ids[:70]), ("tensor", ids[70:75]), ("commit", ids[:72]), ("list", ids[72:73]),
             ("tensor", ids[73:76]), ("commit", ids[:74]), ("move", ids[:80]), ("move", ids[:78])]
    for kind, value in steps:
        if kind == "commit":
            static.commit(value)
            dynamic.commit(value)
            continue
        if kind == "move":
            got, want = static.move_to(value, keep=3), dynamic.move_to(value, keep=3)
        else:
            fed = torch.tensor(value) if kind == "tensor" else value
            got, want = static.feed(fed, keep=len(value)), dynamic.feed(fed, keep=len(value))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        assert static.ids == dynamic.ids
        for a, b in zip(static.hidden(), dynamic.hidden(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with pytest.raises(DrafterError, match=r"static KV cache is full(.|\n)*at most 128 positions"):
        static.feed(ids[:64])


def test_graphs_without_a_gpu_are_refused_when_the_config_loads() -> None:
    from pipeline.config.sections import load_config

    with pytest.raises(DrafterError, match=r"evaluate.decode_path(.|\n)*graphs only with a CUDA device"):
        load_config(None, ["evaluate.device=cpu", "evaluate.decode_path=graphs"])
    with pytest.raises(DrafterError, match=r"evaluate.decode_path(.|\n)*auto, eager, static or graphs(.|\n)*fast"):
        load_config(None, ["evaluate.decode_path=fast"])
    assert load_config(None, ["evaluate.decode_path=static"]).evaluate.decode_path == "static"


def test_the_decode_path_setting() -> None:
    assert resolve_path("auto", "cpu") == "eager"
    assert resolve_path("auto", "cuda") == "graphs"
    assert resolve_path("static", "cpu") == "static"
    with pytest.raises(DrafterError, match=r"CUDA graphs need a CUDA device(.|\n)*device cpu"):
        resolve_path("graphs", "cpu")
    with pytest.raises(DrafterError, match=r"unknown decode path 'fast'"):
        resolve_path("fast", "cpu")
