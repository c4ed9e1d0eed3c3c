"""JAX adapter: numpy batches put on devices ahead of the step, with `jax.device_put`.

    batches = shardcache.jax.Batches("s3://bucket/tokens/", batch_size=1024,
                                     columns=["tokens"], pack=2048)
    for batch in shardcache.jax.DevicePrefetcher(batches, sharding=sharding, depth=2):
        state = ...                   # batch["tokens"] is a jax.Array, already placed

`Batches` is `shardcache.numpy.Batches` with the rank taken from JAX
(`jax.process_index()` of `jax.process_count()`) instead of $RANK; it reads a mixture
as `shardcache.numpy.Batches` does (`source` a `shardcache.Mixture`, or `mixture=`). The prefetcher's
state counts the batches handed over, not those in flight, as for torch, and a new pass
after one left early starts at the first batch not handed over.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

from shardcache import errors as _errors

try:
    import jax
except ModuleNotFoundError as _exc:
    raise _errors.missing_extra(_exc, "shardcache.jax", "jax") from _exc

import shardcache
import shardcache.numpy
from shardcache import stalls


class Batches(shardcache.numpy.Batches):
    """`shardcache.numpy.Batches` for this JAX process's share of the dataset."""

    def __init__(
        self,
        source: str | shardcache.Mixture | None = None,
        *,
        batch_size: int,
        columns: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        **options: Any,
    ) -> None:
        if isinstance(source, shardcache.Mixture):
            # Its sources were opened with their ranks already.
            super().__init__(
                source,
                batch_size=batch_size,
                columns=columns,
                rank=rank,
                world_size=world_size,
                **options,
            )
            return
        super().__init__(
            source,
            batch_size=batch_size,
            columns=columns,
            rank=jax.process_index() if rank is None else rank,
            world_size=jax.process_count() if world_size is None else world_size,
            **options,
        )


class DevicePrefetcher:
    """Iterate `batches` as dicts of jax.Arrays placed by `sharding` (default: the
    default device), `depth` batches ahead: `jax.device_put` is asynchronous, so the
    copies of the next batches overlap the current step."""

    def __init__(
        self, batches: shardcache.numpy.Batches, *, sharding: Any = None, depth: int = 2
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.batches = batches
        self.sharding = sharding
        self.depth = depth
        self._state: dict[str, Any] | None = None
        #: A pass was left before its end: it may have taken batches from `batches`
        #: (placed ahead) that it never handed over.
        self._left_early = False
        #: Counts `set_epoch` and `load_state_dict` moves: an open pass that sees it
        #: change drops the batches it placed ahead of the old place.
        self._moves = 0
        #: How long the loop waited for batches, against its steps.
        self.stalls = stalls.StallMeter()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.stalls.wrap(self._placed())

    def _placed(self) -> Iterator[dict[str, Any]]:
        queue: collections.deque[tuple[dict[str, Any], dict[str, Any]]] = collections.deque()
        # The batches placed ahead and dropped with a pass left early were never handed
        # over: this pass starts with them (else `batches` would go on after them).
        owed = self._left_early and self._state is not None
        if owed and self.batches.state_dict() != self._state:
            assert self._state is not None
            self.batches.load_state_dict(self._state)
        self._left_early = True
        self._state = self.batches.state_dict()
        moves = self._moves
        source: Iterator[dict[str, Any]] | None = iter(self.batches)
        while True:
            if self._moves != moves:
                # `set_epoch` or `load_state_dict` between two batches handed over: the
                # ones placed ahead are of the place `batches` left, and the caller
                # asked for the new one's first batch next. Dropped, their device
                # buffers freed with the last reference; `batches` reads on from the
                # new place (a pass it had ended is begun again, there).
                moves = self._moves
                queue.clear()
                self._state = self.batches.state_dict()
                if source is None:
                    source = iter(self.batches)
            if source is not None:
                batch = next(source, None)
                if batch is None:
                    source = None
                else:
                    placed = jax.device_put(batch, self.sharding)
                    queue.append((placed, self.batches.state_dict()))
                    if len(queue) <= self.depth:
                        continue
            if not queue:
                break
            handed, self._state = queue.popleft()
            yield handed
        self._left_early = False

    def state_dict(self) -> dict[str, Any]:
        return self._state if self._state is not None else self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the exact next batch of the run that saved `state`; called between
        two batches of an open pass, the batches placed ahead are dropped and the next
        one handed over is the state's."""
        self.batches.load_state_dict(state)
        self._state = None
        self._moves += 1

    @property
    def epoch(self) -> int:
        """The epoch read next (`Batches.epoch`): a resumed loop starts at it."""
        return self.batches.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read `epoch` next, from its start; called between two batches of an open
        pass, the batches of the old epoch placed ahead are dropped and the next one
        handed over is the new epoch's first."""
        before = self.batches.state_dict()
        self.batches.set_epoch(epoch)
        # The epoch being read already is no move: a pass left early still owes the
        # batches it placed ahead.
        if self.batches.state_dict() != before:
            self._state = None
            self._moves += 1
