"""Resume: the step-derived data order and the harness's own checkpoint format (no pickle).

Data order. :class:`StepBatchSampler` makes the batches of optimizer step ``s`` a pure function of
``(seed, epoch, s)``: each epoch is a seeded permutation of the dataset cut into global batches of
``micro_batch_size x accumulation x world_size`` examples (the last partial batch dropped), and rank
``r`` takes micro-batch ``micro x world_size + r`` of each. Resuming at step ``s`` starts the sampler at
``s``, so a resumed run sees exactly the batches an uninterrupted one would, with no loader state saved.

Checkpoints. ``<staging>/step-<8 digits>/`` holds ``weights.safetensors`` (the trainable parameters),
``optimizer.rank<r>.safetensors`` (the optimizer's state dict: tensors as entries, everything else as
JSON in the file's metadata; one file per rank when ZeRO shards the state, one shared file otherwise)
and ``state.json`` (step, hash of the training config and the config itself, world size, strategy,
trainable-parameter shapes, MLflow run, and the sha256 and size of every file), written last. All of it
goes into a hidden temp directory renamed into place once complete, so a kill at any moment leaves the
previous checkpoint intact. Loading re-hashes every file and compares the config, refusing a foreign or
damaged checkpoint with a :class:`DrafterError` instead of silently restarting.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipeline.artifacts import canonical_json, sha256_file, write_json_atomic
from pipeline.checksums import fsync_path, temp_sibling
from pipeline.errors import DrafterError

FORMAT = 1
STATE = "state.json"
WEIGHTS = "weights.safetensors"
PREFIX = "step-"
# ZeRO state entries that are objects, not data; the optimizer keeps its own when they are absent.
_ZERO_SKIP = ("loss_scaler", "param_slice_mappings", "universal_checkpoint_info")


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ``parts`` (stable across runs, platforms and Python versions)."""
    digest = hashlib.sha256(",".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class StepBatchSampler:
    """Index batches for one rank from optimizer step ``start_step`` to ``total_steps`` (see module doc)."""

    def __init__(self, num_examples: int, *, micro_batch_size: int, accumulation: int, world_size: int,
                 rank: int, seed: int, start_step: int, total_steps: int) -> None:
        self.num_examples, self.micro_batch_size, self.accumulation = num_examples, micro_batch_size, accumulation
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.start_step, self.total_steps = start_step, total_steps
        self.global_batch = micro_batch_size * accumulation * world_size
        self.steps_per_epoch = num_examples // self.global_batch
        if self.steps_per_epoch == 0:
            raise DrafterError("The training set is smaller than one global batch.",
                               expected=f"at least {self.global_batch} examples (micro_batch_size x "
                                        "gradient_accumulation x ranks)",
                               found=f"{num_examples} examples",
                               fix="Use more data, or lower train.micro_batch_size / gradient_accumulation.")
        self._order: tuple[int, list[int]] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of example indices for ``epoch``: a function of (seed, epoch) only."""
        import torch

        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, "epoch", epoch))
            self._order = (epoch, torch.randperm(self.num_examples, generator=generator).tolist())
        return self._order[1]

    def indices(self, step: int, micro: int) -> list[int]:
        """The examples this rank trains on in micro-batch ``micro`` of optimizer step ``step``."""
        epoch, position = divmod(step, self.steps_per_epoch)
        first = position * self.global_batch + (micro * self.world_size + self.rank) * self.micro_batch_size
        return self.epoch_order(epoch)[first : first + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.total_steps):
            for micro in range(self.accumulation):
                yield self.indices(step, micro)

    def __len__(self) -> int:
        return (self.total_steps - self.start_step) * self.accumulation


def config_hash(identity: Any) -> str:
    return hashlib.sha256(canonical_json(identity).encode()).hexdigest()


def flatten_state(obj: Any, tensors: dict[str, Any], key: str = "s") -> Any:
    """JSON-able skeleton of ``obj`` whose tensors are moved into ``tensors`` (keys are their paths)."""
    import torch

    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().clone().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[k, flatten_state(v, tensors, f"{key}.{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [flatten_state(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else {"__tuple__": items}
    if isinstance(obj, enum.Enum):
        return obj.value
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"Cannot checkpoint {type(obj).__name__} at {key}: only tensors and plain data are saved.")


def unflatten_state(skeleton: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in skeleton["__dict__"]}
    return skeleton


def is_zero_optimizer(optimizer: Any) -> bool:
    """A DeepSpeed ZeRO optimizer holds this rank's shard of the fp32 master weights and moments."""
    return hasattr(optimizer, "single_partition_of_fp32_groups")


def optimizer_state(optimizer: Any) -> dict:
    state = optimizer.state_dict()
    if is_zero_optimizer(optimizer):
        state = {k: v for k, v in state.items() if k not in _ZERO_SKIP}
    return state


def restore_optimizer(optimizer: Any, state: dict, world_size: int) -> None:
    if is_zero_optimizer(optimizer):
        # Rigid (same world size) ZeRO checkpoint: each rank reads its own entry; fp32 masters are copied
        # from the saved partition, not re-derived from (possibly bf16) module weights.
        optimizer.load_state_dict([state] * world_size, load_optimizer_states=True, load_from_fp32_weights=True)
    else:
        optimizer.load_state_dict(state)


def _write_safetensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    tmp = temp_sibling(path)
    save_file(tensors, str(tmp), metadata=metadata)
    fsync_path(tmp)  # on the disk before any state.json (fsynced) can describe it
    os.replace(tmp, path)
    fsync_path(path.parent)


def save_checkpoint(staging: Path, step: int, *, rank: int, world_size: int, weights: dict[str, Any],
                    optimizer: Any, state: dict, barrier: Callable[[], None], keep: int = 1) -> Path:
    """Write checkpoint ``step`` atomically. Every rank calls this (ZeRO ranks write their own shard)."""
    final = staging / f"{PREFIX}{step:08d}"
    tmp = staging / f".{final.name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    sharded = is_zero_optimizer(optimizer) and world_size > 1
    if sharded or rank == 0:
        tensors: dict[str, Any] = {}
        skeleton = flatten_state(optimizer_state(optimizer), tensors)
        _write_safetensors(tmp / f"optimizer.rank{rank if sharded else 0}.safetensors", tensors,
                           {"skeleton": json.dumps(skeleton)})
    if rank == 0:
        _write_safetensors(tmp / WEIGHTS, {k: v.detach().cpu().clone().contiguous() for k, v in weights.items()})
    barrier()
    if rank == 0:
        files = {name: {"sha256": sha256_file(tmp / name), "size": (tmp / name).stat().st_size}
                 for name in _arrived(tmp, checkpoint_files(world_size, sharded))}
        write_json_atomic(tmp / STATE, {**state, "format": FORMAT, "step": step, "files": files,
                                        "optimizer_sharded": sharded})
        fsync_path(tmp)
        if final.exists():  # only when a finished run is rewritten; move it aside, never merge
            aside = staging / f".{final.name}.old"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            shutil.rmtree(aside)
        os.replace(tmp, final)
        fsync_path(staging)  # the new checkpoint is durable before an older one goes
        for old in sorted(checkpoints(staging))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def checkpoint_files(world_size: int, sharded: bool) -> list[str]:
    """The files a checkpoint holds: the weights and the optimizer state, one file per rank when ZeRO shards it."""
    return [WEIGHTS, *(f"optimizer.rank{r}.safetensors" for r in range(world_size if sharded else 1))]


def _arrived(directory: Path, names: list[str], wait: float = 60.0) -> list[str]:
    """``names``, once each is a file in ``directory``. Another node's shard, renamed into place before the barrier,
    may take a while to show over a shared filesystem (NFS caches directory lookups): wait up to ``wait`` seconds
    rather than describe a checkpoint without it."""
    deadline = time.monotonic() + wait
    while missing := [name for name in names if not (directory / name).is_file()]:
        if time.monotonic() > deadline:
            raise DrafterError(f"A checkpoint's files did not all arrive in {directory}.",
                               expected=", ".join(names), found=f"missing {', '.join(missing)} after {wait:g} s",
                               fix="Check the shared filesystem the stage's staging directory lives on (every "
                                   "node writes there); the last complete checkpoint is kept, rerun to resume from it.")
        time.sleep(0.5)
    return names


def checkpoints(staging: Path) -> list[Path]:
    """Completed checkpoint directories in ``staging``, oldest first."""
    if not staging.is_dir():
        return []
    return sorted(p for p in staging.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def remove_temp(staging: Path) -> None:
    """Drop the partial checkpoints a killed run left behind (call before any rank trains)."""
    if staging.is_dir():
        for path in staging.iterdir():
            if path.name.startswith(f".{PREFIX}") and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)


def _damaged(path: Path, what: str) -> DrafterError:
    return DrafterError(
        f"The training checkpoint {path} is corrupt or truncated: {what}.",
        expected="a complete checkpoint written by this harness (state.json lists every file's sha256)",
        found=what,
        fix=f"Delete {path} to resume from an earlier checkpoint (or from step 0 if it is the only one), "
            "and check the disk it lives on.",
    )


def _differences(expected: Any, found: Any, prefix: str = "") -> list[str]:
    if isinstance(expected, dict) and isinstance(found, dict):
        return [d for k in sorted(set(expected) | set(found))
                for d in _differences(expected.get(k), found.get(k), f"{prefix}{k}.")]
    return [] if expected == found else [f"{prefix.rstrip('.')}={expected!r} (checkpoint: {found!r})"]


def read_checkpoint(path: Path, expected: dict) -> dict:
    """``state.json`` of checkpoint ``path`` after checking every file and that it belongs to this run.

    ``expected`` holds ``config_hash``, ``identity`` (the hashed config, to name what differs),
    ``trainable`` (parameter name → shape), ``world_size`` and ``strategy``.
    """
    try:
        state = json.loads((path / STATE).read_text())
        files = state["files"]
        world_size = int(state.get("world_size") or 1)
        if not isinstance(files, dict) or not all(isinstance(meta, dict) and isinstance(meta.get("size"), int)
                                                  and isinstance(meta.get("sha256"), str) for meta in files.values()):
            raise TypeError("files is not a map of name to {size, sha256}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise _damaged(path, f"{STATE} is missing or unreadable ({type(err).__name__})") from err
    if state.get("format") != FORMAT:
        raise _damaged(path, f"format {state.get('format')!r}, this harness writes {FORMAT}")
    required = checkpoint_files(world_size, bool(state.get("optimizer_sharded")))
    if unlisted := [name for name in required if name not in files]:
        raise _damaged(path, f"{STATE} lists no {', '.join(unlisted)}")
    for name, meta in files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != meta["size"]:
            size = file.stat().st_size if file.is_file() else "missing"
            raise _damaged(path, f"{name} has {size} bytes, {meta['size']} were written")
        if sha256_file(file) != meta["sha256"]:
            raise _damaged(path, f"{name} does not match its sha256")
    if state.get("config_hash") != expected["config_hash"]:
        diff = _differences(expected["identity"], state.get("identity"))
        raise DrafterError(
            f"The checkpoint {path} was written by another training config; refusing to resume from it.",
            expected=f"config hash {expected['config_hash'][:16]}",
            found=f"config hash {str(state.get('config_hash'))[:16]}; differences: {'; '.join(diff[:8]) or '?'}",
            fix=f"Rerun with the config that wrote it, or delete {path.parent} to train from step 0.",
        )
    for key in ("trainable", "world_size", "strategy"):
        if state.get(key) != expected[key]:
            raise DrafterError(
                f"The checkpoint {path} does not fit this run: its {key} differs.",
                expected=f"{key} {expected[key]!r}", found=f"{key} {state.get(key)!r}",
                fix=f"Resume with the same model, devices and strategy, or delete {path.parent} to start over.",
            )
    return state


def load_weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path / WEIGHTS))


