"""Whether a pod's ranks can hold their sample-shuffle windows in the memory tier.

In sample mode every reader holds the shards of its current and next window in the
memory tier (docs/reading-plan.md, "A memory tier too small for the readers'
windows"). When a pod's ranks together need more than `spec.cache.memory`, their
sidecar fails their reads a few seconds into the epoch. The webhook knows, before the
pod runs, what the sidecar only learns then: the accelerators the pod asks for (a
launcher such as torchrun starts a rank per device) and the mount's pinned totals. So
admission says it, as a warning on the pod's creation: not a refusal, since the figure
is an estimate from averages and a pod may run fewer ranks than it has devices.
Pure functions of the pod, the spec and the status.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardcache import errors, plans, windows
from shardcache_operator import injection, specs

#: Extended resources that name one accelerator each: a rank per unit.
ACCELERATORS = frozenset(
    {
        "nvidia.com/gpu",
        "amd.com/gpu",
        "gpu.intel.com/i915",
        "gpu.intel.com/xe",
        "google.com/tpu",
        "habana.ai/gaudi",
        "aws.amazon.com/neuron",
        "aws.amazon.com/neuroncore",
    }
)


def accelerators(pod: Mapping[str, Any]) -> int:
    """Accelerators the pod's containers ask for (their limits, else their requests;
    the API server keeps the two equal for extended resources). 0 when none."""
    total = 0
    # Fields of the wrong type count nothing here: the injection refuses such a pod
    # naming the field (`admission.admit`).
    for container in _items(_field(pod, "spec"), "containers"):
        resources = _field(container, "resources")
        asked = {**_field(resources, "requests"), **_field(resources, "limits")}
        for name, amount in asked.items():
            if name in ACCELERATORS:
                total += _count(amount)
    return total


def _field(obj: object, key: str) -> Mapping[str, Any]:
    value = obj.get(key) if isinstance(obj, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _items(obj: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = obj.get(key)
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def local_ranks(pod: Mapping[str, Any]) -> tuple[int, str]:
    """How many ranks read through the pod's sidecar, and how that was found: the
    annotation `shardcache.io/local-ranks`, else one per accelerator the pod asks for,
    else one. InputError for an annotation that is not a positive integer."""
    annotations = _field(_field(pod, "metadata"), "annotations")
    given = injection.positive_annotation(annotations, injection.ANNOTATION_LOCAL_RANKS)
    if given is not None:
        return given, f"as its {injection.ANNOTATION_LOCAL_RANKS} annotation says"
    devices = accelerators(pod)
    if devices > 1:
        return devices, "one per accelerator the pod asks for"
    return 1, ""


def _count(amount: object) -> int:
    """Units of an extended resource: a whole number, as int or string. Anything else
    the API server would have refused; it counts none here."""
    try:
        return specs.parse_quantity(amount, path="accelerators")
    except errors.InputError:
        return 0


@dataclasses.dataclass(frozen=True)
class Room:
    """A sample-mode mount's windows against its memory tier."""

    #: What one rank holds at once, estimated (`windows.estimated_reader_bytes`), every
    #: source of a mixture together.
    per_rank: int
    #: Every source's bytes: ranks never hold more than the whole dataset.
    total: int
    #: spec.cache.memory.
    memory: int

    def needed(self, ranks: int) -> int:
        return min(self.total, ranks * self.per_rank)

    def fits(self, ranks: int) -> bool:
        return self.needed(ranks) <= self.memory


def room(spec: specs.DatasetMountSpec, status: Mapping[str, Any]) -> Room | None:
    """The mount's `Room`, or None where no window applies: not sample mode, or no
    pinned totals yet for spec.source or one of spec.mixture's sources (a mount not
    Ready is not injected). Pins in `status.mixture` of sources the spec no longer
    names count nothing."""
    sharding = spec.sharding
    if not (sharding.shuffle and sharding.granularity == plans.SAMPLE):
        return None
    per_rank = total = 0
    for pin in [status, *_mixture_pins(spec, status)]:
        counts = _totals(pin)
        if counts is None:
            return None
        shards, rows, nbytes = counts
        per_rank += windows.estimated_reader_bytes(
            shards=shards, rows=rows, nbytes=nbytes, window=sharding.window
        )
        total += nbytes
    return Room(per_rank=per_rank, total=total, memory=spec.cache.memory)


