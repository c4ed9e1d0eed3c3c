"""The data states of every rank of a ranked job, gathered at restore.

A ranked pod publishes under `<uri>/rank-<r>` (docs/checkpoints.md), so one pod's
agent sees only its own checkpoints. A job restarted at another world size needs every
old rank's data state from one step to resume (`shardcache.elastic`): at start the
agent reads the manifests under the sibling `rank-*` prefixes and writes them into the
checkpoint volume (`_protocol.DATA_STATES_NAME`), where `checkpoint.data_state("latest")`
finds them. Only manifests are read (a few KiB per step), never checkpoint data.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pyarrow.fs as pafs

from shardcache import errors, states
from shardcache.lineage import published

#: For `fullmatch`, as `published._RANK_DIR`.
_RANK_LEAF = re.compile(r"(.*)/rank-([0-9]+)")


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Every rank's data state at `step`, by rank; `prefixes` are where each published it."""

    step: int
    states: tuple[dict[str, Any], ...]
    prefixes: tuple[str, ...]

    @property
    def world_size(self) -> int:
        return len(self.states)


def base_of(prefix: str) -> str | None:
    """`<uri>` of a ranked pod's `<uri>/rank-<r>`; None for an unranked prefix."""
    m = _RANK_LEAF.fullmatch(prefix.rstrip("/"))
    return m.group(1) if m else None


def gather(fs: pafs.FileSystem, prefix: str) -> Gathered | None:
    """The newest step at which every rank of that step's world size published a data
    state under the siblings of `prefix`; None when `prefix` is not a rank prefix or no
    step is complete."""
    base = base_of(prefix)
    if base is None:
        return None
    by_step: dict[int, dict[int, tuple[dict[str, Any], str]]] = {}
    for rank, rank_prefix in published.rank_prefixes(fs, base).items():
        if rank is None:
            continue
        for manifest in published.checkpoint_manifests(fs, rank_prefix):
            if manifest.data_state is not None:
                by_step.setdefault(manifest.step, {})[rank] = (manifest.data_state, rank_prefix)
    for step in sorted(by_step, reverse=True):
        found = by_step[step]
        try:
            parsed = {r: states.parse(s, where=f"{p} step {step}") for r, (s, p) in found.items()}
        except errors.StateMismatchError:
            continue
        worlds = {s.world_size for s in parsed.values()}
        if len(worlds) != 1:
            continue
        world = worlds.pop()
        if set(parsed) == set(range(world)) and all(s.rank == r for r, s in parsed.items()):
            return Gathered(
                step,
                tuple(found[r][0] for r in range(world)),
                tuple(found[r][1] for r in range(world)),
            )
    return None
