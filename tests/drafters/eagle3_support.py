"""Builders the EAGLE-3 drafter's unit tests share (test_eagle3.py, test_eagle3_objective.py): a random 3-layer Llama
config, a drafter over a 40-id draft vocabulary and a batch of features and target logits."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from transformers import LlamaConfig

from pipeline.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from pipeline.vocab.counting import eagle3_offset_maps

H, V, VD = 32, 1000, 40  # V and VD differ from every other size, so a tensor's vocab dim is recognisable
DRAFT_IDS = np.sort(np.random.default_rng(0).choice(V, VD, replace=False))


def llama(num_layers: int = 3, vocab: int = V, rope: dict | None = None) -> LlamaConfig:
    """The config; ``rope``: its RoPE parameters (default: plain RoPE), set when it is built, so transformers
    completes them as it does a loaded config's."""
    return LlamaConfig(hidden_size=H, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, num_hidden_layers=num_layers, vocab_size=vocab, rms_norm_eps=1e-6,
                       max_position_embeddings=64,
                       rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": 1e4})


def make_drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = Eagle3Config.from_target(llama(), VD)
    drafter = Eagle3Drafter(config, nn.Embedding(V, H))
    drafter.set_vocab_maps(*eagle3_offset_maps(DRAFT_IDS, V))
    return drafter


def random_batch(batch: int = 2, length: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[:, :3] = 0  # a prompt
    mask[0, -2:] = 0  # and some right padding
    # Target logits that peak inside the draft vocabulary, except at position 5 (to be left out of the loss).
    logits = 3 * torch.randn(batch, length, V, generator=gen)
    logits[..., DRAFT_IDS] += 6
    logits[:, 5, int(np.setdiff1d(np.arange(V), DRAFT_IDS)[0])] += 100
    return {"input_ids": torch.randint(0, V, (batch, length), generator=gen), "loss_mask": mask,
            "hidden": torch.randn(batch, length, 3 * H, generator=gen), "logits": logits}
