"""The operator's periodic reads of tenants' stores run in worker processes it bounds,
reuses and kills (`read_workers`, `read_worker`): a prefix of millions of keys costs a
worker its read, never the operator its memory; a store that never answers costs its
namespace one worker until the read's timeout; workers are reused, and never after
they failed. Real worker processes, file:// stores and a TCP port that never answers."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from shardcache_operator import (
    configuration,
    endpoint_policy,
    quiet_stores,
    read_worker,
    read_workers,
    reconcile,
    resolve_child,
    resolve_slots,
    source_reads,
    sources,
)

from shardcache import errors
from tests.support.listener import Listener
from tests.unit.test_operator_skips import publish, record

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FILES = sources.Access(file_sources=True)
MiB = 1 << 20


@pytest.fixture
def silent() -> Iterator[Listener]:
    """A store that accepts connections and never answers on them."""
    served = Listener(hold=True)
    try:
        yield served
    finally:
        served.close()


@pytest.fixture
def pool() -> Iterator[read_workers.Pool]:
    made = read_workers.Pool(memory=256 * MiB, timeout=30, access=FILES)
    try:
        yield made
    finally:
        made.close()


def silent_source(port: int) -> tuple[str, dict[str, str], sources.Access]:
    """An s3:// source on `silent`'s port, and an access whose list allows it."""
    endpoint = f"http://127.0.0.1:{port}"
    options = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "AKIATEST",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t",
        "AWS_REGION": "us-east-1",
    }
    access = sources.Access(source_endpoints=(endpoint_policy.entry(endpoint),))
    return "s3://bucket/data/", options, access


