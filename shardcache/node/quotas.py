"""What this container may use: CPUs and memory from its cgroup, not the host's.

A pod limited to 2 CPUs on a 64-core node sees 64 cores in `os.cpu_count()`; sizing its
decoders from that runs 64 of them on 2 CPUs' worth of quota (throttled, and each
holding a decoded shard in memory against the pod's memory limit). The node cache's
fetch concurrency, when not set, is sized here (`fetch_concurrency`): one fetch and
decode per CPU the container may use, as many as its memory limit leaves room for
beside the memory tier.

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

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Memory the sidecar process needs besides its decodes: the interpreter, pyarrow,
#: aiohttp and the manifest (about 200 MiB resident in the benchmarks), rounded up.
BASE_MEMORY_BYTES = 256 << 20
#: Memory one fetch and decode holds, as a multiple of the source shard's size: the
#: source bytes read, and the decoded batch (uncompressed Arrow; Parquet tokens
#: compress about 2-3x) before it is written to the memory tier.
FETCH_MEMORY_FACTOR = 4
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


def fetch_concurrency(quota: Quota, *, shard_bytes: int, memory_tier_bytes: int) -> int:
    """Concurrent fetches and decodes for a container with `quota`.

    One per CPU, since a decode takes a core; fewer where the memory limit, less the
    memory tier (tmpfs pages are charged to the container that writes them) and the
    process itself, holds fewer decodes of the largest shard (`shard_bytes`, source
    size) at once. Never below 1: one fetch at a time still makes progress.
    """
    workers = quota.cpus
    if quota.memory_limit is not None:
        spare = quota.memory_limit - memory_tier_bytes - BASE_MEMORY_BYTES
        per_fetch = max(1, FETCH_MEMORY_FACTOR * shard_bytes)
        workers = min(workers, spare // per_fetch)
    return max(1, workers)


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
