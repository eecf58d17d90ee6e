"""``drafter bench decode`` (issue 23, part 3): its rows at the kit's shape and at a scaled Llama-3-8B shape on the
CPU, and the formulas its columns apply. No test asserts a time: the bench prints ratios for a person to read."""

from __future__ import annotations

import math
import re

import pytest
import torch

from pipeline.engine.metrics import expected_tokens_per_round
from pipeline.engine.static import DecodeOptions
from pipeline.evaluation.decode_bench import (
    DecodeRow,
    bare_drafter,
    decode_table,
    llama3_8b_models,
    measure,
    verify_curve,
    verify_curve_line,
)
from pipeline.timing import FLUSH_FALLBACK_BYTES, CacheFlusher, last_level_cache_bytes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_columns_follow_their_definitions() -> None:
    row = DecodeRow("tiny", "cpu", "eager", "eagle3", 4, rounds=10, tau=3.0, alpha=0.7, round_ms=2.0, draft_ms=1.2,
                    verify_ms=0.7, rest_ms=0.1, bare_draft_ms=1.0, bare_verify_ms=0.6, bare_ar_ms=0.5,
                    tokens_per_s=900.0, ar_tokens_per_s=600.0, ar_token_ms=1.5)
    assert math.isclose(row.overhead, 2.0 / 1.6)
    assert math.isclose(row.speedup, 1.5) and math.isclose(row.steady_speedup, 3.0 * 1.5 / 2.0)
    assert math.isclose(row.predicted, expected_tokens_per_round(0.7, 4) * 0.5 / 1.6)
    assert row.projected is None  # measured acceptance: nothing projected
    row.alpha_used = 0.6
    assert math.isclose(row.projected, expected_tokens_per_round(0.6, 4) * 0.5 / 2.0)


@pytest.mark.slow
def test_scaled_llama3_shape_rows_are_projected_from_the_kit() -> None:
    """The llama3-8b builder at 1/64 of every width (the same code the GPU runs), through the registry and the
    static path: a row per method with its bare forwards timed, and a projected speedup where the kit gave α."""
    target, proposers = llama3_8b_models(torch.device("cpu"), torch.float32, scale=64, dflash_layers=2, block_size=6)
    assert set(proposers) == {"full", "dynaspec", "eagle3", "dflash"}
    prompts = [torch.randint(3, 1000, (24,), generator=torch.Generator().manual_seed(0)).tolist()]
    kit_alpha = {("eagle3", 3): 0.8, ("dflash", 3): 0.6}
    rows = measure("llama3-8b", target, proposers, prompts, [3], 8, DecodeOptions("static"), repeats=2,
                   kit_alpha=kit_alpha, log=lambda _line: None)
    assert [r.method for r in rows] == list(proposers)
    for row in rows:
        assert row.path == "static" and row.rounds > 0 and row.bare_draft_ms is not None and row.bare_verify_ms > 0
        assert (row.projected is not None) == ((row.method, 3) in kit_alpha)
        assert row.bare_samples == 2  # repeats=2 over one prompt: each median is of two calls, and the table says so
    table = decode_table(rows)
    assert "(n 2) |" in table and "bare draft + verify ms (n) |" in table
    assert "(projected)" in table and "| llama3-8b |" in table and "— (no kit row)" in table
    _, some = llama3_8b_models(torch.device("cpu"), torch.float32, scale=64, dflash_layers=2, block_size=6,
                               methods=("dflash", "eagle3"))
    assert list(some) == ["eagle3", "dflash"]  # the bench's order; the 1B drafter and router are not built


@pytest.mark.slow
def test_drafter_bench_decode_on_the_test_kit(tmp_path, tiny_kit, mlflow_server, capsys) -> None:
    """`drafter bench decode` through the CLI on a config whose count artifact is built: evaluate's own
    configurations on evaluate's prompts, a row for the full head, a line naming the methods whose artifacts are not
    built, and on a CPU a line saying the llama3-8b shape needs CUDA. Without the count artifact it says what to run."""
    from jobs import count, generate
    from jobs.cli import main
    from tests.helpers import SMALL, small_cfg

    overrides = [f"workdir={tmp_path}", f"mlflow.tracking_uri={mlflow_server.uri}", "evaluate.prompts_per_task=1",
                 "evaluate.max_new_tokens=8", "evaluate.gammas=[3]"]
    cfg = small_cfg(tmp_path, *overrides[1:])
    assert main(["bench", "decode", "--steps", "2", *SMALL, *overrides]) == 2
    assert re.search(r"(?s)read the count artifact.*drafter count", capsys.readouterr().err)
    generate.main(cfg)
    count.main(cfg)
    assert main(["bench", "decode", "--steps", "2", "--shape", "llama3-8b", *SMALL, *overrides]) == 0
    out = capsys.readouterr().out
    assert "| tiny | cpu" in out and "| full | 3 |" in out
    assert "not timed: dynaspec, eagle3, dflash" in out and "llama3-8b: needs a CUDA device" in out
    assert re.search(r"tiny: the target's forward by tokens fed .*1: [0-9.]+ \(1\.00×\), .*4: [0-9.]+ \([0-9.]+×\)\.",
                     out)  # 1 .. max γ + 1 = 4
    assert main(["bench", "decode", "--steps", "2", "--methods", "full,eagle3", *SMALL, *overrides]) == 0
    out = capsys.readouterr().out
    assert "| full | 3 |" in out and "not timed: eagle3 (" in out  # only the asked-for ones, built or not
    assert main(["bench", "decode", "--methods", "full,nonesuch", *SMALL, *overrides]) == 2
    assert re.search(r"(?s)does not time.*found:\s+nonesuch", capsys.readouterr().err)