def dataset(tmp_path: Path) -> str:
    """The URI of a directory holding one shard: what a probe finds present."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "part-0.jsonl").write_text("{}\n")
    return data.as_uri()


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_worker_is_reused_and_its_answers_are_the_in_process_reads(
    pool: read_workers.Pool, tmp_path: Path
) -> None:
    pool.probe(dataset(tmp_path), None)
    (first,) = pool.running()
    gone = (tmp_path / "gone").as_uri()
    with pytest.raises(errors.InputError) as in_worker:
        pool.probe(gone, None)
    with pytest.raises(errors.InputError) as in_process:
        sources.probe_source(gone, None, access=FILES)
    assert str(in_worker.value) == str(in_process.value)
    publish(tmp_path / "ckpt", "rank-0", 200, record(0))
    publish(tmp_path / "ckpt", "rank-1", 200, record(1))
    uri = (tmp_path / "ckpt").as_uri()
    assert pool.applied_skips(uri, None) == sources.applied_skips(uri, None, access=FILES)
    assert len(pool.applied_skips(uri, None)) == 2
    assert pool.running() == [first]


def test_a_probe_of_a_pinned_shard_checks_that_file_and_its_size_in_the_worker(
    pool: read_workers.Pool, tmp_path: Path
) -> None:
    uri = dataset(tmp_path)  # part-0.jsonl, 3 bytes
    pool.probe(uri, None, shard=("part-0.jsonl", 3))
    with pytest.raises(errors.InputError, match="is 3 bytes, not the 4 it was pinned at"):
        pool.probe(uri, None, shard=("part-0.jsonl", 4))
    with pytest.raises(errors.InputError, match=r"'part-1\.jsonl' of .* is not there any more"):
        pool.probe(uri, None, shard=("part-1.jsonl", 3))
    single = (tmp_path / "data" / "part-0.jsonl").as_uri()  # a one-file dataset: path ""
    pool.probe(single, None, shard=("", 3))
    assert len(pool.running()) == 1


def test_the_policy_refuses_a_source_before_any_worker_starts(tmp_path: Path) -> None:
    refusing = read_workers.Pool(memory=256 * MiB, timeout=30)
    try:
        with pytest.raises(reconcile.SourceRefused, match="file:// sources are not resolved"):
            refusing.probe(dataset(tmp_path), None)
        assert refusing.running() == []
    finally:
        refusing.close()


def test_a_prefix_over_the_workers_memory_fails_that_read_and_the_worker_is_replaced(
    tmp_path: Path,
) -> None:
    flat = tmp_path / "flat"
    flat.mkdir()
    # A worker maps about 80 MiB before its read; 100,000 entries take about 30 more.
    for i in range(150_000):
        (flat / f"k{i:07d}").touch()
    small = read_workers.Pool(memory=96 * MiB, timeout=60, access=FILES)
    try:
        small.probe(dataset(tmp_path), None)
        (first,) = small.running()
        with pytest.raises(reconcile.ResolveOverMemory) as over:
            small.probe(flat.as_uri(), None)
        message = str(over.value)
        assert "the read went over its memory limit of 96 MiB" in message
        assert "operator.settings.resolveMemory" in message
        assert small.running() == [] and not alive(first)
        small.probe(dataset(tmp_path), None)  # a new worker, the same pool
        assert small.running() != [first]
    finally:
        small.close()


def test_a_read_that_outlives_its_timeout_kills_its_worker(
    silent: Listener, tmp_path: Path
) -> None:
    uri, options, access = silent_source(silent.port)
    slow = read_workers.Pool(memory=256 * MiB, timeout=2, access=access)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not finish within 2 s"):
            slow.probe(uri, options)
        assert time.monotonic() - started < 10
        assert silent.accepts, "the worker never connected"
        assert slow.running() == []
    finally:
        slow.close()


def test_an_idle_worker_kept_past_its_time_is_ended_and_replaced(tmp_path: Path) -> None:
    brief = read_workers.Pool(memory=256 * MiB, timeout=30, access=FILES, idle_seconds=0.0)
    try:
        brief.probe(dataset(tmp_path), None)
        (first,) = brief.running()
        brief.probe(dataset(tmp_path), None)
        (second,) = brief.running()
        assert second != first and not alive(first)
    finally:
        brief.close()


def test_one_mounts_applied_skips_timer_finds_its_worker_warm() -> None:
    """The timer of one mount with a checkpoint store comes every skipsIntervalSeconds:
    its worker must still be kept then (else each read ends it and starts another,
    about 0.25 s of CPU, while the old one had lived on anyway), and must not have ended
    by itself when the pool hands it out."""
    interval = configuration.Settings().skips_interval_seconds
    assert interval < read_workers.IDLE_SECONDS < read_worker.IDLE_EXIT_SECONDS


def test_close_ends_every_worker_and_refuses_later_reads(
    pool: read_workers.Pool, tmp_path: Path
) -> None:
    pool.probe(dataset(tmp_path), None)
    (pid,) = pool.running()
    pool.close()
    assert pool.running() == [] and not alive(pid)
    with pytest.raises(errors.SourceError, match="the operator is stopping"):
        pool.probe(dataset(tmp_path), None)


def test_a_namespace_holds_one_worker_at_a_time_and_the_others_still_read(
    silent: Listener, tmp_path: Path
) -> None:
    """Namespace a's store never answers: a's second read gets none of the two free
    workers in its time (AllBusy, naming the periodic reads), while b reads at once."""
    uri, options, access = silent_source(silent.port)
    shared = read_workers.Pool(
        memory=256 * MiB,
        timeout=60,
        access=sources.Access(file_sources=True, source_endpoints=access.source_endpoints),
        workers=3,
    )

    async def scenario() -> None:
        gate = source_reads.Gate()
        stuck = asyncio.create_task(
            gate.run("a", lambda: shared.probe(uri, options), timeout=6, what="checking a")
        )
        while shared.slots.running("a") < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(resolve_slots.AllBusy) as busy:
            await gate.run(
                "a", lambda: shared.probe(dataset(tmp_path), None), timeout=1.5, what="a again"
            )
        assert "the operator's periodic reads are all busy, not the source" in str(busy.value)
        assert "operator.settings.readWorkers" in str(busy.value)
        await gate.run("b", lambda: shared.probe(dataset(tmp_path), None), timeout=20, what="b")
        with pytest.raises(TimeoutError):
            await stuck

    try:
        asyncio.run(scenario())
    finally:
        shared.close()


def test_a_worker_ends_when_the_operator_process_is_gone(tmp_path: Path) -> None:
    script = f"""
import os, sys
from shardcache_operator import read_workers, sources
pool = read_workers.Pool(memory=256 << 20, timeout=30, access=sources.Access(file_sources=True))
pool.probe({dataset(tmp_path)!r}, None)
print(pool.running()[0], flush=True)
os._exit(0)
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the worker outlived the process that started it"


