"""The cold fill takes every reader's plan round robin: each reader's next shard before
any reader's second, every shard once (issue 14's cold fill)."""

from __future__ import annotations

from shardcache.node import fill_orders


def test_interleaving_takes_each_ranks_next_shard_in_turn_and_each_shard_once() -> None:
    assert fill_orders.interleaved([[5, 1, 2], [7, 5], [3]]) == [
        (5, 0),
        (7, 0),
        (3, 0),
        (1, 1),
        (2, 2),
    ]
    assert fill_orders.interleaved([]) == []
