"""A DFlash drafter on disk: the ``train_dflash`` artifact's own files, and the two serving layouts.

**Artifact** (:func:`save_dflash`, :func:`load_dflash`): ``dflash_config.json`` (the
:class:`~pipeline.drafters.dflash.DFlashConfig` fields) and ``model.safetensors`` holding exactly
:func:`~pipeline.drafters.dflash.reference_keys`. The target's embedding and LM head are not stored; loading
takes them from the target, after checking its shape.

**Reference layout** (:func:`export_reference`), what vLLM 0.33.0 (``qwen3_dflash.py``) and SGLang 0.5.23
(``srt/models/dflash.py``) load: ``config.json`` with ``architectures: ["DFlashDraftModel"]``,
``model_type: "qwen3"``, the layer shape, ``layer_types`` per draft layer, ``block_size``,
``num_target_layers`` and ``dflash_config.{target_layer_ids, mask_token_id}``; the weights exactly the
reference keys — nothing else, because SGLang drops keys it does not know without a word. A drafter with its own
draft-vocabulary head adds ``draft_vocab_size`` to the config and ``lm_head.weight``, ``d2t`` (vLLM's
``draft_id_to_target_id``, used as ``arange + d2t``) and ``t2d`` (skipped by vLLM) to the weights: vLLM serves it;
SGLang 0.5.23's DFlash model has no LM head of its own, so serve such a drafter there only after retraining it with
``train_dflash.head: target`` (:func:`export_layouts` names that export ``dflash-vllm/``).

**speculators layout** (:func:`export_speculators`), what ``speculators.models.dflash`` (0.9.0:
``DFlashSpeculatorConfig``, ``DFlashDraftModel``) loads and vLLM auto-detects by ``speculators_model_type``:
``transformer_layer_config`` (the Qwen3 layer config), ``aux_hidden_state_layer_ids`` = reference ids + 1 (the
``hidden_states`` indices themselves), ``mask_token_id``, ``block_size``, a greedy proposal of
``speculative_tokens = B − 1`` and ``sliding_window_non_causal: true`` (vLLM derives ``causal = not
sliding_window_non_causal`` for every layer: the block stays bidirectional); ``draft_vocab_size`` and, for a
draft-vocabulary head, ``lm_head.weight``, ``d2t``, ``t2d`` (what speculators saves when it trains one).

Both exports are written into a temp sibling and renamed into place (``out_dir`` must not exist or be empty);
nothing here unpickles.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from pipeline.drafters.dflash import DFlashConfig, DFlashDrafter, reference_keys
from pipeline.drafters.export import (
    CONFIG,
    PROVENANCE,
    SPECULATORS_VERSION,
    WEIGHTS,
    _publish,
    _read_weights,
    check_keys,
)
from pipeline.drafters.layers import check_vocab_maps
from pipeline.errors import DrafterError

ARTIFACT_CONFIG = "dflash_config.json"
REFERENCE_ARCHITECTURE = "DFlashDraftModel"
"""The architecture name of the reference layout (vLLM and SGLang register their DFlash model under it)."""
SPECULATORS_MODEL_TYPE = "dflash"
"""``speculators_model_type`` of the speculators layout (``DFlashSpeculatorConfig``'s registry key)."""


# --- the artifact ----------------------------------------------------------------------------------


def _tensors(drafter: DFlashDrafter, dtype: torch.dtype | None, what: str) -> dict[str, torch.Tensor]:
    state = drafter.trainable_state_dict()
    check_keys(state, reference_keys(drafter.config), what)
    return {name: (t.detach().cpu().to(dtype) if dtype is not None and t.is_floating_point() else t.detach().cpu())
            .contiguous().clone() for name, t in state.items()}


def save_dflash(drafter: DFlashDrafter, out: Path) -> None:
    """Write ``dflash_config.json`` and ``model.safetensors`` into ``out`` (a stage's temp directory)."""
    from safetensors.torch import save_file

    tensors = _tensors(drafter, None, f"the DFlash drafter to save into {out}")
    out.mkdir(parents=True, exist_ok=True)
    (out / ARTIFACT_CONFIG).write_text(json.dumps(dataclasses.asdict(drafter.config), indent=2))
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})


def load_config(path: Path) -> DFlashConfig:
    data = json.loads((Path(path) / ARTIFACT_CONFIG).read_text())
    known = {f.name for f in dataclasses.fields(DFlashConfig)}
    if set(data) - known:
        raise DrafterError(f"{Path(path) / ARTIFACT_CONFIG} has fields this version does not know.",
                           expected=f"fields of DFlashConfig: {sorted(known)}", found=sorted(set(data) - known))
    return DFlashConfig(**data)


