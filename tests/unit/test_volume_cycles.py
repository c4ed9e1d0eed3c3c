"""When readers waiting in acquires hold the memory volume's missing room themselves
(`shardcache.node.volume_cycles`): the arithmetic, without a full volume."""

from __future__ import annotations

import dataclasses

from shardcache.node import volume_cycles

MiB = 1 << 20
#: Explorer report D1, scaled: a 40 MiB tier on its 50 MiB volume, 8 readers each
#: mapping one evicted ~7 MB shard, the tier's files all evicted, nothing free.
CYCLE = volume_cycles.Look(
    total=50 * MiB, free=0, own=0, evictable=0, need=7 * MiB, readers=8, waiting=8
)


def test_every_reader_waiting_while_their_mappings_fill_the_volume_is_a_cycle() -> None:
    assert volume_cycles.stuck(CYCLE)
    assert CYCLE.mapped == 50 * MiB


def test_a_reader_not_waiting_may_still_unmap_so_it_is_no_cycle() -> None:
    assert not volume_cycles.stuck(dataclasses.replace(CYCLE, waiting=7))
    assert not volume_cycles.stuck(dataclasses.replace(CYCLE, readers=0, waiting=0))


def test_room_free_or_evictable_is_no_cycle() -> None:
    assert not volume_cycles.stuck(dataclasses.replace(CYCLE, free=7 * MiB))
    assert not volume_cycles.stuck(dataclasses.replace(CYCLE, free=3 * MiB, evictable=4 * MiB))


def test_a_full_volume_with_no_mapped_bytes_is_the_tiers_own_wait_not_this() -> None:
    # The tier's own leased files fill it: the lease wait, not readers' mappings.
    assert not volume_cycles.stuck(dataclasses.replace(CYCLE, own=50 * MiB))


def test_the_cycle_fails_only_after_the_grace_and_not_while_room_comes_back() -> None:
    watch = volume_cycles.Watch()
    assert not watch.lasted(CYCLE, 100.0)
    assert not watch.lasted(CYCLE, 100.0 + volume_cycles.GRACE_S - 0.1)
    # A reader unmapped something: progress, the grace starts again.
    assert not watch.lasted(dataclasses.replace(CYCLE, free=MiB), 100.0 + volume_cycles.GRACE_S)
    assert not watch.lasted(dataclasses.replace(CYCLE, free=MiB), 101.0 + volume_cycles.GRACE_S)
    assert watch.lasted(dataclasses.replace(CYCLE, free=MiB), 100.0 + 2 * volume_cycles.GRACE_S)
    watch.reset()
    assert not watch.lasted(CYCLE, 200.0)


def test_no_cycle_resets_the_watch() -> None:
    watch = volume_cycles.Watch()
    watch.lasted(CYCLE, 0.0)
    watch.lasted(dataclasses.replace(CYCLE, waiting=0), 1.0)
    assert not watch.lasted(CYCLE, volume_cycles.GRACE_S)


#: The explorer's merged run: 3 of 5 readers wait in an acquire; the other 2 got their
#: last batch and keep it mapped while they wait for something else (there, writing
#: their output to a pipe nobody read yet; in training, a collective that waits for
#: the 3). Nothing in the volume is free or evictable.
SHORT = dataclasses.replace(CYCLE, readers=5, waiting=3, ended=7)


def test_readers_waiting_elsewhere_while_the_rest_wait_in_acquires_are_a_cycle_after_the_idle_grace() -> (
    None
):
    watch = volume_cycles.Watch()
    assert not watch.lasted(SHORT, 100.0)
    # Not at the short grace: a reader busy with a long shard asks for nothing either.
    assert not watch.lasted(SHORT, 100.0 + volume_cycles.GRACE_S)
    assert not watch.lasted(SHORT, 100.0 + volume_cycles.IDLE_GRACE_S - 0.1)
    assert watch.lasted(SHORT, 100.0 + volume_cycles.IDLE_GRACE_S)


def test_the_idle_grace_starts_again_when_an_acquire_ends_or_room_comes_back() -> None:
    watch = volume_cycles.Watch()
    idle = volume_cycles.IDLE_GRACE_S
    assert not watch.lasted(SHORT, 0.0)
    # An acquire ended (a reader got its shard, or failed and goes away): progress.
    assert not watch.lasted(dataclasses.replace(SHORT, ended=8), idle)
    assert not watch.lasted(dataclasses.replace(SHORT, ended=8), 2 * idle - 0.1)
    # A busy reader moved on and let go of a shard the tier may evict: progress.
    moved = dataclasses.replace(SHORT, ended=8, evictable=MiB)
    assert not watch.lasted(moved, 2 * idle)
    assert not watch.lasted(moved, 3 * idle - 0.1)
    assert watch.lasted(moved, 3 * idle)


def test_a_reader_that_joins_the_waiting_completes_the_cycle_without_a_new_grace() -> None:
    watch = volume_cycles.Watch()
    assert not watch.lasted(SHORT, 0.0)
    # The last busy readers asked for their next shards: every reader waits now, and
    # the room they hold was missing all along.
    assert watch.lasted(dataclasses.replace(SHORT, waiting=5), volume_cycles.GRACE_S)


def test_no_reader_in_an_acquire_is_no_cycle() -> None:
    assert volume_cycles.grace(dataclasses.replace(SHORT, waiting=0)) is None
    assert volume_cycles.grace(SHORT) == volume_cycles.IDLE_GRACE_S
    assert volume_cycles.grace(CYCLE) == volume_cycles.GRACE_S


def test_the_error_of_a_cycle_short_of_some_readers_says_who_waits_where() -> None:
    text = volume_cycles.describe(
        SHORT, root="/m", limit=40 * MiB, shard_bytes=7 * MiB, setting="X"
    )
    assert "5 reader(s)" in text
    assert "3 of them wait in an acquire and the other 2 gave back no room" in text
    assert "every reader waits" not in text


def test_the_volume_needed_is_the_limit_plus_a_shard_per_reader() -> None:
    assert volume_cycles.volume_needed(40 * MiB, 8, 7 * MiB) == 96 * MiB
    # The webhook's volume is the limit plus a quarter: 8 readers of 7 MiB need a
    # limit of 4 x 56 MiB for their shards to fit in that quarter.
    assert volume_cycles.limit_needed(40 * MiB, 50 * MiB, 8, 7 * MiB) == 224 * MiB
    assert volume_cycles.limit_needed(40 * MiB, 40 * MiB, 8, 7 * MiB) is None


def test_the_error_names_the_volume_the_mapped_bytes_the_readers_and_what_is_needed() -> None:
    text = volume_cycles.describe(
        CYCLE,
        root="/run/m/mem",
        limit=40 * MiB,
        shard_bytes=7 * MiB,
        setting="SHARDCACHE_MEMORY_LIMIT_BYTES",
    )
    assert f"/run/m/mem ({50 * MiB} bytes)" in text
    assert "8 reader(s)" in text
    assert f"{50 * MiB} bytes of the volume are shards the tier evicted" in text
    assert f"at least {96 * MiB} bytes" in text
    assert f"a memory limit of at least {224 * MiB} bytes" in text
    assert "SHARDCACHE_MEMORY_LIMIT_BYTES" in text