def load_optimizer_state(path: Path, state: dict, rank: int) -> dict:
    from safetensors import safe_open

    file = path / f"optimizer.rank{rank if state['optimizer_sharded'] else 0}.safetensors"
    with safe_open(str(file), framework="pt") as handle:
        skeleton = json.loads(handle.metadata()["skeleton"])
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - safe_open has no iterator
    return unflatten_state(skeleton, tensors)


# --- the best evaluated weights ---------------------------------------------------------------------
# ``best-<8 digit step>.safetensors`` beside the checkpoints holds the weights of the best evaluation so
# far (its sha256 and score are in the ``best`` record every checkpoint's state carries). A file from a
# step after the checkpoint a rerun resumes from is dropped: the rerun evaluates that step again.
BEST_PREFIX = "best-"


def best_path(staging: Path, step: int) -> Path:
    return staging / f"{BEST_PREFIX}{step:08d}.safetensors"


def save_best(staging: Path, step: int, weights: dict[str, Any]) -> dict:
    """Write the weights of evaluation ``step`` atomically; returns ``{"step", "sha256"}`` for the record."""
    path = best_path(staging, step)
    _write_safetensors(path, {k: v.detach().cpu().clone().contiguous() for k, v in weights.items()})
    return {"step": step, "sha256": sha256_file(path)}


def prune_best(staging: Path, keep: set[int]) -> None:
    """Delete best-weights files of steps not in ``keep``."""
    for path in staging.glob(f"{BEST_PREFIX}*.safetensors"):
        if int(path.stem[len(BEST_PREFIX):]) not in keep:
            path.unlink(missing_ok=True)


def load_best(staging: Path, record: dict) -> dict[str, Any]:
    """The weights a ``best`` record names, after checking their sha256."""
    from safetensors.torch import load_file

    path = best_path(staging, int(record["step"]))
    if not path.is_file() or sha256_file(path) != record["sha256"]:
        raise _damaged(path.parent, f"{path.name} (the best evaluated weights) is missing or does not match "
                                    "its sha256")
    return load_file(str(path))
