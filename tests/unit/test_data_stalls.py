"""The data-stall signal from the training loop to the sidecar's metrics: how a
Dataset times its batches, the `stalls` field of notes, and what the sidecar counts."""

from __future__ import annotations

import time
from typing import Any

import pytest
from shardcache_sidecar import metrics, readers

from shardcache import errors, plans, stalls
from shardcache.contract import protocol

pytestmark = pytest.mark.unit


def totals(wait: float, step: float, *, batches: int = 1, recent: float = 0.5) -> protocol.Stalls:
    return protocol.Stalls(
        wait_seconds=wait, step_seconds=step, batches=batches, recent_fraction=recent
    )


def test_stalls_round_trip_through_the_notes_body() -> None:
    sent = totals(1.5, 3.0, batches=7, recent=0.25)
    body = {"epoch": 0, "position": 0, "stalls": protocol.stalls_to_json(sent)}
    assert protocol.stalls_from_json(body) == sent
    assert protocol.stalls_from_json({"epoch": 0}) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("wait_seconds", -1.0),
        ("step_seconds", float("inf")),
        ("recent_fraction", 1.5),
        ("batches", 1.5),
        ("wait_seconds", True),
    ],
)
def test_a_bad_stalls_field_is_refused_by_name(field: str, value: Any) -> None:
    body = protocol.stalls_to_json(totals(1.0, 1.0))
    body[field] = value
    with pytest.raises(errors.InputError, match=field):
        protocol.stalls_from_json({"stalls": body})


def test_the_registry_counts_what_the_totals_grew_by_and_restarts_from_a_reopen() -> None:
    registry: readers.Registry[str] = readers.Registry(clock=time.monotonic)
    registry.register("r", plans.PlanParams(seed=1, rank=3, world_size=4), 0)
    assert registry.report_stalls("r", totals(2.0, 8.0)) == (2.0, 8.0)
    # The same report twice (a retried batch) adds nothing.
    assert registry.report_stalls("r", totals(2.0, 8.0)) == (0.0, 0.0)
    assert registry.report_stalls("r", totals(2.5, 9.0)) == (0.5, 1.0)
    # Totals that went down: a new client under the same id counts from zero.
    assert registry.report_stalls("r", totals(0.25, 1.0)) == (0.25, 1.0)
    assert registry.report_stalls("gone", totals(1.0, 1.0)) == (0.0, 0.0)


def test_the_sidecar_exports_wait_seconds_by_rank_and_a_fraction_per_reader() -> None:
    m = metrics.Metrics()
    reported = [("r1", 0, totals(1.0, 3.0, recent=0.75))]
    m.watch_readers(lambda: reported)
    m.stalled(0, 1.0, 3.0)
    m.stalled(0, 0.5, 0.5)
    text = m.render().decode()
    assert 'shardcache_data_wait_seconds_total{rank="0"} 1.5' in text
    assert 'shardcache_data_step_seconds_total{rank="0"} 3.5' in text
    assert 'shardcache_reader_stall_fraction{rank="0",reader="r1"} 0.75' in text
    # A reader that unregisters leaves the next scrape with no stale series.
    reported.clear()
    assert "shardcache_reader_stall_fraction{" not in m.render().decode()


class Recorder:
    """A provider's `note_stalls`, recording what the dataset told it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def note_stalls(self, reader_id: str, meter: stalls.StallMeter) -> None:
        self.calls.append((reader_id, meter.batches))


def test_a_dataset_times_the_loop_around_its_batches_and_tells_its_provider(
    tmp_path: Any,
) -> None:
    import pyarrow as pa

    from shardcache import datasets, provider

    assert isinstance(Recorder(), provider.StallReporter)
    path = tmp_path / "shard.arrow"
    table = pa.table({"x": list(range(40))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)

    class Lease:
        def __init__(self) -> None:
            self.path = path

        def release(self) -> None:
            pass

    class Provider(Recorder):
        manifest: Any = None

        def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
            return "reader-1"

        def acquire(self, reader_id: str, shard: int, *, epoch: int, position: int) -> Lease:
            time.sleep(0.05)  # a cold shard: the loop waits on data
            return Lease()

        def close_reader(self, reader_id: str) -> None:
            pass

        def close(self) -> None:
            pass

    shards = Provider()
    ds = datasets.Dataset(shards, plans.PlanParams(seed=0, shuffle=False))
    runs = [plans.Run(shard=0, start=0, stop=40)]
    ds.runs = lambda: runs  # type: ignore[method-assign]
    for _ in ds.batches(10):
        time.sleep(0.02)  # the step
    assert shards.calls == [("reader-1", n) for n in range(1, 5)]
    meter = ds.stalls
    assert meter.batches == 4
    assert meter.wait_seconds >= 0.05  # the first batch waited for the shard
    assert meter.step_seconds >= 3 * 0.02  # three steps between four batches
    assert 0 < meter.fraction < 1
