"""What this container may use: CPUs and memory from its cgroup, not the host's.

A pod limited to 2 CPUs on a 64-core node sees 64 cores in `os.cpu_count()`; sizing its
decoders from that runs 64 of them on 2 CPUs' worth of quota (throttled, and each
holding a decoded shard in memory against the pod's memory limit). The node cache's
fetch concurrency, when not set, is sized here (`fetch_concurrency`): one fetch and
decode per CPU the container may use, as many as its memory limit leaves room for
beside the memory tier's volume. The same room (`decode_room`) caps the node cache's
decode budget, which each decode reserves its peak in before it starts: the webhook
gives the sidecar 1Gi (its spec's limit) plus the run volume, whose tmpfs pages are
charged to the same cgroup, so decoding against the tier's limit instead (as it did)
got the sidecar OOM-killed, with nothing in its log, by shards that compress well.

cgroup v2 (`cpu.max`, `memory.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`,
`memory.limit_in_bytes`) are both read, for this process's own cgroup and every
ancestor visible under the mount (the tightest limit on the path is the one that
applies). Reading never fails: a file that is missing or unreadable is no limit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from shardcache.contract import variables

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Memory the sidecar process needs besides its decodes: the interpreter, pyarrow,
#: aiohttp and the manifest (about 200 MiB resident in the benchmarks), rounded up.
BASE_MEMORY_BYTES = 256 << 20
#: A shard's decoded bytes per source byte, guessed before any shard's metadata was
#: read (`fetch_concurrency` at start): Parquet tokens compress about 2-3x. Only a
#: guess: each decode then reserves its peak from its own metadata (`decode_peak`).
FETCH_MEMORY_FACTOR = 4
#: Anonymous memory a decode peaks at, as a multiple of the decoded size the shard's
#: metadata gives (`formats.decoded_size`). Measured (RSS high-water mark less the RSS
#: before, `formats.decoded_size` then `formats.decode` of one file, pyarrow 2026-11):
#: flat int64/float64/int32 columns, 4M rows, 83 MB by metadata: 2.55x in 4 row
#: groups, 2.85x in one (the column chunks read, the decoded columns and
#: `combine_chunks`' copy live at once); strings, 170 MB: 2.20x; list<int32> tokens,
#: 552 MB and 1.66 GB by metadata (a bound twice the decoded bytes, offsets at their
#: widest): 1.42x and 1.27x. Rounded up from the largest.
DECODE_PEAK_FACTOR = 3
#: v1 reports "no limit" as a huge number (the largest page-aligned long).
_V1_UNLIMITED = 1 << 62


@dataclasses.dataclass(frozen=True)
class Quota:
    """Limits found for this process; None where there is none."""

    #: CPUs the process may run on (its affinity mask).
    affinity: int
    #: CPUs' worth of time the cgroup quota allows (2.5 for "250000 100000").
    cpu_limit: float | None
    #: Bytes the cgroup may use.
    memory_limit: int | None

    @property
    def cpus(self) -> int:
        """Whole CPUs to size CPU-bound work for: the affinity, capped by the quota."""
        if self.cpu_limit is None:
            return self.affinity
        return max(1, min(self.affinity, math.ceil(self.cpu_limit)))


def read(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> Quota:
    """The limits that apply to this process (or, with other paths, to a test's tree)."""
    directories = _cgroup_dirs(root, proc_cgroup)
    cpu_limits = [c for d in directories if (c := _cpu_limit(d)) is not None]
    memory_limits = [m for d in directories if (m := _memory_limit(d)) is not None]
    return Quota(
        affinity=len(os.sched_getaffinity(0)),
        cpu_limit=min(cpu_limits) if cpu_limits else None,
        memory_limit=min(memory_limits) if memory_limits else None,
    )


def fetch_concurrency(quota: Quota, *, decoded_bytes: int, room: int | None) -> int:
    """Concurrent fetches and decodes for a container with `quota`.

    One per CPU, since a decode takes a core; fewer where the room to decode in
    (`decode_room`) holds fewer decode peaks of the largest shard (`decoded_bytes`, its
    decoded size or a guess of it) at once. Never below 1: one fetch at a time still
    makes progress. The decode budget, not this, keeps the decodes within the room.
    """
    workers = quota.cpus
    if room is not None:
        workers = min(workers, room // decode_peak(decoded_bytes))
    return max(1, workers)


def decode_peak(decoded_bytes: int) -> int:
    """Bytes a decode of a shard of `decoded_bytes` (by its metadata) peaks at."""
    return max(1, DECODE_PEAK_FACTOR * decoded_bytes)


def decode_room(quota: Quota, *, volume_bytes: int, base: int = BASE_MEMORY_BYTES) -> int | None:
    """Bytes this container may decode in: its memory limit less its memory volume's
    tmpfs pages (`volume_bytes`, charged to the same cgroup) and the process itself
    (`base`: `process_base()` where it can be measured). None without a memory limit;
    0 when nothing is left."""
    if quota.memory_limit is None:
        return None
    return max(0, quota.memory_limit - volume_bytes - base)


#: What the process may grow by beyond what it holds when its cache starts (readers'
#: state, connection buffers, metrics), within `process_base`.
GROWTH_BYTES = 64 << 20


def process_base(statm: Path = Path("/proc/self/statm")) -> int:
    """The process's own memory for `decode_room`: what it has resident now (the
    interpreter, pyarrow, aiohttp, the manifest: 100-150 MiB measured, a sidecar with
    8 ranks at 143 MB) plus `GROWTH_BYTES`, never more than `BASE_MEMORY_BYTES`, which
    is also the answer where /proc cannot say. The constant alone left no room at all
    to a sidecar given 256Mi (its decodes all refused), where it had served for
    sessions."""
    try:
        resident_pages = int(statm.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return BASE_MEMORY_BYTES
    return min(BASE_MEMORY_BYTES, resident_pages * os.sysconf("SC_PAGE_SIZE") + GROWTH_BYTES)


def volume_bytes(
    memory_tier_bytes: int, *, tmpfs_size: int | None, memory_limit: int | None
) -> int:
    """Bytes of the memory tier's volume to count against the memory limit.

    A tmpfs smaller than the memory limit is a sized volume (an emptyDir of medium
    Memory with a sizeLimit): its pages are charged to this cgroup, up to its size
    (`tmpfs_size`, None where the volume is no tmpfs). Otherwise the webhook's run
    volume (`contract.variables.run_volume_bytes` of the tier): a tmpfs as large as the
    limit has no size of its own (it may take half the node), and a disk's pages are
    page cache the kernel reclaims, so the webhook's size is the bound counted then.
    """
    if tmpfs_size is not None and (memory_limit is None or tmpfs_size < memory_limit):
        return tmpfs_size
    return variables.run_volume_bytes(memory_tier_bytes)


def tmpfs_size(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> int | None:
    """Bytes the tmpfs holding `path` holds in all; None where `path` is on another
    kind of filesystem or it cannot be told."""
    try:
        target = os.path.realpath(path)
        lines = mountinfo.read_text().splitlines()
        stat = os.statvfs(target)
    except OSError:
        return None
    best, kind = "", ""
    for line in lines:
        # "36 35 98:0 / /mnt rw,noatime shared:1 - tmpfs tmpfs rw,size=..." (proc(5)).
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount_point = fields[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, kind = mount_point, line.split(" - ", 1)[1].split()[0]
    return stat.f_blocks * stat.f_frsize if kind == "tmpfs" else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The directories whose limits apply: this process's cgroup and its ancestors,
    under the v2 mount and under each v1 controller mount; the root itself last."""
    found: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        # v2 is "0::/path"; v1 lines name their controllers ("4:cpu,cpuacct:/path").
        bases = [root] if not controllers else [root / c for c in _v1_dirs(controllers)]
        for base in bases:
            current = base / rel.lstrip("/")
            # Inside a container's cgroup namespace the path is "/" and the mount is
            # the container's own cgroup; outside it, walk up to the mount.
            while True:
                found.append(current)
                if current == base:
                    break
                current = current.parent
    found.append(root)
    found.extend(root / c for c in ("cpu", "cpu,cpuacct", "memory"))
    return list(dict.fromkeys(found))


def _v1_dirs(controllers: str) -> list[str]:
    names = controllers.split(",")
    # The mount is named after the controller list ("cpu,cpuacct") with a link per
    # controller ("cpu"); either may exist.
    return [controllers, *names]


def _cpu_limit(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota = _read(directory / "cpu.cfs_quota_us")
    period = _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _memory_limit(directory: Path) -> int | None:
    for name in ("memory.max", "memory.limit_in_bytes"):
        text = _read(directory / name)
        if text is None:
            continue
        try:
            value = int(text)
        except ValueError:
            return None  # "max": unlimited
        return value if 0 < value < _V1_UNLIMITED else None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
