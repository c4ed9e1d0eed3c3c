"""What sample-mode readers' current and next windows take of the memory tier at once
(`windows.need`): the figure a waiting acquire checks against the memory limit."""

from __future__ import annotations

import pytest

from shardcache import windows

pytestmark = pytest.mark.unit

W = windows.Window

# Reader a meets windows of shards (0, 1) up to position 100, (2, 3) up to 200 and
# (3, 6) up to 300; reader b meets (1, 4) up to 50, then (5,) up to 120.
A = [W(100, (0, 1)), W(200, (2, 3)), W(300, (3, 6))]
B = [W(50, (1, 4)), W(120, (5,))]
SIZES = {0: 10, 1: 20, 2: 30, 3: 40, 4: 50, 5: 60, 6: 70}


def readers(a: int, b: int) -> dict[str, tuple[list[windows.Window], list[int], int]]:
    return {
        "a": (A, windows.window_ends(A), a),
        "b": (B, windows.window_ends(B), b),
    }


def test_each_reader_counts_its_current_and_next_window_and_a_shared_shard_once() -> None:
    need = windows.need(readers(0, 0), SIZES.get)
    assert need.readers == {"a": (0, 1, 2, 3), "b": (1, 4, 5)}
    assert need.bytes == 10 + 20 + 30 + 40 + 50 + 60  # shard 1 is one copy on the node
    assert need.unknown == 0


def test_a_window_is_left_at_its_end_and_a_reader_past_its_last_needs_nothing() -> None:
    need = windows.need(readers(100, 50), SIZES.get)
    assert need.readers == {"a": (2, 3, 6), "b": (5,)}  # shard 3 of both of a's windows
    assert need.bytes == 30 + 40 + 70 + 60
    assert windows.need(readers(200, 119), SIZES.get).readers == {"a": (3, 6), "b": (5,)}
    done = windows.need(readers(300, 120), SIZES.get)
    assert done.readers == {} and done.bytes == 0 and done.unknown == 0


def test_shards_of_unknown_size_count_nothing_and_are_counted_apart() -> None:
    need = windows.need(readers(250, 60), {3: 40, 5: 60}.get)
    assert need.bytes == 40 + 60
    assert need.unknown == 1  # shard 6


def test_the_description_names_the_largest_first_and_how_many_are_left_out() -> None:
    need = windows.need(readers(250, 60), SIZES.get)
    assert need.describe() == "a: 2 shards, 110 bytes; b: 1 shard, 60 bytes"
    assert need.describe(most=1) == "a: 2 shards, 110 bytes; and 1 more"
