"""Exports of the EAGLE-3 drafter (pipeline.drafters.export): the EAGLE-3 layout SGLang reads, the
speculators layout vLLM auto-detects, their strict key checks, atomic writes, and the bit-exact round trip
through :func:`load_eagle3_export`. Fast: a random 3-layer Llama target config, no extra virtualenv
(tests/drafters/test_speculators_interop.py loads the speculators export with speculators itself).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, LlamaConfig

from pipeline.drafters.eagle3 import SERVING_KEYS, Eagle3Config, Eagle3Drafter, KVCache
from pipeline.drafters.export import (
    SPECULATORS_KEYS,
    export_eagle3,
    export_speculators,
    load_eagle3_export,
)
from pipeline.errors import DrafterError
from pipeline.vocab.counting import eagle3_offset_maps

H, V, VD = 32, 1000, 40
DRAFT_IDS = np.sort(np.random.default_rng(0).choice(V, VD, replace=False))


def llama(num_layers: int = 3, **extra: object) -> LlamaConfig:
    return LlamaConfig(hidden_size=H, intermediate_size=88, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, num_hidden_layers=num_layers, vocab_size=V, rms_norm_eps=1e-6,
                       max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **extra)


def make_drafter(target: LlamaConfig | None = None, seed: int = 0, vd: int = VD) -> Eagle3Drafter:
    """A drafter with every tensor random (norm gains too, so a swapped norm would show)."""
    target = target or llama()
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(Eagle3Config.from_target(target, vd), nn.Embedding(V, H))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    ids = DRAFT_IDS if vd == VD else np.arange(vd)
    drafter.set_vocab_maps(*eagle3_offset_maps(ids, V))
    return drafter


def inputs(length: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (2, length), generator=gen), torch.randn(2, length, 3 * H, generator=gen)


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def keys(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        return set(fh.keys())


# --- the EAGLE-3 layout ----------------------------------------------------------------------------

def test_eagle3_config_json_fields(tmp_path: Path) -> None:
    target = llama()
    out = export_eagle3(make_drafter(target), tmp_path / "eagle3", target_model="org/target", target_config=target)
    assert out == tmp_path / "eagle3" and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    doc = read_config(out)
    assert doc["architectures"] == ["LlamaForCausalLMEagle3"] and doc["model_type"] == "llama"
    assert {k: doc[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                                "draft_vocab_size", "num_hidden_layers")} == {
        "hidden_size": H, "intermediate_size": 88, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "vocab_size": V,
        "draft_vocab_size": VD, "num_hidden_layers": 1}
    assert doc["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4}
    assert doc["rope_theta"] == 1e4 and doc["rope_scaling"] is None
    assert doc["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [-1, 0, 1], "use_aux_hidden_state": True}
    assert doc["torch_dtype"] == doc["dtype"] == "float32"
    assert doc["tie_word_embeddings"] is False and doc["hidden_act"] == "silu"
    assert (doc["bos_token_id"], doc["eos_token_id"]) == (1, 2)
    assert doc["drafter_pipeline"]["target_model"] == "org/target"
    assert doc["drafter_pipeline"]["aux_layer_ids"] == [0, 1, 2]


def test_eagle3_config_parses_as_a_one_layer_llama_config(tmp_path: Path) -> None:
    """SGLang and vLLM read config.json through transformers' AutoConfig; the legacy rope keys must not
    fight rope_parameters there."""
    target = llama()
    target.max_position_embeddings = 131072
    target.rope_parameters = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    out = export_eagle3(make_drafter(target), tmp_path / "e", target_model="t", target_config=target)
    parsed = AutoConfig.from_pretrained(out)
    assert type(parsed).__name__ == "LlamaConfig" and parsed.num_hidden_layers == 1
    assert parsed.rope_parameters == target.rope_parameters
    assert parsed.draft_vocab_size == VD and parsed.eagle_config["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
    assert read_config(out)["rope_scaling"]["rope_type"] == "llama3"  # the EAGLE repo's (transformers 4) key


def test_eagle3_weights_are_exactly_the_serving_keys(tmp_path: Path) -> None:
    drafter = make_drafter()
    out = export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=llama())
    assert keys(out) == set(SERVING_KEYS)
    saved = load_file(out / "model.safetensors")
    for name, tensor in drafter.trainable_state_dict().items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool


def test_aux_ids_become_sglang_layer_output_ids(tmp_path: Path) -> None:
    """EAGLE-3 default on an 8-layer target: HF indices (2, 4, 5) are the outputs of layers (1, 3, 4)."""
    target = llama(8)
    drafter = make_drafter(target)
    assert drafter.config.aux_layer_ids == (2, 4, 5)
    doc = read_config(export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=target))
    assert doc["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    spec = read_config(export_speculators(drafter, tmp_path / "s", target_model="t", target_config=target))
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM / speculators: hidden-state indices


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    drafter = make_drafter()
    out = export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=llama())
    loaded = load_eagle3_export(out, drafter.embed_tokens)
    assert loaded.config == drafter.config
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    ids, hidden = inputs()
    with torch.no_grad():
        for a, b in zip(drafter(ids, hidden), loaded(ids, hidden)):
            assert torch.equal(a, b)
        # and a cached draft continuation
        caches = KVCache(), KVCache()
        outs = [d.step(ids[:, :6], hidden[:, :6], cache=c) for d, c in zip((drafter, loaded), caches)]
        outs = [d.step(ids[:, 6:7], o[:, -1:], cache=c) for d, o, c in zip((drafter, loaded), outs, caches)]
    assert torch.equal(*outs)


def test_bf16_export_round_trips_in_bf16(tmp_path: Path) -> None:
    drafter = make_drafter()
    out = export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=llama(), dtype=torch.bfloat16)
    doc, saved = read_config(out), load_file(out / "model.safetensors")
    assert doc["torch_dtype"] == "bfloat16" and saved["fc.weight"].dtype == torch.bfloat16
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    loaded = load_eagle3_export(out, drafter.embed_tokens)
    assert loaded.fc.weight.dtype == torch.bfloat16 and loaded.rotary_emb.inv_freq.dtype == torch.float32
    reference = drafter.to(torch.bfloat16)
    ids, hidden = inputs()
    with torch.no_grad():
        assert torch.equal(reference(ids, hidden.bfloat16())[0], loaded(ids, hidden.bfloat16())[0])


def test_an_extra_key_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    drafter = make_drafter()
    drafter.register_buffer("ema_step", torch.zeros(()))
    with pytest.raises(DrafterError, match=r"not the ones the serving loaders read(.|\n)*found:    extra \['ema_step'\]"):
        export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=llama())
    with pytest.raises(DrafterError, match=r"speculators export(.|\n)*extra \['ema_step'\]"):
        export_speculators(drafter, tmp_path / "s", target_model="t", target_config=llama())
    assert list(tmp_path.iterdir()) == []


def test_a_missing_key_is_refused(tmp_path: Path) -> None:
    drafter = make_drafter()
    drafter.midlayer.hidden_norm = nn.Identity()
    with pytest.raises(DrafterError, match=r"found:    missing \['midlayer.hidden_norm.weight'\]\n"):
        export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=llama())
    assert list(tmp_path.iterdir()) == []


def test_the_loader_refuses_other_keys(tmp_path: Path) -> None:
    drafter = make_drafter()
    out = export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=llama())
    tensors = load_file(out / "model.safetensors")
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().clone()
    del tensors["norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(DrafterError, match=r"missing \['norm.weight'\]; extra \['embed_tokens.weight'\]"):
        load_eagle3_export(out, drafter.embed_tokens)


def test_the_loader_refuses_a_speculators_export(tmp_path: Path) -> None:
    drafter = make_drafter()
    out = export_speculators(drafter, tmp_path / "s", target_model="t", target_config=llama())
    with pytest.raises(DrafterError, match=r"not a one-layer EAGLE-3 export(.|\n)*Eagle3DraftModel"):
        load_eagle3_export(out, drafter.embed_tokens)


def test_the_loader_reads_a_foreign_eagle3_config(tmp_path: Path) -> None:
    """Without our provenance block the HF aux ids are SGLang's + 1."""
    target = llama(8)
    drafter = make_drafter(target)
    out = export_eagle3(drafter, tmp_path / "e", target_model="t", target_config=target)
    doc = read_config(out)
    del doc["drafter_pipeline"]
    (out / "config.json").write_text(json.dumps(doc))
    loaded = load_eagle3_export(out, drafter.embed_tokens)
    assert loaded.config.aux_layer_ids == (2, 4, 5)
    ids, hidden = inputs()
    with torch.no_grad():
        assert torch.equal(drafter(ids, hidden)[0], loaded(ids, hidden)[0])


