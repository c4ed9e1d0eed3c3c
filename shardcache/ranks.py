"""Which rank this process is, as launchers tell it: torchrun (and most launchers on
top of it) set RANK, WORLD_SIZE and LOCAL_RANK in every process's environment; a trainer
that initialised torch.distributed itself (mpirun, a launcher of its own, explicit
`init_process_group(rank=, world_size=)`) may set none of them, and its default process
group says instead."""

from __future__ import annotations

import dataclasses
import os
import sys
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


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """$LOCAL_RANK (0 where unset): the rank among this node's processes, which picks
    the GPU."""
    return _int(os.environ if env is None else env, "LOCAL_RANK", 0)


def resolve(rank: int | None, world_size: int | None, found: Ranks) -> Ranks:
    """`rank` and `world_size` where given, else what was `found`."""
    return Ranks(
        found.rank if rank is None else rank,
        found.world_size if world_size is None else world_size,
        found.local_rank,
    )


def process_group() -> tuple[int, int] | None:
    """(rank, world size) of torch.distributed's default process group where this
    process initialised one, else None. Never imports torch (the client stays light
    without it): a process group can only have been initialised through an imported
    `torch.distributed`, so one not imported yet means none."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def given_or_env(
    rank: int | None, world_size: int | None, env: Mapping[str, str] | None = None
) -> Ranks:
    """`rank` and `world_size` where given, else torch.distributed's initialised default
    process group's (`process_group`), else $RANK/$WORLD_SIZE (`from_env`): what
    `shardcache.open()` and the adapters read as when not told. Under torchrun every
    process has those variables set, and a trainer that initialised its process group
    itself has its group; a default of rank 0 of 1 there would have each rank read the
    whole epoch. The environment is read only for what was left out, so a process told
    both does not depend on a launcher's variables. A mix (one given, one found) is
    checked here, naming where each came from; two given ones are checked by the
    reading plan, as before.

    Where the process group and the environment disagree, the group wins, as in the
    torch adapter (`shardcache.torch.discover`): the group is what the trainer's
    collectives run over, so its ranks are the ones that must split the data; variables
    that say otherwise were set for another process layout (an outer launcher's, one a
    trainer re-ranked) and would have ranks read overlapping shares, silently."""
    if rank is not None and world_size is not None:
        return Ranks(rank, world_size)
    group = process_group()
    # With a group the environment is not read at all: variables it overrides cannot
    # fail the open.
    found = resolve(rank, world_size, from_env(env) if group is None else Ranks(*group))
    if found.world_size < 1 or not 0 <= found.rank < found.world_size:
        source = ("$RANK", "$WORLD_SIZE") if group is None else _GROUP
        said_rank = "rank" if rank is not None else source[0]
        said_world = "world_size" if world_size is not None else source[1]
        raise errors.InputError(
            f"{said_rank}={found.rank} and {said_world}={found.world_size}: expected "
            f"0 <= rank < world_size; give both rank= and world_size=, or neither (to "
            f"read them from the torch.distributed process group, or $RANK/$WORLD_SIZE)"
        )
    return found


#: How an error names the rank and world size of torch.distributed's default group.
_GROUP = ("torch.distributed.get_rank()", "torch.distributed.get_world_size()")
