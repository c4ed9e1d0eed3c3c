"""An acquire's timeout holds whatever it waits on, and its error says what that was.

The store here is a FIFO nobody writes in place of a shard: opening it blocks, as a
store that took the request and never answers does. An acquire that began the shard's
attempt itself used to run the fetch in its own thread and wait on it for good, so its
timeout never came (the reader hung for as long as the store did); and an acquire that
timed out on another's attempt said only "timed out waiting for the shard: ".
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import errors, manifests
from shardcache.node import caches
from tests.support import datasets
from tests.support.hung_shards import HungShard

pytestmark = pytest.mark.integration

SHARDS = [120, 80, 100]
HUNG = 2


@pytest.fixture
def hung_store(tmp_path: Path) -> Iterator[tuple[caches.CacheNode, HungShard]]:
    """A node whose shard `HUNG` blocks on open; answered (and the node closed) after."""
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    manifest = manifests.resolve(f"file://{root}")
    hung = HungShard(root / manifest.shards[HUNG].path)
    settings = caches.NodeSettings(
        disk_dir=tmp_path / "disk", memory_dir=tmp_path / "mem", prefetch_depth=0
    )
    node = caches.CacheNode(manifest, settings)
    try:
        yield node, hung
    finally:
        hung.answer()
        node.close()


def test_an_acquire_that_began_a_fetch_that_never_returns_times_out_naming_the_fetch(
    hung_store: tuple[caches.CacheNode, HungShard],
) -> None:
    node, _ = hung_store
    # A thread of its own, not a pool's: a pool would wait for a blocked acquire.
    acquiring: concurrent.futures.Future[object] = concurrent.futures.Future()

    def acquire() -> None:
        try:
            acquiring.set_result(node.acquire(HUNG, timeout=1.0))
        except BaseException as exc:
            acquiring.set_exception(exc)

    threading.Thread(target=acquire, daemon=True).start()
    try:
        error = acquiring.exception(timeout=20)
    except concurrent.futures.TimeoutError:
        pytest.fail("the acquire was still blocked 20 s into its 1 s timeout")
    assert isinstance(error, errors.AcquireTimeoutError), error
    assert isinstance(error, TimeoutError)  # what the sidecar answers 504 `timeout` for
    message = str(error)
    assert f"shard {HUNG} (part-0000{HUNG}.parquet)" in message, message
    assert "after the acquire timeout of 1 s" in message, message
    assert re.search(
        r"fetching its source bytes from the store since \d{4}-\d\d-\d\dT[\d:]{8}Z", message
    ), message
    assert "for acquire" in message, message
    # The attempt goes on; /v1/status shows it (the sidecar's `in_flight`).
    flight = node.in_flight(HUNG)
    assert flight is not None
    assert (flight["why"], flight["stage"]) == ("acquire", "fetch")


def test_an_acquire_that_times_out_on_a_readaheads_hung_fetch_says_since_when(
    hung_store: tuple[caches.CacheNode, HungShard],
) -> None:
    node, hung = hung_store
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        readahead = pool.submit(node._prefetch, HUNG, "readahead")
        try:
            deadline = time.monotonic() + 20
            while (flight := node.in_flight(HUNG)) is None or flight["stage"] != "fetch":
                assert time.monotonic() < deadline, "the readahead never began the fetch"
                time.sleep(0.01)
            with pytest.raises(errors.AcquireTimeoutError) as info:
                node.acquire(HUNG, timeout=0.5)
            message = str(info.value)
            assert f"shard {HUNG} (part-0000{HUNG}.parquet)" in message, message
            assert "fetching its source bytes from the store since" in message, message
            assert "for readahead" in message, message
            assert not message.rstrip().endswith(":"), message
            assert not readahead.done()
        finally:
            hung.answer()  # else leaving the pool waits for the readahead for good
        assert readahead.result(30) == "inserted"
    # Resident now: the next acquire of it is handed it at once.
    node.acquire(HUNG, timeout=1).release()
    assert node.in_flight(HUNG) is None
