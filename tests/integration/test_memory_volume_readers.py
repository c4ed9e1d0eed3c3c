"""Eight ranks on a run volume the webhook sized, and the shards they keep mapped.

A rank keeps the batch it last used while it asks for the next (`for b in
ds.batches(n)`). That batch was a zero-copy slice that mapped its whole shard; once the
tier evicted that shard its pages stayed in the volume beyond the tier's limit. Eight
ranks held eight shards, more than the volume's room over the limit: every insert
waited for readers to unmap and every reader waited in an acquire, 300 s, then
CacheError (explorer report D1). Block mode now hands out the batch that ends a shard
before the next acquire as a copy (`datasets.Dataset._sliced`), so the plain loop maps
nothing evicted while it waits. A rank that keeps more than its batch in hand (here:
the previous batch too) still maps an evicted shard; the sidecar fails such waiting
acquires within seconds with what the volume needs
(`caches.CacheNode._volume_cycle_check`). Root only (tmpfs).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_operator import pod_volumes

from shardcache import contract
from shardcache.node import volume_cycles
from tests.support import datasets, mounts
from tests.support.sidecar import SidecarProcess

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

RANKS = 8
#: 24 shards of ~1 MiB decoded through a 4 MiB tier on a 5 MiB volume: 8 ranks each
#: mapping one evicted shard need 8 MiB beyond the tier's files.
SHARDS = [15_000] * 24
TIER_BYTES = 4 << 20
#: The tier's wait for room: what the ranks waited before the fix.
WAIT_S = 300

RANK = r"""
import json, sys, shardcache
rank, world, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ds = shardcache.open(rank=rank, world_size=world, seed=1)
uids = []
try:
    for b in ds.batches(batch_size=256):
        uids.extend(b.column("uid").to_pylist())
    result = {"uids": uids}
except Exception as e:
    result = {"uids": uids, "error": f"{type(e).__name__}: {e}"}
# A file, not a pipe: a rank blocked writing to a full pipe would keep its mappings.
with open(out, "w") as f:
    json.dump(result, f)
"""

#: A rank of a job whose ranks step together: one that read its last batch waits for
#: the others (here at a barrier of files; in training, a collective), holding batches
#: and asking for nothing. A rank that failed exits, as a crashed rank would. The batch
#: that ends a shard is a copy, so each rank keeps zero-copy batches on purpose (argv
#: 4): "previous", its loader keeps the previous batch in hand too, which maps the
#: shard it leaves while it asks for the next; "last-shard", it keeps the batches of
#: its last shard (the plain loop before: it meets no cycle while it reads).
RANK_THEN_BARRIER = r"""
import collections, json, os, sys, time, shardcache
rank, world, out, keep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
ds = shardcache.open(rank=rank, world_size=world, seed=1)
runs = ds.runs()
tail = 0
for run in reversed(runs):
    if run.shard != runs[-1].shard:
        break
    tail += len(run)
uids = []
kept = collections.deque(maxlen=2 if keep == "previous" else None)
try:
    for b in ds.batches(batch_size=256):
        if keep == "previous" or len(uids) >= len(ds) - tail:
            kept.append(b)
        uids.extend(b.column("uid").to_pylist())
except Exception as e:
    with open(out, "w") as f:
        json.dump({"uids": uids, "error": f"{type(e).__name__}: {e}"}, f)
    sys.exit(0)
with open(out, "w") as f:
    json.dump({"uids": uids}, f)
here = os.path.dirname(out)
while sum(os.path.exists(os.path.join(here, f"{r}.json")) for r in range(world)) < world:
    time.sleep(0.2)  # zero-copy batches in `kept` stay mapped meanwhile
