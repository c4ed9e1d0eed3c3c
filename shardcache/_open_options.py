"""Checks of `shardcache.open()`'s options: each one's type and range, and the mode
that uses it.

Options arrive from notebooks and from configs turned into keyword arguments as often
as from typed code, so a wrong type fails here, naming what was expected and what was
found, instead of being coerced further down (`shuffle="no"` would read as True).
Ranges that the reading plan owns (rank, world size, epoch, block size) are checked by
`plans.PlanParams`; the cache's own sizes are checked here, with the bounds the sidecar
applies to the same settings.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Mapping

from shardcache import errors, plans, source

#: Options that configure a cache running in this process. Without a URI the pod's
#: sidecar runs the cache and its DatasetMount configures it: these would do nothing.
EMBEDDED_ONLY = (
    "cache_dir",
    "format",
    "memory_dir",
    "memory_limit",
    "disk_limit",
    "prefetch_depth",
    "fetch_concurrency",
    "storage_options",
    "retry",
)
#: Options that pick what the pod's sidecar serves; with a URI there is no sidecar.
SIDECAR_ONLY = ("mount",)


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one option accepts."""

    types: tuple[type, ...]
    #: Said in the error message, e.g. "an int >= 0".
    expected: str
    #: Smallest accepted value of a number, if bounded here.
    minimum: int | None = None
    #: Whether None (the option left out) is accepted.
    optional: bool = False


_PATH: tuple[type, ...] = (str, os.PathLike)
_BYTES = Kind((int,), "a byte count (an int >= 0)", minimum=0, optional=True)

#: Every option of `open()`, by parameter name.
KINDS: dict[str, Kind] = {
    "source_uri": Kind((str,), "a URI string such as 's3://bucket/prefix/'", optional=True),
    "cache_dir": Kind(_PATH, "a directory path (str or os.PathLike)", optional=True),
    "shuffle": Kind((bool, str), 'True, False, "block" or "sample"', optional=True),
    "seed": Kind((int,), "an int", optional=True),
    # Left out: an initialised torch.distributed group's, else $RANK/$WORLD_SIZE
    # (`shardcache.ranks.given_or_env`).
    "rank": Kind((int,), "an int", optional=True),
    "world_size": Kind((int,), "an int", optional=True),
    "epoch": Kind((int,), "an int"),
    "block_size": Kind((int,), "an int", optional=True),
    "window": Kind((int,), "a row count (an int >= 1)", minimum=1, optional=True),
    "format": Kind((str,), "a format name such as 'parquet'", optional=True),
    "digest": Kind((str,), "a manifest digest string", optional=True),
    "memory_dir": Kind(_PATH, "a directory path (str or os.PathLike)", optional=True),
    "memory_limit": _BYTES,
    "disk_limit": _BYTES,
    "prefetch_depth": Kind((int,), "a shard count (an int >= 0)", minimum=0, optional=True),
    "fetch_concurrency": Kind((int,), "an int >= 1", minimum=1, optional=True),
    "storage_options": Kind((Mapping,), "a mapping of str to str", optional=True),
    "retry": Kind((source.RetryPolicy,), "a shardcache.source.RetryPolicy", optional=True),
    "mount": Kind((str,), "a DatasetMount name", optional=True),
    "gather_threads": Kind(
        (int,), "a thread count (an int >= 0; 0 or 1 gathers inline)", minimum=0, optional=True
    ),
    "resume_from": Kind(
        (str, int, os.PathLike), '"latest", a step (int) or a checkpoint path', optional=True
    ),
}


def _found(value: object) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"


def check_value(name: str, value: object) -> None:
    """Raise InputError unless `value` is of the kind option `name` accepts."""
    kind = KINDS[name]
    if value is None and kind.optional:
        return
    # bool is an int to isinstance(); `rank=True` is a mistake, not rank 1.
    wrong_bool = isinstance(value, bool) and bool not in kind.types
    if wrong_bool or not isinstance(value, kind.types):
        raise errors.InputError(
            f"shardcache.open(): {name}: expected {kind.expected}, found {_found(value)}"
        )
    if name == "shuffle" and isinstance(value, str) and value not in plans.GRANULARITIES:
        raise errors.InputError(
            f"shardcache.open(): {name}: expected {kind.expected}, found {_found(value)}"
        )
    if kind.minimum is not None and isinstance(value, int) and value < kind.minimum:
        raise errors.InputError(
            f"shardcache.open(): {name}: expected {kind.expected}, found {value}"
        )
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str) or not isinstance(item, str):
                raise errors.InputError(
                    f"shardcache.open(): {name}: expected {kind.expected}, found the "
                    f"entry {_found(key)}: {_found(item)}"
                )


def check_mode(options: Mapping[str, object]) -> None:
    """Raise InputError naming every given option that the chosen mode does not use."""
    uri = options.get("source_uri")
    if uri is None:
        refused = [name for name in EMBEDDED_ONLY if options.get(name) is not None]
        if refused:
            raise errors.InputError(
                "shardcache.open() without a URI reads through the pod's sidecar, whose "
                "DatasetMount configures the cache: expected none of the options that "
                f"configure a cache in this process, found {', '.join(refused)}; set them "
                "in the DatasetMount spec, or pass a URI to run the cache in this process"
            )
        return
    refused = [name for name in SIDECAR_ONLY if options.get(name) is not None]
    if refused:
        raise errors.InputError(
            f"shardcache.open({uri!r}) runs the cache in this process: expected no "
            f"option that picks a sidecar's dataset, found {', '.join(refused)}; drop "
            "the URI to read through the pod's sidecar"
        )


def check(options: Mapping[str, object]) -> None:
    """Check every option's type and range, then that the mode uses each one given."""
    for name, value in options.items():
        check_value(name, value)
    check_mode(options)
