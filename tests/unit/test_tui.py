"""The TUI driven by textual's own pilot, checked against what `Dataset` yields."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from textual.widgets import DataTable, Static

import shardcache
from shardcache.inspect import locate, render, session, tui
from tests.support import inspect_data

pytestmark = pytest.mark.unit

WORLD, SEED, BATCH, BLOCK = 2, 5, 6, 16


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    base = tmp_path_factory.mktemp("tui")
    return inspect_data.write(base / "ds").as_uri(), base / "cache"


@pytest.fixture
def inspector(paths: tuple[str, Path]) -> Iterator[session.Inspector]:
    uri, cache = paths
    insp = session.open_uri(uri, cache_dir=str(cache))
    yield insp
    insp.close()


def expected_uids(paths: tuple[str, Path], *, rank: int, epoch: int, step: int) -> list[str]:
    uri, cache = paths
    with shardcache.open(
        uri, cache_dir=cache, seed=SEED, rank=rank, world_size=WORLD, block_size=BLOCK
    ) as ds:
        ds.set_epoch(epoch)
        batches = list(ds.batches(BATCH))
    return [str(u) for u in batches[step].column("uid").to_pylist()]


def shown_uids(app: tui.InspectApp) -> list[str]:
    table = app.query_one("#samples", DataTable)
    uid_col = 4 + app.columns.index("uid")
    return [str(table.get_row_at(i)[uid_col]) for i in range(table.row_count)]


def status(app: tui.InspectApp) -> str:
    return str(app.query_one("#status", Static).render())


def start(inspector: session.Inspector) -> tui.InspectApp:
    query = locate.Query(world_size=WORLD, seed=SEED, batch_size=BATCH, block_size=BLOCK)
    return tui.InspectApp(inspector, query)


async def test_pages_through_steps_ranks_and_epochs(
    inspector: session.Inspector, paths: tuple[str, Path]
) -> None:
    app = start(inspector)
    async with app.run_test(size=(160, 48)) as pilot:
        assert shown_uids(app) == expected_uids(paths, rank=0, epoch=0, step=0)
        await pilot.press("n", "n")
        assert app.current.step == 2
        assert shown_uids(app) == expected_uids(paths, rank=0, epoch=0, step=2)
        await pilot.press("r")
        assert (app.current.rank, app.current.step) == (1, 2)
        assert shown_uids(app) == expected_uids(paths, rank=1, epoch=0, step=2)
        await pilot.press("e", "p")
        assert (app.current.epoch, app.current.step) == (1, 1)
        assert shown_uids(app) == expected_uids(paths, rank=1, epoch=1, step=1)
        assert "epoch 1 · rank 1/2 · step 1 of 17" in status(app)


async def test_jumps_to_a_step_and_refuses_one_past_the_end(
    inspector: session.Inspector, paths: tuple[str, Path]
) -> None:
    app = start(inspector)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("g", *"16", "enter")
        # 100 samples per rank at batch size 6: step 16 is the last, partial batch.
        assert app.current.step == 16
        assert shown_uids(app) == expected_uids(paths, rank=0, epoch=0, step=16)
        assert len(shown_uids(app)) == 4
        await pilot.press("g", *"17", "enter")
        assert app.current.step == 16
        assert "step 17 is past the end of epoch 0 for rank 0" in status(app)
        assert shown_uids(app) == expected_uids(paths, rank=0, epoch=0, step=16)


async def test_search_jumps_to_where_the_sample_is_seen(
    inspector: session.Inspector, paths: tuple[str, Path]
) -> None:
    app = start(inspector)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("slash", *"uid == 157", "enter")
        q = app.current
        uids = expected_uids(paths, rank=q.rank, epoch=q.epoch, step=q.step)
        assert "157" in uids
        assert shown_uids(app) == uids
        assert app.query_one("#samples", DataTable).cursor_row == uids.index("157")
        assert "index 157" in str(app.query_one("#detail", Static).render())
        await pilot.press("slash", *"nope == 1", "enter")
        assert "unknown column(s) ['nope']" in status(app)
        assert app.current == q


ESC = "\x1b"
#: Rich markup that would crash (`[/]`) or be eaten (`[b]`), and escape sequences.
TEXTS = [
    "regex a[/] or path [/usr]",
    "see [b]bold[/b] and list[int]",
    f"hi {ESC}]52;c;SEVMTE8K\x07 there",
    f"x{ESC}]8;;http://evil.example/{ESC}\\click\x9b",
]


async def test_cells_are_painted_as_the_data_is_never_as_markup_or_escapes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ds"
    root.mkdir()
    pq.write_table(
        pa.table({"uid": list(range(len(TEXTS))), f"t[b]{ESC}[8m": TEXTS}),
        root / f"p[b]{ESC}[2K.parquet",
    )
    insp = session.open_uri(root.as_uri(), cache_dir=str(tmp_path / "cache"))
    try:
        app = tui.InspectApp(insp, locate.Query(batch_size=len(TEXTS), shuffle=False))
        async with app.run_test(size=(200, 48)):
            table = app.query_one("#samples", DataTable)
            painted = [table.get_row_at(i)[-1].plain for i in range(table.row_count)]
            assert painted == [render.safe(t) for t in TEXTS]
            assert table.get_row_at(0)[2].plain == "p[b]\\u001b[2K.parquet"
            labels = [c.label.plain for c in table.columns.values()]
            assert labels[-1] == "t[b]\\u001b[8m"
            detail = str(app.query_one("#detail", Static).render())
            for shown in (painted, labels, [detail]):
                assert not any(ESC in s or "\x9b" in s for s in shown)
    finally:
        insp.close()


async def test_the_status_line_says_when_the_batch_size_was_assumed(
    inspector: session.Inspector,
) -> None:
    """`shardcache inspect --tui` with neither --batch-size nor a data state: step N is
    batch N of the default, which the status line says is not known to be the run's."""
    query = locate.Query(world_size=WORLD, seed=SEED, block_size=BLOCK)
    app = tui.InspectApp(inspector, query, batch_size_assumed=True)
    async with app.run_test(size=(160, 48)):
        assert "batch size 32 (assumed: --batch-size gives the run's)" in status(app)
    given = start(inspector)
    async with given.run_test(size=(160, 48)):
        assert f"batch size {BATCH} · seed" in status(given)
        assert "assumed" not in status(given)
