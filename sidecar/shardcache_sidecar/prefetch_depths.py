"""How many shards ahead of one reader to prefetch: a pure controller over the stall signal.

The sidecar starts every reader at the configured depth (`prefetch.depth`) and moves it
from there, one decision per stall report (a reader's notes, about once a second):

* **Grow** when the reader stalls on cold shards: its recent stall fraction is at least
  `Policy.grow_above` *and* its acquires had to wait for a shard that was not resident,
  in `Policy.patience` reports in a row. A loop that stalls on something else (its own
  collation, a slow step in a DataLoader worker) has no misses: a deeper read-ahead
  would not help it, so it is left alone. Growth is multiplicative (half the depth
  again, at least one): a stall is paid every step, unused read-ahead only in memory.
* **Hold** when memory is short: never deeper than the memory tier holds beside every
  reader's window (`room`), nor than `Policy.ceiling`.
* **Shrink** one shard at a time towards the configured depth once the stall has
  cleared (fraction at most `Policy.shrink_below`, no waiting acquire) for `Policy.calm`
  reports in a row, and at once to what fits when the room shrank under the depth
  (another reader registered, shards grew).

Hysteresis, so the depth does not oscillate: the thresholds leave a band in which the
depth holds and both streaks restart; growth needs `patience` stalled reports, a
shrink `calm` quiet ones (many more, since the stall fraction, an average over about
the last 20 batches, lags); and waiting acquires, the fast signal, stop growth as soon
as the read-ahead keeps up even while the lagging fraction is still high.

No I/O and no clock: `decide` maps (policy, state, signal, room) to a new state and a
reason; `prefetch_tuner` feeds it and applies, logs and exports what it decides.
"""

from __future__ import annotations

import dataclasses
import enum


class Reason(enum.Enum):
    """Why a depth changed (the `reason` label of the changes counter, and the log)."""

    #: The reader waited on cold shards while its loop stalled.
    STALLED = "stalled"
    #: The stall cleared and stayed clear: back one shard towards the configured depth.
    RECOVERED = "recovered"
    #: The memory tier no longer holds the depth beside every other reader's window.
    MEMORY = "memory"


@dataclasses.dataclass(frozen=True)
class Policy:
    """Bounds and thresholds of the controller (the sidecar's: `prefetch_tuner.policy_for`)."""

    #: Shallowest depth: the configured one; the controller never goes below it.
    floor: int
    #: Deepest depth (`prefetch.maxDepth`); below `floor` it acts as `floor`.
    ceiling: int
    #: A recent stall fraction at or above this counts as stalled. A fifth of the loop's
    #: time waiting on data is well past noise (a fed loop measures a few percent).
    grow_above: float = 0.2
    #: A recent stall fraction at or below this counts as clear.
    shrink_below: float = 0.05
    #: Stalled reports in a row before growing: one report can be a single cold shard.
    patience: int = 2
    #: Clear reports in a row before shrinking one shard: the fraction averages about 20
    #: batches, so a depth that just fixed a stall is kept for a while before it is tried
    #: one shallower.
    calm: int = 30

    def __post_init__(self) -> None:
        if self.floor < 1:
            raise ValueError(f"floor must be >= 1 (depth 0 is not tuned), found {self.floor}")
        if not 0.0 <= self.shrink_below < self.grow_above <= 1.0:
            raise ValueError(
                "expected 0 <= shrink_below < grow_above <= 1 (the band between them is the "
                f"hysteresis), found {self.shrink_below} and {self.grow_above}"
            )
        if self.patience < 1 or self.calm < 1:
            raise ValueError(f"patience and calm must be >= 1, found {self.patience}, {self.calm}")

    @property
    def top(self) -> int:
        return max(self.floor, self.ceiling)


@dataclasses.dataclass(frozen=True)
class Signal:
    """What one reader did since its last stall report."""

    #: Its recent stall fraction (0..1), as the client measured it.
    stall_fraction: float
    #: Its acquires that found their shard not resident and waited for it.
    misses: int
    #: Seconds those acquires waited in all.
    waited_seconds: float = 0.0

    @property
    def waited(self) -> bool:
        return self.misses > 0 or self.waited_seconds > 0


@dataclasses.dataclass(frozen=True)
class Room:
    """What the memory tier holds beyond every reader's current window."""

    #: Bytes of the memory limit not kept for any reader (`room`); negative when the
    #: windows already ask for more than the limit.
    free_bytes: int
    #: Bytes one more shard ahead takes: the largest decoded shard seen.
    shard_bytes: int

    def extra_shards(self) -> int:
        """Shards ahead that fit in the free room (negative: that many too many)."""
        return self.free_bytes // max(1, self.shard_bytes)


def room(
    memory_limit: int, *, depths: list[int], shard_bytes: int, reserved_shards: int = 0
) -> Room:
    """The room left when every reader (depth `d` each, in `depths`) keeps its current
    shard and `d` ahead, and `reserved_shards` more are kept (the startup shards a
    restarted sidecar warms): those are the shards it would need next, which a deeper
    read-ahead of another reader must never push out."""
    kept = (sum(d + 1 for d in depths) + reserved_shards) * shard_bytes
    return Room(free_bytes=memory_limit - kept, shard_bytes=shard_bytes)


@dataclasses.dataclass(frozen=True)
class State:
    """One reader's depth and the streaks that gate its next change."""

    depth: int
    stalled: int = 0
    clear: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    state: State
    #: Why the depth changed; None when it did not.
    reason: Reason | None = None


def start(policy: Policy) -> State:
    return State(depth=policy.floor)


def decide(policy: Policy, state: State, signal: Signal, space: Room) -> Decision:
    """The reader's next depth, given what it did since its last report and the room.

    `state.depth` counts in `space` (its window is kept there), so `space.extra_shards()`
    is how much deeper it may go, or, when negative, how much shallower it must."""
    depth = state.depth
    # The deepest the memory tier allows now; never below the floor (the configured
    # depth: readahead of that much was asked for, and never evicts to make room).
    fits = max(policy.floor, min(policy.top, depth + space.extra_shards()))
    if depth > fits:
        return Decision(State(depth=fits), Reason.MEMORY)
    stalled = signal.stall_fraction >= policy.grow_above and signal.waited
    clear = signal.stall_fraction <= policy.shrink_below and not signal.waited
    if stalled:
        streak = state.stalled + 1
        if streak < policy.patience or depth >= fits:
            # Not yet; or no room (held: memory is short, or at the ceiling).
            return Decision(State(depth=depth, stalled=streak))
        grown = min(fits, depth + max(1, depth // 2))
        return Decision(State(depth=grown), Reason.STALLED)
    if clear:
        streak = state.clear + 1
        if streak < policy.calm or depth <= policy.floor:
            return Decision(State(depth=depth, clear=streak))
        return Decision(State(depth=depth - 1), Reason.RECOVERED)
    # Between the thresholds, or stalling without waiting on shards: hold, and both
    # streaks start over.
    return Decision(State(depth=depth))
