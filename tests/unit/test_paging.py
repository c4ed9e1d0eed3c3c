"""Reading a Kubernetes list in pages (`paging.every_item`)."""

from __future__ import annotations

import pytest
from shardcache_operator import paging

pytestmark = pytest.mark.unit


def test_every_page_is_read_in_order_passing_each_continue_token() -> None:
    pages = {None: (["a", "b"], "t1"), "t1": (["c"], "t2"), "t2": (["d", "e"], "")}
    asked: list[str | None] = []

    def fetch(token: str | None) -> tuple[list[str], str | None]:
        asked.append(token)
        return pages[token]

    assert paging.every_item(fetch) == ["a", "b", "c", "d", "e"]
    assert asked == [None, "t1", "t2"], "the first page without a token, then each one handed"


def test_a_single_page_without_a_token_is_the_whole_list() -> None:
    calls: list[str | None] = []

    def fetch(token: str | None) -> tuple[list[int], str | None]:
        calls.append(token)
        return [1, 2], None

    assert paging.every_item(fetch) == [1, 2]
    assert calls == [None]


def test_an_empty_page_with_a_token_does_not_end_the_list() -> None:
    # The API server may hand an empty page with a token when a page's objects were
    # all filtered out; the list goes on.
    pages = {None: ([], "t1"), "t1": (["x"], None)}
    assert paging.every_item(lambda token: pages[token]) == ["x"]
