"""Which rank this process is, as launchers tell it: torchrun (and most launchers on
top of it) set RANK, WORLD_SIZE and LOCAL_RANK in every process's environment."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from shardcache import errors


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    #: The rank among the processes on this node: picks the GPU.
    local_rank: int = 0


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise errors.InputError(f"${name}: expected an integer, found {raw!r}") from exc


def from_env(env: Mapping[str, str] | None = None) -> Ranks:
    """RANK, WORLD_SIZE and LOCAL_RANK (defaults 0, 1 and 0: a single process)."""
    env = os.environ if env is None else env
    rank = _int(env, "RANK", 0)
    world = _int(env, "WORLD_SIZE", 1)
    local = _int(env, "LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise errors.InputError(
            f"$RANK={rank} and $WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE"
        )
    return Ranks(rank, world, local)


def resolve(rank: int | None, world_size: int | None, found: Ranks) -> Ranks:
    """`rank` and `world_size` where given, else what was `found`."""
    return Ranks(
        found.rank if rank is None else rank,
        found.world_size if world_size is None else world_size,
        found.local_rank,
    )


def given_or_env(
    rank: int | None, world_size: int | None, env: Mapping[str, str] | None = None
) -> Ranks:
    """`rank` and `world_size` where given, else $RANK/$WORLD_SIZE (`from_env`): what
    `shardcache.open()` and the adapters read as when not told. Under torchrun every
    process has those set; a default of rank 0 of 1 there would have each rank read the
    whole epoch. The environment is read only for what was left out, so a process told
    both does not depend on a launcher's variables. A mix (one given, one from the
    environment) is checked here, naming where each came from; two given ones are
    checked by the reading plan, as before."""
    if rank is not None and world_size is not None:
        return Ranks(rank, world_size)
    found = resolve(rank, world_size, from_env(env))
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        said_rank = "rank" if rank is not None else "$RANK"
        said_world = "world_size" if world_size is not None else "$WORLD_SIZE"
        raise errors.InputError(
            f"{said_rank}={found.rank} and {said_world}={found.world_size}: expected "
            f"0 <= rank < world_size; give both rank= and world_size=, or neither (to "
            f"read them from $RANK/$WORLD_SIZE)"
        )
    return found
