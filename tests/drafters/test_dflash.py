"""The DFlash network (pipeline/drafters/dflash.py) and its files (pipeline/drafters/dflash_export.py): its
state dict is exactly the reference layout, the block attends bidirectionally and only to the context before it,
the many-anchor training forward equals one inference forward per block, the artifact and both serving layouts
round-trip, and the tapped layers read the same ``hidden_states`` entries through either layout (the off-by-one
between the reference numbering and ``speculators``). With a draft-vocabulary head (``head: draft``) the head and its
maps join the state dict and both layouts, tampered maps are refused, and the loss learns only rows whose token
the head can draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.drafters.dflash import (
    ContextCache,
    DFlashConfig,
    DFlashDrafter,
    StaticContextCache,
    default_target_layer_ids,
    reference_keys,
)
from pipeline.drafters.dflash_export import (
    export_reference,
    export_speculators,
    hidden_state_indices_of,
    load_dflash,
    load_reference_export,
    save_dflash,
)
from pipeline.errors import DrafterError
from pipeline.training.dflash_task import (
    Blocks,
    DFlashTask,
    block_attention,
    block_loss,
    blocks_at,
    join_blocks,
    next_round_blocks,
    tapped_features,
)


def _target(layers: int = 6, hidden: int = 32, vocab: int = 97) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float64).eval()


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return _target()


DRAFT_IDS = torch.tensor([0, 3, 4, 10, 11, 12, 30, 50, 51, 52, 60, 70, 80, 90, 95])
"""A draft vocabulary of 15 of the fixture target's 97 ids."""


def _drafter(target: torch.nn.Module, *, layers: int = 2, block: int = 4, seed: int = 1,
             draft_ids: torch.Tensor | None = None) -> DFlashDrafter:
    from pipeline.vocab.counting import eagle3_offset_maps

    config = DFlashConfig.from_target(target.config, num_hidden_layers=layers, block_size=block, mask_token_id=96,
                                      draft_vocab_size=None if draft_ids is None else int(draft_ids.numel()))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config, target.get_input_embeddings(), target.get_output_embeddings())
    if draft_ids is not None:
        drafter.set_vocab_maps(*eagle3_offset_maps(draft_ids.numpy(), 97))
    with torch.no_grad():  # non-trivial norms, so a swapped or skipped norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return drafter.to(torch.float64).eval()


def test_default_tapped_layers() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # the published Qwen3-8B drafter
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(4, 2) == (0, 2)  # the tiny kit: spread over 0 .. L - 2
    assert default_target_layer_ids(2, 1) == (0,)
    with pytest.raises(DrafterError, match="target_layer_ids"):
        DFlashConfig.from_target(_target(layers=4).config, num_hidden_layers=1, block_size=4, mask_token_id=0,
                                 target_layer_ids=(1, 4))
    with pytest.raises(DrafterError, match=r"\[0, 2\](.|\n)*no server captures"):  # the last layer's: post-norm
        DFlashConfig.from_target(_target(layers=4).config, num_hidden_layers=1, block_size=4, mask_token_id=0,
                                 target_layer_ids=(1, 3))


def test_state_dict_is_exactly_the_reference_layout(target) -> None:
    drafter = _drafter(target)
    assert sorted(drafter.trainable_state_dict()) == sorted(reference_keys(drafter.config))
    assert "embed_tokens.weight" not in drafter.state_dict() and "lm_head.weight" not in drafter.state_dict()
    assert not target.get_input_embeddings().weight.requires_grad
    assert not target.get_output_embeddings().weight.requires_grad
    assert drafter.fc.weight.shape == (32, 2 * 32)  # two tapped layers x hidden


def _features(target: torch.nn.Module, drafter: DFlashDrafter, ids: torch.Tensor) -> torch.Tensor:
    hidden, _ = tapped_features(target, ids, None, drafter.config.hidden_state_indices)
    return hidden