"""


@pytest.mark.timeout(240)
def test_ranks_holding_their_last_batch_on_a_volume_sized_from_the_tier_read_every_row_once(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}", env={contract.ENV_MEMORY_LIMIT: str(TIER_BYTES)})
    volume = pod_volumes.run_volume_bytes(TIER_BYTES)
    results: list[dict[str, object]] = []
    with mounts.tmpfs(proc.run_dir, volume):
        try:
            proc.start(wait="ready")
            env = {**os.environ, **proc.client_env()}
            began = time.monotonic()
            ranks = [
                subprocess.Popen(
                    [sys.executable, "-c", RANK, str(r), str(RANKS), str(tmp_path / f"{r}.json")],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for r in range(RANKS)
            ]
            try:
                for r, p in enumerate(ranks):
                    p.wait(timeout=max(1.0, began + 90 - time.monotonic()))
                    results.append(json.loads((tmp_path / f"{r}.json").read_text()))
            finally:
                for p in ranks:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            took = time.monotonic() - began
        finally:
            proc.kill()
    # The batch a rank holds while it waits for its next shard maps no shard the
    # tier evicted: no cycle, no error, and well inside the tier's wait for room.
    failed = [str(r["error"]) for r in results if "error" in r]
    assert not failed, failed
    uids = [u for r in results for u in r["uids"]]  # type: ignore[attr-defined]
    seen = collections.Counter(uids)
    assert max(seen.values(), default=1) == 1, "a row was read twice"
    assert len(seen) == sum(SHARDS)
    assert took < WAIT_S / 3, took


@pytest.mark.timeout(240)
def test_ranks_that_wait_for_the_others_holding_zero_copy_batches_do_not_hide_the_cycle(
    sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    # Explorer's merged run: 3 of 8 ranks waited out the tier's 300 s while 2 that had
    # read everything kept their last batches mapped, waiting on something else (a
    # pipe): "every reader waits in an acquire" never came true again. Each such
    # stall now ends after `IDLE_GRACE_S`; ranks that failed exit and the rest may
    # stall again, so this waits for the first such failure only. The first EARLY
    # ranks read everything before the others start, then keep their last shard
    # mapped; the others keep the shard they leave mapped while they wait for the
    # next (the plain loop maps nothing then: a copy ends each shard), so any cycle
    # that follows is the partial one (started together, all eight could meet the
    # whole cycle first: CI's run on d6ae008).
    root = tmp_path / "ds"
    datasets.write_dataset(pafs.LocalFileSystem(), str(root), SHARDS)
    proc = sidecar_factory(f"file://{root}", env={contract.ENV_MEMORY_LIMIT: str(TIER_BYTES)})
    volume = pod_volumes.run_volume_bytes(TIER_BYTES)
    outs = tmp_path / "out"
    outs.mkdir()
    results: dict[int, dict[str, object]] = {}
    with mounts.tmpfs(proc.run_dir, volume):
        try:
            proc.start(wait="ready")
            env = {**os.environ, **proc.client_env()}

            def rank(r: int) -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        RANK_THEN_BARRIER,
                        str(r),
                        str(RANKS),
                        str(outs / f"{r}.json"),
                        "last-shard" if r < EARLY else "previous",
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )

            ranks = [rank(r) for r in range(EARLY)]
            try:
                early_by = time.monotonic() + 60
                while not all((outs / f"{r}.json").exists() for r in range(EARLY)):
                    assert time.monotonic() < early_by, "the early ranks did not finish"
                    assert all(p.poll() is None for p in ranks), "an early rank exited"
                    time.sleep(0.2)
                deadline = time.monotonic() + volume_cycles.IDLE_GRACE_S + 45
                ranks += [rank(r) for r in range(EARLY, RANKS)]
                while len(results) < RANKS and time.monotonic() < deadline:
                    for r in range(RANKS):
                        # Read again until whole: a rank may be writing it.
                        if r not in results and (outs / f"{r}.json").exists():
                            with contextlib.suppress(ValueError):
                                results[r] = json.loads((outs / f"{r}.json").read_text())
                    if any(IDLE_WORDS in str(r.get("error", "")) for r in results.values()):
                        break
                    time.sleep(0.5)
            finally:
                for p in ranks:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            # What stays for someone who finds the ranks gone: the count and the error.
            stats = proc.control("GET", "/v1/status")[1]["stats"]
        finally:
            proc.kill()
    uids = [u for r in results.values() for u in r["uids"]]  # type: ignore[attr-defined]
    seen = collections.Counter(uids)
    assert max(seen.values(), default=1) == 1, "a row was read twice"
    # By rank: an early one (below EARLY) that failed met a cycle before the others.
    errors = {r: str(res["error"]) for r, res in results.items() if "error" in res}
    failed = list(errors.values())
    if len(results) == RANKS and not failed:
        assert len(seen) == sum(SHARDS)
        return
    # Stuck ranks got the error within the idle grace, not the tier's 300 s, and
    # in its partial form: the early ranks never asked again.
    assert any(IDLE_WORDS in e for e in failed), (len(results), errors)
    assert not any("every reader waits" in e for e in failed), errors
    assert stats["volume_cycles"] >= len(failed), stats
    last = stats["last_volume_cycle"]
    assert any(last["error"] in e for e in failed), (last, errors)
    for error in failed:
        assert "cannot hold what its" in error, error
        assert f"({volume} bytes)" in error, error
        assert "shards the tier evicted that readers still map" in error, error
        assert "The volume needs at least" in error, error


IDLE_WORDS = "gave back no room"
#: Ranks that read all their shards, and then hold their last shard's batches, before the
#: rest start. One: a second early rank could meet the partial cycle while the first
#: held its last shard (it then waited out the idle grace before the rest started).
EARLY = 1
