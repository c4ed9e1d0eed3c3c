"""What `make bench-operator` reads while it runs: process CPU and memory from /proc,
the API server's own metrics, and client-side latencies.

The operator's API requests are counted by the API server itself: the benchmark adds a
FlowSchema that matches only the operator's ServiceAccount (same priority level as the
built-in `service-accounts` schema, so API priority and fairness treats it as before)
and reads `apiserver_flowcontrol_dispatched_requests_total` for it. Nothing else in the
cluster uses that identity, so the count is exact: watches, reads, patches, Events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import kubernetes.client

# The scheduler's count in nanoseconds, not /proc's 10 ms ticks: a burst's operator CPU
# is a few hundred milliseconds, which ticks round by several percent.
from bench.node_probes import children
from bench.node_probes import cpu_seconds as cpu_seconds

FLOW_SCHEMA = "shardcache-bench-operator"
#: The API server's webhook-call histogram (seconds) and our webhook's name in the chart.
WEBHOOK_HISTOGRAM = "apiserver_admission_webhook_admission_duration_seconds"
WEBHOOK_NAME = "inject.shardcache.io"

#: The control plane's processes a burst also costs, by their command name in
#: /proc/<pid>/comm (15 characters at most: kube-controller-manager is cut).
CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-scheduler", "kube-controller", "kwok")


def control_plane_cpu(cluster_dir: pathlib.Path) -> dict[str, float]:
    """CPU seconds so far of each control-plane process of the cluster in `cluster_dir`.

    Matched by command name and by a command line that names `cluster_dir` (their
    flags point at its pki and data), so another cluster on the machine (an e2e
    session in another checkout) is not counted. Where the labelled pods' cost lands
    beside the operator: the API server calling the webhook and storing a larger pod,
    etcd writing it, the scheduler and kwok handling it.
    """
    totals: dict[str, float] = {}
    marker = str(cluster_dir).encode()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/comm") as f:
                name = f.read().strip()
            if name not in CONTROL_PLANE:
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if marker not in f.read():
                    continue
            totals[name] = totals.get(name, 0.0) + cpu_seconds(int(entry.name))
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited between the listing and the read
    return totals


def with_children_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of `pid` itself, and of the processes it started, and theirs:
    the operator's read workers and its resolves' fork server with the resolve children
    forked from it (`read_workers`, `resolve_forkserver`), which do its reads of the
    tenants' stores and whose CPU `cpu_seconds(pid)` leaves out.

    A process that ended and was waited for is in its parent's `cutime` + `cstime`
    (`/proc/<pid>/stat`: the kernel adds an exited child's CPU, its own waited children's
    included, when its parent reaps it; clock ticks, 10 ms); a process still running is
    read by its own clock, and its own reaped children by its `cutime` + `cstime`. The
    reaped counts are read before the running processes: one reaped between the two
    reads is missed once (one resolve's or one read's CPU), never counted twice."""

    def descendants(of: int) -> float:
        total = 0.0
        for child in children(of):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                total += _reaped_seconds(child) + descendants(child) + cpu_seconds(child)
        return total

    reaped = _reaped_seconds(pid)
    return cpu_seconds(pid), reaped + descendants(pid)


def _reaped_seconds(pid: int) -> float:
    """CPU seconds of `pid`'s children that ended and were waited for."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    # Fields after the command name start at the state (field 3): cutime is field 16.
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def profiled(pid: int, path: pathlib.Path | None) -> Iterator[None]:
    """Sample the process's Python stacks with py-spy while the block runs (`--profile`).

    Collapsed stacks (one line per stack and its sample count) go to `path`; None, or
    no py-spy on PATH beside this interpreter: nothing. py-spy reads the process from
    outside (`--nonblocking`: never pauses it) but takes CPU of its own on a 2-core
    machine, so a profiled run's figures are not the benchmark's.
    """
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if path is None or spy is None:
        yield
        return
    command = [spy, "record", "--pid", str(pid), "--nonblocking", "--format", "raw",
               "--rate", "250", "--output", str(path)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # py-spy writes what it sampled on SIGINT
        proc.wait(timeout=60)


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def flow_schema(namespace: str, service_account: str) -> dict[str, Any]:
    """A FlowSchema matching only the operator's ServiceAccount (see the module doc)."""
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": FLOW_SCHEMA},
        "spec": {
            # Ahead of the built-in `service-accounts` schema (precedence 9000).
            "matchingPrecedence": 500,
            "priorityLevelConfiguration": {"name": "workload-low"},
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [
                        {
                            "kind": "ServiceAccount",
                            "serviceAccount": {"name": service_account, "namespace": namespace},
                        }
                    ],
                    "resourceRules": [
                        {
                            "verbs": ["*"],
                            "apiGroups": ["*"],
                            "resources": ["*"],
                            "clusterScope": True,
                            "namespaces": ["*"],
                        }
                    ],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                }
            ],
        },
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One read of the API server's /metrics."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    @classmethod
    def take(cls, admin: kubernetes.client.ApiClient) -> Scrape:
        response = admin.call_api("GET", f"{admin.configuration.host}/metrics")
        text = bytes(response.read()).decode()  # type: ignore[no-untyped-call]  # untyped in the kubernetes client
        samples = []
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            match = _SAMPLE.match(line)
            if match:
                labels = tuple(sorted(_LABEL.findall(match.group(2) or "")))
                samples.append((match.group(1), labels, float(match.group(3))))
        return cls(tuple(samples))

    def total(self, name: str, /, **labels: str) -> float:
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all((k, v) in have for k, v in labels.items())
        )

    def buckets(self, name: str, /, **labels: str) -> dict[float, float]:
        """Cumulative counts of a histogram by upper bound (+Inf as inf)."""
        result: dict[float, float] = {}
        for sample, have, value in self.samples:
            if sample != f"{name}_bucket" or not all((k, v) in have for k, v in labels.items()):
                continue
            bound = float(dict(have)["le"])
            result[bound] = result.get(bound, 0.0) + value
        return result


def pod_requests(scrape: Scrape) -> dict[str, float]:
    """The API server's requests on pods so far, by verb and subresource ("create",
    "patch status", ...), whoever made them: a burst's difference says how many writes
    and reads each pod caused (kwok's status updates, the scheduler's binding...)."""
    counts: dict[str, float] = {}
    for sample, have, value in scrape.samples:
        if sample != "apiserver_request_total":
            continue
        labels = dict(have)
        if labels.get("resource") != "pods":
            continue
        key = " ".join(x for x in (labels.get("verb", "?").lower(), labels.get("subresource")) if x)
        counts[key] = counts.get(key, 0.0) + value
    return counts


def operator_requests(scrape: Scrape) -> float:
    return scrape.total("apiserver_flowcontrol_dispatched_requests_total", flow_schema=FLOW_SCHEMA)


def operator_rejections(scrape: Scrape) -> float:
    """Requests of the operator that API priority and fairness answered with 429."""
    return scrape.total("apiserver_flowcontrol_rejected_requests_total", flow_schema=FLOW_SCHEMA)


def histogram_quantile(
    q: float, before: Mapping[float, float], after: Mapping[float, float]
) -> float:
    """Quantile (0..1) of the observations between two scrapes, interpolated linearly
    inside the bucket it falls in, as Prometheus' histogram_quantile does."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return float("nan")
    rank = q * counts[-1]
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return previous_bound
            share = (
                (rank - previous_count) / (count - previous_count) if count > previous_count else 0
            )
            return previous_bound + (bound - previous_bound) * share
        previous_bound, previous_count = bound, count
    return previous_bound
