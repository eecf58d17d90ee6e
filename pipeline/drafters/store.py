"""An EAGLE-3 drafter as the ``train_drafter`` artifact stores it, and loading it back onto a target.

The artifact holds ``eagle3_config.json`` (the :class:`~pipeline.drafters.eagle3.Eagle3Config` fields) and
``model.safetensors`` (exactly :data:`~pipeline.drafters.eagle3.SERVING_KEYS`: the trained weights plus
``d2t``/``t2d``). The target's embedding is not stored: :func:`load_drafter` takes it from the target the
evaluation loads, after checking the target's shape matches the config. Nothing here unpickles.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pipeline.drafters.eagle3 import SERVING_KEYS, Eagle3Config, Eagle3Drafter
from pipeline.errors import DrafterError

CONFIG = "eagle3_config.json"
WEIGHTS = "model.safetensors"


def save_drafter(drafter: Eagle3Drafter, out: Path) -> None:
    """Write ``eagle3_config.json`` and ``model.safetensors`` into ``out`` (a stage's temp directory)."""
    from safetensors.torch import save_file

    from pipeline.drafters.export import check_keys  # deferred: pulls in torch

    state = {k: v.detach().cpu().contiguous() for k, v in drafter.trainable_state_dict().items()}
    check_keys(state, SERVING_KEYS, f"the drafter to save into {out}")
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(dataclasses.asdict(drafter.config), indent=2))
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})


def load_config(path: Path) -> Eagle3Config:
    data = json.loads((Path(path) / CONFIG).read_text())
    known = {f.name for f in dataclasses.fields(Eagle3Config)}
    if set(data) - known:
        raise DrafterError(f"{Path(path) / CONFIG} has fields this version does not know.",
                           expected=f"fields of Eagle3Config: {sorted(known)}", found=sorted(set(data) - known))
    return Eagle3Config(**data)


def load_drafter(path: Path, target: Any) -> Eagle3Drafter:
    """The drafter stored under ``path``, on ``target``'s embedding, device and dtype, in eval mode.

    Raises:
        DrafterError: If the target's shape differs from the drafter's config, or the weights' keys,
            vocabulary maps or shapes are not what the config implies.
    """
    from safetensors.torch import load_file

    from pipeline.drafters.export import drafter_from_weights  # deferred: pulls in torch

    path = Path(path)
    config = load_config(path)
    target_cfg = target.config
    got = (int(target_cfg.hidden_size), int(target_cfg.vocab_size), int(target_cfg.num_hidden_layers))
    want = (config.hidden_size, config.target_vocab_size, config.target_num_layers)
    if got != want:
        raise DrafterError(f"The EAGLE-3 drafter at {path} was trained for another target shape.",
                           expected=f"(hidden, vocab, layers) = {want}", found=f"{got} in the target loaded",
                           fix="Evaluate it with the target it was trained on (train_drafter's fingerprint).")
    embedding = target.get_input_embeddings()
    drafter = drafter_from_weights(config, embedding, load_file(str(path / WEIGHTS)), str(path / WEIGHTS))
    return drafter.to(device=embedding.weight.device, dtype=embedding.weight.dtype).eval()
