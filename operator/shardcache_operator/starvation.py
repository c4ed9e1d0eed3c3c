"""The DataStarved condition: is any pod of a DatasetMount waiting on its data?

Each trainer reports, through its sidecar, the share of its training loop spent waiting
for batches (`shardcache_reader_stall_fraction`, docs/monitoring.md). The operator reads
that gauge from the sidecars of a mount's running pods, the same /metrics endpoint
Prometheus scrapes, and sets DataStarved when a pod stays above the mount's
`spec.stall.thresholdPercent` for `spec.stall.forSeconds`; it clears when every pod is
back below. Why scraping and not a pod annotation the sidecar writes: the sidecar runs
under the tenant's ServiceAccount, which would need `patch pods` in its namespace (any
pod, there is no "own pod" rule), and every change would be an API write fanned out
to every pod watcher; scraping needs no tenant permission and no API write but the
condition's own transitions (docs/operator.md, "DataStarved").

Pure functions here (what a scrape says, what the condition becomes), plus the scrape
itself; the kopf timer in `handlers` only wires them to the API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import aiohttp

from shardcache_operator import injection, pod_updates, specs, status

logger = logging.getLogger(__name__)

CONDITION = status.DATA_STARVED
METRIC = "shardcache_reader_stall_fraction"
#: Seconds one sidecar's /metrics may take; a slow or gone pod is left out of a check,
#: never allowed to hold up the others.
SCRAPE_TIMEOUT_SECONDS = 3.0
#: Pods of one mount scraped at once.
SCRAPE_CONCURRENCY = 32
#: Bytes of one pod's /metrics answer read at most; a sidecar's is tens of KiB (a few
#: lines per reader and per route). The answer comes from the tenant's pod, whose own
#: containers share its network (a native sidecar of the pod author's, started before
#: the injected one, can take its port), so it is read in pieces and given up past
#: this, never buffered whole: an endless answer, read for the whole timeout, was
#: gigabytes in the operator's memory (limit 512Mi), whose restart stops the webhook
#: that admits every namespace's pods (docs/security.md).
SCRAPE_MAX_BYTES = 1024 * 1024
#: Bytes read from an answer at a time.
_SCRAPE_PIECE = 64 * 1024
#: Pods named in a condition message or an Event; the rest are counted.
NAMED_PODS = 10


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where one pod's sidecar for this mount serves /metrics."""

    pod: str
    url: str


def endpoint(pod: Mapping[str, Any], mount: str) -> Endpoint | None:
    """The /metrics URL of `pod`'s sidecar for `mount`; None while it has no IP, is not
    running, or has no sidecar for it (admitted without injection)."""
    metadata = pod.get("metadata") or {}
    state = pod.get("status") or {}
    ip = state.get("podIP")
    if state.get("phase") != "Running" or not ip:
        return None
    if mount not in injection.requested_mounts(metadata):
        return None
    # The injected sidecars only: a trainer container carries $SHARDCACHE_MOUNT too,
    # and its own ports (a trainer's metrics, a rendezvous) are no sidecar's /metrics.
    for container in pod_updates.injected_containers(pod).values():
        if pod_updates.served_mount(container) != mount:
            continue
        ports = container.get("ports") or []
        if ports and "containerPort" in ports[0]:
            host = f"[{ip}]" if ":" in ip else ip
            return Endpoint(
                str(metadata.get("name")), f"http://{host}:{ports[0]['containerPort']}/metrics"
            )
    return None


def worst_fraction(text: str) -> float | None:
    """The largest stall fraction of any reader in one /metrics exposition (None: no
    reader reported one yet)."""
    worst: float | None = None
    prefix = METRIC + "{"
    for line in text.splitlines():
        if not (line.startswith(prefix) or line.startswith(METRIC + " ")):
            continue
        try:
            value = float(line.rsplit(None, 1)[1])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value) and (worst is None or value > worst):
            worst = value
    return worst


@dataclasses.dataclass(frozen=True)
class Verdict:
    #: Pod -> when (monotonic seconds) it was first seen above the threshold.
    above_since: dict[str, float]
    #: Pods above the threshold for at least `forSeconds`, sorted.
    starved: tuple[str, ...]


