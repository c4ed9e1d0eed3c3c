"""Rank and world size for a torch process, without being told."""

from __future__ import annotations

import torch.distributed

from shardcache import ranks


def discover(rank: int | None = None, world_size: int | None = None) -> ranks.Ranks:
    """This process's rank: `rank`/`world_size` where given, else the initialised
    default process group's, else RANK/WORLD_SIZE/LOCAL_RANK as torchrun sets them."""
    found = ranks.from_env()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        found = ranks.Ranks(
            torch.distributed.get_rank(), torch.distributed.get_world_size(), found.local_rank
        )
    return ranks.resolve(rank, world_size, found)
