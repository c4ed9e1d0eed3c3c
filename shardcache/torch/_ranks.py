"""Rank and world size for a torch process, without being told."""

from __future__ import annotations

# Imported for its side effect: `ranks.given_or_env` finds an initialised process group
# only in a process that imported torch.distributed (shardcache's core never imports it).
import torch.distributed  # noqa: F401

from shardcache import ranks


def discover(rank: int | None = None, world_size: int | None = None) -> ranks.Ranks:
    """This process's rank: `rank`/`world_size` where given, else the initialised
    default process group's, else RANK/WORLD_SIZE as torchrun sets them (as
    `shardcache.open()` reads them: `ranks.given_or_env`); LOCAL_RANK picks the GPU.
    With a group, RANK and WORLD_SIZE are not read: variables it overrides cannot fail
    the dataset's construction."""
    found = ranks.given_or_env(rank, world_size)
    return ranks.Ranks(found.rank, found.world_size, ranks.local_rank())
