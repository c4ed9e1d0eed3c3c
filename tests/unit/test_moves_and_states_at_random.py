"""Random walks of a training loop over the numpy batches: batches taken, batches
skipped (through `.dataset` and `Batches.skip_batches`), epochs set (forward, again, back), passes run to the end and started again,
with and without `drop_last`, in every shuffle mode. At every step the state taken
loads into a fresh reader, which then yields exactly what the walked one yields next;
and no pass hands out a row twice. (Skips ahead of a position, a trim recorded before
its batch was handed out, a state that contradicts itself: what s21 found by hand.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest

import shardcache.numpy
from shardcache import errors
from tests.support import datasets

pytestmark = pytest.mark.unit

SHARDS = [9, 6, 0, 13]  # ranks of 14 rows at world size 2
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("next"), st.integers(1, 4)),
        st.tuples(st.just("skip"), st.integers(1, 2)),
        st.tuples(st.just("bskip"), st.integers(1, 2)),  # Batches.skip_batches
        st.tuples(st.just("epoch"), st.integers(0, 2)),
        st.tuples(st.just("rest"), st.just(0)),
    ),
    min_size=1,
    max_size=8,
)


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    return datasets.write_local(tmp_path_factory.mktemp("walks") / "ds", SHARDS)[0]


def uids(batch: dict[str, Any]) -> list[int]:
    return [int(u) for u in batch["uid"]]


@hypothesis.settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
@hypothesis.given(
    ops=OPS,
    size=st.integers(1, 5),
    drop_last=st.booleans(),
    shuffle=st.sampled_from([True, "sample", False]),
)
# The walk's third find: a pass finding nothing left armed the loaded-state refusal.
@hypothesis.example(
    ops=[("epoch", 1), ("skip", 2), ("skip", 2), ("next", 1), ("epoch", 0)],
    size=4, drop_last=False, shuffle=True,
)  # fmt: skip
def test_every_state_of_a_random_walk_resumes_exactly(
    uri: str, tmp_path: Path, ops: list[tuple[str, int]], size: int, drop_last: bool,
    shuffle: bool | str,
) -> None:  # fmt: skip
    options: dict[str, Any] = dict(
        batch_size=size, columns=["uid"], cache_dir=tmp_path / "cache", rank=1, world_size=2,
        drop_last=drop_last, shuffle=shuffle, window=8, block_size=4,
    )  # fmt: skip
    with shardcache.numpy.Batches(uri, **options) as walked:
        it: Iterator[dict[str, Any]] | None = None  # the open pass
        handed: list[int] = []  # its rows
        skipped = 0  # rows it skipped
        ended = False  # whether it ran to its end
        fresh = True  # no pass of this epoch ran yet (one at its end then reads nothing)
        for op, n in ops:
            if op in ("next", "rest") and it is None:
                it = iter(walked)
                if ended:  # a pass after one that ended reads the epoch again
                    handed, skipped, ended = [], 0, False
            if op in ("next", "rest"):
                fresh = False
            if op == "next":
                assert it is not None
                for batch in [b for _, b in zip(range(n), it, strict=False)]:
                    handed += uids(batch)
            elif op == "rest":
                assert it is not None
                handed += [u for b in it for u in uids(b)]
                it, ended = None, True
            elif op == "skip":
                skip = walked.dataset.skip_batches(n, batch_size=size)
                skipped += 0 if skip is None else len(skip)
            elif op == "bskip":
                if it is None and ended:  # it skips the next pass's first batches
                    handed, skipped, ended, fresh = [], 0, False, True
                skip = walked.skip_batches(n)
                skipped += 0 if skip is None else len(skip)
            else:
                # The epoch read keeps its place; another starts at its beginning.
                if n != walked.epoch:
                    handed, skipped, ended, fresh = [], 0, False, True
                walked.set_epoch(n)
                it = None
            assert len(handed) == len(set(handed)), (op, n, handed)
            state = walked.state_dict()
            at_end = state["dataset"]["position"] >= len(walked.dataset) and not state["skip"]
            if at_end and not fresh:
                # Its last batch was taken (or skipped): the next pass reads the epoch again.
                it, ended = None, True
            with shardcache.numpy.Batches(uri, **options) as resumer:
                resumer.load_state_dict(state)  # every state loads
                resumed = [u for b in resumer for u in uids(b)]
            # A resume reads the rest of the open pass: never a row it handed out or
            # skipped, and without drop_last every other row of the epoch.
            everything = epoch_rows(uri, options, walked.epoch)
            assert not set(resumed) & set(handed), (op, n, state)
            assert set(handed + resumed) <= set(everything)
            read = len(handed) + len(resumed) + skipped
            if drop_last:
                assert read <= len(everything), (op, n, state)
            else:
                assert read == len(everything), (op, n, state)


def epoch_rows(uri: str, options: dict[str, Any], epoch: int) -> list[int]:
    with shardcache.numpy.Batches(uri, **{**options, "drop_last": False}) as whole:
        whole.set_epoch(epoch)
        return [u for b in whole for u in uids(b)]


def test_a_batch_handed_after_a_skip_through_dataset_is_counted(uri: str, tmp_path: Path) -> None:
    """The walk's first find: the reader counted its place from the last batch, not the
    dataset's, so the batch handed after `.dataset.skip_batches` was left out of the
    state and a resume handed it out again."""
    options: dict[str, Any] = dict(
        batch_size=1, columns=["uid"], cache_dir=tmp_path / "cache", rank=1, world_size=2
    )
    with shardcache.numpy.Batches(uri, **options) as walked:
        it = iter(walked)
        first = uids(next(it))
        walked.dataset.skip_batches(1)
        second = uids(next(it))
        state = walked.state_dict()
        rest = [u for b in it for u in uids(b)]
    assert state["dataset"]["position"] == 3
    with shardcache.numpy.Batches(uri, **options) as resumed:
        resumed.load_state_dict(state)
        assert [u for b in resumed for u in uids(b)] == rest
    assert len(first + second + rest) == 14 - 1


def test_a_skip_before_the_first_batch_is_kept_in_the_state(uri: str, tmp_path: Path) -> None:
    options: dict[str, Any] = dict(
        batch_size=2, columns=["uid"], cache_dir=tmp_path / "cache", rank=1, world_size=2
    )
    with shardcache.numpy.Batches(uri, **options) as walked:
        walked.dataset.skip_batches(2, batch_size=2)  # no batches() call yet to say it
        state = walked.state_dict()  # refused on load before: a skip ahead of position 0
        rest = [u for b in walked for u in uids(b)]
    assert state["dataset"]["position"] == 4 and len(rest) == 14 - 4
    with shardcache.numpy.Batches(uri, **options) as resumed:
        resumed.load_state_dict(state)
        assert [u for b in resumed for u in uids(b)] == rest


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, "sample", False])
def test_batches_skip_batches_before_any_batch_skips_its_own_batches_and_resumes(
    uri: str, tmp_path: Path, drop_last: bool, shuffle: bool | str
) -> None:
    """`Batches.skip_batches(k)` before any batch: `.dataset.skip_batches(k)` needed
    batch_size= there (the dataset has had no batches() call). With the batches' own
    size it skips k of them, is in the state, and a resume hands every other row."""
    options: dict[str, Any] = dict(
        batch_size=3, columns=["uid"], cache_dir=tmp_path / "cache", rank=1, world_size=2,
        drop_last=drop_last, shuffle=shuffle, window=8, block_size=4,
    )  # fmt: skip
    everything = epoch_rows(uri, options, 0)  # 14 rows: 4 whole batches and 2 rows
    with shardcache.numpy.Batches(uri, **options) as walked:
        skip = walked.skip_batches(2)
        state = walked.state_dict()
        rest = [u for b in walked for u in uids(b)]
    assert skip is not None and (skip.start, skip.stop) == (0, 6)
    assert state["dataset"]["skips"] == [{"epoch": 0, "start": 0, "stop": 6}]
    with shardcache.numpy.Batches(uri, **options) as resumed:
        resumed.load_state_dict(state)
        again = [u for b in resumed for u in uids(b)]
    assert again == rest
    skipped = everything[:6]
    assert not set(again) & set(skipped)
    kept = everything[6:12] if drop_last else everything[6:]
    assert again == kept


def test_batches_skip_batches_is_refused_for_packed_batches(uri: str, tmp_path: Path) -> None:
    with shardcache.numpy.Batches(
        uri, batch_size=2, columns=["tokens"], cache_dir=tmp_path / "cache", rank=1,
        world_size=2, pack=4,
    ) as packed:  # fmt: skip
        with pytest.raises(errors.InputError, match="packed sequences, not rows"):
            packed.skip_batches(1)
        assert packed.state_dict()["dataset"]["skips"] == []


def test_an_earlier_epoch_after_a_pass_that_found_nothing_left_is_read_not_refused(
    uri: str, tmp_path: Path
) -> None:
    """A pass's own seek to its start looked like a loaded state not read from yet when
    that start was the epoch's end (every batch skipped), so `set_epoch(0)` after it was
    refused as a resume going back."""
    options: dict[str, Any] = dict(
        batch_size=4, columns=["uid"], cache_dir=tmp_path / "cache", rank=1, world_size=2
    )
    with shardcache.numpy.Batches(uri, **options) as walked:
        walked.set_epoch(1)
        walked.dataset.skip_batches(4, batch_size=4)  # all 14 of the rank's rows
        assert list(walked) == []
        walked.set_epoch(0)
        again = [u for b in walked for u in uids(b)]
    assert sorted(again) == sorted(epoch_rows(uri, options, 0)) and len(again) == 14


def test_a_loaded_state_stays_refusing_an_earlier_epoch_across_the_passs_first_seek(
    uri: str, tmp_path: Path
) -> None:
    """A reader's seek to where a loaded state stands keeps the resume's refusal."""
    options: dict[str, Any] = dict(
        batch_size=2, columns=["uid"], cache_dir=tmp_path / "cache", rank=1, world_size=2
    )
    with shardcache.numpy.Batches(uri, **options) as walked:
        walked.set_epoch(1)
        next(iter(walked))
        state = walked.state_dict()
    ds = shardcache.numpy.Batches(uri, **options)
    with ds:
        ds.load_state_dict(state)
        ds.dataset.seek(ds.dataset.position)
        with pytest.raises(errors.StateMismatchError, match="set_epoch\\(0\\)"):
            ds.set_epoch(0)
