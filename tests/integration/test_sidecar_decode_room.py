"""A sidecar under the webhook's memory limit is never OOM-killed by its decodes.

The webhook gives the sidecar its spec's limit (1Gi by default) plus the run volume,
whose tmpfs pages are charged to the same cgroup. Decodes budgeted against the memory
tier's limit (as they were) and fetches sized from 4 x the source got the sidecar
OOM-killed during warm-up by shards that compress well, with nothing in its log, and a
native sidecar crash-loops on the same shards (explorer D2). Here the sidecar runs in a
real cgroup v1 memory group of `1Gi + run_volume_bytes(tier)` on a tmpfs run volume of
`run_volume_bytes(tier)`, as in a pod: it becomes ready, or stays up and says why not,
and the kernel never kills it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardcache import errors, plans, sidecar_client
from shardcache.contract import variables
from shardcache.node import quotas
from tests.support import mounts
from tests.support.sidecar import SidecarProcess

MiB = 1 << 20
GiB = 1 << 30
CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
#: Shards of token lists (64 int32 each): 3M rows decode to 804 MB (over a third of the
#: whole limit) from 20 MB of Parquet, 40x: the explorer's data set. Smaller shards
#: (2M rows, a 1.5Gi tier) did not get the old code killed, the kernel reclaimed enough.
TOKENS = 64
BIG_ROWS = 3_000_000
#: The default DatasetMount's memory tier (2Gi): the webhook's default sizing.
TIER = variables.MEMORY_LIMIT.required_default
READY_WITHIN_S = 90.0


def _writable_memory_cgroup() -> str | None:
    """Why this machine cannot run the test, or None."""
    if os.geteuid() != 0:
        return "a memory cgroup and a tmpfs mount need root"
    probe = CGROUP_MEMORY / f"shardcache-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"no writable cgroup v1 memory controller at {CGROUP_MEMORY} ({exc})"
    return None


_CANNOT = _writable_memory_cgroup()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT)),
]


def write_token_shards(root: Path, rows: int, shards: int) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        offsets = pa.array(np.arange(0, (rows + 1) * TOKENS, TOKENS, dtype=np.int32))
        values = pa.array(np.tile(np.arange(TOKENS, dtype=np.int32), rows))
        table = pa.table(
            {
                "uid": np.arange(i * rows, (i + 1) * rows, dtype=np.int64),
                "tokens": pa.ListArray.from_arrays(offsets, values),
            }
        )
        pq.write_table(table, root / f"part-{i:05d}.parquet")
    return f"file://{root}"


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    group = CGROUP_MEMORY / f"shardcache-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit))
        yield group
    finally:
        for _ in range(50):  # the killed sidecar leaves the group a moment later
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def readyz(proc: SidecarProcess, group: Path) -> tuple[int, object]:
    """/readyz's answer; a sidecar that stopped answering must not have died."""
    try:
        return proc.http_get("/readyz")
    except OSError as exc:
        time.sleep(0.5)  # the kernel's kill, then the exit
        assert proc.running, f"the sidecar died (oom_kill {oom_kills(group)}):\n{proc.log_tail()}"
        return 0, str(exc)


def test_shards_decoding_past_the_room_are_refused_with_a_reason_not_oom_killed(
    tmp_path: Path,
) -> None:
    uri = write_token_shards(tmp_path / "data", BIG_ROWS, 2)
    volume = variables.run_volume_bytes(TIER)
    limit = GiB + volume  # sidecar_container._limits: the spec's 1Gi + the run volume
    workdir = tmp_path / "w"
    with memory_cgroup(limit) as group, mounts.tmpfs(workdir / "run", volume):
        proc = SidecarProcess(uri, workdir=workdir, env={variables.MEMORY_LIMIT.env: str(TIER)})
        proc.command_prefix = [
            "sh", "-c", f'echo $$ > {group}/cgroup.procs; exec "$@"', "in-cgroup",
        ]  # fmt: skip
        try:
            proc.start(wait="healthy")
            deadline = time.monotonic() + READY_WITHIN_S
            status, body = readyz(proc, group)
            while status != 200 and "refused before decoding" not in str(body):
                assert time.monotonic() < deadline, f"/readyz: {status} {body}\n{proc.log_tail()}"
                time.sleep(0.2)
                status, body = readyz(proc, group)
            assert proc.running, proc.log_tail()
            assert oom_kills(group) == 0, proc.log_tail()
            # Not ready, and the reason says what does not fit and what to raise.
            assert status == 503, body
            reason = str(body)
            assert "spec.sidecar.resources.limits.memory" in reason, reason
            # The room: the limit less the volume and the process (what it held at
            # start plus the growth allowed, at most the constant).
            budget = re.search(r"decode budget of (\d+) bytes", reason)
            assert budget, reason
            room = int(budget.group(1))
            assert (
                limit - volume - quotas.BASE_MEMORY_BYTES
                <= room
                <= limit - volume - quotas.GROWTH_BYTES
            ), reason
            # A trainer reading the shard gets the same error at once (kind=cache), not
            # a sidecar that vanished under it.
            provider = sidecar_client.SidecarProvider.from_env(
                environ=proc.client_env(), reconnect_timeout=30.0
            )
            try:
                reader = provider.open_reader(plans.PlanParams(seed=1), position=0)
                with pytest.raises(errors.CacheError) as caught:
                    provider.acquire(reader, 0, epoch=0, position=0)
                message = str(caught.value)
                assert "part-00000.parquet" in message, message  # which shard
                assert "refused before decoding" in message, message
                assert "spec.sidecar.resources.limits.memory" in message, message
            finally:
                provider.close()
            assert proc.running and oom_kills(group) == 0, proc.log_tail()
        finally:
            proc.kill()


def test_shards_that_fit_the_room_are_decoded_and_the_sidecar_becomes_ready(
    tmp_path: Path,
) -> None:
    """The room refuses only what cannot fit: flat shards of 192 MB decoded (a peak of
    3x is 576 MB, within 768 MiB) warm up one decode at a time, without a kill."""
    root = tmp_path / "data"
    root.mkdir()
    rows = 8_000_000
    for i in range(2):
        uid = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        pq.write_table(
            pa.table({"uid": uid, "a": uid * 3, "b": uid % 1000}), root / f"part-{i}.parquet"
        )
    volume = variables.run_volume_bytes(TIER)
    limit = GiB + volume
    workdir = tmp_path / "w"
    with memory_cgroup(limit) as group, mounts.tmpfs(workdir / "run", volume):
        proc = SidecarProcess(
            f"file://{root}", workdir=workdir, env={variables.MEMORY_LIMIT.env: str(TIER)}
        )
        proc.command_prefix = [
            "sh", "-c", f'echo $$ > {group}/cgroup.procs; exec "$@"', "in-cgroup",
        ]  # fmt: skip
        try:
            proc.start(wait="healthy")
            deadline = time.monotonic() + READY_WITHIN_S
            status, body = readyz(proc, group)
            while status != 200:
                assert "refused" not in str(body), body
                assert time.monotonic() < deadline, f"/readyz: {status} {body}\n{proc.log_tail()}"
                time.sleep(0.2)
                status, body = readyz(proc, group)
            assert "first 2 shard(s)" in str(body), body
            assert oom_kills(group) == 0, proc.log_tail()
        finally:
            proc.kill()
