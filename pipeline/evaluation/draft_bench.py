"""``drafter bench draft``: what one round's drafting costs, EAGLE-3's chain of γ steps against DFlash's one block
forward, by DFlash depth and head, at the configured target's shape and at Llama-3.1-8B's, in one run on one device.

Both drafters get random weights: what a forward costs does not depend on what it learnt, so any depth and head can
be timed without training it. Each round is the bench's bare drafting (:func:`~pipeline.evaluation.decode_bench.
bare_drafter`): the forwards over the round's new context rows and the head rows, at ``γ = B − 1``
(``train_dflash.block_size``), through the registry's proposers on ``evaluate.decode_path``. The variants of each
shape are timed in turn (:func:`~pipeline.timing.interleaved_times`), so their ratios to EAGLE-3's round hold on a
shared machine.

Beside each time the table gives the **weights a round reads**: the bytes of every weight the round's forwards use,
counted once per forward that uses them (EAGLE-3's layer and head ``γ`` times, DFlash's layers and head once), and
the **operations a round dispatches**: torch's top-level operations in one round, counted by its profiler on the host
(on a CPU each costs a few microseconds whatever its size; on a GPU each launches at least one kernel). At a serving
shape a drafter at batch 1 is bound by its bytes, and its time ratio follows their ratio. At the tiny kit's shape it
is bound by its operations and the time ratio sits far above the bytes ratio: a second DFlash layer there adds about
a tenth of EAGLE-3's bytes and a sixth of its time. Both regimes in one table say what a cost ratio measured on the kit
stands for at a serving shape.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pipeline.config.sections import PipelineConfig
from pipeline.drafters.dflash import DFlashConfig, DFlashDrafter
from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.engine.inputs import BlockFeatureInputs, FeatureInputs
from pipeline.engine.methods import DECODE_BENCH, METHODS, build_proposer
from pipeline.engine.static import DecodeOptions
from pipeline.evaluation.decode_bench import (
    LLAMA_3_1_8B,
    LLAMA_DRAFT_VOCAB,
    bare_drafter,
    random_draft_vocab,
    scaled_shape,
)
from pipeline.evaluation.evaluator import decode_options
from pipeline.evaluation.matrix import resolve_device
from pipeline.models.target import Target
from pipeline.timing import device_name, interleaved_times

CONTEXT = 512
"""Context rows cached before a timed round."""


@dataclass
class DraftRow:
    """One drafter's round on one shape: its time and the weights it reads, each also as a ratio to EAGLE-3's."""

    shape: str
    device: str
    path: str
    drafter: str
    forwards: int
    head_rows: int
    weight_bytes: int
    ms: float
    eagle3_bytes: int
    eagle3_ms: float
    operations: int
    eagle3_operations: int

    @property
    def bytes_ratio(self) -> float:
        return self.weight_bytes / self.eagle3_bytes

    @property
    def time_ratio(self) -> float:
        return self.ms / self.eagle3_ms

    @property
    def operations_ratio(self) -> float:
        return self.operations / self.eagle3_operations


def _bytes(*modules: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for module in modules for p in module.parameters())


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at ``/dev/null`` for the block: torch's profiler (Kineto) writes lines such as
    ``USDT:… profiler_start`` from C++ at each start and stop, whatever its log level, between the bench's own
    progress lines. Python's exceptions are unaffected (they are printed after the block, once fd 2 is back)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def operations_of(fn: Callable[[], Any]) -> int:
    """Top-level torch operations one call of ``fn`` dispatches, counted by torch's profiler on the host."""
    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.cpu_parent is None)


def eagle3_round_bytes(drafter: Eagle3Drafter, gamma: int) -> int:
    """Weights one EAGLE-3 round reads: ``fc`` once (the target's features, in the first forward) and the layer, its
    norm and the draft-vocabulary head in each of the ``γ`` steps."""
    return _bytes(drafter.fc) + gamma * _bytes(drafter.midlayer, drafter.norm, drafter.lm_head)