def judge(
    previous: Mapping[str, float],
    fractions: Mapping[str, float | None],
    *,
    now: float,
    stall: specs.StallSpec,
    starved_before: bool = False,
) -> Verdict:
    """Which pods are starved, given each pod's worst stall fraction now (None: no
    answer or no reader). A pod must stay above the threshold across checks: one below,
    or one without an answer, starts its clock again. `starved_before`: the condition is
    True but no clock is known (a new leader): a pod above now counts as starved at once,
    so an operator restart does not clear the condition and set it again."""
    threshold = stall.threshold_percent / 100.0
    start = now - stall.for_seconds if starved_before and not previous else now
    above = {
        pod: previous.get(pod, start)
        for pod, fraction in fractions.items()
        if fraction is not None and fraction > threshold
    }
    starved = tuple(sorted(p for p, since in above.items() if now - since >= stall.for_seconds))
    return Verdict(above, starved)


def _named(pods: Sequence[str]) -> str:
    shown = ", ".join(pods[:NAMED_PODS])
    more = len(pods) - NAMED_PODS
    return f"{shown} and {more} more" if more > 0 else shown


def condition(starved: Sequence[str], stall: specs.StallSpec) -> status.Condition:
    if starved:
        return status.Condition(
            CONDITION,
            "True",
            "ReadersWaitingOnData",
            f"{len(starved)} pod(s) spent over {stall.threshold_percent}% of their training "
            f"loop waiting for data for {stall.for_seconds}s or more: {_named(starved)}. "
            "Check the cache hit ratio and source latency (docs/monitoring.md); a larger "
            "spec.prefetch.depth or cache.memory may help.",
        )
    return status.Condition(
        CONDITION,
        "False",
        "DataKeepsUp",
        f"no pod waits on data for more than {stall.threshold_percent}% of its loop",
    )


def conditions_with(
    previous: Iterable[Mapping[str, Any]], new: status.Condition, *, now: str
) -> tuple[list[dict[str, Any]], bool]:
    """status.conditions with DataStarved set to `new`; whether its status changed (a
    message that only lists other pods is updated too, without an Event). A mount that
    never starved gets no DataStarved condition at all."""
    kept = [dict(c) for c in previous if isinstance(c, Mapping)]
    old = next((c for c in kept if c.get("type") == CONDITION), None)
    if old is None and new.status == "False":
        # Absent until a pod first starves: no write for every mount with pods.
        return kept, False
    (merged,) = status.merge_conditions([old] if old else [], [new], now=now, generation=None)
    if old is not None and {k: old.get(k) for k in merged} == merged:
        return kept, False
    flipped = (old or {}).get("status", "False") != new.status
    return [c for c in kept if c.get("type") != CONDITION] + [merged], flipped


async def bounded_body(response: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The answer's body, or None when it is longer than `limit` bytes (said by its
    Content-Length, or found while reading): then at most `limit` plus one piece of it
    was ever in memory."""
    if response.content_length is not None and response.content_length > limit:
        return None
    pieces: list[bytes] = []
    size = 0
    async for piece in response.content.iter_chunked(_SCRAPE_PIECE):
        size += len(piece)
        if size > limit:
            return None
        pieces.append(piece)
    return b"".join(pieces)


async def scrape(
    session: aiohttp.ClientSession, endpoints: Sequence[Endpoint]
) -> dict[str, float | None]:
    """Each pod's worst stall fraction; None for one that did not answer in time."""
    gate = asyncio.Semaphore(SCRAPE_CONCURRENCY)

    async def one(ep: Endpoint) -> tuple[str, float | None]:
        async with gate:
            try:
                async with session.get(ep.url) as response:
                    if response.status != 200:
                        return ep.pod, None
                    body = await bounded_body(response, SCRAPE_MAX_BYTES)
                    if body is None:
                        logger.warning(
                            "DataStarved check: pod %s answered %s with more than %d bytes, "
                            "expected a sidecar's /metrics (tens of KiB); not read further, "
                            "counted as no answer",
                            ep.pod,
                            ep.url,
                            SCRAPE_MAX_BYTES,
                        )
                        return ep.pod, None
                    return ep.pod, worst_fraction(body.decode("utf-8"))
            except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
                return ep.pod, None

    found: dict[str, float | None] = {}
    for pod, fraction in await asyncio.gather(*(one(ep) for ep in endpoints)):
        worst = found.get(pod)
        if pod not in found or (fraction is not None and (worst is None or fraction > worst)):
            found[pod] = fraction
    return found