def test_each_rows_timings_are_paired_in_time_prompt_by_prompt(monkeypatch) -> None:
    """What a row divides is measured side by side: per prompt, autoregressive decoding, the method's decoding, then
    its bare forwards (rebuilt after that generation), so a load that comes and goes weighs on both sides of every
    ratio. Measured one after the other, a busy 2-core host moved one method's engine overhead between 1.04× and
    1.56× from run to run."""
    import pipeline.evaluation.decode_bench as bench

    target, proposers = llama3_8b_models(torch.device("cpu"), torch.float32, scale=64, dflash_layers=1, block_size=4,
                                         methods=("dflash",))
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 16)]
    trace: list[tuple[str, int]] = []

    def traced(kind: str, fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            prompt = next(a for a in args if isinstance(a, list))
            trace.append((kind, len(prompt)))
            return fn(*args, **kwargs)
        return call

    def bare(kind: str, fn):  # noqa: ANN001, ANN202
        def build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            run = fn(*args, **kwargs)
            return None if run is None else lambda: (trace.append((kind, 0)), run())[1]
        return build

    monkeypatch.setattr(bench, "generate_autoregressive", traced("ar", bench.generate_autoregressive))
    monkeypatch.setattr(bench, "generate_speculative", traced("spec", bench.generate_speculative))
    monkeypatch.setattr(bench, "bare_target", bare("bare target", bench.bare_target))
    monkeypatch.setattr(bench, "bare_drafter", bare("bare drafter", bench.bare_drafter))
    rows = measure("llama3-8b", target, proposers, prompts, [3], 6, DecodeOptions("static"), repeats=4,
                   log=lambda _line: None)
    assert len(rows) == 1 and rows[0].bare_draft_ms is not None
    headline = [("ar", 12), ("ar", 16)] * 2 + [("bare target", 0)] * (3 + 4)  # warm-up, timed, the bare AR forward
    assert trace[: len(headline)] == headline
    rest = trace[len(headline):]
    assert rest[:2] == [("spec", 12), ("spec", 16)]  # the method's warm-up
    # then per prompt: AR, the method, and 1 warm-up + 2 timed rounds of (verify, one-token forward, drafter) in turn
    per_prompt = [("bare target", 0), ("bare target", 0), ("bare drafter", 0)] * 3
    assert rest[2:] == [("ar", 12), ("spec", 12), *per_prompt, ("ar", 16), ("spec", 16), *per_prompt]


def test_bare_drafting_of_either_drafter_family_is_its_forwards_and_head_rows_over_the_rounds_new_context() -> None:
    """The bare drafter costs a DFlash row is divided by are what EAGLE-3's are: the forwards over the round's
    ``catch_up`` new context rows and the head, returning logits (neither standardises: a one-hot greedy ``q`` over
    the vocabulary is the proposer's, not the forward's), with the context cache back at ``length`` after each call."""
    target, proposers = llama3_8b_models(torch.device("cpu"), torch.float32, scale=64, dflash_layers=1, block_size=4,
                                         methods=("eagle3", "dflash"))
    options, length, catch_up = DecodeOptions("eager"), 12, 3
    dflash = proposers["dflash"]
    fed: list[int] = []
    forward = dflash.drafter.forward

    def counted(block_ids, target_hidden, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        fed.append(int(target_hidden.shape[1]))
        return forward(block_ids, target_hidden, *args, **kwargs)

    dflash.drafter.forward = counted
    run = bare_drafter(dflash, target, options, length, 3, catch_up)
    assert fed == [length]  # the cache filled once, outside the timed call
    for _ in range(3):
        out = run()
        assert dflash.cache.length == length
    assert fed[1:] == [catch_up] * 3
    vocab = int(target.config.vocab_size)
    assert out.shape == (dflash.block_size - 1, vocab) and out.dtype == torch.float32
    assert not bool(((out == 0) | (out == 1)).all())  # logits, not a one-hot distribution
    eagle3 = bare_drafter(proposers["eagle3"], target, options, length, 3, catch_up)()
    assert eagle3.dtype == torch.float32 and not bool(((eagle3 == 0) | (eagle3 == 1)).all())


def test_with_cold_caches_every_bare_forward_follows_an_eviction_of_the_caches(monkeypatch) -> None:
    """``drafter bench decode --cold``: each timed bare forward (warm-up included) runs right after the flusher, which
    writes a buffer of four times the last-level cache; decoding itself is not flushed."""
    import pipeline.evaluation.decode_bench as bench

    target, proposers = llama3_8b_models(torch.device("cpu"), torch.float32, scale=64, dflash_layers=1, block_size=4,
                                         methods=("dflash",))
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 16)]
    trace: list[str] = []
    sizes: list[int] = []

    def flusher(device):  # noqa: ANN001, ANN202
        flush = CacheFlusher(device)
        sizes.append(flush.bytes)
        return lambda: (trace.append("flush"), flush())[1]

    def bare(fn):  # noqa: ANN001, ANN202
        def build(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            run = fn(*args, **kwargs)
            return None if run is None else lambda: (trace.append("bare"), run())[1]
        return build

    def traced(fn):  # noqa: ANN001, ANN202
        return lambda *args, **kwargs: (trace.append("decode"), fn(*args, **kwargs))[1]

    monkeypatch.setattr(bench, "CacheFlusher", flusher)
    monkeypatch.setattr(bench, "bare_target", bare(bench.bare_target))
    monkeypatch.setattr(bench, "bare_drafter", bare(bench.bare_drafter))
    monkeypatch.setattr(bench, "generate_speculative", traced(bench.generate_speculative))
    rows = measure("llama3-8b", target, proposers, prompts, [3], 6, DecodeOptions("eager"), repeats=4,
                   log=lambda _line: None, cold=True)
    assert len(rows) == 1 and rows[0].bare_draft_ms is not None
    paired = trace[trace.index("decode"):]
    paired = paired[paired.index("decode", 2):]  # after the method's warm-up decodes
    bares = [i for i, event in enumerate(paired) if event == "bare"]
    assert len(bares) == 2 * 3 * 3  # per prompt: 1 warm-up + 2 timed rounds of verify, one-token forward, drafter
    assert all(paired[i - 1] == "flush" for i in bares)
    assert paired.count("flush") == len(bares)  # nothing else is flushed: decoding runs as it would
    llc = last_level_cache_bytes(torch.device("cpu"))
    assert sizes == [4 * (llc or FLUSH_FALLBACK_BYTES // 4)]


def test_the_verify_curve_times_the_targets_forward_of_each_token_count_in_turn(monkeypatch) -> None:
    """The verify cost curve: for n = 1 .. most, the target's forward of n device-fed tokens after the bench's context
    length, timed in turn within each repetition, one median a count; the line names
    every count with its ratio to one token's."""
    import pipeline.evaluation.decode_bench as bench

    target, _ = llama3_8b_models(torch.device("cpu"), torch.float32, scale=64, methods=("dflash",))
    prompts = [torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 16)]
    fed: list[tuple[int, int]] = []
    built: list[int] = []
    original = bench.bare_target

    def bare(target_, options, layers, length, n):  # noqa: ANN001, ANN202
        built.append(n)
        run = original(target_, options, layers, length, n)

        def call():  # noqa: ANN202
            out = run()
            fed.append((n, out.shape[0]))
            return out

        return call

    monkeypatch.setattr(bench, "bare_target", bare)
    curve = verify_curve(target, prompts, 6, 4, DecodeOptions("eager"), repeats=3)
    assert built == [1, 2, 3, 4] and sorted(curve) == [1, 2, 3, 4]
    assert all(ms > 0 for ms in curve.values())
    assert [n for n, _ in fed] == [1, 2, 3, 4] * (1 + 3)  # one warm-up round, then three timed ones, in turn
    assert all(rows == n for n, rows in fed)  # a forward of n tokens gives n rows of logits
    line = verify_curve_line("tiny", {1: 2.0, 2: 3.0, 3: 3.0})
    assert line.startswith("tiny: the target's forward by tokens fed")
    assert "1: 2.000 (1.00×), 2: 3.000 (1.50×), 3: 3.000 (1.50×)" in line


def test_the_last_level_cache_is_the_highest_level_sysfs_lists() -> None:
    import pathlib

    root = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")
    if not root.is_dir():
        assert last_level_cache_bytes(torch.device("cpu")) is None
        return
    levels = {}
    for entry in root.glob("index*"):
        size = (entry / "size").read_text().strip()
        levels[int((entry / "level").read_text())] = int(size[:-1]) * {"K": 2**10, "M": 2**20}[size[-1]]
    assert last_level_cache_bytes(torch.device("cpu")) == levels[max(levels)]