def drafter_from_weights(config: DFlashConfig, target: Any, weights: dict[str, torch.Tensor],
                         where: str) -> DFlashDrafter:
    """A :class:`DFlashDrafter` of ``config`` on ``target``'s embedding and head holding ``weights``.

    Raises:
        DrafterError: If the target's shape is not the config's, or the keys or shapes are not the reference ones.
    """
    got = (int(target.config.hidden_size), int(target.config.vocab_size), int(target.config.num_hidden_layers))
    want = (config.hidden_size, config.vocab_size, config.num_target_layers)
    if got != want:
        raise DrafterError(f"The DFlash drafter in {where} was built for another target.",
                           expected=f"(hidden_size, vocab_size, num_hidden_layers) = {want}", found=f"{got}",
                           fix="Evaluate it with the target it was trained for.")
    check_keys(weights, reference_keys(config), where)
    if config.draft_vocab_size is not None:  # a tampered map would draft ids the head was not trained for
        check_vocab_maps(weights["d2t"], weights["t2d"], config.draft_vocab_size, config.vocab_size)
    drafter = DFlashDrafter(config, target.get_input_embeddings(), target.get_output_embeddings())
    drafter = drafter.to(weights["fc.weight"].dtype)
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise DrafterError(f"The weights in {where} do not fit their config.", found=str(err),
                           fix="Re-export the drafter instead of editing the files.") from err
    return drafter


def load_dflash(path: Path, target: Any) -> DFlashDrafter:
    """The drafter stored under ``path`` on ``target``'s embedding, head, device and dtype, in eval mode."""
    path = Path(path)
    drafter = drafter_from_weights(load_config(path), target, _read_weights(path), f"{path}/{WEIGHTS}")
    weight = target.get_input_embeddings().weight
    return drafter.to(device=weight.device, dtype=weight.dtype).eval()


# --- the serving layouts ---------------------------------------------------------------------------


def _check_target(config: DFlashConfig, target_config: Any) -> None:
    found = (int(target_config.hidden_size), int(target_config.vocab_size), int(target_config.num_hidden_layers))
    wanted = (config.hidden_size, config.vocab_size, config.num_target_layers)
    if found != wanted:
        raise DrafterError("The DFlash drafter was not built for this target config.",
                           expected=f"(hidden_size, vocab_size, num_hidden_layers) = {wanted}", found=f"{found}",
                           fix="Pass the config of the target the drafter was trained against.")


def qwen3_fields(config: DFlashConfig, target_config: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3 decoder fields of the draft layers (both layouts): shape, RoPE, attention kind per layer."""
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    fields = {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        # Every layer is full attention and no layer is a sliding window: the block is bidirectional because the
        # DFlash model runs its attention non-causally, not through a window setting.
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(target_config, name, None)
        if value is not None:
            fields[name] = value
    return fields


def _provenance(config: DFlashConfig, target_model: str) -> dict[str, Any]:
    return {"target_model": target_model, "target_layer_ids": list(config.target_layer_ids),
            "target_layer_ids_meaning": "reference numbering: id i is the output of target layer i, "
                                        "HF output_hidden_states[i + 1]",
            "num_target_layers": config.num_target_layers}


def reference_config_dict(config: DFlashConfig, *, target_model: str, target_config: Any,
                          dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of the reference layout (vLLM's and SGLang's DFlash loaders)."""
    return {
        "architectures": [REFERENCE_ARCHITECTURE],
        **qwen3_fields(config, target_config, dtype),
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id},
        **({} if config.draft_vocab_size is None else {"draft_vocab_size": config.draft_vocab_size}),
        PROVENANCE: _provenance(config, target_model),
    }


