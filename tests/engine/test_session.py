"""``common_prefix_length`` and ``SessionBase.commit``: what every round calls on the whole context.

They run in C over the shared prefix instead of a Python loop over every position (a session holding rejected
drafts, or positions fed from the device as ``-1``, parts from the context a few positions before its end). Each is
checked against the plain definition on random sequences: any length, parting anywhere or nowhere, lists or tuples.
"""

from __future__ import annotations

import random

from pipeline.engine.session import ModelSession, common_prefix_length


def _by_definition(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _pairs(count: int, seed: int = 0):  # noqa: ANN202 - an iterator of (a, b)
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.choice([rng.randrange(0, 12), rng.randrange(0, 700), rng.randrange(4000, 5000)])
        a = [rng.randrange(3, 2048) for _ in range(n)]
        b = list(a)
        if n and rng.random() < 0.8:  # part at a random position, or near the end as a round does
            k = rng.randrange(n) if rng.random() < 0.5 else max(0, n - 1 - rng.randrange(10))
            b[k] = -1 if rng.random() < 0.5 else a[k] + 1
        b = b[: rng.randrange(0, n + 1)] if rng.random() < 0.3 else b
        yield a, b + [rng.randrange(3, 2048) for _ in range(rng.randrange(0, 5))]


def test_common_prefix_length_is_the_definitions_on_random_sequences() -> None:
    parted = 0
    for a, b in _pairs(3000):
        expected = _by_definition(a, b)
        parted += expected < min(len(a), len(b))
        for x, y in ((a, b), (b, a), (tuple(a), b), (a, tuple(b))):
            assert common_prefix_length(x, y) == expected, (len(x), len(y), expected)
    assert parted > 1000  # most pairs part before either ends, so the search after the first comparison runs


def test_commit_names_the_positions_fed_from_the_device_and_drops_the_rest() -> None:
    """A real session (a small random Llama): the context fed from the host, a round's drafts fed from the device
    (``-1`` on the host), then the context and the accepted drafts committed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024)
    session = ModelSession(LlamaForCausalLM(config).eval())
    rng = random.Random(1)
    with torch.no_grad():
        for a, _ in _pairs(40, seed=2):
            a = a[:600]
            if len(a) < 2:
                continue
            fed = rng.randrange(1, min(8, len(a) - 1) + 1)
            session.move_to(a[: len(a) - fed])
            session.feed(torch.tensor(a[len(a) - fed :]))
            assert session.ids[len(a) - fed :] == [-1] * fed
            kept = rng.randrange(len(a) - fed, len(a) + 1)  # the context and the accepted drafts
            session.commit(a[:kept])
            assert session.ids == a[:kept]
