"""``drafter bench fingerprint``: what a plan pays to fingerprint a large local checkpoint, first and after.

Writes a synthetic checkpoint of ``gib`` GiB (shards of safetensors, as ``save_pretrained`` leaves them), then
times :func:`pipeline.models.loading.local_weights_digest` with an empty stat cache (every byte hashed) and again
with the cache it wrote (a ``stat`` per file), and prints the ratio and the time extrapolated to Llama-3-8B's
16 GB of bf16 weights. The first figure is a page-cache read: on a cold disk it is bounded by the disk instead.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from pipeline.checksums import StatCache
from pipeline.models.loading import local_weights_digest

LLAMA3_8B_BYTES = 16.06e9


def bench_fingerprint(gib: float = 2.0, shard_gib: float = 0.5) -> str:
    import torch
    from safetensors.torch import save_file


    with tempfile.TemporaryDirectory(prefix="drafter-bench-fp-") as tmp:
        root = Path(tmp) / "ckpt"
        root.mkdir()
        (root / "config.json").write_text('{"model_type": "llama"}')
        total, shard = int(gib * 2**30), int(shard_gib * 2**30)
        for i, start in enumerate(range(0, total, shard)):
            size = min(shard, total - start) // 2
            save_file({"w": torch.randint(-2**15, 2**15, (size,), dtype=torch.int16)},
                      str(root / f"model-{i:05d}.safetensors"))
        cache_file = Path(tmp) / "stat.json"
        first = StatCache(cache_file)
        start = time.perf_counter()
        digest = local_weights_digest(root, first)
        hashed = time.perf_counter() - start
        second = StatCache(cache_file)
        start = time.perf_counter()
        assert local_weights_digest(root, second) == digest
        cached = time.perf_counter() - start
    rate = total / hashed
    return (f"fingerprint of a {gib:g} GiB local checkpoint ({first.hashed} files hashed):\n"
            f"  first plan (sha256 of every byte): {hashed:.2f} s ({rate / 1e9:.2f} GB/s)\n"
            f"  next plans (stat cache, {second.hashed} files hashed): {cached * 1e3:.2f} ms "
            f"= {cached / hashed:.5f}x the first ({hashed / cached:,.0f}x faster)\n"
            f"  at Llama-3-8B's 16.06 GB of bf16 weights: first ~{LLAMA3_8B_BYTES / rate:.0f} s, then ~{cached * 1e3:.1f} ms")