def _totals(pin: Mapping[str, Any]) -> tuple[int, int, int] | None:
    """A pin's shards, rows and bytes; None when one is missing."""
    counts = [pin.get(key) for key in ("shards", "rows", "bytes")]
    whole = [c for c in counts if isinstance(c, int) and not isinstance(c, bool)]
    if len(whole) != len(counts):
        return None
    shards, rows, nbytes = whole
    return shards, rows, nbytes


def _mixture_pins(
    spec: specs.DatasetMountSpec, status: Mapping[str, Any]
) -> list[Mapping[str, Any]]:
    """The pin of each of spec.mixture's sources, by name; an empty one for a source
    without. A status written before the spec dropped a source may still list it."""
    if spec.mixture is None:
        return []
    pinned = status.get("mixture")
    by_name = {
        entry.get("name"): entry
        for entry in (pinned if isinstance(pinned, list) else [])
        if isinstance(entry, Mapping)
    }
    return [by_name.get(source.name, {}) for source in spec.mixture.sources]


def warning(
    where: str,
    spec: specs.DatasetMountSpec,
    status: Mapping[str, Any],
    pod: Mapping[str, Any],
) -> str | None:
    """What to tell the pod's creator when its ranks' windows do not fit, else None.
    InputError for a malformed local-ranks annotation, whatever the mount's mode."""
    ranks, how = local_ranks(pod)
    found = room(spec, status)
    if found is None:
        return None
    if found.fits(ranks):
        return None
    fmt = specs.format_bytes
    who = f"{ranks} ranks, {how}, need" if ranks > 1 else "one rank needs"
    aside = (
        f" (a pod that reads with one process for all its accelerators runs one rank: "
        f'say so with the annotation {injection.ANNOTATION_LOCAL_RANKS}: "1")'
        if how.startswith("one per accelerator")
        else ""
    )
    return (
        f"{where} shuffles samples: a rank holds the shards of its current and next "
        f"{spec.sharding.window:,}-row window in the memory tier, about {fmt(found.per_rank)} "
        f"or more (the source's size; decoded rows can take more); {who} about "
        f"{fmt(found.needed(ranks))}, over spec.cache.memory ({fmt(found.memory)}): their "
        "reads would fail. Raise spec.cache.memory to at least "
        f"{fmt(found.needed(ranks))}, lower spec.sharding.window, or read with "
        f"granularity block (docs/reading-plan.md){aside}"
    )


def capacity(
    spec: specs.DatasetMountSpec, status: Mapping[str, Any]
) -> tuple[str, str, str] | None:
    """An Event (type, reason, message) saying how many ranks a pod's memory tier holds
    the windows of, for a Ready sample-mode mount whose dataset it does not hold whole;
    else None. A Warning when it cannot hold one rank's."""
    found = room(spec, status)
    if found is None or found.total <= found.memory:
        return None
    fmt = specs.format_bytes
    each = (
        f"the current and next {spec.sharding.window:,}-row window of a rank take about "
        f"{fmt(found.per_rank)} or more (the source's size)"
    )
    ranks = found.memory // max(1, found.per_rank)
    if ranks < 1:
        return (
            "Warning",
            "SampleWindowsDoNotFit",
            f"spec.cache.memory ({fmt(found.memory)}) cannot hold one rank's sample-shuffle "
            f"windows: {each}, so reads in sample mode would fail. Raise spec.cache.memory "
            f"to at least {fmt(found.per_rank)}, lower spec.sharding.window, or read with "
            "granularity block (docs/reading-plan.md)",
        )
    return (
        "Normal",
        "SampleWindows",
        f"spec.cache.memory ({fmt(found.memory)}) holds the sample-shuffle windows of "
        f"about {ranks} rank{'s' if ranks > 1 else ''} a pod: {each}; a pod with more local "
        "ranks needs more (docs/reading-plan.md)",
    )
