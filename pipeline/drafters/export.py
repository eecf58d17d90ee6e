"""Exports of an :class:`~pipeline.drafters.eagle3.Eagle3Drafter` that serving engines load as they are.

Two directory layouts, each a ``config.json`` and one ``model.safetensors`` (no pickle anywhere):

**EAGLE-3 layout** (:func:`export_eagle3`), the one SGLang and the EAGLE repo read: a Llama config with
``architectures: ["LlamaForCausalLMEagle3"]``, ``num_hidden_layers: 1``, ``vocab_size`` = the target's,
``draft_vocab_size`` and an ``eagle_config``; the weights are exactly
:data:`~pipeline.drafters.eagle3.SERVING_KEYS` (``midlayer.*``, ``d2t`` offsets, ``t2d`` mask). Checked,
read not copied, against SGLang 0.5.23 (PyPI wheel): ``sglang/srt/models/llama_eagle3.py``
(``LlamaForCausalLMEagle3``: reads ``draft_vocab_size``, without which it loads the target's full lm_head;
``eagle_config.eagle_aux_hidden_state_layer_ids`` only to count the fused features;
``target_hidden_size``/``norm_before_fc``/``fc_norm``/``norm_output`` optional and off when absent;
``hidden_act``, ``head_dim``, ``rms_norm_eps``, ``rope_parameters`` through its Llama layers; weight names
bare or under ``model.``, ``midlayer`` renamed ``layers.0``, ``d2t`` turned into ``hot_token_id``,
``t2d`` skipped, the embedding taken from the target), ``sglang/srt/models/llama.py``
(``set_eagle3_layers_to_capture``) and ``sglang/srt/model_executor/model_runner_components/
spec_aux_hidden_state.py`` (the ids come from the draft's ``eagle_config``). vLLM 0.33.0 (PyPI wheel)
registers the same architecture name (``vllm/model_executor/models/registry.py`` maps
``LlamaForCausalLMEagle3`` to ``llama_eagle3.Eagle3LlamaForCausalLM``) and loads the same weight names
(``vllm/model_executor/models/llama_eagle3.py``) — but see the aux ids below.

**speculators layout** (:func:`export_speculators`), which vLLM recognises by ``speculators_model_type``
(``vllm/transformers_utils/configs/speculators/{base,algos}.py``, vLLM 0.33.0) and the ``speculators``
package loads with ``Eagle3DraftModel.from_pretrained``: keys as in :data:`SPECULATORS_KEYS` (``layers.0.``
instead of ``midlayer.``), config as ``Eagle3SpeculatorConfig`` serialises itself. Read in speculators
0.9.0: ``speculators/models/eagle3/{config,core,model_definitions}.py``, ``speculators/config.py``,
``speculators/model.py``, ``speculators/proposals/greedy.py``, ``speculators/models/utils.py``; the layout
was compared with what ``Eagle3DraftModel.save_pretrained`` writes. That includes the target's token
embedding, and so do we: speculators lists ``embed_tokens.weight`` in ``_keys_to_ignore_on_load_missing``
and means to read it from the verifier when its NaN sentinel is still there, but under transformers 5.19
``from_pretrained`` leaves a missing embedding uninitialised instead (observed: std 2e-12, no NaN), so
without the key speculators drafts from garbage. vLLM shares the target's embedding when the draft's is
identical to it (``vllm/v1/spec_decode/llm_base_proposer.py::_maybe_share_embeddings``), so the copy
costs disk only.

Auxiliary layer ids — the two engines disagree. Our ``aux_layer_ids`` index HF ``output_hidden_states``:
0 is the embedding output, ``i`` the input of layer ``i`` (= output of layer ``i-1``), and ``L`` (the last)
comes after the target's final norm.

* SGLang 0.5.23 captures *before* layer ``id + 1`` (``layers_to_capture = [val + 1 for val in layer_ids]``),
  i.e. its id names a layer **output**: ``eagle_aux_hidden_state_layer_ids = aux_layer_ids - 1``. Aux id 0
  becomes -1; SGLang 0.5.23 then captures before layer 0, which is the embedding output — the feature the
  drafter was trained on — so it is exported, not refused. (SGLang PR #25454 describes a heuristic that
  adds the 1 only when the first id is 1; the 0.5.23 wheel's code does not have it. Under it, exports of
  shallow targets whose ids start at 0 would be read one layer low, and -1 never captured. The EAGLE-3
  default ``(2, L//2, L-3)`` exports as ``(1, ...)`` and is read the same either way.)
* vLLM 0.33.0 (``EagleModelMixin._maybe_add_hidden_state`` in ``vllm/model_executor/models/interfaces.py``:
  index 0 before the first layer, ``idx + 1`` after layer ``idx``) and speculators 0.9.0
  (``resolve_target_layer_ids`` accepts ``[0, num_layers]``) read the ids as hidden-state indices, i.e. our
  ``aux_layer_ids`` unchanged — and vLLM reads the *same* ``eagle_config`` field of an EAGLE-3 directory
  that way. So: serve the EAGLE-3 export with SGLang, the speculators export with vLLM.
* ``aux_layer_ids`` containing ``L`` cannot be served: HF applies the final norm to that entry, which no
  server captures (SGLang never reaches layer ``L``; vLLM takes the pre-norm residual). Both exports
  refuse it (only 2-layer targets have it by default).

Atomicity: each export writes into a temporary sibling of ``out_dir`` and renames it into place with
``os.replace``, so ``out_dir`` either does not exist or is complete. ``out_dir`` must not exist yet (or be
an empty directory). Inside a stage's ``write(out)`` callback pass e.g. ``out / "eagle3"``: the stage's own
temp-dir publication then covers it too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from pipeline.drafters.eagle3 import SERVING_KEYS, Eagle3Config, Eagle3Drafter
from pipeline.errors import DrafterError

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
"""The architecture name of the EAGLE-3 layout (SGLang's class; vLLM maps it to its own)."""

SPECULATORS_VERSION = "0.9.0"
"""The ``speculators`` release whose format :func:`export_speculators` writes (and the interop test loads)."""

SPECULATORS_KEYS = (
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "embed_tokens.weight",
    "d2t",
    "t2d",
)
"""Tensors of a speculators 0.9.0 ``Eagle3DraftModel`` checkpoint, as its ``save_pretrained`` writes them: the
state dict minus ``verifier_lm_head.weight``/``verifier_norm.weight`` (``_keys_to_ignore_on_save``).
``embed_tokens.weight`` is the target's embedding (see the module docstring)."""

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
PROVENANCE = "drafter_pipeline"
"""A config.json block of ours (loaders ignore unknown keys): target, HF aux ids and target depth, so
:func:`load_eagle3_export` rebuilds the exact :class:`Eagle3Config`."""


# --- checks ----------------------------------------------------------------------------------------

def check_keys(found: Iterable[str], expected: Sequence[str], what: str) -> None:
    """Raise :class:`DrafterError` naming the missing and extra keys unless ``found == expected`` as sets."""
    found, wanted = set(found), set(expected)
    missing, extra = sorted(wanted - found), sorted(found - wanted)
    if missing or extra:
        raise DrafterError(
            f"{what}: the tensor names are not the ones the serving loaders read.",
            expected=f"exactly these {len(wanted)} keys: {sorted(wanted)}",
            found=(f"missing {missing}" if missing else "") + ("; " if missing and extra else "")
                  + (f"extra {extra}" if extra else ""),
            fix="Export an unmodified Eagle3Drafter (its trainable_state_dict() is the export contract).",
        )


def check_servable_aux_ids(config: Eagle3Config) -> None:
    """Refuse ``aux_layer_ids`` that name the target's post-final-norm hidden state (see the module doc)."""
    if config.target_num_layers in config.aux_layer_ids:
        raise DrafterError(
            "This EAGLE-3 drafter reads the target's last hidden state, which no serving engine captures.",
            expected=f"aux_layer_ids below {config.target_num_layers} (HF output_hidden_states[-1] is taken "
                     "after the final norm; SGLang never captures it and vLLM captures the pre-norm residual)",
            found=f"aux_layer_ids={list(config.aux_layer_ids)} for a {config.target_num_layers}-layer target",
            fix="Train the drafter with aux_layer_ids below the target depth (a target of 3 layers or more "
                "gets such defaults).",
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _export_tensors(drafter: Eagle3Drafter, dtype: torch.dtype | None, what: str) -> dict[str, torch.Tensor]:
    """The drafter's serving tensors on CPU, key-checked, floats cast to ``dtype`` (d2t/t2d keep theirs)."""
    state = drafter.trainable_state_dict()
    check_keys(state, SERVING_KEYS, what)
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous().clone()
    return out


def _weights_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    return tensors["fc.weight"].dtype


# --- writing ---------------------------------------------------------------------------------------

def _publish(out_dir: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into a temp sibling, fsync, rename to ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DrafterError(f"Refusing to export into {out_dir}: it already exists and is not an empty directory.",
                           fix="Export into a new directory (exports are never overwritten in place).")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}-{os.urandom(4).hex()}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        with open(tmp / CONFIG, "w") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
            fh.write("\n")
        for name in (WEIGHTS, CONFIG):
            with open(tmp / name, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _rope_fields(config: Eagle3Config) -> dict[str, Any]:
    """RoPE both ways: ``rope_parameters`` (transformers 5, which SGLang 0.5.23 and vLLM 0.33.0 pin) and the
    legacy ``rope_theta``/``rope_scaling`` (transformers 4, the EAGLE repo, speculators' Eagle3Converter)."""
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    return {
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
    }


def _llama_fields(config: Eagle3Config, target_config: Any) -> dict[str, Any]:
    """The Llama decoder-layer fields both layouts share (one layer, target vocabulary)."""
    fields = {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "num_hidden_layers": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **_rope_fields(config),
    }
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(target_config, name, None)
        if value is not None:
            fields[name] = value
    return fields


def _check_target(config: Eagle3Config, target_config: Any) -> None:
    """The drafter must have been built for ``target_config`` (the export names that target)."""
    found = {"vocab_size": int(target_config.vocab_size), "hidden_size": int(target_config.hidden_size),
             "num_hidden_layers": int(target_config.num_hidden_layers)}
    wanted = {"vocab_size": config.target_vocab_size, "hidden_size": config.hidden_size,
              "num_hidden_layers": config.target_num_layers}
    if found != wanted:
        raise DrafterError("The drafter was not built for this target config.",
                           expected=f"a target with {wanted}", found=f"{found}",
                           fix="Pass the config of the target the drafter was trained against.")


def _provenance(config: Eagle3Config, target_model: str) -> dict[str, Any]:
    return {"target_model": target_model, "aux_layer_ids": list(config.aux_layer_ids),
            "target_num_hidden_layers": config.target_num_layers,
            "aux_layer_ids_meaning": "indices into HF output_hidden_states (0 = embedding output)"}


def eagle3_config_dict(config: Eagle3Config, *, target_model: str, target_config: Any,
                       dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of the EAGLE-3 layout (see the module docstring for each field's reader)."""
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        **_llama_fields(config, target_config),
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layer_ids],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
        "use_cache": True,
        PROVENANCE: _provenance(config, target_model),
    }


def speculators_config_dict(config: Eagle3Config, *, target_model: str, target_config: Any,
                            dtype: torch.dtype, speculative_tokens: int = 3) -> dict[str, Any]:
    """The ``config.json`` of the speculators 0.9.0 layout (``Eagle3SpeculatorConfig`` serialised).

    ``norm_before_residual`` is written false explicitly: our residual is the un-normed fused feature,
    and vLLM 0.33.0 defaults the field to *true* when a speculators config omits it (``update_eagle3``).
    """
    layer = _llama_fields(config, target_config)
    layer.pop("rope_scaling")  # transformers 5 style only: speculators 0.9.0 pins transformers 5
    layer.pop("rope_theta")
    layer["dtype"] = _dtype_name(dtype)
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": target_model,
                         "architectures": list(getattr(target_config, "architectures", None) or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": _dtype_name(dtype),
        PROVENANCE: _provenance(config, target_model),
    }


def export_eagle3(drafter: Eagle3Drafter, out_dir: str | Path, *, target_model: str, target_config: Any,
                  dtype: torch.dtype | None = None) -> Path:
    """Write the EAGLE-3 layout (SGLang, the EAGLE repo) into the new directory ``out_dir``, atomically.

    Args:
        drafter: the trained drafter.
        out_dir: directory to create (must not exist, or be empty); see the module docstring.
        target_model: the target's name or path (recorded in the ``drafter_pipeline`` block).
        target_config: the target's ``transformers`` config (checked against the drafter; token ids copied).
        dtype: cast floating weights to this (e.g. ``torch.bfloat16``); None keeps the drafter's.

    Returns:
        ``out_dir``, holding ``config.json`` and ``model.safetensors`` (exactly ``SERVING_KEYS``).

    Raises:
        DrafterError: keys other than ``SERVING_KEYS``, an unservable aux id, a drafter built for another
            target, or an existing non-empty ``out_dir``. Nothing is left behind.
    """
    config = drafter.config
    _check_target(config, target_config)
    check_servable_aux_ids(config)
    tensors = _export_tensors(drafter, dtype, "EAGLE-3 export")
    doc = eagle3_config_dict(config, target_model=target_model, target_config=target_config,
                             dtype=_weights_dtype(tensors))
    return _publish(Path(out_dir), doc, tensors)


def export_speculators(drafter: Eagle3Drafter, out_dir: str | Path, *, target_model: str, target_config: Any,
                       dtype: torch.dtype | None = None, speculative_tokens: int = 3) -> Path:
    """Write the speculators 0.9.0 layout (vLLM auto-detects it) into the new directory ``out_dir``.

    Args:
        drafter: the trained drafter.
        out_dir: directory to create (must not exist, or be empty); see the module docstring.
        target_model: the verifier's name or path (``speculators_config.verifier.name_or_path``:
            speculators' ``from_pretrained`` reads the verifier's config, lm_head and final norm from
            there, so it must be reachable where the export is loaded with speculators).
        target_config: the target's ``transformers`` config.
        dtype: cast floating weights to this; None keeps the drafter's.
        speculative_tokens: draft length vLLM uses by default (``proposal_methods[0].speculative_tokens``).

    Returns:
        ``out_dir``, holding ``config.json`` and ``model.safetensors`` (exactly ``SPECULATORS_KEYS``, the
        target's embedding included, in the export dtype, less
        ``d2t``/``t2d`` when the draft vocabulary is the whole target vocabulary: speculators then has no
        such buffers and vLLM no ``draft_id_to_target_id`` to load them into).

    Raises:
        DrafterError: as :func:`export_eagle3`.
    """
    config = drafter.config
    _check_target(config, target_config)
    check_servable_aux_ids(config)
    served = _export_tensors(drafter, dtype, "speculators export")
    tensors = {name.replace("midlayer.", "layers.0.", 1): tensor for name, tensor in served.items()}
    embedding = drafter.embed_tokens.weight.detach().cpu()
    tensors["embed_tokens.weight"] = embedding.to(tensors["fc.weight"].dtype).contiguous().clone()
    expected = list(SPECULATORS_KEYS)
    if config.draft_vocab_size == config.target_vocab_size:
        del tensors["d2t"], tensors["t2d"]  # identity maps (set_vocab_maps allows no other at full size)
        expected = [k for k in expected if k not in ("d2t", "t2d")]
    check_keys(tensors, expected, "speculators export")
    doc = speculators_config_dict(config, target_model=target_model, target_config=target_config,
                                  dtype=_weights_dtype(tensors), speculative_tokens=speculative_tokens)
    return _publish(Path(out_dir), doc, tensors)


# --- reading back ----------------------------------------------------------------------------------

def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / CONFIG).read_text())
    except FileNotFoundError as err:
        raise DrafterError(f"{path} is not an EAGLE-3 export: it has no {CONFIG}.",
                           fix="Pass the directory export_eagle3 wrote.") from err
    except json.JSONDecodeError as err:
        raise DrafterError(f"The {CONFIG} of {path} is not valid JSON: {err}.") from err


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` (safetensors only: nothing is unpickled)."""
    file = path / WEIGHTS
    if not file.is_file():
        raise DrafterError(f"{path} has no {WEIGHTS}.", fix="Pass the directory export_eagle3 wrote.")
    with safe_open(str(file), framework="pt", device="cpu") as fh:
        return {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 - safe_open has no __iter__


def _aux_ids(doc: dict, path: Path) -> tuple[tuple[int, ...], int]:
    """HF aux ids and target depth: from our block, else SGLang's output ids + 1 (depth: the least that fits)."""
    served = (doc.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    block = doc.get(PROVENANCE) or {}
    if "aux_layer_ids" in block:
        aux = tuple(int(i) for i in block["aux_layer_ids"])
        if served is not None and [i - 1 for i in aux] != list(served):
            raise DrafterError(f"{path}/{CONFIG} contradicts itself about the target feature layers.",
                               expected=f"eagle_aux_hidden_state_layer_ids = {PROVENANCE}.aux_layer_ids - 1 "
                                        f"= {[i - 1 for i in aux]}",
                               found=f"{served}", fix="Re-export the drafter instead of editing config.json.")
        return aux, int(block.get("target_num_hidden_layers", max(aux) + 1))
    if not served:
        raise DrafterError(f"{path}/{CONFIG} does not say which target layers the drafter reads.",
                           expected="eagle_config.eagle_aux_hidden_state_layer_ids",
                           fix="Add the ids the drafter was trained with (layer outputs, SGLang's convention).")
    aux = tuple(int(i) + 1 for i in served)
    return aux, max(aux) + 1


def load_eagle3_export(path: str | Path, target_embedding: nn.Embedding) -> Eagle3Drafter:
    """Rebuild an :class:`Eagle3Drafter` from an EAGLE-3 export directory (:func:`export_eagle3`).

    Args:
        path: the export directory.
        target_embedding: the target's token embedding (not part of the export).

    Returns:
        The drafter, in the dtype of the saved weights, with its vocabulary maps installed.

    Raises:
        DrafterError: not an EAGLE-3 layout, tensor names other than ``SERVING_KEYS``, shapes that do
            not fit the config, inconsistent aux ids, or invalid ``d2t``/``t2d``.
    """
    path = Path(path)
    doc = _read_config(path)
    if EAGLE3_ARCHITECTURE not in (doc.get("architectures") or []) or doc.get("num_hidden_layers") != 1:
        raise DrafterError(f"{path} is not a one-layer EAGLE-3 export.",
                           expected=f"architectures [{EAGLE3_ARCHITECTURE!r}] and num_hidden_layers 1",
                           found=f"architectures {doc.get('architectures')}, "
                                 f"num_hidden_layers {doc.get('num_hidden_layers')}",
                           fix="A speculators export is read by speculators/vLLM, not by this loader.")
    weights = _read_weights(path)
    rope = dict(doc.get("rope_parameters") or {"rope_type": "default", **(doc.get("rope_scaling") or {}),
                                                "rope_theta": doc.get("rope_theta", 10000.0)})
    theta = float(rope.pop("rope_theta", 10000.0))
    aux, depth = _aux_ids(doc, path)
    try:
        config = Eagle3Config(
            hidden_size=int(doc["hidden_size"]), intermediate_size=int(doc["intermediate_size"]),
            num_attention_heads=int(doc["num_attention_heads"]),
            num_key_value_heads=int(doc.get("num_key_value_heads") or doc["num_attention_heads"]),
            head_dim=int(doc.get("head_dim") or doc["hidden_size"] // doc["num_attention_heads"]),
            rms_norm_eps=float(doc["rms_norm_eps"]), rope_theta=theta,
            max_position_embeddings=int(doc["max_position_embeddings"]),
            target_vocab_size=int(doc["vocab_size"]), draft_vocab_size=int(doc["draft_vocab_size"]),
            aux_layer_ids=aux, target_num_layers=depth,
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None)
    except KeyError as err:
        raise DrafterError(f"{path}/{CONFIG} lacks the field {err.args[0]!r}.",
                           fix="Re-export the drafter with export_eagle3.") from err
    return drafter_from_weights(config, target_embedding, weights, f"{path}/{WEIGHTS}")


def drafter_from_weights(config: Eagle3Config, target_embedding: nn.Embedding, weights: dict[str, torch.Tensor],
                         where: str) -> Eagle3Drafter:
    """An :class:`Eagle3Drafter` of ``config`` on ``target_embedding`` holding ``weights`` (keyed as
    ``SERVING_KEYS``), in the weights' dtype, its ``d2t``/``t2d`` checked by ``set_vocab_maps``.

    Raises:
        DrafterError: other keys than ``SERVING_KEYS``, invalid vocabulary maps, or shapes that do not fit
            ``config`` (``where`` names the file).
    """
    check_keys(weights, SERVING_KEYS, where)
    drafter = Eagle3Drafter(config, target_embedding).to(weights["fc.weight"].dtype)
    drafter.set_vocab_maps(weights["d2t"], weights["t2d"])
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise DrafterError(f"The weights in {where} do not fit their config.", found=str(err),
                           fix="Re-export the drafter instead of editing the files.") from err
    return drafter
