"""Fetch concurrency follows the container's cgroup limits, not the host's cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardcache.node import quotas

MiB = 1 << 20
GiB = 1 << 30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_cgroup_v2_cpu_max_and_memory_max_of_the_own_cgroup(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/kubepods/pod1/c1")
    write(tmp_path / "cg" / "kubepods" / "pod1" / "c1" / "cpu.max", "200000 100000")
    write(tmp_path / "cg" / "kubepods" / "pod1" / "c1" / "memory.max", str(3 * GiB))
    quota = quotas.read(tmp_path / "cg", tmp_path / "proc")
    assert (quota.cpu_limit, quota.memory_limit) == (2.0, 3 * GiB)
    assert quota.cpus == min(2, len(os.sched_getaffinity(0)))


def test_an_ancestors_tighter_limit_applies(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/pod/c")
    write(tmp_path / "cg" / "pod" / "c" / "cpu.max", "max 100000")
    write(tmp_path / "cg" / "pod" / "cpu.max", "150000 100000")
    write(tmp_path / "cg" / "pod" / "c" / "memory.max", "max")
    write(tmp_path / "cg" / "pod" / "memory.max", str(GiB))
    quota = quotas.read(tmp_path / "cg", tmp_path / "proc")
    assert (quota.cpu_limit, quota.memory_limit) == (1.5, GiB)
    assert quota.cpus == min(2, len(os.sched_getaffinity(0)))  # 1.5 CPUs: two threads


def test_a_container_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/")
    write(tmp_path / "cg" / "cpu.max", "100000 100000")
    assert quotas.read(tmp_path / "cg", tmp_path / "proc").cpu_limit == 1.0


def test_cgroup_v1_cfs_quota_and_memory_limit(tmp_path: Path) -> None:
    write(tmp_path / "proc", "5:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc")
    cpu = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    write(cpu / "cpu.cfs_quota_us", "400000")
    write(cpu / "cpu.cfs_period_us", "100000")
    write(tmp_path / "cg" / "memory" / "docker" / "abc" / "memory.limit_in_bytes", str(8 * GiB))
    # v1's "no limit" at the root is a huge number, not a limit.
    write(tmp_path / "cg" / "memory" / "memory.limit_in_bytes", str(9223372036854771712))
    quota = quotas.read(tmp_path / "cg", tmp_path / "proc")
    assert (quota.cpu_limit, quota.memory_limit) == (4.0, 8 * GiB)


def test_no_cgroup_files_means_no_limits(tmp_path: Path) -> None:
    quota = quotas.read(tmp_path / "none", tmp_path / "missing")
    assert (quota.cpu_limit, quota.memory_limit) == (None, None)
    assert quota.cpus == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("affinity", "cpu_limit", "memory_limit", "expected"),
    [
        # A 2-CPU pod on a 16-core host runs two decoders, not sixteen.
        (16, 2.0, None, 2),
        (16, None, None, 16),
        (4, 16.0, None, 4),
        # The memory limit, less the memory volume and the process, holds 3 decode peaks
        # of a shard of 64 MiB decoded (3 x 64 MiB each).
        (16, None, GiB + 256 * MiB + 3 * 3 * 64 * MiB + MiB, 3),
        # Even a pod with no room to spare fetches one at a time.
        (16, 8.0, GiB, 1),
    ],
)
def test_fetch_concurrency_is_the_cpu_quota_capped_by_memory(
    affinity: int, cpu_limit: float | None, memory_limit: int | None, expected: int
) -> None:
    quota = quotas.Quota(affinity=affinity, cpu_limit=cpu_limit, memory_limit=memory_limit)
    room = quotas.decode_room(quota, volume_bytes=GiB)
    got = quotas.fetch_concurrency(quota, decoded_bytes=64 * MiB, room=room)
    assert got == expected
