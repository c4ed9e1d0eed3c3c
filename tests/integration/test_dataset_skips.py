"""`Dataset.skip_batches`: skipped samples are never read, everything else is read
once, and a resume after a skip is exact (embedded cache over local files)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache import errors, states
from tests.support import datasets

pytestmark = pytest.mark.integration

SHARDS = [70, 0, 33, 128, 9, 50]
TOTAL = sum(SHARDS)
BATCH = 8
#: (epoch, batches read before the skip, batches skipped) for each rank.
PLAN = {0: [(0, 2, 3), (0, 7, 1), (1, 0, 2)], 1: [(0, 4, 2)], 2: [(1, 5, 100)]}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), SHARDS)
    return tmp_path


def open_rank(root: Path, rank: int, world: int = 3, **kwargs: Any) -> shardcache.Dataset:
    return shardcache.open(
        str(root / "ds"),
        cache_dir=root / "c",
        rank=rank,
        world_size=world,
        seed=5,
        block_size=16,
        **kwargs,
    )


def uid_list(batch: Any) -> list[int]:
    return list(batch.column("uid").to_pylist())


def read_with_skips(
    ds: shardcache.Dataset,
    skips: list[tuple[int, int, int]],
    epochs: int,
    *,
    start_epoch: int = 0,
    done: int = 0,
) -> Iterator[tuple[int, list[int]]]:
    """(epoch, uids) per batch, skipping between batches as `skips` says, from batch
    `done` of `start_epoch` on (a resumed run has read the first `done`)."""
    for epoch in range(start_epoch, epochs):
        ds.set_epoch(epoch)
        base = done if epoch == start_epoch else 0
        todo = {after: k for e, after, k in skips if e == epoch and after >= base}
        if base in todo:
            ds.skip_batches(todo.pop(base), batch_size=BATCH)
        for n, batch in enumerate(ds.batches(BATCH), start=base + 1):
            yield epoch, uid_list(batch)
            if n in todo:
                ds.skip_batches(todo.pop(n))


def test_skipped_samples_are_never_read_and_every_other_sample_is_read_once(
    root: Path,
) -> None:
    for epoch in range(2):
        seen: list[int] = []
        skipped: list[int] = []
        for rank in range(3):
            with open_rank(root, rank) as ds:
                got = [
                    u for e, uids in read_with_skips(ds, PLAN[rank], 2) if e == epoch for u in uids
                ]
                seen += got
                # The state names exactly the positions passed over; map them to uids
                # through an unskipped reader of the same rank.
                ranges = [s for s in ds.skips if s.epoch == epoch]
            with open_rank(root, rank) as plain:
                plain.set_epoch(epoch)
                stream = [u for b in plain.batches(BATCH) for u in uid_list(b)]
            skipped += [stream[p] for s in ranges for p in range(s.start, s.stop)]
            assert got == [u for p, u in enumerate(stream) if not states.is_skipped(ranges, p)]
        assert skipped, "the plan skips something in every epoch"
        assert not set(seen) & set(skipped)
        assert sorted(seen + skipped) == list(range(TOTAL))


def test_resume_after_skips_is_exact_at_every_batch_boundary(root: Path) -> None:
    skips = PLAN[0]
    with open_rank(root, 0) as ds:
        full = list(read_with_skips(ds, skips, 2))
    with open_rank(root, 0) as ds:
        states_at = []
        for epoch, _ in read_with_skips(ds, skips, 2):
            states_at.append((epoch, json.loads(json.dumps(ds.state_dict()))))
    for point, (epoch, state) in enumerate(states_at):
        done = sum(1 for e, _ in full[: point + 1] if e == epoch)
        with open_rank(root, 0) as resumed:
            resumed.load_state_dict(state)
            assert resumed.skips == states.parse(state).skips
            rest = list(read_with_skips(resumed, skips, 2, start_epoch=epoch, done=done))
        assert full[: point + 1] + rest == full, f"resume after batch {point} diverged"


def test_a_skip_inside_an_open_iterator_continues_after_the_range(root: Path) -> None:
    with open_rank(root, 0, world=1) as plain:
        stream = [u for b in plain.batches(BATCH) for u in uid_list(b)]
    with open_rank(root, 0, world=1) as ds:
        it = ds.batches(BATCH)
        first = uid_list(next(it))
        skip = ds.skip_batches(2)
        second = uid_list(next(it))
    assert skip == states.Skip(0, BATCH, 3 * BATCH)
    assert first == stream[:BATCH]
    assert second == stream[3 * BATCH : 4 * BATCH]
    assert ds.position == 4 * BATCH


def test_a_skip_stops_at_the_end_of_the_epoch(root: Path) -> None:
    with open_rank(root, 2) as ds:
        skip = ds.skip_batches(10_000, batch_size=BATCH)
        assert skip == states.Skip(0, 0, len(ds))
        assert list(ds.batches(BATCH)) == []
        assert ds.skip_batches(1) is None
        ds.set_epoch(1)
        assert ds.position == 0 and ds.skips == (skip,)


def test_skip_without_a_known_batch_size_says_to_pass_one(root: Path) -> None:
    with open_rank(root, 0) as ds:
        with pytest.raises(errors.InputError, match="batch_size=, or shardcache skip --batch-size"):
            ds.skip_batches(1)
        with pytest.raises(errors.InputError, match=">= 1"):
            ds.skip_batches(0, batch_size=4)


def test_a_version_1_state_still_loads_and_resumes(root: Path) -> None:
    with open_rank(root, 0) as ds:
        batches = ds.batches(BATCH)
        next(batches)
        next(batches)
        state = ds.state_dict()
        want = [uid_list(b) for b in batches]
    old = {k: v for k, v in state.items() if k not in ("skips", "batch_size")}
    old["version"] = 1
    with open_rank(root, 0) as resumed:
        resumed.load_state_dict(old)
        assert [uid_list(b) for b in resumed.batches(BATCH)] == want
        assert resumed.state_dict()["version"] == states.version_of(None) == 3


def test_an_unknown_state_version_is_refused_by_name(root: Path) -> None:
    with open_rank(root, 0) as ds:
        state = {**ds.state_dict(), "version": 9}
        with pytest.raises(errors.StateMismatchError, match="state version 9 is not supported"):
            ds.load_state_dict(state)


def test_the_inspector_honours_skips_step_n_is_the_nth_batch_handed_out(root: Path) -> None:
    from shardcache.inspect import locate, session

    with open_rank(root, 0) as ds:
        handed = [uid_list(b) for _, b in zip(range(3), ds.batches(BATCH), strict=False)]
        ds.skip_batches(2)
        handed += [uid_list(b) for b in ds.batches(BATCH)]
        state = ds.state_dict()
    run = {0: states.parse(state)}
    (root / "state.json").write_text(json.dumps(state))
    inspector = session.open_uri(str(root / "ds"), cache_dir=str(root / "c"))
    try:
        base = locate.Query(world_size=3, seed=5, block_size=16, batch_size=BATCH)
        assert inspector.steps(base) > len(handed)  # without the skips: more steps
        for step, want in enumerate(handed):
            view = inspector.step(base.replace(step=step), ["uid"], run=run)
            assert view.batch.column("uid").to_pylist() == want, f"step {step}"
            assert view.steps == len(handed)
        skipped_uids = set(range(TOTAL)) - {u for b in handed for u in b}
        found = inspector.where("uid >= 0", base, limit=TOTAL, run=run)
        marked = {s.index for s in found.sightings if s.skipped}
        assert marked and marked == {s.index for s in found.sightings if s.rank == 0} & skipped_uids
    finally:
        inspector.close()
    proc = subprocess.run(
        [sys.executable, "-m", "shardcache", "inspect", str(root / "ds"), "--cache-dir",
         str(root / "c"), "--world-size", "3", "--seed", "5", "--block-size", "16",
         "--batch-size", str(BATCH), "--step", "3", "--json", "--data-state",
         str(root / "state.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = [s["values"]["uid"]["value"] for s in json.loads(proc.stdout)["samples"]]
    assert got == handed[3]
