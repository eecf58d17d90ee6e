"""The EAGLE-3 drafter (pipeline.drafters.eagle3): serving key names, frozen embedding, vocabulary maps, the attention
the unrolled loop simulates, and the decoding layout (KV cache, fused norms, RoPE table, joint rotation). Its
training-time-test objective is tested in test_eagle3_objective.py.

Unit tests use the random 3-layer Llama config of eagle3_support.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.drafters.eagle3 import (
    SERVING_KEYS,
    Eagle3Config,
    Eagle3Drafter,
    KVCache,
    TTTCache,
    default_aux_layer_ids,
)
from pipeline.drafters.layers import rotate, rotate_together, signed_sin
from pipeline.engine.eagle3 import Eagle3Proposer
from pipeline.engine.static import DecodeOptions
from pipeline.errors import DrafterError
from pipeline.training.eagle3_objective import ttt_loss
from pipeline.vocab.counting import eagle3_offset_maps, top_k
from tests.drafters.eagle3_support import VD, H, V, llama, make_drafter, random_batch

# Read from SGLang python/sglang/srt/models/llama_eagle3.py and vLLM
# vllm/model_executor/models/llama_eagle3.py (LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM.load_weights).
SGLANG_VLLM_KEYS = {
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}

# --- config ----------------------------------------------------------------------------------------

def test_from_target_copies_the_target_shape() -> None:
    config = Eagle3Config.from_target(llama(), VD)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim) == (H, 88, 4, 2, 8)
    assert (config.rope_theta, config.rms_norm_eps, config.target_vocab_size, config.draft_vocab_size) == (
        1e4, 1e-6, V, VD)
    assert config.aux_layer_ids == (0, 1, 2) and config.rope_scaling is None


def test_scaled_rope_is_carried_over() -> None:
    target = llama()
    target.max_position_embeddings = 131072
    target.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = Eagle3Config.from_target(target, VD)
    assert config.rope_theta == 5e5 and config.rope_scaling["rope_type"] == "llama3"
    scaled = Eagle3Drafter(config, nn.Embedding(V, H)).rotary_emb.inv_freq
    plain = 1 / 5e5 ** (torch.arange(0, 8, 2) / 8)
    assert scaled[0] == pytest.approx(plain[0].item()) and scaled[-1] < plain[-1]  # long wavelengths stretched
    # a config object with the old key name ("type"): its scaling was dropped without a word
    old = SimpleNamespace(**{k: v for k, v in target.to_dict().items() if k != "rope_parameters"},
                          rope_scaling={"type": "linear", "factor": 4.0}, rope_theta=1e4)
    assert Eagle3Config.from_target(old, VD).rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_default_aux_layer_ids_are_valid_for_any_depth() -> None:
    for num_layers in range(2, 129):
        ids = Eagle3Config.from_target(llama(num_layers), VD).aux_layer_ids
        assert ids == default_aux_layer_ids(num_layers)
        assert 0 <= ids[0] < ids[1] < ids[2] <= num_layers, num_layers
        if num_layers >= 3:
            assert ids[2] < num_layers  # a layer input, which servers can capture
        if num_layers >= 7:
            assert ids == (2, num_layers // 2, num_layers - 3)  # the EAGLE-3 recipe


@pytest.mark.parametrize("ids", [(0, 1, 4), (-1, 1, 2), (1, 1, 2), (2, 1, 0), (1, 2), (0, 1, 2, 3)])
def test_bad_aux_layer_ids_raise(ids: tuple) -> None:
    with pytest.raises(DrafterError, match=r"aux_layer_ids(.|\n)*each in \[0, 3\](.|\n)*found:    aux_layer_ids="):
        Eagle3Config.from_target(llama(3), VD, aux_layer_ids=ids)


def test_a_one_layer_target_has_no_default_aux_ids() -> None:
    with pytest.raises(DrafterError, match="at least 2 layers(.|\n)*1 layer"):
        Eagle3Config.from_target(llama(1), VD)


def test_draft_vocab_larger_than_target_raises() -> None:
    with pytest.raises(DrafterError, match="draft_vocab_size <= 1000"):
        Eagle3Config.from_target(llama(), V + 1)


# --- module ----------------------------------------------------------------------------------------

def test_state_dict_is_exactly_the_serving_keys() -> None:
    drafter = make_drafter()
    state = drafter.trainable_state_dict()
    assert set(state) == SGLANG_VLLM_KEYS == set(SERVING_KEYS)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    assert shapes["fc.weight"] == (H, 3 * H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 8, 2 * H)
    assert shapes["midlayer.self_attn.k_proj.weight"] == shapes["midlayer.self_attn.v_proj.weight"] == (2 * 8, 2 * H)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (H, 4 * 8)
    assert shapes["midlayer.mlp.down_proj.weight"] == (H, 88)
    assert shapes["lm_head.weight"] == (VD, H)
    assert state["d2t"].dtype == torch.int64 and shapes["d2t"] == (VD,)
    assert state["t2d"].dtype == torch.bool and shapes["t2d"] == (V,)
    fresh = make_drafter(seed=5)
    fresh.load_state_dict(state)  # strict: an export round-trips
    assert torch.equal(fresh.draft_to_target, drafter.draft_to_target)


def test_embedding_is_frozen_and_outside_the_drafter() -> None:
    drafter = make_drafter()
    assert not drafter.embed_tokens.weight.requires_grad
    assert all(p is not drafter.embed_tokens.weight for p in drafter.parameters())
    assert all(p.requires_grad for p in drafter.parameters())
    batch = random_batch()
    result = ttt_loss(drafter, batch["input_ids"], batch["loss_mask"], batch["hidden"], batch["logits"], steps=2)
    result.loss.backward()
    assert drafter.embed_tokens.weight.grad is None
    assert all(p.grad is not None for p in drafter.parameters())


def test_rope_tables_stay_float32_under_a_bf16_cast() -> None:
    drafter = make_drafter().to(torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(drafter.rotary_emb.inv_freq, make_drafter().rotary_emb.inv_freq)
    assert drafter.d2t.dtype == torch.int64 and drafter.t2d.dtype == torch.bool


def test_embedding_of_the_wrong_shape_raises() -> None:
    config = Eagle3Config.from_target(llama(), VD)
    with pytest.raises(DrafterError, match=r"embedding(.|\n)*\(1000, 32\)(.|\n)*\(999, 32\)"):
        Eagle3Drafter(config, nn.Embedding(V - 1, H))


def test_forward_shapes_and_widths() -> None:
    drafter = make_drafter()
    batch = random_batch()
    logits, hidden_out = drafter(batch["input_ids"], batch["hidden"])
    assert logits.shape == (2, 12, VD) and hidden_out.shape == (2, 12, H)
    fused = drafter.fc(batch["hidden"])
    assert torch.allclose(drafter(batch["input_ids"], fused)[0], logits, atol=1e-6)
    with pytest.raises(DrafterError, match=r"expected: 96 \(three target layers\) or 32(.|\n)*last dimension 64"):
        drafter(batch["input_ids"], batch["hidden"][..., :64])


# --- vocabulary maps -------------------------------------------------------------------------------

def test_d2t_offsets_round_trip_from_counts() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.zipf(1.3, 20_000) % V  # a long-tailed token stream
    counts = np.bincount(tokens, minlength=V)
    chosen = top_k(counts, VD)
    d2t, t2d = eagle3_offset_maps(chosen, V)
    drafter = make_drafter()
    drafter.set_vocab_maps(d2t, t2d)
    assert drafter.draft_to_target.tolist() == sorted(chosen.tolist())
    assert torch.equal(drafter.t2d, torch.from_numpy(t2d))
    assert torch.equal(drafter.d2t, torch.from_numpy(d2t))
    # A draft argmax maps to a target token of the shortlist, and back.
    inverse = torch.full((V,), -1, dtype=torch.long)
    inverse[drafter.draft_to_target] = torch.arange(VD)
    draft_ids = torch.tensor([0, 5, VD - 1])
    target_ids = draft_ids + drafter.d2t[draft_ids]
    assert drafter.t2d[target_ids].all() and torch.equal(inverse[target_ids], draft_ids)
    assert counts[target_ids.numpy()].min() >= np.sort(counts)[-VD]


def _maps() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(0, 2 * VD, 2)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(VD), t2d


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d2t, t2d: (d2t[:-1], t2d), rf"d2t is not an integer offset vector(.|\n)*shape \({VD - 1},\)"),
    (lambda d2t, t2d: (d2t.float(), t2d), rf"integer shape \({VD},\)(.|\n)*torch.float32"),
    (lambda d2t, t2d: (d2t, t2d.long()), r"t2d is not a bool mask(.|\n)*torch.int64"),
    (lambda d2t, t2d: (torch.cat([d2t[:-1], torch.tensor([V])]), t2d), rf"distinct increasing(.|\n)*to {V + VD - 1}"),
    (lambda d2t, t2d: (torch.cat([d2t[:1], d2t[:1] - 1, d2t[2:]]), t2d), rf"distinct increasing(.|\n)*{VD - 1} distinct"),
    (lambda d2t, t2d: (d2t, t2d.clone().index_fill_(0, torch.tensor([1]), True)),
     rf"t2d does not mark exactly(.|\n)*{VD + 1} true entries"),
])
def test_bad_vocab_maps_raise(edit, message: str) -> None:  # noqa: ANN001 - a lambda
    drafter = make_drafter()
    before = drafter.d2t.clone()
    with pytest.raises(DrafterError, match=message):
        drafter.set_vocab_maps(*edit(*_maps()))
    assert torch.equal(drafter.d2t, before)  # nothing half-installed


# --- attention: KV-cache decoding and what the training-time test simulates -------------------------

def test_kv_cache_decoding_matches_one_forward() -> None:
    drafter = make_drafter()
    batch = random_batch(length=10)
    ids, fused = batch["input_ids"], drafter.fc(batch["hidden"])
    with torch.no_grad():
        full = drafter.step(ids, fused)
        cache = KVCache()
        parts = [drafter.step(ids[:, :6], fused[:, :6], cache=cache)]
        parts += [drafter.step(ids[:, t : t + 1], fused[:, t : t + 1], cache=cache) for t in range(6, 10)]
    assert cache.length == 10
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def test_a_kv_cache_feed_writes_only_its_own_rows() -> None:
    """A draft step writes its one row into the cache's buffer: no copy of the cached rows per feed (they were
    concatenated afresh at every step, seven times a round). After a crop the next feed overwrites the dropped rows,
    and the decode still equals one forward over the kept and new rows. A drafter converted to another dtype under a
    live cache carries the kept rows over, converted (the old buffer would have cast the new rows down)."""
    drafter = make_drafter()
    batch = random_batch(length=12)
    ids, fused = batch["input_ids"], drafter.fc(batch["hidden"])
    with torch.no_grad():
        cache = KVCache()
        drafter.step(ids[:, :6], fused[:, :6], cache=cache)
        storage = cache.key.untyped_storage().data_ptr()
        prefix = cache.key.clone()
        rows = [drafter.step(ids[:, t : t + 1], fused[:, t : t + 1], cache=cache) for t in range(6, 9)]
        assert cache.key.untyped_storage().data_ptr() == storage
        assert torch.equal(cache.key[:, :, :6], prefix) and cache.key.shape[2] == 9
        cache.crop(7)
        kept = drafter.step(ids[:, 7:12], fused[:, 7:12], cache=cache)
        assert cache.length == 12 and cache.key.untyped_storage().data_ptr() == storage
        full = drafter.step(ids, fused)
        drafter.double()  # a drafter converted under a live cache: its kept rows follow, converted
        cache.crop(11)
        drafter.step(ids[:, 11:12], fused[:, 11:12].double(), cache=cache)
        assert cache.length == 12 and cache.key.dtype == torch.float64
        assert torch.equal(cache.key[:, :, :6], prefix.double())
    torch.testing.assert_close(torch.cat([rows[0], kept], dim=1), full[:, 6:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_fused_rms_norm_is_llamas_in_every_dtype(dtype: torch.dtype) -> None:
    """The decoding layout's one ``rms_norm`` gives Llama's norm (statistics in float32, the weight applied after the
    cast back) for float32, bf16 (a float32 weight over bf16 rows: training's autocast) and float64 rows."""
    from pipeline.drafters.layers import RMSNorm

    norm = RMSNorm(H, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(0)))
    x = (3 * torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))).to(dtype)
    want = norm(x)
    norm.fused = True
    got = norm(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotating_queries_and_keys_together_gives_rotates_values_to_the_bit(dtype: torch.dtype) -> None:
    """The decoding layout's one rotation of the stacked queries and keys equals the training layout's two
    rotations bit for bit, at several positions (a roll with a negated sin half in place of the chunk, negate and
    concatenate of the rotated half)."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, heads, 5, 8, generator=gen).to(dtype) for heads in (4, 2))
    angles = torch.randn(2, 5, 4, generator=gen) * 7
    cos, sin = (torch.cat([f(angles), f(angles)], dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    together = rotate_together(torch.cat([q, k], dim=1), cos, signed_sin(sin))
    assert torch.equal(together[:, :4], rotate(q, cos, sin)) and torch.equal(together[:, 4:], rotate(k, cos, sin))
    assert not torch.equal(together[:, :4], q * cos.unsqueeze(1))  # the rotation did something


def test_the_decoding_layout_steps_alike_and_never_outlives_the_weights_it_stacked() -> None:
    """Stacked projections and fused norms (what the proposer switches on) give the separate layers' steps over a
    KV cache, the state dict keeps the serving keys, and loaded weights or training mode drop the stacks."""
    drafter = make_drafter().double().eval()
    batch = random_batch(length=10)
    ids, fused = batch["input_ids"], drafter.fc(batch["hidden"].double()).detach()

    def steps() -> torch.Tensor:
        cache = KVCache()
        parts = [drafter.step(ids[:, :6], fused[:, :6], cache=cache)]
        parts += [drafter.step(ids[:, t : t + 1], fused[:, t : t + 1], cache=cache) for t in range(6, 10)]
        return drafter.logits(torch.cat(parts, dim=1))

    with torch.no_grad():
        separate = steps()
        drafter.stack_for_decoding()
        assert drafter.midlayer.self_attn.qkv is not None and drafter.midlayer.mlp.gate_up is not None
        torch.testing.assert_close(steps(), separate, rtol=0, atol=1e-12)
        assert set(drafter.state_dict()) == set(SERVING_KEYS)
        drafter.load_state_dict(make_drafter(seed=4).double().state_dict())
        assert drafter.midlayer.self_attn.qkv is None and not drafter.norm.fused
        drafter.stack_for_decoding()
        stacked = steps()
        drafter.stack_for_decoding(False)
        torch.testing.assert_close(stacked, steps(), rtol=0, atol=1e-12)
        assert (stacked - separate).abs().max() > 1e-3
        drafter.stack_for_decoding()
        drafter.train()
        assert drafter.midlayer.mlp.gate_up is None and not drafter.midlayer.input_layernorm.fused


@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16},
                                  {"rope_type": "dynamic", "factor": 2.0}], ids=lambda r: r["rope_type"])
def test_decoding_reads_rope_from_a_table_rotary_emb_computed_once(rope: dict) -> None:
    """In the decoding layout a step reads cos/sin as rows of a table ``rotary_emb`` built once (and again only to
    grow it), equal to ``rotary_emb``'s own values, scaled RoPE included; a RoPE whose frequencies follow the sequence
    length (``dynamic``) calls ``rotary_emb`` at every step, as training does."""
    torch.manual_seed(0)
    target = llama()
    target.rope_parameters = {**rope, "rope_theta": 1e4}
    drafter = Eagle3Drafter(Eagle3Config.from_target(target, VD), nn.Embedding(V, H)).double().eval()
    batch = random_batch(length=40)
    ids, fused = batch["input_ids"][:1], drafter.fc(batch["hidden"][:1].double()).detach()
    calls = []
    forward = drafter.rotary_emb.forward
    drafter.rotary_emb.forward = lambda x, positions: calls.append(positions.shape[-1]) or forward(x, positions)

    def steps() -> torch.Tensor:
        cache = KVCache()
        parts = [drafter.step(ids[:, :6], fused[:, :6], cache=cache)]
        parts += [drafter.step(ids[:, t : t + 1], fused[:, t : t + 1], cache=cache) for t in range(6, 40)]
        return torch.cat(parts, dim=1)

    with torch.no_grad():
        plain = steps()
        assert len(calls) == 35
        drafter.stack_for_decoding()
        calls.clear()
        decoded = steps()
        assert calls == ([6] + [1] * 34 if rope["rope_type"] == "dynamic" else [64])
        cos, signed = drafter.rope(fused, torch.arange(40).unsqueeze(0), 40)
        want = forward(fused, torch.arange(40).unsqueeze(0))
        assert torch.equal(cos, want[0]) and torch.equal(signed, signed_sin(want[1]))  # rotate_together's form
        assert torch.equal(signed[..., :4], -want[1][..., :4]) and torch.equal(signed[..., 4:], want[1][..., 4:])
        drafter.train()
        assert drafter._rope_rows is None
    torch.testing.assert_close(decoded, plain, rtol=0, atol=1e-12)


LENGTH_DEPENDENT_ROPE = [{"rope_type": "dynamic", "factor": 2.0},
                         {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0, 3.0, 4.0, 5.0],
                          "original_max_position_embeddings": 16}]


def _drafter_with_rope(rope: dict) -> Eagle3Drafter:
    torch.manual_seed(0)
    return Eagle3Drafter(Eagle3Config.from_target(llama(rope=rope), VD), nn.Embedding(V, H)).double().eval()


@pytest.mark.parametrize("rope", LENGTH_DEPENDENT_ROPE, ids=lambda r: r["rope_type"])
def test_a_static_paths_reserve_leaves_a_length_dependent_rope_as_it_was(rope: dict) -> None:
    """``dynamic`` and ``longrope`` frequencies follow the longest length ``rotary_emb`` has seen, so decoding reads no
    table for them, and the static path's ``prepare`` (which reserves the table for its capacity) builds none: a step
    past ``max_position_embeddings`` (64) then rotates as a fresh drafter's does. Reserving 2 × 110 rows for them grew
    ``dynamic``'s frequencies for 220 positions and left them so: logits at position 80 moved by 0.03, a DFlash
    block's at 100 by 0.4."""
    fresh, drafter = _drafter_with_rope(rope), _drafter_with_rope(rope)
    proposer = Eagle3Proposer(drafter)
    proposer.prepare(DecodeOptions("static", capacity=110))
    assert drafter._rope_rows is None and drafter.reserve_rope(110, drafter.fc.weight) == ()
    torch.testing.assert_close(drafter.rotary_emb.inv_freq, fresh.rotary_emb.inv_freq, rtol=0, atol=0)
    x, positions = torch.zeros(1, 81, H, dtype=torch.float64), torch.arange(81).unsqueeze(0)
    fresh.stack_for_decoding()
    with torch.no_grad():
        for got, want in zip(drafter.rope(x, positions, 81), fresh.rope(x, positions, 81), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_longropes_original_frequencies_survive_a_long_call_and_a_conversion() -> None:
    """Longrope switches to its long frequencies by writing ``inv_freq`` in place; a conversion (``.float()``) puts
    the original ones back from the drafter's own copy, which that write must not reach (after a same-device
    conversion ``inv_freq`` was that copy itself, so the long frequencies became the originals)."""
    rope = LENGTH_DEPENDENT_ROPE[1]
    fresh, drafter = _drafter_with_rope(rope), _drafter_with_rope(rope)
    x, short = torch.zeros(1, 1, H, dtype=torch.float64), fresh.rotary_emb.inv_freq.clone()
    with torch.no_grad():
        drafter.rotary_emb(x, torch.tensor([[40]]))  # past original_max_position_embeddings (16): the long set
        long = drafter.rotary_emb.inv_freq.clone()
        drafter.float().double()
        for position in (5, 40):
            got = drafter.rotary_emb(x, torch.tensor([[position]]))[0]
            torch.testing.assert_close(got, fresh.rotary_emb(x, torch.tensor([[position]]))[0], rtol=0, atol=0)
    assert not torch.equal(long, short)  # the two sets differ, so a leak would show


def test_ttt_steps_see_what_a_chain_drafter_sees_at_inference() -> None:
    """Row t of step s equals drafting at inference: prefill step-0 rows 0..t (the verified prefix),
    then feed the drafts of steps 1..s one at a time (position t+j, its own previous hidden)."""
    drafter = make_drafter()
    batch = random_batch(batch=1, length=9)
    ids, fused = batch["input_ids"], drafter.fc(batch["hidden"])
    steps = 3
    with torch.no_grad():
        cache, hidden, outs, inputs = TTTCache(), fused, [], []
        for s in range(steps):
            step_ids = torch.roll(ids, -s, dims=1)  # any per-step tokens will do here
            inputs.append(step_ids)
            hidden = drafter.step(step_ids, hidden, cache=cache)
            outs.append(hidden)
        for t in range(ids.shape[1]):
            kv = KVCache()
            chain = drafter.step(inputs[0][:, : t + 1], fused[:, : t + 1], cache=kv)[:, -1:]
            assert torch.allclose(chain, outs[0][:, t : t + 1], atol=1e-5)
            for s in range(1, steps):
                chain = drafter.step(inputs[s][:, t : t + 1], chain, cache=kv)
                assert torch.allclose(chain, outs[s][:, t : t + 1], atol=1e-5), (t, s)
