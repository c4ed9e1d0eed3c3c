"""What `make bench-node` reads off the machine: usable cores, a process's CPU time and
memory, the sidecar's Prometheus counters.

Cores are those this process may use: its CPU affinity, capped by the cgroup's CPU
quota (a container limited to 2 CPUs on a 16-core host has 2), since that is what a
pod's sidecar and ranks get.
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
from pathlib import Path


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup's quota (v2 `cpu.max`, else v1 cfs), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cores() -> int:
    cores = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return cores


def cpu_seconds(pid: int, *, thread: int | None = None) -> float:
    """CPU seconds of `pid`, all its threads so far, those that exited too; of its
    thread `thread` alone if given (the main thread's id is the pid: the sidecar's event
    loop).

    Counted by the scheduler in nanoseconds: a warm pass here takes a few 10 ms clock
    ticks of the sidecar's CPU, so the ticks of `/proc/<pid>/stat` made its CPU per
    request a multiple of 10 ms over a few dozen requests. The process's count is its
    CPU clock (what `clock_getcpuclockid(pid)` names), which the kernel keeps whole
    across thread exits; a sum over `/proc/<pid>/task/*/schedstat` went backwards when a
    thread exited between two readings. A thread's own count is its schedstat, since
    Linux lets no other process read a thread's CPU clock.
    """
    if thread is not None:
        try:
            return _schedstat_seconds(pid, str(thread))
        except FileNotFoundError:
            return _ticks_seconds(pid, thread)
    try:
        return time.clock_gettime(_process_cpu_clock(pid))
    except OSError:  # not a process here any more, or a kernel without the clock
        return _ticks_seconds(pid, None)


def _process_cpu_clock(pid: int) -> int:
    # Linux's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED), the id clock_getcpuclockid
    # returns, which Python's time module does not wrap.
    return ((~pid) << 3) | 2


def _schedstat_seconds(pid: int, tid: str) -> float:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _ticks_seconds(pid: int, thread: int | None) -> float:
    """User + system CPU seconds from `/proc/<pid>/stat`, in clock ticks."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path) as f:
        # The command name (2nd field) may hold spaces; fields after ')' are fixed.
        fields = f.read().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            out.extend(
                int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            )
        except OSError:
            continue
    return out


def find_child(argv_part: str) -> int:
    """The pid of this process's child whose command line contains `argv_part`."""
    for pid in children(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if argv_part in cmdline:
            return pid
    raise LookupError(f"no child process runs {argv_part!r}")


def metrics(base_url: str) -> dict[str, float]:
    """The sidecar's /metrics as {'name{labels}': value} (samples only, no comments)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def control_requests(samples: dict[str, float], prefix: str) -> float:
    """Control requests served so far: `shardcache_control_requests_total` summed over
    the routes under `prefix` (the versioned data-plane routes, not probes or /metrics)."""
    return sum(
        value
        for name, value in samples.items()
        if name.startswith("shardcache_control_requests_total{") and f'route="{prefix}/' in name
    )


def memory_tier_bytes(samples: dict[str, float]) -> int:
    return int(samples.get('shardcache_cache_resident_bytes{tier="memory"}', 0))


def evictions(samples: dict[str, float]) -> int:
    return int(samples.get('shardcache_cache_evictions_total{tier="memory"}', 0))
