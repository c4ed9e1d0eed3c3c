"""One Dataset object given to `shardcache.mix()` as two sources is refused, naming
both: two iterators over one dataset each walk on from their own cursor while both
advance its one position, so block mode handed rows out twice."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardcache
from shardcache import errors
from tests.support import datasets

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shuffle", [True, False, "sample"])
def test_one_dataset_as_two_mixture_sources_is_refused_naming_both(
    tmp_path: Path, shuffle: bool | str
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [13, 7, 9])
    with shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=shuffle, window=8) as ds:
        other = shardcache.open(uri, cache_dir=tmp_path / "cache", shuffle=shuffle, window=8)
        with pytest.raises(
            errors.InputError, match=r"mix\(\): sources 'a' and 'c' are one Dataset object"
        ):
            shardcache.mix({"a": ds, "b": other, "c": ds}, weights={"a": 1, "b": 1, "c": 1})
        other.close()


def test_two_datasets_of_the_same_data_mix_each_row_once_per_source(tmp_path: Path) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [13, 7, 9])
    a = shardcache.open(uri, cache_dir=tmp_path / "cache")
    b = shardcache.open(uri, cache_dir=tmp_path / "cache")
    with shardcache.mix({"a": a, "b": b}, weights={"a": 1, "b": 1}, seed=0) as mixed:
        batches = list(mixed.batches(3, steps=9))
    assert sum(batch.num_rows for batch in batches) == 27
    assert mixed.counts["a"].batches + mixed.counts["b"].batches == 9