def _one_block(drafter: DFlashDrafter, features: torch.Tensor, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """The inference forward for the block at ``anchor``: context = features before it, no mask."""
    size = drafter.config.block_size
    block = drafter.block_ids(ids[0, anchor:anchor + 1])
    return drafter(block, features[:, :anchor], torch.arange(anchor, anchor + size).unsqueeze(0),
                   torch.arange(anchor).unsqueeze(0))[0]


def test_the_block_is_bidirectional_and_reads_every_context_feature(target) -> None:
    """The inference forward (what training's masked forward must equal for each of its blocks, so that no block
    reads a feature at or after its anchor: test_many_anchors_in_one_masked_forward_equal_one_forward_per_block)."""
    drafter = _drafter(target)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    features = _features(target, drafter, ids)
    anchor = 12
    out = _one_block(drafter, features, ids, anchor)
    # A later block row changes an earlier row's output (no causal mask inside the block) ...
    block = drafter.block_ids(ids[0, anchor:anchor + 1])
    block[0, 3] = 5
    changed = drafter(block, features[:, :anchor], torch.arange(anchor, anchor + 4).unsqueeze(0),
                      torch.arange(anchor).unsqueeze(0))[0]
    assert (changed[1] - out[1]).abs().max() > 1e-6
    # ... and every context feature matters.
    moved = features.clone()
    moved[:, 0] += 1.0
    assert (_one_block(drafter, moved, ids, anchor)[1] - out[1]).abs().max() > 1e-6


def test_both_context_caches_equal_a_fresh_forward_across_rounds_and_a_rollback(target) -> None:
    """Round after round (one a rollback to fewer positions than the cache holds), a block drafted over the eager
    cache and over the static cache (its feed padded to 8 rows, the padding past the context's end) equals the block
    drafted over the whole context without a cache; the static cache hands every layer its own whole buffers."""
    drafter = _drafter(target, block=4)
    config = drafter.config
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    features = _features(target, drafter, ids)
    eager = ContextCache(config.num_hidden_layers)
    static = StaticContextCache(config.num_hidden_layers, 32, 4, config.num_key_value_heads, config.head_dim,
                                torch.float64, torch.device("cpu"))
    buffers = [(k.data_ptr(), v.data_ptr()) for k, v in zip(static.keys, static.values, strict=True)]
    for valid, rows in ((0, 6), (6, 9), (7, 13), (13, 20)):  # (7, 13): two of the nine cached rows rolled back
        want = _one_block(drafter, features, ids, rows)
        block = drafter.block_ids(ids[0, rows:rows + 1])
        eager.crop(valid)
        got = drafter(block, features[:, valid:rows], torch.arange(rows, rows + 4).unsqueeze(0),
                      torch.arange(valid, rows).unsqueeze(0), cache=eager)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        static.crop(valid)
        n = rows - valid
        padded = torch.cat([features[:, valid:rows], torch.full((1, 8 - n, features.shape[-1]), 7.0,
                                                                 dtype=features.dtype)], dim=1)
        static.at(n)
        got = drafter(block, padded, (static.end + torch.arange(4)).unsqueeze(0),
                      (static.position + torch.arange(8)).unsqueeze(0), cache=static)[0]
        static.length = rows
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert [(k.data_ptr(), v.data_ptr()) for k, v in zip(static.keys, static.values, strict=True)] == buffers
    assert static.keys[0].shape[2] == 32 + 4
    with pytest.raises(DrafterError, match="block_size"):
        static.mask(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoding_layouts_joint_query_key_norm_and_rotation_give_the_separate_ones_values(target, dtype) -> None:
    """Decoding norms queries and keys with one unweighted norm and each weight on its own heads, and rotates them
    together: ``q_norm``/``k_norm`` (fused, as decoding had them) and ``rotate`` to the bit, in float32 and bf16."""
    from pipeline.drafters.layers import rotate, rotate_together, signed_sin

    attention = _drafter(target).to(dtype).layers[0].self_attn
    with torch.no_grad():
        for seed, norm in ((4, attention.q_norm), (7, attention.k_norm)):  # two different weights
            norm.weight.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(seed)))
            norm.fused = True
    heads, kv = attention.heads, attention.kv_heads
    qk = torch.randn(1, 9, heads + kv, attention.head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    angles = 5 * torch.randn(1, 9, attention.head_dim // 2, generator=torch.Generator().manual_seed(6))
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    with torch.no_grad():
        together = rotate_together(attention._norm_together(qk).transpose(1, 2), cos, signed_sin(sin))
        q = rotate(attention.q_norm(qk[:, :, :heads]).transpose(1, 2), cos, sin)
        k = rotate(attention.k_norm(qk[:, :, heads:]).transpose(1, 2), cos, sin)
    assert together.dtype == dtype
    assert torch.equal(together[:, :heads], q) and torch.equal(together[:, heads:], k)


def test_the_decoding_layout_drafts_the_same_block_and_holds_each_weight_once(target, tmp_path: Path) -> None:
    """Stacked projections, fused norms and RoPE read from a table (what the proposer switches on) give the separate
    layers' block over the eager cache; each layer's weight is a view of the stack (held once, so the two cannot
    part), a dtype conversion stacks again, and the state dict stays the reference layout and saves as safetensors;
    loaded weights or training mode give the layers their own weights back, and the next stack follows the new ones."""
    drafter = _drafter(target, block=4)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    features = _features(target, drafter, ids)

    def blocks() -> list[torch.Tensor]:
        cache = ContextCache(drafter.config.num_hidden_layers)
        out = []
        for valid, rows in ((0, 7), (7, 12)):  # a fresh context, then a round that extends it
            block = drafter.block_ids(ids[0, rows:rows + 1])
            out.append(drafter(block, features[:, valid:rows].to(drafter.fc.weight.dtype),
                               torch.arange(rows, rows + 4).unsqueeze(0), torch.arange(valid, rows).unsqueeze(0),
                               cache=cache, bound=rows + 4)[0])
        return out

    with torch.no_grad():
        separate = blocks()
        drafter.stack_for_decoding()
        assert drafter.layers[0].self_attn.qkv.shape[0] == sum(
            getattr(drafter.layers[0].self_attn, name).out_features for name in ("q_proj", "k_proj", "v_proj"))
        for got, want in zip(blocks(), separate, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert drafter._rope_rows[0].shape[0] >= 16  # RoPE was read from the decoding table
        attention = drafter.layers[0].self_attn
        storage = attention.qkv.untyped_storage().data_ptr()
        assert all(getattr(attention, name).weight.untyped_storage().data_ptr() == storage
                   for name in ("q_proj", "k_proj", "v_proj"))
        assert set(drafter.state_dict()) == set(reference_keys(drafter.config))
        save_file(drafter.trainable_state_dict(), str(tmp_path / "stacked.safetensors"))  # views of disjoint rows
        saved = load_file(str(tmp_path / "stacked.safetensors"))
        assert set(saved) == set(reference_keys(drafter.config))
        assert all(torch.equal(saved[name], tensor) for name, tensor in drafter.state_dict().items())
        drafter.float()
        assert drafter.layers[0].mlp.gate_up.dtype == torch.float32
        assert drafter.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == \
            drafter.layers[0].mlp.gate_up.untyped_storage().data_ptr()
        for got, want in zip(blocks(), separate, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
        drafter.double()
        other = _drafter(target, block=4, seed=5)
        drafter.load_state_dict(other.state_dict())
        assert drafter.layers[0].self_attn.qkv is None and drafter.layers[0].mlp.gate_up is None
        drafter.stack_for_decoding()
        stacked = blocks()
        drafter.stack_for_decoding(False)
        for got, want in zip(stacked, blocks(), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        assert (stacked[0] - separate[0]).abs().max() > 1e-3  # the new weights, not the stacked old ones
        drafter.stack_for_decoding()
        drafter.train()
        assert drafter.layers[0].self_attn.qkv is None and not drafter.norm.fused
        assert attention.q_proj.weight.untyped_storage().data_ptr() != \
            attention.k_proj.weight.untyped_storage().data_ptr()  # weights of their own again


def test_many_anchors_in_one_masked_forward_equal_one_forward_per_block(target) -> None:
    """The training forward (every block side by side, block_attention's mask) gives each block exactly what the
    proposer's forward for that block alone gives."""
    drafter = _drafter(target, block=5)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    features = _features(target, drafter, ids)
    anchors = torch.tensor([[3, 9, 15], [1, 20, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    size = drafter.config.block_size
    first = ids.gather(1, anchors)
    block = drafter.block_ids(first.flatten()).view(2, 3 * size)
    positions = (anchors.unsqueeze(-1) + torch.arange(size)).view(2, 3 * size)
    mask = block_attention(anchors, valid, 24, size)
    batched = drafter(block, features, positions, torch.arange(24).expand(2, 24), mask=mask).view(2, 3, size, -1)
    for b in range(2):
        for j in range(3):
            if not valid[b, j]:
                continue
            alone = _one_block(drafter, features[b:b + 1], ids[b:b + 1], int(anchors[b, j]))
            torch.testing.assert_close(batched[b, j], alone, rtol=0, atol=1e-10)


def test_artifact_files_round_trip(target, tmp_path: Path) -> None:
    drafter = _drafter(target)
    save_dflash(drafter, tmp_path / "art")
    assert set(load_file(str(tmp_path / "art" / "model.safetensors"))) == set(reference_keys(drafter.config))
    loaded = load_dflash(tmp_path / "art", target)
    assert loaded.config == drafter.config
    for name, tensor in drafter.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[name], tensor), name
    with pytest.raises(DrafterError, match="another target"):
        load_dflash(tmp_path / "art", _target(layers=4))


def test_reference_export_holds_exactly_the_reference_keys_and_fields(target, tmp_path: Path) -> None:
    drafter = _drafter(target)
    out = export_reference(drafter, tmp_path / "ref", target_model="t", target_config=target.config)
    assert set(load_file(str(out / "model.safetensors"))) == set(reference_keys(drafter.config))
    doc = json.loads((out / "config.json").read_text())
    assert doc["architectures"] == ["DFlashDraftModel"] and doc["model_type"] == "qwen3"
    assert doc["layer_types"] == ["full_attention"] * 2 and doc["block_size"] == 4
    assert doc["num_target_layers"] == 6 and doc["num_hidden_layers"] == 2
    assert doc["dflash_config"] == {"target_layer_ids": list(drafter.config.target_layer_ids), "mask_token_id": 96}
    assert "is_causal" not in doc  # vLLM and SGLang then take full_attention layers as bidirectional
    back = load_reference_export(out, target)
    assert back.config == drafter.config
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    features = _features(target, drafter, ids)
    torch.testing.assert_close(_one_block(back, features, ids, 9), _one_block(drafter, features, ids, 9),
                               rtol=0, atol=0)
    with pytest.raises(DrafterError, match="not an empty directory"):
        export_reference(drafter, tmp_path / "ref", target_model="t", target_config=target.config)


def test_speculators_export_stores_the_hidden_state_indices(target, tmp_path: Path) -> None:
    drafter = _drafter(target)
    out = export_speculators(drafter, tmp_path / "spec", target_model="t", target_config=target.config)
    doc = json.loads((out / "config.json").read_text())
    assert doc["speculators_model_type"] == "dflash"
    assert doc["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids]
    assert doc["block_size"] == 4 and doc["mask_token_id"] == 96
    assert doc["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    # served bidirectionally: vLLM 0.33.0 sets dflash_config.causal = not sliding_window_non_causal (default true) and
    # applies it to every layer; no layer is a sliding one, so speculators and SGLang attend both ways too
    assert doc["sliding_window_non_causal"] is True and doc["sample_from_anchor"] is False
    layer = doc["transformer_layer_config"]
    assert layer["layer_types"] == ["full_attention"] * 2 and layer["use_sliding_window"] is False
    assert "is_causal" not in layer and "is_causal" not in doc


def test_tapped_layers_round_trip_to_the_same_hidden_states_through_both_layouts(target, tmp_path: Path) -> None:
    """Reference id i (what vLLM/SGLang capture after layer i) and speculators' stored i + 1 both name the
    ``output_hidden_states`` entry that is layer i's output, the one the drafter was trained on."""
    drafter = _drafter(target, layers=3)
    reference = export_reference(drafter, tmp_path / "ref", target_model="t", target_config=target.config)
    speculators = export_speculators(drafter, tmp_path / "spec", target_model="t", target_config=target.config)
    trained_on = drafter.config.hidden_state_indices
    assert hidden_state_indices_of(reference) == trained_on == hidden_state_indices_of(speculators)
    # and that entry is the output of layer i, captured by a hook on the layer itself
    outputs: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[i].register_forward_hook(
        lambda _m, _a, out, i=i: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in drafter.config.target_layer_ids]
    try:
        ids = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(3))
        hidden = target(ids, output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    for layer_id, index in zip(drafter.config.target_layer_ids, trained_on, strict=True):
        torch.testing.assert_close(hidden[index], outputs[layer_id], rtol=0, atol=0)


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_block_loss_is_the_decayed_cross_entropy_of_each_row(target, loss: str) -> None:
    """One block at anchor 6, rows 1-3 learnable: ``kl`` is the soft cross-entropy to the target's distribution at
    each row, ``ce`` the cross-entropy to the row's own next token, both weighted ``exp(-(k - 1)/decay)``."""
    drafter = _drafter(target, layers=1, block=4)
    ids = torch.randint(0, 96, (1, 14), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden, logits = tapped_features(target, ids, None, drafter.config.hidden_state_indices)
    anchor, decay = 6, 2.0
    blocks = Blocks(anchors=torch.tensor([[anchor]]), valid=torch.tensor([[True]]),
                    targets=torch.tensor([[[True, True, False]]]))
    result = block_loss(drafter, ids, hidden, logits, blocks, decay, loss)
    log_q = torch.log_softmax(drafter.logits(_one_block(drafter, hidden, ids, anchor)[1:]), dim=-1)
    terms = []
    for k in (1, 2):  # row 3 is not learnable
        if loss == "ce":
            terms.append(-log_q[k - 1, ids[0, anchor + k]])
        else:
            terms.append(-(torch.softmax(logits[0, anchor + k - 1], -1) * log_q[k - 1]).sum())
    weights = torch.exp(-torch.tensor([0.0, 1.0], dtype=torch.float64) / decay)
    expected = (torch.stack(terms) * weights).sum() / weights.sum()
    torch.testing.assert_close(result.loss.double(), expected, rtol=1e-6, atol=1e-8)


def test_next_round_blocks_start_after_the_accepted_rows_and_the_missed_token() -> None:
    """A block at a whose first L rows agreed makes the next round open at a + L + 1 (the target's token at the miss
    opens it); that anchor is invalid past length − 2, where its next token is not an assistant token, and after an
    invalid block."""
    loss_mask = torch.ones(2, 20, dtype=torch.long)
    loss_mask[0, :3] = 0  # the prompt
    loss_mask[1, 12] = 0  # a non-assistant token inside row 1
    lengths = torch.tensor([20, 16])
    drawn = blocks_at(torch.tensor([[3, 8, 14], [2, 5, 0]]), torch.tensor([[True, True, True], [True, True, False]]),
                       loss_mask, lengths, 4)
    follow = next_round_blocks(drawn, torch.tensor([[0, 3, 3], [2, 5, 0]]), loss_mask, lengths, 4)
    assert follow.anchors.tolist() == [[4, 12, 18], [5, 0, 0]]  # row 1: 5 + 5 + 1 = 11 opens on position 12
    assert follow.valid.tolist() == [[True, True, True], [True, False, False]]
    assert follow.targets[0, 0].tolist() == [True, True, True]
    assert follow.targets[0, 2].tolist() == [True, False, False]  # rows 19, 20, 21 of a 20-token row
    assert not follow.targets[1, 1:].any()
    far = next_round_blocks(drawn, torch.tensor([[0, 3, 4], [2, 5, 0]]), loss_mask, lengths, 4)
    assert not far.valid[0, 2]  # 14 + 4 + 1 = 19 > 20 - 2: no next token to draft
    both = join_blocks(drawn, follow)
    assert both.anchors.shape == (2, 6) and both.valid[:, 3:].tolist() == follow.valid.tolist()


def test_training_with_next_round_anchors_adds_the_next_rounds_blocks(target) -> None:
    """train_dflash.next_round_anchors: a training step trains the drawn blocks and, after a probe forward, the block
    each one's next round would open; evaluation keeps the drawn blocks alone (the held-out metric is unchanged)."""
    drafter = _drafter(target, block=4)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    task = DFlashTask(drafter, target, [], anchors_per_row=5, decay=4.0, next_round_anchors=True)
    drawn = task._blocks(batch, torch.Generator().manual_seed(0))
    both = task._blocks(batch, torch.Generator().manual_seed(0), next_round=True)
    assert drawn.blocks == 10 and 10 < both.blocks <= 20
    assert both.loss.requires_grad and torch.isfinite(both.loss)


def test_a_draft_vocabulary_head_is_saved_exported_and_loaded_with_its_maps(target, tmp_path: Path) -> None:
    """State dict = reference keys + ``lm_head.weight``, ``d2t``, ``t2d``; the artifact, the reference layout (with
    ``draft_vocab_size``, what vLLM's DFlash loader reads with ``lm_head`` and ``d2t``) and the speculators layout
    (``draft_vocab_size`` 15) carry them; both read back to the same drafts; a tampered ``d2t`` is refused."""
    from safetensors.torch import save_file

    drafter = _drafter(target, draft_ids=DRAFT_IDS)
    with torch.no_grad():
        drafter.lm_head.weight.add_(0.1)  # trained away from the target's rows
    keys = set(reference_keys(drafter.config))
    assert keys - set(reference_keys(_drafter(target).config)) == {"lm_head.weight", "d2t", "t2d"}
    assert set(drafter.trainable_state_dict()) == keys
    assert torch.equal(drafter.draft_to_target, DRAFT_IDS)
    assert drafter.lm_head.weight.requires_grad and not target.get_output_embeddings().weight.requires_grad
    save_dflash(drafter, tmp_path / "art")
    loaded = load_dflash(tmp_path / "art", target)
    assert loaded.config == drafter.config and torch.equal(loaded.draft_to_target, DRAFT_IDS)
    for name, tensor in drafter.trainable_state_dict().items():
        assert torch.equal(loaded.trainable_state_dict()[name], tensor), name
    ref = export_reference(drafter, tmp_path / "ref", target_model="t", target_config=target.config)
    doc = json.loads((ref / "config.json").read_text())
    assert doc["draft_vocab_size"] == 15 and doc["vocab_size"] == 97
    weights = load_file(str(ref / "model.safetensors"))
    assert set(weights) == keys and weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(15) + weights["d2t"], DRAFT_IDS)
    spec = export_speculators(drafter, tmp_path / "spec", target_model="t", target_config=target.config)
    assert json.loads((spec / "config.json").read_text())["draft_vocab_size"] == 15
    assert set(load_file(str(spec / "model.safetensors"))) == keys
    back = load_reference_export(ref, target)
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(2))
    features = _features(target, drafter, ids)
    want = drafter.logits(_one_block(drafter, features, ids, 9))
    assert want.shape[-1] == 15
    torch.testing.assert_close(back.logits(_one_block(back, features, ids, 9)), want, rtol=0, atol=0)
    tampered = dict(weights)
    tampered["d2t"] = weights["d2t"].flip(0)  # no longer increasing target ids
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((ref / "config.json").read_text())
    save_file(tampered, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(DrafterError, match="d2t"):
        load_reference_export(tmp_path / "bad", target)
    with pytest.raises(DrafterError, match="draft vocabulary must be smaller"):
        DFlashConfig.from_target(target.config, num_hidden_layers=1, block_size=4, mask_token_id=96,
                                 draft_vocab_size=97)


def test_a_draft_vocabulary_heads_reference_export_is_named_for_the_engine_that_serves_it(target,
                                                                                         tmp_path: Path) -> None:
    """SGLang 0.5.23 loads the reference layout without a head of its own, dropping ``lm_head.weight``, ``d2t`` and
    ``t2d`` without a word, so a draft-vocabulary drafter exported as ``exports/dflash`` (the layout both engines
    load) drafted there through the target's head. Its reference export is ``exports/dflash-vllm``; a drafter on
    the target's head keeps ``exports/dflash``."""
    from pipeline.drafters.dflash_export import export_layouts

    for draft_ids, name in ((None, "dflash"), (DRAFT_IDS, "dflash-vllm")):
        exports = tmp_path / name / "exports"
        written = export_layouts(_drafter(target, draft_ids=draft_ids), exports, target_model="t",
                                 target_config=target.config, dtype=torch.bfloat16)  # the job: the checkpoint's
        assert written == {"reference": exports / name, "speculators": exports / "speculators"}
        assert sorted(p.name for p in exports.iterdir()) == sorted([name, "speculators"])
        assert all(json.loads((path / "config.json").read_text())["dtype"] == "bfloat16" for path in written.values())


def test_block_loss_with_a_draft_vocabulary_head_learns_only_rows_it_can_draft(target) -> None:
    """``ce`` with a draft-vocabulary head: the cross-entropy over the head's 15 ids to the row's token, at the rows
    whose token is one of them (weights renormalised over those); agreement maps the head's argmax to its target id
    and counts every learnable row (a token outside the vocabulary is a miss)."""
    drafter = _drafter(target, layers=1, block=4, draft_ids=DRAFT_IDS)
    ids = torch.tensor([[1, 2, 5, 6, 7, 8, 3, 10, 20, 11, 13, 14, 15, 16]])  # rows 1-3 at anchor 6: 10, 20, 11
    with torch.no_grad():
        hidden, logits = tapped_features(target, ids, None, drafter.config.hidden_state_indices)
    anchor, decay = 6, 2.0
    blocks = Blocks(anchors=torch.tensor([[anchor]]), valid=torch.tensor([[True]]),
                    targets=torch.tensor([[[True, True, True]]]))
    result = block_loss(drafter, ids, hidden, logits, blocks, decay, "ce")
    log_q = torch.log_softmax(drafter.logits(_one_block(drafter, hidden, ids, anchor)[1:]), dim=-1)
    draft_id = {int(t): i for i, t in enumerate(DRAFT_IDS)}
    terms = torch.stack([-log_q[0, draft_id[10]], -log_q[2, draft_id[11]]])  # row 2's token 20 is not in the vocabulary
    weights = torch.exp(-torch.tensor([0.0, 2.0], dtype=torch.float64) / decay)
    torch.testing.assert_close(result.loss.double(), (terms * weights).sum() / weights.sum(), rtol=1e-6, atol=1e-8)
    assert result.per_position_tokens.tolist() == [1, 1, 1]
    agree = DRAFT_IDS[log_q.argmax(-1)] == logits[0, anchor : anchor + 3].argmax(-1)
    assert result.per_position_correct.tolist() == agree.long().tolist()