def test_the_final_hidden_state_is_not_exportable(tmp_path: Path) -> None:
    """A 2-layer target's default aux ids include 2: HF's post-final-norm state, which no server captures."""
    target = llama(2)
    drafter = make_drafter(target)
    assert drafter.config.aux_layer_ids == (0, 1, 2)
    for export in (export_eagle3, export_speculators):
        with pytest.raises(DrafterError, match=r"last hidden state(.|\n)*aux_layer_ids=\[0, 1, 2\] for a 2-layer"):
            export(drafter, tmp_path / "x", target_model="t", target_config=target)


def test_a_drafter_for_another_target_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DrafterError, match=r"not built for this target(.|\n)*'num_hidden_layers': 4"):
        export_eagle3(make_drafter(), tmp_path / "e", target_model="t", target_config=llama(4))


def test_exports_never_overwrite(tmp_path: Path) -> None:
    drafter = make_drafter()
    (tmp_path / "empty").mkdir()
    export_eagle3(drafter, tmp_path / "empty", target_model="t", target_config=llama())  # an empty dir is fine
    before = (tmp_path / "empty" / "model.safetensors").read_bytes()
    with pytest.raises(DrafterError, match="already exists and is not an empty directory"):
        export_eagle3(make_drafter(seed=3), tmp_path / "empty", target_model="t", target_config=llama())
    assert (tmp_path / "empty" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no temp dir left


# --- the speculators layout ------------------------------------------------------------------------

def test_speculators_layout(tmp_path: Path) -> None:
    target = llama(architectures=["LlamaForCausalLM"])
    drafter = make_drafter(target)
    out = export_speculators(drafter, tmp_path / "s", target_model="/models/target", target_config=target)
    assert keys(out) == set(SPECULATORS_KEYS)
    saved = load_file(out / "model.safetensors")
    state = drafter.trainable_state_dict()
    assert torch.equal(saved["layers.0.self_attn.q_proj.weight"], state["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(saved["d2t"], state["d2t"]) and torch.equal(saved["t2d"], state["t2d"])
    assert torch.equal(saved["embed_tokens.weight"], drafter.embed_tokens.weight)  # speculators needs it
    doc = read_config(out)
    assert doc["speculators_model_type"] == "eagle3" and doc["speculators_version"] == "0.9.0"
    assert doc["architectures"] == ["Eagle3DraftModel"]
    assert doc["speculators_config"] == {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": "/models/target", "architectures": ["LlamaForCausalLM"]}}
    assert doc["draft_vocab_size"] == VD and doc["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert doc["norm_before_residual"] is False  # vLLM defaults it to true when absent
    layer = doc["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == V
    assert layer["head_dim"] == 8 and layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4}
    assert "rope_scaling" not in layer and doc["dtype"] == layer["dtype"] == "float32"


def test_speculators_full_vocabulary_has_no_maps(tmp_path: Path) -> None:
    drafter = make_drafter(vd=V)
    out = export_speculators(drafter, tmp_path / "s", target_model="t", target_config=llama())
    assert keys(out) == set(SPECULATORS_KEYS) - {"d2t", "t2d"}


def test_the_training_job_exports_in_the_dtype_the_targets_checkpoint_declares(tmp_path: Path) -> None:
    """Training loads the target in float32, and the loaded config then says float32: the exports declared that.
    SGLang builds a draft from its own config's dtype and, under --dtype auto, runs a float32 one in float16 beside a
    bfloat16 target. They now declare (and hold) the checkpoint's dtype."""
    from transformers import LlamaForCausalLM

    from jobs.train_drafter import _exports
    from pipeline.config.sections import load_config
    from pipeline.models.target import Target

    config = llama()
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "target")
    cfg = load_config(None, [f"target.model={tmp_path / 'target'}", f"workdir={tmp_path / 'w'}"])
    target = Target(cfg.target).model()
    assert target.config.dtype == torch.float32 and Target(cfg.target).checkpoint_dtype() == torch.bfloat16
    _exports(cfg, make_drafter(config), target, tmp_path / "exports")
    for layout in ("eagle3", "speculators"):
        written = read_config(tmp_path / "exports" / layout)
        assert written["dtype"] == "bfloat16" and written.get("torch_dtype", "bfloat16") == "bfloat16", layout
        floats = {t.dtype for t in load_file(tmp_path / "exports" / layout / "model.safetensors").values()
                  if t.is_floating_point()}
        assert floats == {torch.bfloat16}, layout
