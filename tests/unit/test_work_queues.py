"""The prefetcher's queue hands out the most urgent shard first, each shard once
(issue 14's cold fill: no fetch slot idles behind another reader's far readahead)."""

from __future__ import annotations

import threading

from shardcache.node import work_queues

READ, FILL = work_queues.READAHEAD, work_queues.FILL


def drain(queue: work_queues.WorkQueue) -> list[tuple[int, str]]:
    out = []
    while len(queue):
        item = queue.get()
        assert item is not None
        out.append((item[0], item[2]))
    return out


def test_the_most_urgent_shard_comes_first_and_a_reader_before_the_fill_at_equal_index() -> None:
    queue = work_queues.WorkQueue()
    queue.put(7, (3, READ), "readahead")
    queue.put(5, (0, FILL), "fill")
    queue.put(6, (0, READ), "readahead")
    queue.put(8, (1, FILL), "fill")
    assert drain(queue) == [(6, "readahead"), (5, "fill"), (8, "fill"), (7, "readahead")]


def test_a_shard_asked_for_again_more_urgently_is_handed_out_once_at_the_better_priority() -> None:
    queue = work_queues.WorkQueue()
    assert queue.put(4, (5, FILL), "fill")
    assert queue.put(9, (2, READ), "readahead")
    assert queue.put(4, (0, READ), "readahead")
    assert not queue.put(4, (3, READ), "readahead")  # less urgent than it is queued
    assert not queue.put(9, (2, READ), "readahead")  # as urgent: nothing changes
    assert len(queue) == 2
    assert drain(queue) == [(4, "readahead"), (9, "readahead")]
    assert 4 not in queue


def test_a_shard_keeps_the_time_it_was_first_queued() -> None:
    queue = work_queues.WorkQueue()
    queue.put(1, (9, FILL), "fill")
    first = queue.get()
    queue.put(2, (9, FILL), "fill")
    queue.put(2, (0, READ), "readahead")
    second = queue.get()
    assert first is not None and second is not None
    assert second[0] == 2 and second[3] >= first[3]


def test_equal_priorities_come_out_in_the_order_they_were_queued() -> None:
    queue = work_queues.WorkQueue()
    for shard in (3, 1, 2):
        queue.put(shard, (1, READ), "readahead")
    assert [s for s, _ in drain(queue)] == [3, 1, 2]


def test_closing_wakes_a_waiting_get_with_none_and_refuses_more() -> None:
    queue = work_queues.WorkQueue()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(queue.get()))
    waiter.start()
    queue.close()
    waiter.join(10)
    assert not waiter.is_alive() and got == [None]
    assert not queue.put(1, (0, READ), "readahead")
    assert queue.get() is None


def test_a_shard_is_unfinished_from_queued_until_done() -> None:
    queue = work_queues.WorkQueue()
    queue.put(1, (1, READ), "readahead")
    queue.put(1, (0, READ), "readahead")
    assert queue.unfinished == 1
    assert queue.get() is not None
    assert (len(queue), queue.unfinished) == (0, 1)
    queue.done()
    assert queue.unfinished == 0