def worker_answers(*lines: bytes) -> list[dict[str, object]]:
    """Run one `read_worker` on `lines` (then stdin closes) and read its answers."""
    env = {
        **os.environ,
        **resolve_child.ENV,
        "PYTHONPATH": f"{ROOT}:{ROOT / 'operator'}",
    }
    done = subprocess.run(
        [sys.executable, "-m", read_worker.__name__, str(256 * MiB)],
        input=b"".join(lines),
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_worker_answers_a_bad_request_with_an_error_and_serves_the_next(
    tmp_path: Path,
) -> None:
    good: Mapping[str, object] = {
        "op": "probe",
        "uri": dataset(tmp_path),
        "storage_options": None,
        "retry": {},
    }
    answers = worker_answers(
        json.dumps({**good, "op": "delete"}).encode() + b"\n",
        b"not json\n",
        json.dumps({**good, "shard": "part-0.jsonl"}).encode() + b"\n",
        json.dumps(good).encode() + b"\n",
    )
    assert answers[0]["error"] == {
        "kind": "InputError",
        "message": "expected a request op of ['probe', 'applied_skips'], found 'delete'",
    }
    assert answers[1]["error"]["kind"] == "InputError"  # type: ignore[index]
    assert answers[2]["error"] == {
        "kind": "InputError",
        "message": "expected a request's shard as [path, size], found 'part-0.jsonl'",
    }
    assert answers[3] == {"ok": True}


def test_a_store_that_hung_is_left_alone_for_its_namespace_and_read_for_the_others(
    silent: Listener,
) -> None:
    """Namespace a's store never answers: after one read of it timed out, a's next reads
    of that store (another mount's prefix in the same bucket) fail at once, with no
    worker and no connection, saying when it is read again; namespace b's read of the
    same store is still made."""
    uri, options, access = silent_source(silent.port)
    quiet = quiet_stores.Quiet(after=1.0, hold=60.0)
    hung = read_workers.Pool(memory=256 * MiB, timeout=3, access=access, quiet=quiet)

    async def scenario() -> None:
        gate = source_reads.Gate()
        with pytest.raises(TimeoutError):
            await gate.run("a", lambda: hung.probe(uri, options), timeout=10, what="checking a")
        accepted = silent.accepts
        started = time.monotonic()
        with pytest.raises(quiet_stores.Unanswered) as unanswered:
            await gate.run(
                "a",
                lambda: hung.probe("s3://bucket/other/", options),
                timeout=10,
                what="checking s3://bucket/other/",
            )
        assert time.monotonic() - started < 1
        assert isinstance(unanswered.value, errors.SourceError)
        message = str(unanswered.value)
        assert message.startswith("checking s3://bucket/other/: not read now: a read of the ")
        assert "did not answer within 3 s" in message
        assert re.search(r"reads it again in (5\d|60) s", message), message
        assert silent.accepts == accepted and hung.running() == []
        with pytest.raises(TimeoutError):
            await gate.run("b", lambda: hung.probe(uri, options), timeout=10, what="checking b")
        assert silent.accepts > accepted

    try:
        asyncio.run(scenario())
    finally:
        hung.close()


def test_a_store_is_left_alone_after_a_slow_failure_only_and_longer_at_each_in_a_row() -> None:
    quiet = quiet_stores.Quiet(after=10.0, hold=300.0, most=900.0)
    store = quiet.key("a", "s3://bucket/data/", {"AWS_ENDPOINT_URL": "http://store:9000"})
    quiet.failed(store, 0.2, "failed after 0 s")  # refused at once: held no worker long
    quiet.check(store, "checking")
    holds = []
    for _ in range(4):
        quiet.failed(store, 60.0, "did not answer within 60 s")
        with pytest.raises(quiet_stores.Unanswered) as unanswered:
            quiet.check(store, "checking")
        holds.append(int(str(unanswered.value).split("reads it again in ")[1].split(" s")[0]))
    assert [round(h, -1) for h in holds] == [300, 600, 900, 900]
    # Its first answer forgets it; other stores, and the same store for another
    # namespace or through another endpoint, were never held.
    quiet.check(quiet.key("b", "s3://bucket/data/", {"AWS_ENDPOINT_URL": "http://store:9000"}), "x")
    quiet.check(quiet.key("a", "s3://bucket/data/", {"AWS_ENDPOINT_URL": "http://other:9000"}), "x")
    quiet.check(
        quiet.key("a", "s3://elsewhere/data/", {"AWS_ENDPOINT_URL": "http://store:9000"}), "x"
    )
    quiet.answered(store)
    quiet.check(store, "checking")


def test_a_check_of_a_store_left_alone_degrades_the_mount_saying_when_it_is_read_again(
    tmp_path: Path,
) -> None:
    quiet = quiet_stores.Quiet(after=0.0, hold=300.0)
    left_alone = read_workers.Pool(memory=256 * MiB, timeout=30, access=FILES, quiet=quiet)
    uri = dataset(tmp_path)
    quiet.failed(quiet.key("ml", uri, None), 61.0, "did not answer within 60 s")
    obj = {
        "metadata": {"name": "data", "namespace": "ml", "generation": 1},
        "spec": {"source": {"uri": uri, "format": "jsonl"}},
    }

    async def secret(namespace: str, name: str) -> None:
        return None

    try:
        reconciled = asyncio.run(
            reconcile.reconcile(
                obj,
                read_secret=secret,
                resolve=lambda u, f, o: sources.resolve_manifest(u, f, o, access=FILES),
                probe=left_alone.probe,
                now="t",
            )
        )
        obj["status"] = reconciled.status
        result = asyncio.run(
            reconcile.check_source(obj, read_secret=secret, probe=left_alone.probe, now="t2")
        )
    finally:
        left_alone.close()
    assert result is not None and result.status["phase"] == "Degraded"
    ready = {c["type"]: c for c in result.status["conditions"]}["Ready"]
    assert ready["reason"] == "SourceUnreachable"
    assert "did not answer within 60 s" in ready["message"]
    assert "the operator reads it again in 300 s" in ready["message"] or (
        "the operator reads it again in 299 s" in ready["message"]
    )
    assert left_alone.running() == []
