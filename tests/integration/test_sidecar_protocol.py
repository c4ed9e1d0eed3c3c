"""The control protocol against a real `shardcache sidecar` process (file:// source)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import shardcache
from shardcache import errors, plans, sidecar_client
from shardcache.contract import protocol
from shardcache.node import reader_locks
from tests.support import datasets, waiting
from tests.support.locks import exclusively_lockable
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260]
BLOCK = 64

Factory = Callable[..., SidecarProcess]


@pytest.fixture
def dataset(tmp_path: Path) -> tuple[str, pa.Table]:
    return datasets.write_local(tmp_path / "ds", SHARDS)


@pytest.fixture
def sidecar(sidecar_factory: Factory, dataset: tuple[str, pa.Table]) -> SidecarProcess:
    proc = sidecar_factory(dataset[0], args=["--block-size", str(BLOCK)])
    proc.start(wait="ready")
    return proc


def provider(proc: SidecarProcess, **kwargs: Any) -> sidecar_client.SidecarProvider:
    kwargs.setdefault("reconnect_timeout", 5.0)
    return sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), **kwargs)


def uids(ds: shardcache.Dataset, batch_size: int = 50) -> list[int]:
    return [u for b in ds.batches(batch_size) for u in b.column("uid").to_pylist()]


def test_manifest_from_the_sidecar_matches_a_direct_resolve(
    sidecar: SidecarProcess, dataset: tuple[str, pa.Table]
) -> None:
    shards = provider(sidecar)
    assert shards.manifest == shardcache.resolve(dataset[0])
    assert shards.manifest.shard_rows == SHARDS


def test_acquire_hands_over_a_pinned_decoded_shard_that_release_unpins(
    sidecar: SidecarProcess, dataset: tuple[str, pa.Table]
) -> None:
    shards = provider(sidecar)
    reader = shards.open_reader(plans.PlanParams(shuffle=False, block_size=BLOCK), position=0)
    lease = shards.acquire(reader, 3, epoch=0, position=0)
    assert lease.path.parent == sidecar.memory_dir
    with pa.memory_map(str(lease.path)) as source:
        batch = ipc.open_file(source).get_batch(0)
    offsets = plans.shard_offsets(SHARDS)
    assert batch.to_pydict() == dataset[1].slice(offsets[3], SHARDS[3]).to_pydict()
    # The pin is this process's own lock, and the sidecar lets go of its hold (the
    # client drops it off the read path, within milliseconds).
    assert not exclusively_lockable(lease.lock_path)
    assert sidecar.holds_drain() == 0
    lease.release()
    lease.release()  # idempotent
    assert exclusively_lockable(lease.lock_path)


def test_dataset_through_the_sidecar_equals_embedded_mode(
    sidecar: SidecarProcess, dataset: tuple[str, pa.Table], tmp_path: Path
) -> None:
    os.environ.update(sidecar.client_env())
    try:
        with shardcache.open(seed=7, block_size=BLOCK) as via_sidecar:
            got = uids(via_sidecar)
    finally:
        for key in sidecar.client_env():
            os.environ.pop(key, None)
    with shardcache.open(dataset[0], seed=7, block_size=BLOCK, cache_dir=tmp_path / "c") as local:
        want = uids(local)
    assert got == want
    assert sorted(got) == list(range(sum(SHARDS)))


def test_readahead_hints_move_the_reader_and_prefetch_from_there(
    sidecar_factory: Factory, dataset: tuple[str, pa.Table]
) -> None:
    # Readahead of one shard only, and a startup plan that warms just shard 0.
    args = ["--prefetch-depth", "0", "--ready-shards", "1", "--no-shuffle"]
    sidecar = sidecar_factory(dataset[0], args=args)
    sidecar.start(wait="ready")
    shards = provider(sidecar)
    params = plans.PlanParams(shuffle=False, block_size=BLOCK)
    # The registration's grants are noted on the notifier, in a batch that may reach the
    # sidecar after the hint below though built before it: the hint's later `seq` keeps
    # the reader where the hint put it (a CI run met it moved back to 0 before).
    reader = shards.open_reader(params, position=0)
    runs = plans.rank_runs(shards.manifest.shard_rows, shards.manifest.digest, params)
    near_end = sum(SHARDS) - 10  # inside the last shard
    last = plans.upcoming_shards(runs, near_end)[0]
    key = shards.manifest.decoded_key(last)
    assert last != 0 and not (sidecar.memory_dir / key).exists()
    shards.readahead(reader, epoch=1, position=near_end)
    (state,) = [r for r in shards.status()["readers"] if r["id"] == reader]
    assert (state["epoch"], state["position"]) == (1, near_end)
    waiting.wait_until(
        f"readahead to make shard {last} resident", (sidecar.memory_dir / key).exists
    )


def test_two_readers_of_one_sidecar_split_the_epoch(sidecar: SidecarProcess) -> None:
    shards = provider(sidecar)
    seen: list[int] = []
    for rank in range(2):
        ds = shardcache.Dataset(
            shards, plans.PlanParams(seed=1, rank=rank, world_size=2, block_size=BLOCK)
        )
        seen += uids(ds)
    status = shards.status()
    assert len(status["readers"]) == 2
    assert sorted(seen) == list(range(sum(SHARDS)))


def test_bad_requests_get_4xx_json_and_the_sidecar_keeps_serving(sidecar: SidecarProcess) -> None:
    params = protocol.params_to_json(plans.PlanParams(block_size=BLOCK))
    good = {**params, "position": 0}
    assert sidecar.control("PUT", protocol.reader_path("r1"), good)[0] == 200
    cases: list[tuple[str, str, Any, int, str]] = [
        (
            "POST",
            protocol.acquire_path("r1"),
            {"shard": 99, "epoch": 0, "position": 0},
            400,
            protocol.CODE_UNKNOWN_SHARD,
        ),
        (
            "POST",
            protocol.acquire_path("r1"),
            {"shard": -1, "epoch": 0, "position": 0},
            400,
            protocol.CODE_UNKNOWN_SHARD,
        ),
        (
            "POST",
            protocol.acquire_path("r1"),
            {"shard": "3", "epoch": 0, "position": 0},
            400,
            protocol.CODE_BAD_REQUEST,
        ),
        (
            "POST",
            protocol.acquire_path("nobody"),
            {"shard": 0, "epoch": 0, "position": 0},
            404,
            protocol.CODE_UNKNOWN_READER,
        ),
        (
            "PUT",
            protocol.reader_path("r2"),
            {**good, "rank": 2, "world_size": 2},
            400,
            protocol.CODE_BAD_REQUEST,
        ),
        ("PUT", protocol.reader_path("r2"), {**good, "seed": True}, 400, protocol.CODE_BAD_REQUEST),
        (
            "PUT",
            protocol.reader_path("r2"),
            {**good, "position": -5},
            400,
            protocol.CODE_BAD_REQUEST,
        ),
        ("PUT", protocol.reader_path("r2"), [1, 2], 400, protocol.CODE_BAD_REQUEST),
        (
            "PUT",
            protocol.reader_path("r2"),
            {**good, "digest": "sha256:" + "0" * 64},
            409,
            protocol.CODE_MANIFEST_MISMATCH,
        ),
        ("PUT", protocol.reader_path("bad%20id"), good, 400, protocol.CODE_BAD_REQUEST),
        ("GET", f"{protocol.PREFIX}/nothing-here", None, 404, protocol.CODE_UNKNOWN_ROUTE),
        ("DELETE", protocol.MANIFEST, None, 405, protocol.CODE_UNKNOWN_ROUTE),
    ]
    for method, path, body, status, code in cases:
        got_status, got = sidecar.control(method, path, body)
        assert (got_status, got["error"]["code"]) == (status, code), (method, path, body, got)
        assert got["error"]["kind"] == protocol.KIND_INPUT
        assert got["error"]["message"]
    status, _ = sidecar.control("POST", protocol.acquire_path("r1"), raw=b"{not json")
    assert status == 400
    # Still serving, to this reader and a new one.
    status, answer = sidecar.control(
        "POST", protocol.acquire_path("r1"), {"shard": 0, "epoch": 0, "position": 0}
    )
    assert status == 200 and answer["shard"] == 0
    assert sidecar.control("DELETE", protocol.lease_path(answer["lease"]))[1]["released"] is True
    assert sidecar.control("DELETE", protocol.lease_path(answer["lease"]))[1]["released"] is False
    shards = provider(sidecar)
    ds = shardcache.Dataset(shards, plans.PlanParams(block_size=BLOCK))
    assert sorted(uids(ds)) == list(range(sum(SHARDS)))


def test_client_maps_error_kinds_to_shardcache_errors(sidecar: SidecarProcess) -> None:
    shards = provider(sidecar)
    reader = shards.open_reader(plans.PlanParams(block_size=BLOCK), position=0)
    with pytest.raises(errors.ShardIndexError, match="out of range: the manifest has 6 shards"):
        shards.acquire(reader, 6, epoch=0, position=0)
    with pytest.raises(errors.InputError, match="unknown reader"):
        shards.acquire("never-opened", 0, epoch=0, position=0)


def test_registering_the_same_reader_id_again_is_idempotent(sidecar: SidecarProcess) -> None:
    body = {**protocol.params_to_json(plans.PlanParams(seed=3, block_size=BLOCK)), "position": 10}
    first = sidecar.control("PUT", protocol.reader_path("same"), body)[1]
    again = sidecar.control("PUT", protocol.reader_path("same"), {**body, "position": 40})[1]
    other = sidecar.control("PUT", protocol.reader_path("same"), {**body, "seed": 4})[1]
    assert [first["change"], again["change"], other["change"]] == [
        "created",
        "unchanged",
        "replaced",
    ]
    readers = sidecar.control("GET", protocol.STATUS)[1]["readers"]
    assert [(r["id"], r["seed"], r["position"]) for r in readers] == [("same", 4, 10)]


def test_a_hold_nobody_takes_over_expires(
    sidecar_factory: Factory, dataset: tuple[str, pa.Table]
) -> None:
    proc = sidecar_factory(dataset[0], args=["--handoff-timeout", "0.5"])
    proc.start(wait="ready")
    body = {**protocol.params_to_json(plans.PlanParams()), "position": 0}
    assert proc.control("PUT", protocol.reader_path("r"), body)[0] == 200
    status, answer = proc.control(
        "POST", protocol.acquire_path("r"), {"shard": 0, "epoch": 0, "position": 0}
    )
    assert status == 200
    lock = proc.memory_dir / answer["lock"]
    # Held by the sidecar for the handover: a lease file's lock, or in its own memory
    # once it has read the entry's meta (`Tier.hold`); the status route counts both.
    assert proc.control("GET", protocol.STATUS)[1]["holds"] == 1
    waiting.wait_until(
        "the sidecar to drop its handover hold after the 0.5 s handoff timeout",
        lambda: proc.control("GET", protocol.STATUS)[1]["holds"] == 0,
    )
    assert exclusively_lockable(lock)


def test_an_acquire_grants_the_readers_next_resident_shards_ahead(
    sidecar: SidecarProcess,
) -> None:
    params = plans.PlanParams(shuffle=False, block_size=BLOCK)
    # Read an epoch first (nothing granted ahead) so every shard is resident.
    warm = shardcache.Dataset(provider(sidecar, ahead=0), params)
    assert len(uids(warm)) == sum(SHARDS)
    warm.close()
    body = {**protocol.params_to_json(params), "position": 0}
    status, registered = sidecar.control("PUT", protocol.reader_path("r"), body)
    assert (status, registered["features"]) == (200, list(protocol.FEATURES))

    status, answer = sidecar.control(
        "POST", protocol.acquire_path("r"), {"shard": 0, "epoch": 0, "position": 0, "ahead": 3}
    )
    assert status == 200 and answer["shard"] == 0
    # The next shards of the plan (shard 1 has no rows, so no run), each with a hold.
    assert [g["shard"] for g in answer["ahead"]] == [2, 3, 4]
    assert sidecar.control("GET", protocol.STATUS)[1]["holds"] == 4
    for grant in answer["ahead"]:
        assert set(grant) == {"lease", "shard", "path", "lock", "size"}
        assert (sidecar.memory_dir / grant["path"]).stat().st_size == grant["size"]
    # (The sidecar's holds on its own memory tier are kept in its memory, `Tier.hold`:
    # the status route counts them; the lock files stay free for the trainer's pins.)
    # Asking for none grants none; an acquire away from where the plan is grants none.
    none = sidecar.control(
        "POST", protocol.acquire_path("r"), {"shard": 0, "epoch": 0, "position": 0}
    )
    assert "ahead" not in none[1]
    elsewhere = sidecar.control(
        "POST", protocol.acquire_path("r"), {"shard": 5, "epoch": 0, "position": 0, "ahead": 3}
    )
    assert elsewhere[1]["ahead"] == []

    # One batch drops every hold and says which shard the reader took itself.
    hits = sidecar.control("GET", protocol.STATUS)[1]["stats"]["hits"]["memory"]
    leases = [answer["lease"], *(g["lease"] for g in answer["ahead"])]
    leases += [none[1]["lease"], elsewhere[1]["lease"]]
    note = {"epoch": 0, "position": 300, "pinned": [2], "released": leases}
    status, noted = sidecar.control("POST", protocol.notes_path("r"), note)
    assert (status, noted) == (
        200,
        {"reader": "r", "epoch": 0, "position": 300, "pinned": 1, "released": 6},
    )
    state = sidecar.control("GET", protocol.STATUS)[1]
    assert state["holds"] == 0 and state["stats"]["hits"]["memory"] == hits + 1
    assert [(r["id"], r["position"]) for r in state["readers"]] == [("r", 300)]
    for grant in answer["ahead"]:
        assert exclusively_lockable(sidecar.memory_dir / grant["lock"])


def test_a_registration_grants_the_readers_first_resident_shards(
    sidecar: SidecarProcess,
) -> None:
    params = plans.PlanParams(shuffle=False, block_size=BLOCK)
    warm = shardcache.Dataset(provider(sidecar, ahead=0), params)
    assert len(uids(warm)) == sum(SHARDS)
    warm.close()
    # As an older client registers: no `ahead`, nothing granted, no hold.
    body = {**protocol.params_to_json(params), "position": 0}
    status, plain = sidecar.control("PUT", protocol.reader_path("old"), body)
    assert status == 200 and "ahead" not in plain
    assert protocol.FEATURE_OPEN_AHEAD in plain["features"]
    assert sidecar.control("GET", protocol.STATUS)[1]["holds"] == 0
    # From position 310 (shard 2, after shard 0's 300 rows and empty shard 1): shard 2,
    # then the next ones, at most the prefetch depth (4) beyond it.
    status, answer = sidecar.control(
        "PUT", protocol.reader_path("r"), {**body, "position": 310, "ahead": 16}
    )
    assert status == 200 and answer["reuse"] is True
    assert [g["shard"] for g in answer["ahead"]] == [2, 3, 4, 5]
    assert sidecar.control("GET", protocol.STATUS)[1]["holds"] == 4
    for grant in answer["ahead"]:
        assert set(grant) == {"lease", "shard", "path", "lock", "size"}
        assert (sidecar.memory_dir / grant["path"]).stat().st_size == grant["size"]
    # Unregistering drops the holds of what the reader never took over.
    assert sidecar.control("DELETE", protocol.reader_path("r"))[1]["released_leases"] == 4
    for grant in answer["ahead"]:
        assert exclusively_lockable(sidecar.memory_dir / grant["lock"])


def test_a_warm_open_reads_exactly_without_an_acquire_round_trip(
    sidecar: SidecarProcess, dataset: tuple[str, pa.Table]
) -> None:
    params = plans.PlanParams(seed=4, block_size=BLOCK)
    with shardcache.open(
        dataset[0], cache_dir=sidecar.workdir / "ref", seed=4, block_size=BLOCK
    ) as ds:
        want = uids(ds)
    warm = shardcache.Dataset(provider(sidecar), params)
    assert uids(warm) == want
    warm.close()
    acquire = protocol.acquire_path("{reader_id}")
    acquires = requests_by_route(sidecar).get(acquire, 0)
    # Every shard is resident, and the five with rows are within the prefetch depth of
    # the first: the registration grants them all, and the epoch needs no acquire.
    shards = provider(sidecar)
    ds = shardcache.Dataset(shards, params)
    assert uids(ds) == want
    assert shards.flush()
    ds.close()
    assert requests_by_route(sidecar).get(acquire, 0) == acquires
    assert sidecar.holds_drain() == 0


def test_the_notes_route_refuses_bad_requests(sidecar: SidecarProcess) -> None:
    body = {**protocol.params_to_json(plans.PlanParams(block_size=BLOCK)), "position": 0}
    assert sidecar.control("PUT", protocol.reader_path("r"), body)[0] == 200
    good = {"epoch": 0, "position": 0, "pinned": [0], "released": []}
    cases: list[tuple[str, Any, int, str, str]] = [
        ("nobody", good, 404, protocol.CODE_UNKNOWN_READER, "unknown reader 'nobody'"),
        ("r", {**good, "pinned": [6]}, 400, protocol.CODE_UNKNOWN_SHARD, "out of range"),
        # The first bad shard of a batch is the one named.
        ("r", {**good, "pinned": [1, 7, 2, 9]}, 400, protocol.CODE_UNKNOWN_SHARD, "index 7 is"),
        ("r", {**good, "pinned": [0, -1]}, 400, protocol.CODE_UNKNOWN_SHARD, "index -1 is"),
        ("-r", good, 400, protocol.CODE_BAD_REQUEST, "reader id: expected"),
        ("r", {**good, "pinned": [True]}, 400, protocol.CODE_BAD_REQUEST, "field 'pinned'"),
        ("r", {**good, "pinned": 3}, 400, protocol.CODE_BAD_REQUEST, "field 'pinned'"),
        ("r", {**good, "released": ["x"]}, 400, protocol.CODE_BAD_REQUEST, "field 'released'"),
        ("r", {"position": 0}, 400, protocol.CODE_BAD_REQUEST, "field 'epoch'"),
    ]
    for reader, payload, status, code, message in cases:
        got_status, got = sidecar.control("POST", protocol.notes_path(reader), payload)
        assert (got_status, got["error"]["code"]) == (status, code), (reader, payload, got)
        assert message in got["error"]["message"], got
    # A lease nobody holds (already dropped, expired) is no error: dropping is idempotent.
    gone = {**good, "released": ["0" * 32]}
    assert sidecar.control("POST", protocol.notes_path("r"), gone)[1]["released"] == 0


def test_a_notes_batch_that_arrives_after_a_later_position_call_moves_the_reader_nowhere(
    sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The race behind a flaky readahead test, made deterministic: the notifier builds a
    # batch (the acquired shard's hold to drop, the reader's position then), a position
    # call of the trainer's thread overtakes it, and the batch arrives after it.
    shards = provider(sidecar, ahead=0)  # no grants: the acquire's hold is the one note
    params = plans.PlanParams(shuffle=False, block_size=BLOCK)
    reader = shards.open_reader(params, position=0)
    assert shards.flush()
    built, go = threading.Event(), threading.Event()
    call = sidecar_client.Transport.call

    def held_back(
        self: sidecar_client.Transport, method: str, path: str, *a: Any, **kw: Any
    ) -> Any:
        if path == protocol.notes_path(reader) and not go.is_set():
            built.set()
            go.wait(30)
        return call(self, method, path, *a, **kw)

    monkeypatch.setattr(sidecar_client.Transport, "call", held_back)
    near_end = sum(SHARDS) - 10
    try:
        lease = shards.acquire(reader, 2, epoch=0, position=SHARDS[0])
        assert built.wait(30), "the notifier never sent the acquired shard's notes"
        assert shards.status()["holds"] == 1  # the sidecar's, dropped by the late batch
        shards.readahead(reader, epoch=1, position=near_end)
    finally:
        go.set()
    assert shards.flush()
    status = shards.status()
    (state,) = [r for r in status["readers"] if r["id"] == reader]
    assert (state["epoch"], state["position"]) == (1, near_end)
    # Only the batch's position was stale: the hold it drops is dropped.
    assert status["holds"] == 0
    lease.release()
    shards.close()


def test_a_late_position_moves_the_reader_nowhere_and_the_rest_of_its_request_applies(
    sidecar: SidecarProcess,
) -> None:
    body = protocol.params_to_json(plans.PlanParams(shuffle=False, block_size=BLOCK))
    status, registered = sidecar.control(
        "PUT", protocol.reader_path("r"), {**body, "position": 0, "seq": 0}
    )
    assert status == 200
    first = sidecar.control(
        "POST", protocol.acquire_path("r"), {"shard": 2, "epoch": 0, "position": 300, "seq": 1}
    )[1]
    moved = sidecar.control(
        "POST", protocol.position_path("r"), {"epoch": 1, "position": 900, "seq": 3}
    )[1]
    assert (moved["epoch"], moved["position"]) == (1, 900)

    def where() -> tuple[int, int]:
        (reader,) = sidecar.control("GET", protocol.STATUS)[1]["readers"]
        return reader["epoch"], reader["position"]

    def seq() -> int | None:
        (reader,) = sidecar.control("GET", protocol.STATUS)[1]["readers"]
        return reader["seq"]  # type: ignore[no-any-return]

    def memory_hits() -> int:
        return int(sidecar.control("GET", protocol.STATUS)[1]["stats"]["hits"]["memory"])

    hits = memory_hits()
    # A batch of notes built before the position call: its shards and holds count,
    # its position does not, and the answer says where the reader stays.
    late = {"epoch": 0, "position": 300, "seq": 2, "pinned": [0], "released": [first["lease"]]}
    answer = sidecar.control("POST", protocol.notes_path("r"), late)[1]
    assert answer == {"reader": "r", "epoch": 1, "position": 900, "pinned": 1, "released": 1}
    assert (where(), seq()) == ((1, 900), 3)  # the status says which move it shows
    assert sidecar.control("GET", protocol.STATUS)[1]["holds"] == 0
    assert memory_hits() == hits + 1
    # So with a late pinned shard, and a late acquire: leased, the reader not moved.
    pinned = sidecar.control(
        "POST", protocol.pinned_path("r"), {"shard": 0, "epoch": 0, "position": 5, "seq": 2}
    )[1]
    assert (pinned["epoch"], pinned["position"]) == (1, 900)
    assert memory_hits() == hits + 2
    status, acquired = sidecar.control(
        "POST", protocol.acquire_path("r"), {"shard": 3, "epoch": 0, "position": 470, "seq": 2}
    )
    assert status == 200 and acquired["shard"] == 3 and where() == (1, 900)
    sidecar.control("DELETE", protocol.lease_path(acquired["lease"]))
    # A registration again of the same plan, built before: the reader stays too.
    again = sidecar.control("PUT", protocol.reader_path("r"), {**body, "position": 10, "seq": 2})[1]
    assert (again["change"], again["params"]["epoch"], again["position"]) == ("unchanged", 1, 900)
    assert where() == (1, 900)
    # An equal seq is the same position, a later one moves the reader.
    sidecar.control("POST", protocol.position_path("r"), {"epoch": 1, "position": 900, "seq": 3})
    sidecar.control("POST", protocol.position_path("r"), {"epoch": 2, "position": 7, "seq": 4})
    assert (where(), seq()) == ((2, 7), 4)
    for bad in ("4", -1, True, 1.5):
        status, refused = sidecar.control(
            "POST", protocol.position_path("r"), {"epoch": 0, "position": 0, "seq": bad}
        )
        assert (status, refused["error"]["code"]) == (400, protocol.CODE_BAD_REQUEST), bad
        assert "field 'seq'" in refused["error"]["message"], refused
    assert where() == (2, 7)
    assert "seq" in registered["features"]


def test_requests_without_seq_move_the_reader_as_before(sidecar: SidecarProcess) -> None:
    # An older client sends no seq: every position it sends is applied, in the order
    # the sidecar gets them, as before the feature (and after a seq of a newer one).
    body = protocol.params_to_json(plans.PlanParams(shuffle=False, block_size=BLOCK))
    assert sidecar.control("PUT", protocol.reader_path("old"), {**body, "position": 0})[0] == 200

    def where() -> tuple[int, int]:
        (reader,) = sidecar.control("GET", protocol.STATUS)[1]["readers"]
        return reader["epoch"], reader["position"]

    sidecar.control("POST", protocol.position_path("old"), {"epoch": 1, "position": 900})
    answer = sidecar.control(
        "POST", protocol.notes_path("old"), {"epoch": 0, "position": 300, "pinned": [0]}
    )[1]
    assert (answer["epoch"], answer["position"]) == (0, 300) and where() == (0, 300)
    sidecar.control("POST", protocol.position_path("old"), {"epoch": 1, "position": 50, "seq": 9})
    sidecar.control("POST", protocol.pinned_path("old"), {"shard": 0, "epoch": 0, "position": 3})
    assert where() == (0, 3)
    # A registration without seq forgets the reader's: a lower one applies after it.
    sidecar.control("PUT", protocol.reader_path("old"), {**body, "position": 4})
    sidecar.control("POST", protocol.position_path("old"), {"epoch": 0, "position": 8, "seq": 1})
    assert where() == (0, 8)


def test_a_client_talking_to_a_sidecar_without_the_features_uses_the_first_v1_routes(
    sidecar: SidecarProcess, dataset: tuple[str, pa.Table], monkeypatch: pytest.MonkeyPatch
) -> None:
    # An older sidecar answers a registration without `features`: the client must not
    # send `notes` or ask for grants ahead, and still read exactly the same rows.
    call = sidecar_client.Transport.call

    def older(self: sidecar_client.Transport, method: str, path: str, *a: Any, **kw: Any) -> Any:
        answer = call(self, method, path, *a, **kw)
        if method == "PUT" and isinstance(answer, dict):
            answer.pop("features", None)
        return answer

    monkeypatch.setattr(sidecar_client.Transport, "call", older)
    params = plans.PlanParams(seed=2, block_size=BLOCK)
    with shardcache.open(
        dataset[0], cache_dir=sidecar.workdir / "ref", seed=2, block_size=BLOCK
    ) as ds:
        want = [uids(ds)]
        ds.set_epoch(1)
        want.append(uids(ds))
    shards = provider(sidecar)
    ds = shardcache.Dataset(shards, params)
    got = [uids(ds)]
    ds.set_epoch(1)
    got.append(uids(ds))
    assert shards.flush()
    ds.close()
    assert got == want
    routes = requests_by_route(sidecar)
    nonempty = sum(1 for rows in SHARDS if rows)
    assert routes.get(protocol.notes_path("{reader_id}"), 0) == 0
    assert routes[protocol.acquire_path("{reader_id}")] == nonempty  # one per shard
    assert routes[protocol.lease_path("{lease_id}")] == nonempty  # each hold dropped
    assert routes[protocol.pinned_path("{reader_id}")] == nonempty  # epoch 1: pinned


def requests_by_route(proc: SidecarProcess) -> dict[str, int]:
    """Answered (200) control requests by route, from the sidecar's /metrics."""
    status, text = proc.http_get("/metrics")
    assert status == 200
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("shardcache_control_requests_total{") and 'status="200"' in line:
            route = line.split('route="', 1)[1].split('"', 1)[0]
            out[route] = out.get(route, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


RANK_KILLED_MID_EPOCH = textwrap.dedent(
    """
    import signal, shardcache
    ds = shardcache.open(shuffle="sample", window=300, block_size=64)
    next(ds.batches(50))
    print("mid-epoch", flush=True)
    signal.pause()
    """
)


def dropped_dead(proc: SidecarProcess) -> float:
    """`shardcache_readers_dropped_dead_total` from /metrics (which checks nothing)."""
    status, text = proc.http_get("/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith("shardcache_readers_dropped_dead_total "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no shardcache_readers_dropped_dead_total in /metrics")


def test_a_rank_killed_mid_epoch_loses_its_reader_and_a_silent_live_one_keeps_its(
    sidecar: SidecarProcess,
) -> None:
    shards = provider(sidecar)
    # Opened, then silent: a trainer in a long step sends nothing for minutes.
    live = shards.open_reader(plans.PlanParams(shuffle=False, block_size=BLOCK), position=0)
    env = {**os.environ, **sidecar.client_env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", RANK_KILLED_MID_EPOCH], env=env, stdout=subprocess.PIPE, text=True
    ) as rank:
        assert rank.stdout is not None
        assert rank.stdout.readline().strip() == "mid-epoch"
        ids = [r["id"] for r in sidecar.control("GET", protocol.STATUS)[1]["readers"]]
        assert len(ids) == 2 and live in ids
        rank.send_signal(signal.SIGKILL)
        rank.wait()
    # Found by the sidecar's own periodic check: /metrics checks nothing itself.
    waiting.wait_until("the dead rank's reader to be dropped", lambda: dropped_dead(sidecar))
    status = sidecar.control("GET", protocol.STATUS)[1]
    assert [(r["id"], r[protocol.READER_LOCK_FIELD]) for r in status["readers"]] == [(live, True)]
    assert status["readers_dropped_dead"] == 1
    assert status["holds"] == 0
    # Its sample windows no longer count against the memory tier.
    assert status["stats"]["sample_windows_bytes"] == 0
    assert status["stats"]["readers"] == 1
    lease = shards.acquire(live, 0, epoch=0, position=0)
    lease.release()
    shards.close()
    assert sidecar.control("GET", protocol.STATUS)[1]["readers"] == []
    assert not list((sidecar.memory_dir / reader_locks.DIRECTORY).iterdir())


def test_a_reader_without_a_lock_the_sidecar_sees_is_never_dropped(
    sidecar: SidecarProcess,
) -> None:
    body = {**protocol.params_to_json(plans.PlanParams(block_size=BLOCK)), "position": 0}
    # An older client sends no lock; a client whose memory directory is another than
    # the sidecar's claims one the sidecar cannot find.
    assert sidecar.control("PUT", protocol.reader_path("older"), body)[0] == 200
    claimed = {**body, protocol.READER_LOCK_FIELD: True}
    assert sidecar.control("PUT", protocol.reader_path("elsewhere"), claimed)[0] == 200
    bad = {**body, protocol.READER_LOCK_FIELD: "yes"}
    status, answer = sidecar.control("PUT", protocol.reader_path("bad"), bad)
    assert (status, answer["error"]["code"]) == (400, protocol.CODE_BAD_REQUEST)
    assert "reader_lock" in answer["error"]["message"]
    # A reader whose lock is let go, to see a check run.
    held = reader_locks.hold(sidecar.memory_dir, "gone")
    assert sidecar.control("PUT", protocol.reader_path("gone"), claimed)[0] == 200
    held.forget()
    waiting.wait_until("the reader let go to be dropped", lambda: dropped_dead(sidecar))
    readers = sidecar.control("GET", protocol.STATUS)[1]["readers"]
    assert sorted((r["id"], r[protocol.READER_LOCK_FIELD]) for r in readers) == [
        ("elsewhere", False),
        ("older", False),
    ]


def test_a_live_reader_dropped_by_mistake_registers_again_and_reads_on_exactly(
    sidecar: SidecarProcess,
) -> None:
    shards = provider(sidecar)
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=5, block_size=BLOCK))
    batches = ds.batches(50)
    got = [u for _ in range(3) for u in next(batches).column("uid").to_pylist()]
    (lock,) = (sidecar.memory_dir / reader_locks.DIRECTORY).iterdir()
    lock.unlink()  # by hand: the sidecar finds no lock and drops the reader
    waiting.wait_until("the reader to be dropped", lambda: dropped_dead(sidecar))
    got += [u for b in batches for u in b.column("uid").to_pylist()]
    assert sorted(got) == list(range(sum(SHARDS)))
    # The batches' notes go on the notifier's thread: the first one after the drop
    # registers the reader again, maybe after the last batch was handed over.
    waiting.wait_until(
        "the reader to register again",
        lambda: len(sidecar.control("GET", protocol.STATUS)[1]["readers"]) == 1,
    )
    (reader,) = sidecar.control("GET", protocol.STATUS)[1]["readers"]
    assert reader[protocol.READER_LOCK_FIELD] is True  # with a new lock file
    assert lock.exists()
    ds.close()
