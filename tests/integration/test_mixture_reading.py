"""Mixtures read through real embedded caches: exact sources, exact resume."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardcache
from shardcache import errors
from tests.support import datasets

pytestmark = pytest.mark.integration

#: Small sources of unlike sizes, so both end several epochs within a short run, and
#: their epoch ends fall inside batches.
SHARDS = {"web": [23, 17, 25], "code": [11, 30]}
#: uids of source "code" start here, so every row names its source.
CODE_UIDS = 10_000
BATCH = 8
STEPS = 60


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, str]:
    written = datasets.write_sources(tmp_path, SHARDS, first_uids={"code": CODE_UIDS})
    return {name: str(root) for name, root in written.items()}


def open_sources(roots: dict[str, str], cache: Path) -> dict[str, shardcache.Dataset]:
    return {
        name: shardcache.open(uri, cache_dir=cache / name, seed=7, block_size=4)
        for name, uri in roots.items()
    }


def uids(batches: list[pa.RecordBatch]) -> list[int]:
    return [u for b in batches for u in b.column("uid").to_pylist()]


def run(
    roots: dict[str, str],
    cache: Path,
    weights: object,
    *,
    stop_at: int | None = None,
    state: dict[str, object] | None = None,
) -> tuple[list[pa.RecordBatch], dict[str, object]]:
    with shardcache.mix(open_sources(roots, cache), weights=weights, seed=3) as m:  # type: ignore[arg-type]
        if state is not None:
            m.load_state_dict(state)
        steps = (stop_at if stop_at is not None else STEPS) - m.step
        got = list(m.batches(BATCH, steps=steps))
        # Through JSON, as a checkpoint stores it.
        return got, json.loads(json.dumps(m.state_dict()))


def plain_stream(uri: str, cache: Path) -> Iterator[int]:
    """A source read alone, epoch after epoch: what the mixture must read of it."""
    with shardcache.open(uri, cache_dir=cache, seed=7, block_size=4) as ds:
        epoch = 0
        while True:
            ds.set_epoch(epoch)
            for batch in ds.batches(5):
                yield from batch.column("uid").to_pylist()
            epoch += 1


def test_each_source_is_read_by_its_own_plan_across_its_epochs(
    roots: dict[str, str], tmp_path: Path
) -> None:
    got, state = run(roots, tmp_path / "c", {"web": 2, "code": 1})
    assert all(b.num_rows == BATCH for b in got)
    rows = uids(got)
    for name in SHARDS:
        read = [u for u in rows if (u >= CODE_UIDS) == (name == "code")]
        expected = plain_stream(roots[name], tmp_path / f"plain-{name}")
        assert read == [next(expected) for _ in read]
        # Long enough to cross epochs: each source restarted at least once.
        assert len(read) > sum(SHARDS[name])
    assert state["step"] == STEPS


@pytest.mark.parametrize("stop_at", [0, 1, 5, 13, 29, 59])
def test_resume_at_any_step_continues_row_by_row(
    roots: dict[str, str], tmp_path: Path, stop_at: int
) -> None:
    weights = {"web": 0.6, "code": 0.4}
    reference, _ = run(roots, tmp_path / "ref", weights)
    first, state = run(roots, tmp_path / "a", weights, stop_at=stop_at)
    rest, _ = run(roots, tmp_path / "b", weights, state=state)
    assert uids(first) + uids(rest) == uids(reference)
    assert pa.concat_batches(first + rest).equals(pa.concat_batches(reference))


@pytest.mark.parametrize("stop_at", [10, 25, 40])
def test_resume_mid_schedule_continues_row_by_row(
    roots: dict[str, str], tmp_path: Path, stop_at: int
) -> None:
    schedule = [(0, {"web": 1.0, "code": 0.0}), (50, {"web": 0.0, "code": 1.0})]
    reference, _ = run(roots, tmp_path / "ref", schedule)
    first, state = run(roots, tmp_path / "a", schedule, stop_at=stop_at)
    rest, _ = run(roots, tmp_path / "b", schedule, state=state)
    assert uids(first) + uids(rest) == uids(reference)
    # The schedule shows: all "web" at first, all "code" at the end.
    assert all(u < CODE_UIDS for u in uids(reference[:1]))
    assert all(u >= CODE_UIDS for u in uids(reference[50:]))


def test_a_state_of_another_mixture_is_refused_saying_what_differs(
    roots: dict[str, str], tmp_path: Path
) -> None:
    _, state = run(roots, tmp_path / "a", {"web": 1, "code": 1}, stop_at=3)
    with (
        shardcache.mix(open_sources(roots, tmp_path / "b"), weights={"web": 1, "code": 2}) as m,
        pytest.raises(errors.StateMismatchError, match=r"seed: state has 3.*weights: state has"),
    ):
        m.load_state_dict(state)


def test_a_state_of_another_world_size_is_refused_saying_a_mixture_resumes_only_at_its_own(
    roots: dict[str, str], tmp_path: Path
) -> None:
    """A mixture saved at world size 2 loaded at 3: refused naming both world sizes and
    that mixtures have no elastic resume (it used to pass on a source's advice to load
    the list of every rank's states, which a mixture refuses as no dict), and a list of
    the ranks' states is refused saying the same. Nothing moves."""

    def mixture(rank: int, world: int, cache: Path) -> shardcache.Mixture:
        opened = {
            name: shardcache.open(
                uri, cache_dir=cache / name, seed=7, block_size=4, rank=rank, world_size=world
            )
            for name, uri in roots.items()
        }
        return shardcache.mix(opened, weights={"web": 1, "code": 1}, seed=3)

    saved = []
    for rank in range(2):
        with mixture(rank, 2, tmp_path / "old") as m:
            list(m.batches(BATCH, steps=3))
            saved.append(json.loads(json.dumps(m.state_dict())))
    with mixture(0, 3, tmp_path / "new") as m:
        with pytest.raises(errors.StateMismatchError) as refused:
            m.load_state_dict(saved[0])
        message = str(refused.value)
        assert "saved at world size 2 (source 'web'), this mixture reads at world size 3" in message
        assert "resumes only at the world size it was saved at (2)" in message
        assert "elastic resume is not offered for mixtures" in message
        assert "load_state_dict([...])" not in message
        with pytest.raises(
            errors.StateMismatchError,
            match=r"found a list of 2: a mixture resumes only at the world size it was saved",
        ):
            m.load_state_dict(saved)  # type: ignore[arg-type]
        assert m.step == 0
        assert {n: (ds.epoch, ds.position) for n, ds in m.sources.items()} == {
            "web": (0, 0),
            "code": (0, 0),
        }


def test_counts_say_how_many_batches_and_rows_each_source_served(
    roots: dict[str, str], tmp_path: Path
) -> None:
    with shardcache.mix(open_sources(roots, tmp_path / "c"), weights={"web": 1, "code": 1}) as m:
        got = list(m.batches(BATCH, steps=20))
        snap = m.snapshot()
    web = sum(1 for b in got if b.column("uid")[0].as_py() < CODE_UIDS)
    assert snap["step"] == 20
    assert snap["sources"]["web"]["batches"] == web
    assert snap["sources"]["code"]["batches"] == 20 - web
    assert snap["sources"]["web"]["rows"] == web * BATCH
    assert json.loads(json.dumps(snap)) == snap


def test_an_empty_source_may_only_have_weight_zero(roots: dict[str, str], tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    pq.write_table(datasets.make_table(50_000, 2), tiny / "part-00000.parquet")

    def sources(cache: Path) -> dict[str, shardcache.Dataset]:
        # Rank 0 of 4 over 2 rows reads nothing.
        empty = shardcache.open(str(tiny), cache_dir=cache / "tiny", rank=0, world_size=4)
        return {"web": shardcache.open(roots["web"], cache_dir=cache / "web"), "tiny": empty}

    with shardcache.mix(sources(tmp_path / "a"), weights={"web": 1, "tiny": 0}) as m:
        assert len(list(m.batches(BATCH, steps=5))) == 5
    with (
        shardcache.mix(sources(tmp_path / "b"), weights={"web": 0, "tiny": 1}) as m,
        pytest.raises(
            errors.InputError, match="source 'tiny' has no rows for rank 0 but was drawn"
        ),
    ):
        next(m.batches(BATCH))


def test_a_state_refused_for_one_source_moves_no_source_and_not_the_step(
    roots: dict[str, str], tmp_path: Path
) -> None:
    weights = {"web": 1, "code": 1}
    reference, _ = run(roots, tmp_path / "ref", weights, stop_at=10)
    _, state = run(roots, tmp_path / "a", weights, stop_at=5)
    sources = state["sources"]
    assert isinstance(sources, dict)
    # "web" comes first and fits; "code" was saved by another configuration.
    sources["code"]["seed"] = 99
    with shardcache.mix(open_sources(roots, tmp_path / "b"), weights=weights, seed=3) as m:
        with pytest.raises(errors.StateMismatchError, match=r"source 'code'.*seed: state has 99"):
            m.load_state_dict(state)
        assert m.step == 0
        assert {n: (ds.epoch, ds.position) for n, ds in m.sources.items()} == {
            "web": (0, 0),
            "code": (0, 0),
        }
        assert uids(list(m.batches(BATCH, steps=10))) == uids(reference)


def test_a_source_set_to_another_epoch_between_two_batches_reads_on_from_there(
    roots: dict[str, str], tmp_path: Path
) -> None:
    weights = {"web": 1, "code": 0}  # every batch from "web"
    with shardcache.open(roots["web"], cache_dir=tmp_path / "plain", seed=7, block_size=4) as ds:
        ds.set_epoch(3)
        epoch3 = uids(list(ds.batches(BATCH)))
    with shardcache.mix(open_sources(roots, tmp_path / "a"), weights=weights, seed=3) as m:
        it = m.batches(BATCH)
        next(it)
        next(it)
        m.sources["web"].set_epoch(3)
        got = uids([next(it) for _ in range(3)])
        state = json.loads(json.dumps(m.state_dict()))
        following = uids([next(it) for _ in range(3)])
    assert got == epoch3[: 3 * BATCH]
    assert (state["sources"]["web"]["epoch"], state["sources"]["web"]["position"]) == (3, 24)
    with shardcache.mix(open_sources(roots, tmp_path / "b"), weights=weights, seed=3) as m:
        m.load_state_dict(state)
        assert uids(list(m.batches(BATCH, steps=3))) == following


def test_a_batch_size_or_steps_of_another_type_is_refused_and_numpy_integers_are_taken(
    roots: dict[str, str], tmp_path: Path
) -> None:
    import numpy as np

    with shardcache.mix(open_sources(roots, tmp_path / "c"), weights={"web": 1, "code": 1}) as m:
        for batch_size, count, message in [
            (BATCH, 1.5, "steps: expected an int >= 0, found float 1.5"),
            (BATCH, "2", "steps: expected an int >= 0, found str '2'"),
            (BATCH, True, "steps: expected an int >= 0, found bool True"),
            (2.0, 1, "batch_size: expected an int >= 1, found float 2.0"),
        ]:
            with pytest.raises(errors.InputError, match=re.escape(message)):
                next(m.batches(batch_size, steps=count))  # type: ignore[arg-type]
        assert m.step == 0
        size: Any = np.int64(BATCH)
        two: Any = np.int64(2)
        assert [b.num_rows for b in m.batches(size, steps=two)] == [BATCH, BATCH]
        state = m.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert (state["step"], state["batch_size"]) == (2, BATCH)
