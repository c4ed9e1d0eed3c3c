"""Decodes running at once share one byte budget: `fetch_concurrency` does not multiply
what a process holds decoded."""

from __future__ import annotations

import threading

import pytest

from shardcache import errors
from shardcache.node import decode_budgets


def test_a_reservation_waits_until_others_release_enough() -> None:
    budget = decode_budgets.DecodeBudget(100)
    entered = threading.Event()
    with budget.reserve(60):
        waiter = threading.Thread(target=lambda: _hold(budget, 60, entered))
        waiter.start()
        assert not entered.wait(0.2)  # 60 + 60 > 100: it waits
        assert budget.held == 60
    assert entered.wait(5)
    waiter.join(5)
    assert budget.held == 0


def test_reservations_that_fit_together_do_not_wait() -> None:
    budget = decode_budgets.DecodeBudget(100)
    with budget.reserve(40), budget.reserve(60):
        assert budget.held == 100


def test_a_reservation_over_the_capacity_is_refused_at_once() -> None:
    with (
        pytest.raises(
            decode_budgets.DecodeRoomError,
            match=r"peaks at about 101 bytes, more than the decode budget of 100 bytes",
        ),
        decode_budgets.DecodeBudget(100).reserve(101),
    ):
        pass
    # A cache error (HTTP 503, kind=cache): not the source's fault, nor a bug.
    assert issubclass(decode_budgets.DecodeRoomError, errors.CacheError)


def _hold(budget: decode_budgets.DecodeBudget, nbytes: int, entered: threading.Event) -> None:
    with budget.reserve(nbytes):
        entered.set()


def test_only_a_shard_whose_decoded_size_alone_exceeds_the_capacity_is_refused() -> None:
    # The peak factor is an estimate (token lists peak near 1.4x their metadata's
    # size, flat columns near 3x): a shard that fits decoded runs alone with all the
    # room rather than being refused for an estimate.
    budget = decode_budgets.DecodeBudget(100, what="the room")
    budget.check_fits(100)
    with pytest.raises(
        decode_budgets.DecodeRoomError,
        match=r"that is more than the decode budget of 100 bytes \(the room\)",
    ) as refused:
        budget.check_fits(101)
    assert (refused.value.size, refused.value.room) == (101, 100)
