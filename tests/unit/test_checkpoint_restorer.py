"""Pure parts of the restorer: how files are split for parallel ranged downloads."""

from __future__ import annotations

import pytest
from shardcache_sidecar.checkpoint import restorer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("size", [0, 1, restorer.RANGE - 1, restorer.RANGE, 3 * restorer.RANGE + 7])
def test_ranges_cover_the_file_exactly_once_in_order(size: int) -> None:
    pieces = restorer.ranges(size)
    assert all(0 <= n <= restorer.RANGE for _, n in pieces)
    covered = 0
    for offset, length in pieces:
        assert offset == covered
        covered += length
    assert covered == size


def test_an_empty_file_is_one_empty_piece() -> None:
    assert restorer.ranges(0) == [(0, 0)]
