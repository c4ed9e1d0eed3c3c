"""A view that follows a run (`shardcache inspect --checkpoint-uri`, the web
inspector's step view) of an epoch the run read twice: it took each rank's newest data
state, whose skips of that epoch are the last pass's, so a step of the first pass was
rendered with the second pass's skips (other rows). The view now selects a pass
(`--pass K` / `pass=K`, from 1; the newest by default) and says which it shows."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from shardcache_sidecar.ui import routes

import shardcache.numpy
from shardcache import cli, errors, placements, states
from shardcache.inspect import locate, session
from shardcache.lineage import history
from tests.support import datasets, web_inspector

pytestmark = pytest.mark.unit

ROWS = [25, 25]
BATCH = 10


def uids(batch: dict[str, object]) -> list[int]:
    return [int(u) for u in batch["uid"]]  # type: ignore[attr-defined]


class Run:
    """Epoch 0 of 50 rows read twice by one rank, batches of 10: pass 1 reads a batch,
    skips 2 (positions [10, 30)), reads a batch, publishes step 1, reads on to the
    epoch's end; pass 2 reads 2 batches and publishes step 2. `handed[pass][step]` is
    the batch's uids (uid = the sample's index)."""

    def __init__(self, base: Path) -> None:
        self.uri, _ = datasets.write_local(base / "ds", ROWS)
        self.cache = base / "cache"
        self.store = base / "store"
        with shardcache.numpy.Batches(
            self.uri, batch_size=BATCH, columns=["uid"], cache_dir=self.cache, rank=0, world_size=1
        ) as batches:
            it = iter(batches)
            first = [uids(next(it))]
            self.skip = batches.dataset.skip_batches(2)
            first.append(uids(next(it)))
            at_1 = batches.state_dict()["dataset"]
            first += [uids(b) for b in it]
            again = iter(batches)
            second = [uids(next(again)), uids(next(again))]
            at_2 = batches.state_dict()["dataset"]
            self.digest = batches.dataset.manifest.digest
        self.handed = {1: first, 2: second}
        self.states = [states.parse(at_1), states.parse(at_2)]
        web_inspector.publish(self.store, 0, 1, at_1)
        web_inspector.publish(self.store, 0, 2, at_2)

    @property
    def params(self) -> shardcache.plans.PlanParams:
        return self.states[0].params

    def plan_rows(self, start: int, stop: int) -> list[int]:
        """The sample indices at positions [start, stop) of epoch 0, from the plan."""
        ranges = placements.index_ranges(ROWS, self.digest, self.params.with_epoch(0), start, stop)
        return [i for lo, hi in ranges for i in range(lo, hi)]

    def plan_args(self) -> list[str]:
        p = self.params
        return [
            "--seed", str(p.seed), "--block-size", str(p.block_size),
            "--granularity", p.granularity, "--window", str(p.window),
            *([] if p.shuffle else ["--no-shuffle"]),
        ]  # fmt: skip

    def query(self) -> dict[str, str]:
        p = self.params
        return {
            "epoch": "0", "rank": "0", "world_size": "1", "step": "1",
            "batch_size": str(BATCH), "seed": str(p.seed), "shuffle": str(p.shuffle).lower(),
            "block_size": str(p.block_size), "granularity": p.granularity,
            "window": str(p.window),
        }  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return Run(tmp_path_factory.mktemp("run-pass"))


def test_newest_states_of_an_earlier_pass_carry_that_passs_skips(run: Run) -> None:
    hist = history.build(
        run.digest, ROWS, {0: [history.Checkpoint(n + 1, s) for n, s in enumerate(run.states)]}
    )
    view = run.params.with_epoch(0)
    assert hist.view_passes(view, 0) == [0, 1]
    assert hist.newest_states(view, 0, 0)[0].skips == (run.skip,)
    assert hist.newest_states(view, 0, 1)[0].skips == ()
    assert hist.newest_states(view, 0)[0] == run.states[1]  # the default: the newest
    with pytest.raises(
        errors.InputError, match=r"expected one of .*\(from 1: 1, 2\), found pass 3"
    ):
        hist.newest_states(view, 0, 2)


def inspect_rows(
    run: Run, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[int, list[int], str]:
    args = ["inspect", run.uri, "--cache-dir", str(run.cache), "--columns", "uid", "--json"]
    args += ["--checkpoint-uri", run.store.as_uri(), "--epoch", "0", "--step", "1"]
    status = cli.main([*args, *run.plan_args(), *extra])
    out = capsys.readouterr()
    if status != 0:
        return status, [], out.err
    data = json.loads(out.out)
    return status, [s["provenance"]["index"] for s in data["samples"]], out.err


def test_inspect_checkpoint_uri_pass_renders_each_passs_own_rows(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    # The ground truth: the plan's positions after each pass's skips are the rows the
    # rank was handed at step 1, other rows in each pass.
    assert run.skip == states.Skip(0, 10, 30) and run.states[1].skips == ()
    assert run.handed[1][1] == run.plan_rows(30, 40)  # after the skip of pass 1
    assert run.handed[2][1] == run.plan_rows(10, 20)  # pass 2 skipped nothing
    status, first, err = inspect_rows(run, capsys, "--pass", "1")
    assert status == 0, err
    assert first == run.handed[1][1] == run.plan_rows(30, 40)
    note = "epoch 0 was read 2 times by this run; showing pass 1 (--pass / pass= selects another)"
    assert note in err

    status, second, err = inspect_rows(run, capsys, "--pass", "2")
    assert (status, second) == (0, run.handed[2][1])
    assert "showing pass 2" in err
    # No --pass: the newest pass, as before, and the note says so.
    status, newest, err = inspect_rows(run, capsys)
    assert (status, newest) == (0, run.handed[2][1])
    assert "epoch 0 was read 2 times by this run; showing pass 2" in err


def test_inspect_refuses_a_pass_the_run_did_not_make_naming_those_it_made(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = inspect_rows(run, capsys, "--pass", "3")
    assert status == 2
    assert "pass 3 over epoch 0: expected one of the passes the world size 1 ranks made" in err
    assert "(from 1: 1, 2), found pass 3" in err
    status, _, err = inspect_rows(run, capsys, "--pass", "0")
    assert (status, "--pass counts from 1: expected >= 1, found 0" in err) == (2, True)


def web_step(run: Run, **extra: str) -> tuple[int, dict[str, Any]]:
    async def get() -> tuple[int, dict[str, Any]]:
        insp = session.open_uri(run.uri, cache_dir=run.cache)
        try:
            app = web.Application()
            defaults = routes.Defaults(batch_size=BATCH)
            routes.mount(app, lambda: insp, defaults, checkpoint_uri=run.store.as_uri())
            async with TestClient(TestServer(app, host="127.0.0.1")) as client:
                params = {**run.query(), "columns": "uid", **extra}
                response = await client.get("/ui/api/step", params=params)
                return response.status, json.loads(await response.text())
        finally:
            insp.close()

    return asyncio.run(get())


def test_web_step_pass_parameter_renders_that_passs_rows_and_says_so(run: Run) -> None:
    status, data = web_step(run, **{"pass": "1"})
    assert status == 200, data
    assert [s["provenance"]["index"] for s in data["samples"]] == run.handed[1][1]
    assert (
        "epoch 0 was read 2 times by this run; showing pass 1 (--pass / pass= selects another)"
        in data["run_notes"]
    )
    status, data = web_step(run, **{"pass": "2"})
    assert [s["provenance"]["index"] for s in data["samples"]] == run.handed[2][1]
    status, data = web_step(run, **{"pass": ""})  # the page's empty field: the newest
    assert status == 200 and any("showing pass 2" in n for n in data["run_notes"])
    assert [s["provenance"]["index"] for s in data["samples"]] == run.handed[2][1]


def test_web_step_refuses_a_pass_the_run_did_not_make_with_400(run: Run) -> None:
    status, data = web_step(run, **{"pass": "3"})
    assert status == 400
    assert "(from 1: 1, 2), found pass 3" in data["error"]
    status, data = web_step(run, **{"pass": "0"})
    assert status == 400
    assert data["error"] == "query parameter 'pass': counts from 1, expected >= 1, found 0"


def test_run_states_passes_the_pass_through(run: Run) -> None:
    hist = history.build(
        run.digest, ROWS, {0: [history.Checkpoint(n + 1, s) for n, s in enumerate(run.states)]}
    )
    query = locate.Query(
        epoch=0, batch_size=BATCH, seed=run.params.seed, shuffle=run.params.shuffle,
        block_size=run.params.block_size, granularity=run.params.granularity,
        window=run.params.window,
    )  # fmt: skip
    assert routes.run_states(hist, query, 0)[0].skips == (run.skip,)
    assert routes.run_states(hist, query)[0].skips == ()


def test_web_where_pass_parameter_finds_a_sample_at_that_passs_step(run: Run) -> None:
    """The sample at position 30: step 1 of pass 1 (after its skip of [10, 30)), step 3
    of pass 2 (which skipped nothing)."""
    [index] = run.plan_rows(30, 31)

    async def where(pass_number: str) -> dict[str, Any]:
        insp = session.open_uri(run.uri, cache_dir=run.cache)
        try:
            app = web.Application()
            routes.mount(
                app,
                lambda: insp,
                routes.Defaults(batch_size=BATCH),
                checkpoint_uri=run.store.as_uri(),
            )
            async with TestClient(TestServer(app, host="127.0.0.1")) as client:
                params = {**run.query(), "expr": f"uid == {index}", "pass": pass_number}
                response = await client.get("/ui/api/where", params=params)
                assert response.status == 200, await response.text()
                data: dict[str, Any] = json.loads(await response.text())
                return data
        finally:
            insp.close()

    first, second = asyncio.run(where("1")), asyncio.run(where("2"))
    assert [(s["index"], s["step"]) for s in first["sightings"]] == [(index, 1)]
    assert [(s["index"], s["step"]) for s in second["sightings"]] == [(index, 3)]
    assert any("showing pass 1" in n for n in first["run_notes"])
