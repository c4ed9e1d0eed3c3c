"""Feature `skip_handed`: grants ahead leave out the shards a reader was handed before.

A client pins again, itself, every entry it was handed with `reuse`; granting it one of
those ahead costs the sidecar a lookup, a hold and the hold's release for nothing. Against
a real `shardcache sidecar` process (file:// source); entries are evicted from the test
through a `Tier` on the sidecar's memory directory, as another process on the node would.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import shardcache
from shardcache import plans, sidecar_client
from shardcache.contract import protocol
from shardcache.node import tiers
from tests.support import datasets
from tests.support.locks import exclusively_lockable
from tests.support.sidecar import SidecarProcess

pytestmark = pytest.mark.integration

SHARDS = [300, 0, 170, 512, 45, 260]
#: Where each shard starts in an unshuffled plan of one rank (shard 1 has no rows).
STARTS = {0: 0, 2: 300, 3: 470, 4: 982, 5: 1027}
BLOCK = 64
SEED = 3

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
    kwargs.setdefault("reconnect_timeout", 10.0)
    return sidecar_client.SidecarProvider.from_env(environ=proc.client_env(), **kwargs)


def uids(ds: shardcache.Dataset, batch_size: int = 50) -> list[int]:
    return [u for b in ds.batches(batch_size) for u in b.column("uid").to_pylist()]


def warm_every_shard(proc: SidecarProcess) -> None:
    params = plans.PlanParams(shuffle=False, block_size=BLOCK)
    warm = shardcache.Dataset(provider(proc, ahead=0), params)
    assert len(uids(warm)) == sum(SHARDS)
    warm.close()


def acquire(proc: SidecarProcess, reader: str, shard: int, ahead: int = 0) -> dict[str, Any]:
    body = {"shard": shard, "epoch": 0, "position": STARTS[shard]}
    if ahead:
        body["ahead"] = ahead
    status, answer = proc.control("POST", protocol.acquire_path(reader), body)
    assert status == 200 and answer["reuse"] is True, answer
    return dict(answer)


def test_grants_ahead_pass_over_the_shards_handed_to_a_reader_that_pins_them_itself(
    sidecar: SidecarProcess,
) -> None:
    warm_every_shard(sidecar)
    body = {**protocol.params_to_json(plans.PlanParams(shuffle=False, block_size=BLOCK))}
    status, new = sidecar.control(
        "PUT", protocol.reader_path("new"), {**body, "position": 0, "skip_handed": True}
    )
    assert status == 200 and protocol.FEATURE_SKIP_HANDED in new["features"]
    # As an older client registers: no `skip_handed`.
    assert sidecar.control("PUT", protocol.reader_path("old"), {**body, "position": 0})[0] == 200
    for reader in ("new", "old"):
        acquire(sidecar, reader, 3)  # handed with reuse: the client may pin it again
    # From shard 0, 3 ahead: the old reader gets the next three shards of its plan; the
    # new one is not granted shard 3 and gets the next one after it instead.
    old = acquire(sidecar, "old", 0, ahead=3)
    new = acquire(sidecar, "new", 0, ahead=3)
    assert [g["shard"] for g in old["ahead"]] == [2, 3, 4]
    assert [g["shard"] for g in new["ahead"]] == [2, 4, 5]
    # A registration's grants (`open_ahead`) pass over them too: shards 0, 2, 3, 4 and 5
    # were all handed to the new reader now; the old one is granted its first five.
    again = {**body, "position": 0, "ahead": 16}
    status, reopened = sidecar.control(
        "PUT", protocol.reader_path("new"), {**again, "skip_handed": True}
    )
    assert (status, reopened["ahead"]) == (200, [])
    status, plain = sidecar.control("PUT", protocol.reader_path("old"), again)
    assert [g["shard"] for g in plain["ahead"]] == [0, 2, 3, 4, 5]
    # Every hold goes with its reader, as before.
    for reader in ("new", "old"):
        assert sidecar.control("DELETE", protocol.reader_path(reader))[0] == 200
    assert sidecar.control("GET", protocol.STATUS)[1]["holds"] == 0
    for grant in [*old["ahead"], *new["ahead"], *plain["ahead"]]:
        assert exclusively_lockable(sidecar.memory_dir / grant["lock"])


def test_a_reader_registered_again_without_the_field_is_granted_everything_again(
    sidecar: SidecarProcess,
) -> None:
    warm_every_shard(sidecar)
    body = {**protocol.params_to_json(plans.PlanParams(shuffle=False, block_size=BLOCK))}
    sidecar.control("PUT", protocol.reader_path("r"), {**body, "position": 0, "skip_handed": True})
    acquire(sidecar, "r", 2)
    assert sidecar.control("PUT", protocol.reader_path("r"), {**body, "position": 0})[0] == 200
    assert [g["shard"] for g in acquire(sidecar, "r", 0, ahead=2)["ahead"]] == [2, 3]


def test_skip_handed_must_be_a_boolean(sidecar: SidecarProcess) -> None:
    body = {**protocol.params_to_json(plans.PlanParams(block_size=BLOCK)), "position": 0}
    status, answer = sidecar.control(
        "PUT", protocol.reader_path("r"), {**body, "skip_handed": "yes"}
    )
    assert (status, answer["error"]["code"]) == (400, protocol.CODE_BAD_REQUEST)
    assert "skip_handed" in answer["error"]["message"]
    assert "expected true or false, found 'yes'" in answer["error"]["message"]
    # Refused before anything was registered.
    readers = sidecar.control("GET", protocol.STATUS)[1]["readers"]
    assert "r" not in [r["id"] for r in readers]


def test_a_shard_left_out_of_the_grants_and_evicted_is_fetched_again_and_read_exactly(
    sidecar_factory: Factory,
    dataset: tuple[str, pa.Table],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with shardcache.open(
        dataset[0], seed=SEED, block_size=BLOCK, cache_dir=tmp_path / "ref"
    ) as ref:
        want = []
        for epoch in range(3):
            ref.set_epoch(epoch)
            want.append(uids(ref))
    proc = sidecar_factory(dataset[0], args=["--ready-shards", "1", "--block-size", str(BLOCK)])
    proc.start(wait="ready")
    answers: list[dict[str, Any]] = []
    call = sidecar_client.Transport.call

    def recording(
        self: sidecar_client.Transport, method: str, path: str, *a: Any, **kw: Any
    ) -> Any:
        answer = call(self, method, path, *a, **kw)
        if path.endswith("/acquire") and isinstance(answer, dict):
            answers.append(answer)
        return answer

    monkeypatch.setattr(sidecar_client.Transport, "call", recording)
    shards = provider(proc)
    ds = shardcache.Dataset(shards, plans.PlanParams(seed=SEED, block_size=BLOCK))
    got = [uids(ds)]
    # Epoch 0 handed the reader every shard with rows (acquired or granted ahead).
    ds.set_epoch(1)
    order = [shard for shard, _ in acquired_at(ds.runs())]
    assert sorted(order) == sorted(STARTS)
    # Evict the epoch's first shard and its last: the reader's own pin of the first
    # fails at once, so it asks for it (a fetch); the last is fetched again by the
    # readahead or by the reader's acquire, whichever comes first.
    assert shards.flush() and proc.holds_drain() == 0
    gone = [order[0], order[-1]]
    memory = tiers.Tier(
        proc.memory_dir, limit_bytes=1 << 40, name="memory", fsync=False, verify="never"
    )
    for shard in gone:
        assert memory.evict(shards.manifest.decoded_key(shard))
    del answers[:]
    got.append(uids(ds))
    # Only evicted shards cost a round trip, the first one surely; nothing handed
    # before was granted ahead with it (a sidecar granting them would have granted
    # the epoch's second to fourth shards, resident all along).
    assert answers and answers[0]["shard"] == order[0]
    assert {a["shard"] for a in answers} <= set(gone)
    assert [g for a in answers for g in a.get("ahead", [])] == []
    ds.set_epoch(2)
    got.append(uids(ds))
    assert shards.flush()
    ds.close()
    assert got == want


def acquired_at(runs: list[plans.Run]) -> list[tuple[int, int]]:
    """(shard, position) of every acquire a `Dataset` makes over `runs`."""
    out: list[tuple[int, int]] = []
    position = 0
    for run in runs:
        if not out or out[-1][0] != run.shard:
            out.append((run.shard, position))
        position += len(run)
    return out