def dflash_round_bytes(drafter: DFlashDrafter) -> int:
    """Weights one DFlash round reads: ``fc``, every layer, the norms and the head (its own, or the target's whole
    one), each once."""
    return _bytes(drafter.fc, drafter.hidden_norm, drafter.layers, drafter.norm, drafter.lm_head)


def _method_of(inputs: type) -> str:
    """The decode bench's method that drafts from ``inputs`` (the registry's name for it)."""
    return next(method for method in DECODE_BENCH if METHODS[method].inputs is inputs)


def drafting_variants(target_config: Any, embedding: nn.Module, head: nn.Module, *, block_size: int,
                      draft_vocab_size: int, layers: tuple[int, ...], dflash_shape: dict | None = None,
                      ) -> dict[str, tuple[Any, int, int, int]]:
    """EAGLE-3 and DFlash at ``layers`` draft layers with the target's head and with an own ``draft_vocab_size``-row
    head, random weights in the embedding's dtype and device, through the registry: name → (proposer, forwards a
    round, head rows, weight bytes a round). ``dflash_shape``: the keyword arguments of
    :meth:`DFlashConfig.from_target` that widen the draft layers (``train_dflash``'s)."""
    vocab = int(target_config.vocab_size)
    weight = embedding.weight
    maps = random_draft_vocab(vocab, draft_vocab_size)
    gamma = block_size - 1
    torch.manual_seed(0)
    with torch.device(weight.device):  # initialised where it runs: ~1B float32 parameters are slow to fill on a CPU
        eagle3 = Eagle3Drafter(Eagle3Config.from_target(target_config, draft_vocab_size=draft_vocab_size), embedding)
    eagle3 = eagle3.to(dtype=weight.dtype).eval()
    eagle3.set_vocab_maps(*maps)
    chain, block = _method_of(FeatureInputs), _method_of(BlockFeatureInputs)
    out = {chain: (build_proposer(chain, FeatureInputs(eagle3, target_vocab_size=vocab)), gamma, draft_vocab_size,
                   eagle3_round_bytes(eagle3, gamma))}
    for depth in layers:
        for own in (False, True):
            config = DFlashConfig.from_target(target_config, num_hidden_layers=depth, block_size=block_size,
                                              mask_token_id=vocab - 1, **(dflash_shape or {}),
                                              draft_vocab_size=draft_vocab_size if own else None)
            with torch.device(weight.device):
                dflash = DFlashDrafter(config, embedding, head)
            dflash = dflash.to(dtype=weight.dtype).eval()
            if own:
                dflash.set_vocab_maps(*maps)
            name = f"{block} {depth} layer{'s' if depth > 1 else ''}, {'own' if own else 'target'} head"
            out[name] = (build_proposer(block, BlockFeatureInputs(dflash, target_vocab_size=vocab)), 1,
                         draft_vocab_size if own else vocab, dflash_round_bytes(dflash))
    return out


def measure_drafting(shape: str, target_config: Any, embedding: nn.Module, head: nn.Module, *, block_size: int,
                     draft_vocab_size: int, layers: tuple[int, ...], options: DecodeOptions, repeats: int,
                     dflash_shape: dict | None = None, log: Callable[[str], None] = print) -> list[DraftRow]:
    """The rows of one shape: every variant of :func:`drafting_variants` timed in turn, ``repeats`` rounds each
    (after one untimed), medians in milliseconds; then one more round of each, its operations counted
    (:func:`operations_of`)."""
    device = embedding.weight.device
    gamma = block_size - 1
    sized = replace(options, capacity=CONTEXT + 2 * block_size + 8)
    variants = drafting_variants(target_config, embedding, head, block_size=block_size,
                                 draft_vocab_size=draft_vocab_size, layers=layers, dflash_shape=dflash_shape)
    vocab_only = SimpleNamespace(config=target_config)  # bare_drafter reads the target's vocabulary size alone
    with torch.no_grad():
        fns = {name: bare_drafter(proposer, vocab_only, sized, CONTEXT, gamma, gamma - 1)
               for name, (proposer, *_) in variants.items()}
        log(f"bench draft {shape}: timing {len(fns)} drafters in turn, {repeats} rounds each")
        times = interleaved_times(fns, device, repeats, warmup=1)
        operations = {name: operations_of(fn) for name, fn in fns.items()}
    where = device_name(device)
    ms = {name: 1e3 * float(np.median(seconds)) for name, seconds in times.items()}
    chain = next(iter(variants))  # the chain drafter comes first: every ratio is to its round
    return [DraftRow(shape, where, options.path, name, forwards, head_rows, weight_bytes, ms[name],
                     variants[chain][3], ms[chain], operations[name], operations[chain])
            for name, (_, forwards, head_rows, weight_bytes) in variants.items()]


