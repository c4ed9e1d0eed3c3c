"""Sample mode's gather run ahead on threads (`gather_threads`) changes nothing a reader
sees: the same batches in the same order, the same states at every batch, the same
continuation after a resume, a skip or a loaded state mid-iteration; and its threads
are gone once the iteration is closed, abandoned or its dataset closed. Embedded
(file:// source), checked batch by batch against the inline gather."""

from __future__ import annotations

import gc
import random
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, gather_ahead
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260, 1, 333]
TOTAL = sum(SHARDS)


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("ahead") / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    return str(root)


def open_sample(uri: str, cache: Path, threads: int, **kwargs: Any) -> shardcache.Dataset:
    kwargs.setdefault("window", 200)
    kwargs.setdefault("block_size", 64)
    return shardcache.open(uri, cache_dir=cache, shuffle="sample", gather_threads=threads, **kwargs)


def gather_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(gather_ahead.THREAD_NAME)]


def read(ds: shardcache.Dataset, batch_size: int, **kwargs: Any) -> list[pa.RecordBatch]:
    return list(ds.batches(batch_size, **kwargs))


def uids(batches: list[pa.RecordBatch]) -> list[int]:
    return [u for b in batches for u in b.column("uid").to_pylist()]


def test_batches_and_states_equal_the_inline_gathers_over_random_plans(
    uri: str, tmp_path: Path
) -> None:
    rng = random.Random(15)
    for _ in range(6):
        plan = {
            "seed": rng.randrange(1 << 30),
            "window": rng.choice([1, 7, 64, 200, 1000, 4096]),
            "world_size": rng.choice([1, 2, 3]),
            "epoch": rng.randrange(3),
        }
        plan["rank"] = rng.randrange(plan["world_size"])
        batch_size = rng.choice([1, 13, 64, 100, 257])
        drop_last = rng.random() < 0.5
        runs: dict[int, tuple[list[pa.RecordBatch], list[dict[str, Any]]]] = {}
        for threads in (0, 2, 3, 5):
            with open_sample(uri, tmp_path / "c", threads, **plan) as ds:
                batches, states = [], []
                for batch in ds.batches(batch_size, drop_last=drop_last):
                    batches.append(batch)
                    states.append(ds.state_dict())
                runs[threads] = (batches, states)
        inline_batches, inline_states = runs[0]
        assert inline_batches, plan
        for threads, (batches, states) in runs.items():
            assert len(batches) == len(inline_batches), (plan, threads)
            for i, (got, want) in enumerate(zip(batches, inline_batches, strict=True)):
                assert got.equals(want), (plan, batch_size, threads, i)
            assert states == inline_states, (plan, threads)


@pytest.mark.parametrize("threads", [2, 4])
def test_a_resume_at_every_batch_boundary_and_mid_window_continues_exactly(
    uri: str, tmp_path: Path, threads: int
) -> None:
    with open_sample(uri, tmp_path / "c", 0, seed=3, world_size=2, rank=1) as ds:
        whole = uids(read(ds, 1000))
        state = ds.state_dict()
    # States saved by a reader gathering ahead, at every batch it handed over: the
    # batches it had gathered beyond are not counted.
    with open_sample(uri, tmp_path / "c", threads, seed=3, world_size=2, rank=1) as ds:
        saved = []
        for _ in ds.batches(37):
            saved.append(ds.state_dict())
    assert [s["position"] for s in saved] == [
        min(37 * (i + 1), len(whole)) for i in range(len(saved))
    ]
    # Mid-window positions that are no batch boundary of either batch size.
    saved += [{**state, "position": p} for p in (1, 199, 213, 601, len(whole) - 2)]
    with open_sample(uri, tmp_path / "c", threads, seed=3, world_size=2, rank=1) as resumed:
        for state in saved:
            resumed.load_state_dict(state)
            assert uids(read(resumed, 50)) == whole[state["position"] :]


@pytest.mark.parametrize("threads", [2, 4])
def test_a_skip_or_a_loaded_state_mid_iteration_drops_what_was_gathered_ahead(
    uri: str, tmp_path: Path, threads: int
) -> None:
    with open_sample(uri, tmp_path / "c", 0, seed=8) as ds:
        whole = uids(read(ds, 40))
        state = ds.state_dict()
    with open_sample(uri, tmp_path / "c", threads, seed=8) as ds:
        it = ds.batches(40)
        got = uids([next(it), next(it)])
        ds.skip_batches(3)
        got += uids([next(it)])
        # Back to position 20 (mid-batch of this batch size) while the iterator is open.
        ds.load_state_dict({**state, "position": 20})
        got += uids([next(it)])
        assert ds.state_dict()["position"] == 60
        got += uids(list(it))
    assert got == whole[:80] + whole[200:240] + whole[20:60] + whole[60:]


def test_closing_abandoning_or_closing_the_dataset_stops_the_threads(
    uri: str, tmp_path: Path
) -> None:
    with open_sample(uri, tmp_path / "c", 4, seed=1) as ds:
        it = ds.batches(10)
        next(it)
        assert gather_threads()
        it.close()
        assert not gather_threads()
        assert ds.position == 10

        it = ds.batches(10)
        next(it)
        del it
        gc.collect()
        assert not gather_threads()
        assert ds.position == 20

        for _ in ds.batches(10):
            break
        gc.collect()
        assert not gather_threads()

        kept = ds.batches(10)
        next(kept)
        assert gather_threads()
    # The dataset's close() ends the threads of the iteration still open, which says
    # so at its next batch instead of ending as if the epoch were done.
    assert not gather_threads()
    with pytest.raises(errors.InputError, match="this dataset was closed"):
        next(kept)


@pytest.mark.parametrize("bad", [-1, 2.0, "4", True])
def test_a_bad_gather_threads_value_is_refused_naming_what_was_expected(
    uri: str, tmp_path: Path, bad: object
) -> None:
    with pytest.raises(errors.InputError, match=r"shardcache.open\(\): gather_threads: expected"):
        shardcache.open(uri, cache_dir=tmp_path / "c", shuffle="sample", gather_threads=bad)  # type: ignore[arg-type]
    with open_sample(uri, tmp_path / "c", 0) as ds:
        with pytest.raises(errors.InputError, match="gather_threads: expected a thread count"):
            ds.gather_threads = bad  # type: ignore[assignment]
        assert ds.gather_threads == 0


def test_a_mixture_of_sample_mode_sources_reads_the_same_gathering_ahead(
    uri: str, tmp_path: Path
) -> None:
    # A mixture opens and closes its sources' streams as it draws (and asks for other
    # batch sizes at an epoch's end): what was gathered ahead must never count.
    def run(threads: int, stop: int, state: dict[str, Any] | None = None) -> tuple[list[int], Any]:
        sources = {
            name: open_sample(uri, tmp_path / f"c-{name}", threads, seed=seed, window=150)
            for name, seed in (("a", 1), ("b", 2))
        }
        with shardcache.mix(sources, weights={"a": 0.6, "b": 0.4}, seed=5) as mixed:
            if state is not None:
                mixed.load_state_dict(state)
            got = uids(list(mixed.batches(23, steps=stop - mixed.step)))
            return got, mixed.state_dict()

    inline, _ = run(0, 120)
    ahead, _ = run(3, 120)
    assert ahead == inline
    head, state = run(3, 47)
    rest, _ = run(3, 120, state)
    assert head + rest == inline
