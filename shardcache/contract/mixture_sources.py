"""The sources of a multi-source DatasetMount, as they cross process boundaries.

The webhook writes them into the sidecar's `$SHARDCACHE_MIXTURE` (`variables.MIXTURE`)
as one JSON object; the sidecar serves every source and writes the same object, with
each source's socket, to `<run dir>/<mount>/mixture.json` (`DESCRIPTOR_NAME`), where
`shardcache.open_mixture()` in the trainer finds it. The first source is the mount's
own `spec.source`, served at the mount's usual socket; every further source has its
own socket and memory tier below `<run dir>/<mount>/sources/<name>/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache import errors
from shardcache.contract import parsers

FORMAT_VERSION = 1
DESCRIPTOR_NAME = "mixture.json"
SOURCES_SUBDIR = "sources"
#: A source name: a DNS label (it names a directory, a metric label and a state key).
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"
_NAME_RE = re.compile(NAME_PATTERN)
#: A descriptor nests 3 deep (the object, its sources list, a source object; every
#: value in a source is a scalar). Anything deeper is refused before it is parsed or
#: walked: `json.loads` recurses once per level, so a few KiB of "[" raised
#: RecursionError (no ValueError) in the trainer and the sidecar, and a descriptor
#: object that contains itself has no depth at all.
MAX_DEPTH = 3
#: The largest descriptor a reader reads. A legitimate one holds at most 16 sources
#: (spec.source and spec.mixture.sources' maxItems of 15), each a name, a weight, a
#: format, a digest and a URI of at most 2048 characters: under 40 KiB. A file above
#: this is not one (a stray or hostile write into the run directory) and is refused
#: before it is read into the trainer's memory.
MAX_DESCRIPTOR_BYTES = 1 << 20


def _deeper_than(data: object, limit: int) -> bool:
    """Whether `data` (parsed JSON, or any object) nests lists and mappings more than
    `limit` deep. Walked without recursion and never below `limit + 1`, so an object
    that contains itself is simply too deep."""
    level: list[object] = [data]
    for _ in range(limit + 1):
        below: list[object] = []
        for item in level:
            if isinstance(item, Mapping):
                below.extend(item.values())
            elif isinstance(item, list | tuple):
                below.extend(item)
        if not below:
            return False
        level = below
    # Something remains at level limit + 1: a container at level limit + 1 exists only
    # if one of these is one.
    return any(isinstance(item, Mapping | list | tuple) for item in level)


def _too_deep() -> errors.InputError:
    return errors.InputError(
        f"expected a mixture descriptor nested at most {MAX_DEPTH} deep (an "
        "object, its list of sources, a source object of scalars), found one nested "
        "deeper (or containing itself)"
    )


@dataclasses.dataclass(frozen=True)
class Source:
    """One source of the mixture."""

    name: str
    #: Relative weight (>= 0); the mixture normalises the weights.
    weight: float
    uri: str
    #: Shard format; None infers it from the file names.
    format: str | None = None
    #: The pinned manifest digest (the DatasetMount's status), if any.
    digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "weight": self.weight, "uri": self.uri}
        if self.format is not None:
            out["format"] = self.format
        if self.digest is not None:
            out["digest"] = self.digest
        return out


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Every source of a mount (the first is `spec.source`) and the draw's seed."""

    sources: tuple[Source, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.sources) < 2:
            raise errors.InputError(
                f"a mixture needs at least two sources, found {len(self.sources)}"
            )
        names = [s.name for s in self.sources]
        for s in self.sources:
            # fullmatch: `match` lets the pattern's `$` accept a final newline.
            if not _NAME_RE.fullmatch(s.name):
                raise errors.InputError(
                    f"mixture source name {s.name!r}: expected a DNS label of at most 32 "
                    "characters (a-z, 0-9, '-')"
                )
            # Held to the form every URI setting has (`parsers.URI`): a source without
            # `scheme://` would otherwise get past the settings and fail later, at its
            # first read, as a relative local path.
            parsers.URI(f"mixture source {s.name!r}: uri", s.uri)
            if not math.isfinite(s.weight) or s.weight < 0:
                raise errors.InputError(
                    f"mixture source {s.name!r}: expected a weight >= 0, found {s.weight}"
                )
        if len(set(names)) != len(names):
            raise errors.InputError(f"mixture source names must differ, found {names}")
        if not any(s.weight > 0 for s in self.sources):
            raise errors.InputError("a mixture needs some source with a weight > 0")

    @property
    def weights(self) -> dict[str, float]:
        return {s.name: s.weight for s in self.sources}

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "seed": self.seed,
            "sources": [s.to_json() for s in self.sources],
        }

    def __str__(self) -> str:
        # What `parsers.render` writes into the env: compact JSON.
        return json.dumps(self.to_json(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, data: object) -> Mixture:
        # Before anything is looked at or shown: a repr of a deep value recurses too.
        if _deeper_than(data, MAX_DEPTH):
            raise _too_deep()
        if not isinstance(data, Mapping) or data.get("version") != FORMAT_VERSION:
            raise errors.InputError(
                f"expected a mixture of version {FORMAT_VERSION}, found "
                + (repr(data.get("version")) if isinstance(data, Mapping) else repr(data))
            )
        raw = data.get("sources")
        seed = data.get("seed", 0)
        if not isinstance(raw, list) or isinstance(seed, bool) or not isinstance(seed, int):
            raise errors.InputError("expected a mixture with a list of sources and an int seed")
        sources = []
        for item in raw:
            if not isinstance(item, Mapping):
                raise errors.InputError(f"expected a mixture source object, found {item!r}")
            try:
                sources.append(
                    Source(
                        name=str(item["name"]),
                        weight=float(item["weight"]),
                        uri=str(item["uri"]),
                        format=item.get("format"),
                        digest=item.get("digest"),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise errors.InputError(f"malformed mixture source {item!r}: {exc}") from exc
        return cls(tuple(sources), seed=seed)

    @classmethod
    def parse(cls, text: str) -> Mixture:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise errors.InputError(f"not JSON ({exc})") from exc
        except RecursionError:
            # This layer is below `shardcache.node.nested_json`, which would tell the
            # depth before parsing; the parser gives up at its recursion limit instead.
            raise _too_deep() from None
        return cls.from_json(data)


def source_dir(mount_dir: str | Path, name: str) -> Path:
    """The directory of a further source (not the first) inside the mount's directory."""
    return Path(mount_dir) / SOURCES_SUBDIR / name


def socket_of(mount_dir: str | Path, mixture: Mixture, name: str) -> Path:
    """The control socket serving source `name` (the first source: the mount's own)."""
    # Imported here: `names` imports `variables`, which imports this module.
    from shardcache.contract import names

    if name == mixture.sources[0].name:
        return Path(mount_dir) / names.SOCKET_NAME
    return source_dir(mount_dir, name) / names.SOCKET_NAME


def memory_of(mount_dir: str | Path, mixture: Mixture, name: str) -> Path:
    from shardcache.contract import names

    if name == mixture.sources[0].name:
        return Path(mount_dir) / names.MEMORY_SUBDIR
    return source_dir(mount_dir, name) / names.MEMORY_SUBDIR