def speculators_config_dict(config: DFlashConfig, *, target_model: str, target_config: Any,
                            dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of the speculators 0.9.0 layout (``DFlashSpeculatorConfig`` serialised)."""
    layer = qwen3_fields(config, target_config, dtype)
    return {
        "architectures": [REFERENCE_ARCHITECTURE],
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_model,
                         "architectures": list(getattr(target_config, "architectures", None) or [])},
        },
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": list(config.hidden_state_indices),
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        # vLLM 0.33.0 (transformers_utils/configs/speculators/algos.py, update_dflash) turns this into
        # dflash_config.causal = not sliding_window_non_causal, which qwen3_dflash.py applies to *every* layer before
        # looking at layer_types; speculators' own default (false) would serve the block causally. True keeps it
        # bidirectional there; speculators reads it only for sliding-window layers, of which there are none.
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "dtype": layer["dtype"],
        PROVENANCE: _provenance(config, target_model),
    }


def export_reference(drafter: DFlashDrafter, out_dir: str | Path, *, target_model: str, target_config: Any,
                     dtype: torch.dtype | None = None) -> Path:
    """Write the reference layout (vLLM, SGLang) into the new directory ``out_dir``, atomically.

    Returns:
        ``out_dir``, holding ``config.json`` and ``model.safetensors`` (exactly the reference keys).
    """
    config = drafter.config
    _check_target(config, target_config)
    tensors = _tensors(drafter, dtype, "DFlash reference export")
    doc = reference_config_dict(config, target_model=target_model, target_config=target_config,
                                dtype=tensors["fc.weight"].dtype)
    return _publish(Path(out_dir), doc, tensors)


def export_layouts(drafter: DFlashDrafter, exports: Path, *, target_model: str, target_config: Any,
                   dtype: torch.dtype | None = None) -> dict[str, Path]:
    """Both serving layouts under ``exports``: ``speculators/``, and the reference layout as ``dflash/`` or, for a
    draft-vocabulary head, ``dflash-vllm/``. SGLang 0.5.23 loads a reference checkpoint without a head of its own
    and drops ``lm_head.weight``, ``d2t`` and ``t2d`` without a word, drafting through the target's head, which such
    a drafter never trained for: a folder named for the engine that serves it keeps it from being mistaken for the
    layout both engines load.

    ``dtype``: the tensors' and the configs' (None: the drafter's own).

    Returns:
        The written directories, by layout (``reference``, ``speculators``).
    """
    name = "dflash" if drafter.config.draft_vocab_size is None else "dflash-vllm"
    return {"reference": export_reference(drafter, exports / name, target_model=target_model,
                                          target_config=target_config, dtype=dtype),
            "speculators": export_speculators(drafter, exports / "speculators", target_model=target_model,
                                              target_config=target_config, dtype=dtype)}


def speculators_keys(config: DFlashConfig) -> tuple[str, ...]:
    """Tensors of a speculators 0.9.0 DFlash checkpoint: the reference keys."""
    return reference_keys(config)


def export_speculators(drafter: DFlashDrafter, out_dir: str | Path, *, target_model: str, target_config: Any,
                       dtype: torch.dtype | None = None) -> Path:
    """Write the speculators 0.9.0 layout (vLLM auto-detects it) into the new directory ``out_dir``."""
    config = drafter.config
    _check_target(config, target_config)
    tensors = _tensors(drafter, dtype, "DFlash speculators export")
    check_keys(tensors, speculators_keys(config), "DFlash speculators export")
    doc = speculators_config_dict(config, target_model=target_model, target_config=target_config,
                                  dtype=tensors["fc.weight"].dtype)
    return _publish(Path(out_dir), doc, tensors)


# --- reading the layouts back ----------------------------------------------------------------------


def hidden_state_indices_of(path: str | Path) -> tuple[int, ...]:
    """The ``output_hidden_states`` indices an export's consumer reads, from its ``config.json`` alone.

    The reference layout names layer outputs (``dflash_config.target_layer_ids``: index = id + 1, what vLLM's
    and SGLang's loaders capture); the speculators layout names the indices themselves
    (``aux_hidden_state_layer_ids``).
    """
    path = Path(path)
    doc = json.loads((path / CONFIG).read_text())
    if doc.get("speculators_model_type") == SPECULATORS_MODEL_TYPE:
        return tuple(int(i) for i in doc["aux_hidden_state_layer_ids"])
    if REFERENCE_ARCHITECTURE in (doc.get("architectures") or []) and "dflash_config" in doc:
        return tuple(int(i) + 1 for i in doc["dflash_config"]["target_layer_ids"])
    raise DrafterError(f"{path} is not a DFlash export.",
                       expected="a config.json with dflash_config (reference) or speculators_model_type dflash",
                       found=f"architectures {doc.get('architectures')}")


def load_reference_export(path: str | Path, target: Any) -> DFlashDrafter:
    """Rebuild a :class:`DFlashDrafter` from a reference-layout export on ``target``'s embedding and head."""
    path = Path(path)
    doc = json.loads((path / CONFIG).read_text())
    rope = dict(doc.get("rope_parameters") or {"rope_type": "default", **(doc.get("rope_scaling") or {}),
                                                "rope_theta": doc.get("rope_theta", 10000.0)})
    theta = float(rope.pop("rope_theta", 10000.0))
    try:
        config = DFlashConfig(
            hidden_size=int(doc["hidden_size"]), intermediate_size=int(doc["intermediate_size"]),
            num_hidden_layers=int(doc["num_hidden_layers"]), num_attention_heads=int(doc["num_attention_heads"]),
            num_key_value_heads=int(doc["num_key_value_heads"]), head_dim=int(doc["head_dim"]),
            rms_norm_eps=float(doc["rms_norm_eps"]), rope_theta=theta,
            max_position_embeddings=int(doc["max_position_embeddings"]), vocab_size=int(doc["vocab_size"]),
            block_size=int(doc["block_size"]),
            target_layer_ids=tuple(int(i) for i in doc["dflash_config"]["target_layer_ids"]),
            num_target_layers=int(doc["num_target_layers"]), mask_token_id=int(doc["dflash_config"]["mask_token_id"]),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            draft_vocab_size=int(doc["draft_vocab_size"]) if doc.get("draft_vocab_size") is not None else None)
    except KeyError as err:
        raise DrafterError(f"{path}/{CONFIG} lacks the field {err.args[0]!r}.",
                           fix="Re-export the drafter with export_reference.") from err
    return drafter_from_weights(config, target, _read_weights(path), f"{path}/{WEIGHTS}")