def draft_table(rows: list[DraftRow], gamma: int) -> str:
    """The rows as a markdown table, each shape's ratios against its own EAGLE-3 row."""
    lines = [f"## Drafting a round at γ = {gamma}: EAGLE-3's chain against one DFlash block forward", "",
             "| shape | device | path | drafter | forwards | head rows | weights read, MB | ÷ EAGLE-3 | ms a round "
             "| ÷ EAGLE-3 | operations a round | ÷ EAGLE-3 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.shape} | {r.device} | {r.path} | {r.drafter} | {r.forwards} | {r.head_rows:,} | "
                     f"{r.weight_bytes / 1e6:,.1f} | {r.bytes_ratio:.2f}× | {r.ms:.3f} | {r.time_ratio:.2f}× | "
                     f"{r.operations:,} | {r.operations_ratio:.2f}× |")
    return "\n".join(lines)


def bench_draft(cfg: PipelineConfig, steps: int = 10, scale: int = 1) -> str:
    """``drafter bench draft``: :func:`measure_drafting` at the configured target's shape (its own embedding and
    head; DFlash tapping and widened as ``train_dflash`` says, own head of ``count.draft_vocab_size`` rows) and at
    Llama-3.1-8B's (random bf16 weights, 32k own head; every width divided by ``scale`` for a smoke run), DFlash at
    1, 2, ``train_dflash.num_layers`` and the published 5 layers, ``B = train_dflash.block_size``. The 8B shape's
    drafters are all built at once: about 12 GB of memory on the device (a minute on a 2-core CPU)."""
    from transformers import LlamaConfig  # deferred: pulls in transformers

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    tc = cfg.train_dflash
    device = resolve_device(cfg.evaluate)
    options = decode_options(cfg.evaluate, device)
    layers = tuple(sorted({1, 2, tc.num_layers, 5}))
    block = tc.block_size
    target = Target(cfg.target).model(device)
    widened = {"num_key_value_heads": tc.num_key_value_heads, "intermediate_size": tc.intermediate_size,
               "num_attention_heads": tc.num_attention_heads,
               "target_layer_ids": tuple(tc.target_layer_ids) if tc.target_layer_ids else None}
    rows = measure_drafting("target", target.config, target.get_input_embeddings(), target.get_output_embeddings(),
                            block_size=block, draft_vocab_size=min(cfg.count.draft_vocab_size,
                                                                   int(target.config.vocab_size) - 1),
                            layers=layers, options=options, repeats=steps, dflash_shape=widened, log=log)
    del target
    shape = LlamaConfig(**scaled_shape(LLAMA_3_1_8B, scale))
    with torch.device(device):
        embedding = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=torch.bfloat16)
        head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, dtype=torch.bfloat16)
    rows += measure_drafting("llama3-8b" if scale == 1 else f"llama3-8b/{scale}", shape, embedding, head,
                             block_size=block, draft_vocab_size=max(2, LLAMA_DRAFT_VOCAB // scale), layers=layers,
                             options=options, repeats=steps, log=log)
    return draft_table(rows, block - 1)
