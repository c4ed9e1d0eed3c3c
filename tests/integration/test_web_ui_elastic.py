"""The web inspector over a run resumed at another world size (`shardcache web
--checkpoint-uri`, through its JSON API): viewed at the new world size, a step is the
batch the resumed rank was handed from its elastic-resume segments (after its skips),
and a sample the earlier ranks consumed is said to be so."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import shardcache
from tests.support import inspect_data, web_inspector

pytestmark = pytest.mark.integration

OLD, NEW, SEED, BATCH, BLOCK = 3, 2, 3, 8, 16


class Run:
    """The dataset, its cache, the checkpoint store, what each new rank was handed and
    the uids the old ranks read."""

    def __init__(self, base: Path) -> None:
        self.uri = inspect_data.write(base / "ds").as_uri()
        self.cache = base / "cache"
        self.store = base / "store"
        self.handed: dict[int, list[list[int]]] = {}
        self.consumed: set[int] = set()


def open_rank(run: Run, rank: int, world_size: int) -> shardcache.Dataset:
    return shardcache.open(
        run.uri, cache_dir=run.cache, seed=SEED, rank=rank, world_size=world_size,
        block_size=BLOCK,
    )  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """3 ranks read 3 batches of epoch 0 and publish checkpoint 3; 2 ranks resume from
    those states (elastic), new rank 0 skips 2 batches after its second, and both
    publish checkpoint 5 and, at the end of the epoch, checkpoint 100."""
    r = Run(tmp_path_factory.mktemp("web-elastic"))
    old = []
    for rank in range(OLD):
        with open_rank(r, rank, OLD) as ds:
            batches = ds.batches(BATCH)
            for _ in range(3):
                r.consumed.update(next(batches).column("uid").to_pylist())
            old.append(ds.state_dict())
            web_inspector.publish(r.store, rank, 3, old[-1])
            batches.close()
    for rank in range(NEW):
        with open_rank(r, rank, NEW) as ds:
            ds.load_state_dict(old)
            got: list[list[int]] = []
            for batch in ds.batches(BATCH):
                got.append(batch.column("uid").to_pylist())
                if len(got) == 2:
                    if rank == 0:
                        ds.skip_batches(2)
                    web_inspector.publish(r.store, rank, 5, ds.state_dict())
            web_inspector.publish(r.store, rank, 100, ds.state_dict())
            r.handed[rank] = got
    return r


@pytest.fixture(scope="module")
def server(run: Run, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [run.uri, "--cache-dir", str(run.cache), "--checkpoint-uri", run.store.as_uri()]
    args += ["--batch-size", str(BATCH), "--seed", str(SEED), "--block-size", str(BLOCK)]
    log = tmp_path_factory.mktemp("web-elastic-log") / "stderr.log"
    with web_inspector.serving(args, log) as url:
        yield url


def test_a_resumed_ranks_step_is_the_batch_it_read_from_its_segments(server: str, run: Run) -> None:
    for rank, batches in run.handed.items():
        for step, batch in enumerate(batches):
            data = web_inspector.get_json(
                server, "/ui/api/step", world_size=NEW, rank=rank, step=step
            )
            assert [s["provenance"]["index"] for s in data["samples"]] == batch, (rank, step)
            assert data["steps"] == len(batches)


def test_where_at_the_new_world_size_says_what_the_old_ranks_consumed(
    server: str, run: Run
) -> None:
    read = {u for batches in run.handed.values() for batch in batches for u in batch}
    skipped = set(range(sum(inspect_data.SHARD_ROWS))) - read - run.consumed
    kinds = set()
    # The view reports the first 50 matches: from the first sample of each kind (which
    # uids those are follows the shuffle, which follows the dataset's digest).
    for lo in (min(run.consumed), min(skipped), min(read)):
        data = web_inspector.get_json(server, "/ui/api/where", world_size=NEW, expr=f"uid >= {lo}")
        assert data["sightings"][0]["index"] == lo
        for s in data["sightings"]:
            uid = s["index"]
            kinds.add((s["before_resize"], s["skipped"]))
            assert s["before_resize"] == (uid in run.consumed), uid
            assert s["skipped"] == (uid in skipped), uid
            if s["before_resize"]:
                assert (s["rank"], s["step"], s["slot"]) == (None, None, None)
            elif not s["skipped"]:
                assert run.handed[s["rank"]][s["step"]][s["slot"]] == uid
    assert kinds == {(True, False), (False, True), (False, False)}, "consumed, skipped, read"
