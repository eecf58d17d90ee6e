"""The ranks of a multi-rank run: which took part, and what a lost peer looks like to the others.

Every rank-parallel stage (generate, estimate_rdk, train_drafter, train_router) records the ranks that ran it —
global rank, node rank, local rank and host, gathered over the process group by :func:`participants` — in its
artifact (:func:`took_part`). :func:`collectives` turns the error a rank gets when a peer dies or hangs in a
collective (gloo's and NCCL's timeouts, a closed connection) into our own error, which says that the rerun resumes;
under Slurm, ``srun --kill-on-bad-exit`` then ends the job's other ranks.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pipeline.errors import DrafterError

PEER_LOST = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "pair closure",
             "broken pipe", "communicator was aborted")
"""Words of the errors gloo and NCCL raise on a rank whose peer died or stopped answering."""


def participants(trainer: Any) -> list[dict]:
    """Every rank of ``trainer``'s run, gathered over its process group: global rank, node rank, local rank and
    the host it ran on. One entry where there is no process group (one rank, or nothing ran)."""
    mine = {"rank": trainer.global_rank, "node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
            "host": socket.gethostname()}
    return sorted(gather(trainer.world_size, mine), key=lambda rank: rank["rank"])


def gather(world_size: int, mine: Any) -> list[Any]:
    """Every rank's ``mine`` (a JSON-like value), in global-rank order: one all-gather over the process group;
    ``[mine]`` where there is none (one rank)."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def took_part(ranks: list[dict]) -> dict[str, list]:
    """A stage's record of its ranks: the hosts in node-rank order (``nodes``) and every rank (``ranks``)."""
    ordered = sorted(ranks, key=lambda rank: (rank["node_rank"], rank["rank"]))
    return {"nodes": list(dict.fromkeys(rank["host"] for rank in ordered)), "ranks": ranks}


@contextmanager
def collectives(label: str, trainer: Any, timeout: int, setting: str) -> Iterator[None]:
    """Inside the block, a collective that fails because a peer died or hung is a :class:`DrafterError`
    (multi-rank runs only; ``setting`` names the timeout's config key)."""
    try:
        yield
    except RuntimeError as err:
        text = str(err).strip()
        if trainer.world_size == 1 or not any(words in text.lower() for words in PEER_LOST):
            raise
        raise DrafterError(
            f"{label}: rank {trainer.global_rank} of {trainer.world_size} lost its peers in a collective: another "
            f"rank died, or did not answer for {timeout} s.",
            found=f"{type(err).__name__}: {text.splitlines()[0][:300] if text else '(no message)'}",
            fix="Rerun (for a Slurm job: drafter submit again); it resumes from the finished shards or the last "
                "checkpoint. Under Slurm, srun --kill-on-bad-exit ends the job's other ranks. If a node was only "
                f"slow (a long checkpoint write, uneven shards), raise {setting}.") from err
