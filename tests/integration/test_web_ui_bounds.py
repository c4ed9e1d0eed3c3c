"""The web inspector's API in-process (aiohttp's test server over `routes.mount`):
what a request may cost, which Host it answers, and values a page could show wrong.

Each test names the behaviour: a bounded cost with an honest answer (a 4xx naming the
limit, or "searched the first N of M rows"), exact 64-bit integers, nanosecond
timestamps, a run with a model-only checkpoint, and the DNS-rebinding guard."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from shardcache_sidecar.ui import routes

from shardcache.checkpoint import layout
from shardcache.inspect import session
from tests.support import inspect_data, web_inspector

pytestmark = pytest.mark.integration

BIG = 2**62 + 1
DOC_BYTES = 2 << 20


def write(root: Path, table: pa.Table, name: str = "part-0.parquet") -> str:
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, root / name, compression="zstd")
    return root.as_uri()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def values_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """64-bit ids, nanosecond times and 2 MiB documents."""
    n = 32
    return write(
        tmp_path_factory.mktemp("values"),
        pa.table(
            {
                "uid": pa.array([BIG + i for i in range(n)], pa.int64()),
                "id": pa.array([2**64 - 1 - i for i in range(n)], pa.uint64()),
                "ts": pa.array(
                    [1_700_000_000_123_456_789 + i for i in range(n)], pa.timestamp("ns")
                ),
                "took": pa.array(range(n), pa.duration("ns")),
                "doc": [f"{i} " + "x" * DOC_BYTES for i in range(n)],
            }
        ),
    )


@pytest.fixture
def inspectors() -> Iterator[list[session.Inspector]]:
    made: list[session.Inspector] = []
    yield made
    for insp in made:
        insp.close()


async def client_for(
    uri: str,
    cache: Path,
    made: list[session.Inspector],
    *,
    hosts: tuple[str, ...] = (),
    **mount: Any,
) -> TestClient[web.Request, web.Application]:
    insp = session.open_uri(uri, cache_dir=str(cache))
    made.append(insp)
    app = web.Application()
    defaults = mount.pop("defaults", routes.Defaults(batch_size=4, shuffle=False))
    routes.mount(app, lambda: insp, defaults, hosts=hosts, **mount)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


@pytest.fixture
async def values(
    values_uri: str, cache: Path, inspectors: list[session.Inspector]
) -> AsyncIterator[TestClient[web.Request, web.Application]]:
    client = await client_for(values_uri, cache, inspectors, hosts=("inspector.example",))
    yield client
    await client.close()


async def answer(client: TestClient[Any, Any], path: str, **headers: str) -> tuple[int, Any]:
    response = await client.get(path, headers=headers)
    return response.status, json.loads(await response.text())


# --- DNS rebinding -------------------------------------------------------------------


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8471", "127.0.0.1.evil.example"])
async def test_a_foreign_host_header_is_refused(values: TestClient[Any, Any], host: str) -> None:
    for path in ("/ui/api/info", "/ui/api/step", "/ui", "/ui/api/stats"):
        status, body = await answer(values, path, Host=host)
        assert status == 403, path
        assert "DNS rebinding" in body["error"]


@pytest.mark.parametrize(
    "host", ["localhost:8471", "127.0.0.1:9", "[::1]:8471", "LOCALHOST", "inspector.example:80"]
)
async def test_loopback_addresses_and_the_started_for_name_are_answered(
    values: TestClient[Any, Any], host: str
) -> None:
    status, _ = await answer(values, "/ui/api/info", Host=host)
    assert status == 200


# --- bounded cost ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("/ui/api/step?world_size=10000000", "limit of 65536 ranks"),
        ("/ui/api/where?expr=uid%3D%3D1&world_size=10000000", "limit of 65536 ranks"),
        (
            "/ui/api/where?expr=uid%3D%3D1&world_size=65536&epochs=100",
            "limit of 262144 rank-epochs",
        ),
    ],
)
async def test_a_lookup_over_too_many_ranks_is_refused_naming_the_limit(
    values: TestClient[Any, Any], path: str, limit: str
) -> None:
    status, body = await answer(values, path)
    assert status == 400
    assert limit in body["error"]


async def test_a_step_of_long_documents_converts_only_the_clipped_text(
    values: TestClient[Any, Any],
) -> None:
    await answer(values, "/ui/api/info")  # the shard is cached and mapped
    tracemalloc.start()
    try:
        status, data = await answer(values, "/ui/api/step?batch_size=32&columns=doc")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 200
    # 64 MiB of documents: what the request made in Python is the clipped 2000 chars each
    # and the answer (a few hundred KiB), not the documents.
    assert peak < 8 << 20, peak
    cell = data["samples"][3]["values"]["doc"]
    assert cell["value"] == ("3 " + "x" * DOC_BYTES)[:2000]
    assert (cell["truncated"], cell["length"], cell["bytes"]) == (True, None, DOC_BYTES + 2)


async def test_a_where_over_a_shard_larger_than_the_budget_says_how_far_it_searched(
    tmp_path: Path,
    cache: Path,
    inspectors: list[session.Inspector],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routes, "WHERE_SCAN_ROWS", 1000)
    uri = write(tmp_path / "big", pa.table({"uid": pa.array(range(5000), pa.int64())}))
    client = await client_for(uri, cache, inspectors)
    try:
        status, data = await answer(client, "/ui/api/where?expr=uid%20%3D%3D%203")
        assert status == 200
        assert [s["index"] for s in data["sightings"]] == [3]
        assert (data["stopped"], data["scanned_rows"], data["dataset_rows"]) == (
            "budget",
            1000,
            5000,
        )
        status, data = await answer(client, "/ui/api/where?expr=uid%20%3D%3D%204000")
        assert (data["matches"], data["truncated"], data["stopped"]) == (0, True, "budget")
    finally:
        await client.close()


async def test_cells_over_the_limit_are_refused_naming_it(
    tmp_path: Path, cache: Path, inspectors: list[session.Inspector]
) -> None:
    wide = pa.table({f"c{i}": pa.array(range(1100), pa.int32()) for i in range(17)})
    client = await client_for(write(tmp_path / "wide", wide), cache, inspectors)
    try:
        status, body = await answer(client, "/ui/api/step?batch_size=1024")
        assert status == 400
        assert "limit of 16384 cells" in body["error"]
    finally:
        await client.close()


# --- values a page or a client could get wrong -------------------------------------


async def test_64_bit_integers_carry_their_exact_text_for_the_page(
    values: TestClient[Any, Any],
) -> None:
    status, data = await answer(values, "/ui/api/step?batch_size=4&columns=uid,id")
    assert status == 200
    uids = [s["values"]["uid"] for s in data["samples"]]
    assert [c["value"] for c in uids] == [BIG + i for i in range(4)]
    assert [c["display"] for c in uids] == [str(BIG + i) for i in range(4)]
    assert data["samples"][0]["values"]["id"]["display"] == str(2**64 - 1)
    _, stats = await answer(values, "/ui/api/stats")
    uid_stats = next(c for c in stats["columns"] if c["name"] == "uid")["values"]
    assert uid_stats["display"].startswith(f"{BIG} / ")
    assert uid_stats["display"].endswith(f" / {BIG + 31}")


async def test_nanosecond_temporal_columns_are_answered(values: TestClient[Any, Any]) -> None:
    status, data = await answer(values, "/ui/api/step?batch_size=2&columns=ts,took")
    assert status == 200, data
    first = data["samples"][0]["values"]
    assert first["ts"]["value"] == "2023-11-14T22:13:20.123456789"
    assert first["took"]["value"] == "0 ns"


async def test_a_uint64_id_above_2_63_is_found_and_an_out_of_range_one_is_a_400(
    values: TestClient[Any, Any],
) -> None:
    status, data = await answer(values, f"/ui/api/where?expr=id%20%3D%3D%20{2**64 - 1}")
    assert (status, data["matches"]) == (200, 1)
    status, body = await answer(values, f"/ui/api/where?expr=uid%20%3D%3D%20{2**64}")
    assert status == 400
    assert "out of range for column 'uid' (int64)" in body["error"]


async def test_a_column_named_twice_is_answered_once(values: TestClient[Any, Any]) -> None:
    status, data = await answer(values, "/ui/api/step?batch_size=2&columns=uid,uid")
    assert status == 200
    assert [c["name"] for c in data["columns"]] == ["uid"]


async def test_an_unexpected_failure_is_a_json_500_and_the_inspector_keeps_serving(
    values: TestClient[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(session, "step_json", broken)
    status, body = await answer(values, "/ui/api/step")
    assert status == 500
    assert "RuntimeError: boom" in body["error"]
    monkeypatch.undo()
    assert (await answer(values, "/ui/api/step"))[0] == 200


# --- a followed run with a model-only checkpoint ------------------------------------

WORLD, SEED, BATCH, BLOCK = 2, 1, 8, 16


async def test_a_model_only_checkpoint_is_left_out_of_the_data_views_with_a_note(
    tmp_path: Path, cache: Path, inspectors: list[session.Inspector]
) -> None:
    uri = inspect_data.write(tmp_path / "ds").as_uri()
    store = tmp_path / "store"
    handed = web_inspector.record_run(
        uri, cache=cache, store=store, world_size=WORLD, batch_size=BATCH, seed=SEED,
        block_size=BLOCK,
    )  # fmt: skip
    model_only = layout.CheckpointManifest(
        step=7, name="step-7", files=(), data_state=None, created_at=7.0
    )
    where = layout.manifest_path(str(store / "rank-0"), 7)
    layout.write_json(pafs.LocalFileSystem(), where, model_only.to_json())
    # The job's plan, at the default batch size (32): the page opens at the run's.
    defaults = routes.Defaults(world_size=WORLD, seed=SEED, block_size=BLOCK)
    client = await client_for(
        uri, cache, inspectors, defaults=defaults, checkpoint_uri=store.as_uri()
    )
    try:
        _, info = await answer(client, "/ui/api/info")
        assert info["defaults"]["batch_size"] == BATCH
        # Rank 1 skipped 2 batches after step 3: its step 4 is what it was handed.
        status, data = await answer(client, f"/ui/api/step?rank=1&step=4&batch_size={BATCH}")
        assert status == 200, data
        assert [s["values"]["uid"]["value"] for s in data["samples"]] == handed[1][4]
        assert any("step-000000000007" in n and "model only" in n for n in data["run_notes"])
        status, data = await answer(client, "/ui/api/where?expr=uid%20%3D%3D%203")
        assert status == 200, data
        assert data["run_notes"]
        # Another batch size than the run's, over the run's plan: refused, both named.
        status, body = await answer(client, "/ui/api/step?rank=1&step=4&batch_size=9")
        assert status == 400
        assert "batch_size: state has 8, the inspector has 9" in body["error"]
        # Lineage needs every checkpoint's data state, and says so.
        status, body = await answer(client, "/ui/api/lineage?expr=uid%20%3D%3D%203")
        assert status == 400
        assert "has no data state" in body["error"]
    finally:
        await client.close()
