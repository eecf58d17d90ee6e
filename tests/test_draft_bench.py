"""``drafter bench draft``: the weights each drafter's round reads, counted by hand from the shapes; a row per
variant with the forwards each runs; the whole bench on the test kit and a scaled Llama-3-8B shape. No test asserts
a time: the bench prints ratios for a person to read."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from pipeline.engine.static import DecodeOptions
from pipeline.evaluation.decode_bench import LLAMA_3_1_8B, scaled_shape
from pipeline.evaluation.draft_bench import bench_draft, drafting_variants, measure_drafting, operations_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SHAPE = LlamaConfig(**scaled_shape(LLAMA_3_1_8B, 64))  # hidden 64, MLP 224, vocab 2004, 32 heads of 2, 8 kv heads


def _target_parts() -> tuple[nn.Module, nn.Module]:
    return nn.Embedding(SHAPE.vocab_size, SHAPE.hidden_size), nn.Linear(SHAPE.hidden_size, SHAPE.vocab_size, bias=False)


def test_each_round_reads_what_its_forwards_use_counted_from_the_shapes() -> None:
    """float32 (4 bytes a weight), hidden h = 64, MLP m = 224, 32 query heads and 8 key/value heads of 2, vocabulary
    V = 2004, draft vocabulary d = 100, B = 8 (γ = 7). EAGLE-3: ``fc`` (3h → h) once, then per step its layer (q/k/v
    from 2h: h + 2·16 rows; o; gate, up, down; three norms) and its norm and d-row head. DFlash: ``fc`` from its
    tapped layers (at a 32-layer target, one a draft layer), each draft layer (q/k/v from h, o, the MLP, two layer
    norms and the 2-wide q/k norms), hidden_norm and norm, and the head once: the target's V rows or its own d."""
    h, m, vocab, d, kv = 64, 224, 2004, 100, 16
    embedding, head = _target_parts()
    variants = drafting_variants(SHAPE, embedding, head, block_size=8, draft_vocab_size=d, layers=(1, 2))
    assert list(variants) == ["eagle3", "dflash 1 layer, target head", "dflash 1 layer, own head",
                              "dflash 2 layers, target head", "dflash 2 layers, own head"]
    eagle3_layer = (2 * h) * (h + 2 * kv) + h * h + 3 * h * m + 3 * h  # attention from 2h, o, MLP, three norms
    eagle3 = 4 * (3 * h * h + 7 * (eagle3_layer + h + d * h))
    dflash_layer = h * (h + 2 * kv) + h * h + 3 * h * m + 2 * h + 2 * 2  # q/k/v, o, MLP, two norms, q/k norms
    dflash = {depth: 4 * (depth * h * h + depth * dflash_layer + 2 * h) for depth in (1, 2)}  # a tap a layer
    assert variants["eagle3"][1:] == (7, d, eagle3)
    for depth, layers in ((1, "1 layer"), (2, "2 layers")):
        assert variants[f"dflash {layers}, target head"][1:] == (1, vocab, dflash[depth] + 4 * vocab * h)
        assert variants[f"dflash {layers}, own head"][1:] == (1, d, dflash[depth] + 4 * d * h)


def test_a_row_per_variant_each_drafting_one_round_per_timed_call() -> None:
    """Every variant is timed over the same rounds (one untimed, then ``repeats``), each call one round: EAGLE-3's
    γ head steps, DFlash's one block forward; each shape's ratios are to its own EAGLE-3 row."""
    from pipeline.drafters.dflash import DFlashDrafter

    embedding, head = _target_parts()
    forwards = []
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, _args, _out: forwards.append(1) if isinstance(module, DFlashDrafter) else None)
    try:
        rows = measure_drafting("llama3-8b/64", SHAPE, embedding, head, block_size=6, draft_vocab_size=100,
                                layers=(1,), options=DecodeOptions("static"), repeats=3, log=lambda _line: None)
    finally:
        hook.remove()
    assert [r.drafter for r in rows] == ["eagle3", "dflash 1 layer, target head", "dflash 1 layer, own head"]
    assert [r.forwards for r in rows] == [5, 1, 1] and all(r.ms > 0 and r.path == "static" for r in rows)
    assert rows[0].time_ratio == 1.0 and rows[0].bytes_ratio == 1.0
    assert rows[1].bytes_ratio > rows[2].bytes_ratio  # the target's 2,004 head rows against its own 100
    # the prefill of the context, then one forward per call: 1 untimed round, 3 timed and 1 counted, two variants
    assert len(forwards) == 2 * (1 + 1 + 3 + 1)
    # operations: EAGLE-3's five steps each dispatch more than a fifth of one DFlash block forward's (a layer and a
    # head a step), and the head's width changes no count
    assert rows[0].operations_ratio == 1.0 and rows[0].operations > rows[1].operations > 0
    assert rows[1].operations == rows[2].operations and rows[1].operations_ratio == rows[2].operations_ratio


def test_counting_operations_counts_the_top_level_ones_and_writes_nothing(capfd) -> None:
    """Three top-level operations (``ones``, ``add_``, ``mul_``; their kernels are not counted again), and torch's
    profiler writes none of its own lines to the bench's stderr; stderr works again afterwards."""
    assert operations_of(lambda: torch.ones(3).add_(1).mul_(2)) == 3
    print("after", file=sys.stderr, flush=True)
    assert capfd.readouterr().err == "after\n"


@pytest.mark.slow
def test_drafter_bench_draft_on_the_test_kit(tmp_path, tiny_kit) -> None:
    """The whole bench: the test kit's target with its own embedding and head (DFlash at 1, 2 and the published 5
    layers, B = 6, an own head of count.draft_vocab_size rows), then Llama-3.1-8B's shape scaled down."""
    from tests.helpers import small_cfg

    table = bench_draft(small_cfg(tmp_path, "train_dflash.block_size=6"), steps=1, scale=64)
    lines = table.splitlines()
    assert lines[0] == "## Drafting a round at γ = 5: EAGLE-3's chain against one DFlash block forward"
    rows = [line for line in lines if line.startswith("| target |") or line.startswith("| llama3-8b/64 |")]
    assert len(rows) == 2 * 7  # EAGLE-3 and DFlash at 1, 2 and 5 layers with either head, on each shape
    # EAGLE-3's head: count.draft_vocab_size = 64 rows on the kit, 32,768 / 64 at the scaled shape; DFlash's target
    # head: the test kit's 1,024 rows and 128,256 / 64
    for shape, draft, vocab in (("target", 64, "1,024"), ("llama3-8b/64", 512, "2,004")):
        shape = re.escape(shape)
        assert re.search(rf"\| {shape} \| cpu [^|]* \| \w+ \| eagle3 \| 5 \| {draft} \| [0-9.,]+ \| 1\.00× \| "
                         r"[0-9.]+ \| 1\.00× \| [0-9,]+ \| 1\.00× \|$", table, re.MULTILINE)
        assert re.search(rf"\| {shape} \| .* \| dflash 5 layers, own head \| 1 \| {draft} \|", table)
        assert re.search(rf"\| {shape} \| .* \| dflash 2 layers, target head \| 1 \| {vocab} \|", table)
