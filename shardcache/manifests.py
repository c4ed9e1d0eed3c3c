"""The manifest: the exact list of shards a dataset is, pinned by a sha256 digest.

Resolved once (by the operator when a DatasetMount is created, or by `open()` in
embedded mode); every reader of a job then reads the identical dataset even if the
bucket changes later. A digest mismatch is a loud error, never a silent mix.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from shardcache import errors, formats, source, uris
from shardcache.formats import schemas

#: 3: every shard carries the sha256 of its bytes (`ShardEntry.sha256`), which the
#: digest covers and every served byte is checked against; 2: a shard's `version` is
#: the store's identity (ETag), not its mtime. Pins of other versions are re-resolved
#: (the operator) or refused naming both versions (`from_json`); docs/wire-format.md.
MANIFEST_VERSION = 3
#: 4: as 3, with a promotion by name (JSON Lines shards whose fields differ in order or
#: presence: `schemas.unify(by_name=True)`). Only such a manifest is written as 4, so an
#: older shardcache refuses it by its number instead of decoding each shard in its own
#: field order; every other manifest, and its digest, stays version 3.
BY_NAME_VERSION = 4
#: The versions this release reads.
READABLE = (MANIFEST_VERSION, BY_NAME_VERSION)
#: Shards inspected at once. Inspection reads metadata only (a JSON Lines shard in
#: `jsonl.INSPECT_CHUNK` pieces), so memory is bounded by this times a few MiB, whatever
#: the shards hold; 8 keeps a listing of thousands of shards fast on slow stores.
_INSPECT_CONCURRENCY = 8
_NO_FIELDS = formats.fingerprint(pa.schema([]))


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    #: Path relative to the manifest root, '/'-separated.
    path: str
    size: int
    #: The store's identity (`source.content_identity`): "etag:<ETag>" on object
    #: stores, else "mtime:<ns>". Checked on every fetch; the digest covers it.
    version: str
    rows: int
    #: `formats.fingerprint` of the shard's schema.
    fingerprint: str
    #: sha256 of the shard's bytes, lowercase hex (`source.content_sha256`), hashed at
    #: resolve time. Every fetch and every disk-tier hit is checked against it, never
    #: against a record the tier keeps (docs/security.md).
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    root: str
    format: str
    shards: tuple[ShardEntry, ...]
    digest: str
    #: `formats.schemas.encode` of the fields some shards have as type null and others
    #: as a type (`formats.schemas.unify`): decoding casts those columns to it. None
    #: when every shard has the same schema (then the digest is as before unification).
    promoted: str | None = None

    @classmethod
    def build(
        cls, root: str, fmt: str, shards: tuple[ShardEntry, ...], *, promoted: str | None = None
    ) -> Manifest:
        digest = compute_digest(fmt, shards, promoted=promoted)
        return cls(root=root, format=fmt, shards=shards, digest=digest, promoted=promoted)

    @cached_property
    def promoted_schema(self) -> pa.Schema | None:
        """The fields decoding promotes from type null (None: nothing to promote)."""
        return schemas.decode(self.promoted) if self.promoted is not None else None

    @cached_property
    def version(self) -> int:
        return version_of(self.promoted)

    @cached_property
    def shard_rows(self) -> list[int]:
        return [s.rows for s in self.shards]

    @property
    def total_rows(self) -> int:
        return sum(self.shard_rows)

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def shard_count(self) -> int:
        return len(self.shards)

    @property
    def largest_shard(self) -> ShardEntry | None:
        """The shard of the largest stored size, the first of equal sizes in the
        manifest's order; None for a manifest of no shards."""
        found: ShardEntry | None = None
        for shard in self.shards:
            if found is None or shard.size > found.size:
                found = shard
        return found

    def shard_uri_path(self, index: int) -> str:
        """The shard's path inside the root's filesystem (not a URI)."""
        _, root_path = source.split_uri(self.root)
        rel = self.shards[index].path
        return f"{root_path.rstrip('/')}/{rel}" if rel else root_path

    def source_key(self, index: int) -> str:
        """Content identity of a shard's source bytes: the disk-tier key."""
        s = self.shards[index]
        text = f"{self.root}|{s.path}|{s.size}|{s.version}|{s.sha256}"
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def decoded_key(self, index: int) -> str:
        """The memory-tier key: source identity plus the decoded form's version, and the
        promotion when there is one (the same source shard decodes to another schema in
        a dataset whose other shards type its null columns)."""
        key = f"{self.source_key(index)}-d{formats.DECODE_VERSION}"
        if self.promoted is not None:
            key += f"-u{schemas.identity(self.promoted)}"
        return key

    def to_json(self) -> dict[str, Any]:
        out = self.to_json_head()
        promoted = out.pop("promoted", None)  # after the shards, as it always was
        out["shards"] = [dataclasses.asdict(s) for s in self.shards]
        if promoted is not None:
            out["promoted"] = promoted
        return out

    def to_json_head(self) -> dict[str, Any]:
        """`to_json` without its shard list."""
        out: dict[str, Any] = {
            "version": self.version,
            "root": self.root,
            "format": self.format,
            "digest": self.digest,
        }
        if self.promoted is not None:
            out["promoted"] = self.promoted
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        if data.get("version") not in READABLE:
            raise errors.InputError(
                f"manifest version {data.get('version')!r} is not supported: expected "
                f"{MANIFEST_VERSION} (per-shard sha256) or {BY_NAME_VERSION} (JSON Lines "
                "fields matched by name); resolve the source again (the operator re-pins "
                "a DatasetMount pinned by an older version by itself)"
            )
        try:
            shards = tuple(ShardEntry(**s) for s in data["shards"])
            promoted = data.get("promoted")
            manifest = cls.build(
                str(data["root"]),
                str(data["format"]),
                shards,
                promoted=str(promoted) if promoted is not None else None,
            )
        except (KeyError, TypeError) as exc:
            raise errors.InputError(f"malformed manifest: {exc}") from exc
        if manifest.version != data["version"]:
            raise errors.InputError(
                f"malformed manifest: it says version {data['version']}, but its "
                f"promotion makes it version {manifest.version}"
            )
        if manifest.digest != data["digest"]:
            raise errors.ManifestMismatchError(
                f"manifest content hashes to {manifest.digest}, "
                f"but it claims {data['digest']}: it was altered"
            )
        return manifest


def compute_digest(fmt: str, shards: tuple[ShardEntry, ...], *, promoted: str | None = None) -> str:
    """sha256 over the shard list (and the promotion, when there is one). The root is
    left out: a copy of the same objects under another prefix is the same dataset."""
    content: dict[str, Any] = {
        "version": version_of(promoted),
        "format": fmt,
        "shards": [[s.path, s.size, s.version, s.rows, s.fingerprint, s.sha256] for s in shards],
    }
    if promoted is not None:
        content["promoted"] = promoted
    return _digest(content)


def _digest(content: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of `content` (keys sorted, no spaces)."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def served_version_note(version: object) -> str | None:
    """Why a manifest of `version`, served by a pod's sidecar, cannot be read by this
    client library; None when it can. The two come from separate images (the sidecar's
    from the chart, the client from the trainer's), so after an upgrade of one only the
    number says which of them is behind."""
    if version in READABLE:
        return None
    readable = " and ".join(str(v) for v in READABLE)
    if isinstance(version, int) and not isinstance(version, bool) and version > max(READABLE):
        return (
            f"the sidecar serves manifest version {version}, newer than this shardcache "
            f"client reads ({readable}): the sidecar image is of a newer shardcache release "
            "than the trainer's; install the sidecar's release of shardcache in the trainer "
            "image (client and sidecar must share a manifest version: docs/wire-format.md)"
        )
    if isinstance(version, int) and not isinstance(version, bool):
        return (
            f"the sidecar serves manifest version {version}, older than this shardcache "
            f"client reads ({readable}): the sidecar image predates the trainer's shardcache "
            "release; upgrade the chart (and so the sidecar image) to the trainer's release, "
            "or install the sidecar's release of shardcache in the trainer image"
        )
    return f"the sidecar serves a manifest without a version number (version {version!r})"


def version_2_digests(manifest: Manifest) -> frozenset[str]:
    """The digests this manifest's shards had at manifest version 2 (before per-shard
    sha256), what the data states of runs of that time carry. A local file's `version`
    was then the sha256 of its bytes (now its mtime), so both spellings are tried. None
    for a promoted manifest: version 2 refused shards that disagree on the schema.

    Only to name why such a state cannot resume: the reading plan is seeded by the
    digest (docs/reading-plan.md, rule 1), so its order was another."""
    if manifest.promoted is not None:
        return frozenset()
    out = set()
    for local in (False, True):
        shards = [
            [
                s.path,
                s.size,
                source.SHA256_PREFIX + s.sha256
                if local and s.version.startswith(source.MTIME_PREFIX)
                else s.version,
                s.rows,
                s.fingerprint,
            ]
            for s in manifest.shards
        ]
        out.add(_digest({"version": 2, "format": manifest.format, "shards": shards}))
    return frozenset(out)


def version_of(promoted: str | None) -> int:
    """The manifest version a manifest with this promotion is written as."""
    if promoted is not None and schemas.is_by_name(schemas.decode(promoted)):
        return BY_NAME_VERSION
    return MANIFEST_VERSION


def _hidden(rel: str) -> bool:
    # As pyarrow.dataset does: Spark's _SUCCESS, .crc files, _temporary/ dirs.
    return any(part.startswith((".", "_")) for part in PurePosixPath(rel).parts)


def _list(fs: pafs.FileSystem, root: str, uri: str) -> list[pafs.FileInfo]:
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        return [info]
    if info.type == pafs.FileType.NotFound:
        raise errors.InputError(
            f"nothing found at {uris.redact(uri)!r}: expected a file or a prefix with shards"
        )
    selector = pafs.FileSelector(root, recursive=True)
    return [i for i in fs.get_file_info(selector) if i.type == pafs.FileType.File]


def _single_root(uri: str, path: str) -> str:
    """The root of a dataset of the one object at `uri` (its path `path`): the URI of
    its parent. A bare path's parent is taken from its absolute path: "data.parquet"
    has no "/" to cut at, and a relative root would name the file itself, or another
    directory once the process changes its working directory."""
    if "://" not in uri:
        return str(PurePosixPath(path).parent)
    return uri.rstrip("/").rsplit("/", 1)[0]


def _single_name(root_uri: str, path: str) -> str:
    """The one shard's path relative to `root_uri` (`_single_root`), where `path` is the
    object's path in its filesystem: what `Manifest.shard_uri_path` joins back to `path`.

    Not the last segment of `path`: s3://b/dir/a%2Fb.parquet names the key
    "dir/a/b.parquet", and its root, cut at the URI's last "/", is s3://b/dir, so the
    shard is "a/b.parquet" ("b.parquet" there would read the object "dir/b.parquet")."""
    _, parent = source.split_uri(root_uri)
    prefix = parent.rstrip("/") + "/"
    if path.startswith(prefix):
        return path[len(prefix) :]
    return PurePosixPath(path).name


def resolve(
    uri: str,
    *,
    format: str | None = None,
    storage_options: Mapping[str, str] | None = None,
    retry: source.RetryPolicy | None = None,
) -> Manifest:
    """List the shards under `uri`, read each one's row count and schema, and pin it.

    Raises InputError for what the caller must fix (bad URI, missing bucket or prefix,
    empty dataset, unsupported format, schemas that disagree) and SourceError when the
    store keeps failing after retries.
    """
    fs, root = source.filesystem(uri, storage_options=storage_options)
    what = f"listing {uris.redact(uri)}"
    infos = source.with_retries(lambda: _list(fs, root, uri), what=what, policy=retry)
    single = len(infos) == 1 and infos[0].path.rstrip("/") == root.rstrip("/")
    files: list[tuple[str, pafs.FileInfo]] = []
    for info in infos:
        rel = "" if single else info.path[len(root) :].lstrip("/")
        if not single and _hidden(rel):
            continue
        files.append((rel, info))
    files.sort(key=lambda f: f[0])
    if not files:
        raise errors.InputError(
            f"empty dataset at {uris.redact(uri)!r}: expected at least one shard file "
            "(names starting with '.' or '_' are ignored)"
        )
    fmt = format or formats.infer([info.path for _, info in files])
    reader = formats.get(fmt)
    # Each FileInfo is dropped once its shard is inspected (`_inspected` takes them off
    # the front): what is kept a shard is its ShardEntry alone.
    pending = collections.deque(files)
    del infos, files

    # Shards of a dataset mostly share one schema: its fingerprint is held once, not once
    # a shard (a dict's setdefault is atomic under the GIL, whatever thread calls it).
    fingerprints: dict[str, str] = {}

    def inspect(item: tuple[str, pafs.FileInfo]) -> tuple[ShardEntry, pa.Schema, str]:
        rel, info = item

        def read_meta() -> tuple[ShardEntry, pa.Schema, str]:
            with fs.open_input_file(info.path) as f:
                version = source.content_identity(f, info)
                try:
                    rows, schema = reader.inspect(f)
                except (ValueError, TypeError) as exc:
                    # pyarrow raises ArrowInvalid (a ValueError) for bytes of another format.
                    raise errors.InputError(
                        f"shard {info.path!r} is not readable as {fmt}: {exc}"
                    ) from exc
            # Streamed once more to hash it: the one identity of the bytes that every
            # store gives alike (an ETag of a multipart upload is no content hash).
            # Costs a read of the dataset per resolve; docs/security.md says why here.
            sha256 = source.content_sha256(fs, info.path)
            fingerprint = formats.fingerprint(schema)
            fingerprint = fingerprints.setdefault(fingerprint, fingerprint)
            entry = ShardEntry(rel, info.size or 0, version, rows, fingerprint, sha256)
            # What names the shard in a schema conflict (a single file's rel is "").
            return entry, schema, rel or info.path

        return source.with_retries(read_meta, what=f"reading {info.path}", policy=retry)

    shards: list[ShardEntry] = []
    # One schema per distinct fingerprint, with the first shard (manifest order) that
    # has it: all `schemas.unify` reads. Shards of one fingerprint have the same fields
    # (names, types, nullability, field metadata), so unify finds the same first path of
    # each field's type, the same field order and so the same promotion and message.
    # An empty JSON Lines shard has no schema at all; it cannot disagree with others.
    distinct: dict[str, tuple[str, pa.Schema]] = {}
    for entry, schema, path in _inspected(inspect, pending):
        shards.append(entry)
        if entry.rows == 0 and entry.fingerprint == _NO_FIELDS:
            continue
        distinct.setdefault(entry.fingerprint, (entry.path or path, schema))
    unified = None
    if len(distinct) > 1:
        # JSON objects have no key order and may leave keys out: JSON Lines shards are
        # matched by field name (formats/README.md, "Schema unification").
        unified = schemas.unify(list(distinct.values()), by_name=fmt == "jsonl")
    promoted = schemas.encode(unified) if unified is not None else None
    root_uri = _single_root(uri, root) if single else uri.rstrip("/")
    if single:
        name = _single_name(root_uri, root)
        shards = [dataclasses.replace(s, path=name) for s in shards]
    return Manifest.build(root_uri, fmt, tuple(shards), promoted=promoted)


#: Inspections submitted ahead of the shard whose result is taken next: enough that a
#: slow shard at the head of the line leaves every thread busy, and a bound on the
#: futures, FileInfos and schemas held, whatever the shard count (submitting every
#: shard at once held about 5.5 KB a shard until the end).
_INSPECT_WINDOW = 4 * _INSPECT_CONCURRENCY


def _inspected(
    inspect: Callable[[tuple[str, pafs.FileInfo]], tuple[ShardEntry, pa.Schema, str]],
    pending: collections.deque[tuple[str, pafs.FileInfo]],
) -> Iterator[tuple[ShardEntry, pa.Schema, str]]:
    """`inspect` of each of `pending` (taken off it as submitted), in their order, at
    most `_INSPECT_WINDOW` submitted and `_INSPECT_CONCURRENCY` running at once. The
    first failure in that order is raised, as `Executor.map` did; the rest are
    cancelled, and the inspections running then are not waited for: the resolve has
    failed, and each of them may be a slow read of the store, or a thread of a child
    over its memory limit that no longer makes progress."""
    pool = concurrent.futures.ThreadPoolExecutor(_INSPECT_CONCURRENCY)
    window: collections.deque[concurrent.futures.Future[tuple[ShardEntry, pa.Schema, str]]]
    window = collections.deque()
    finished = False
    try:
        while pending or window:
            while pending and len(window) < _INSPECT_WINDOW:
                window.append(pool.submit(inspect, pending.popleft()))
            yield window.popleft().result()
        finished = True
    finally:
        pool.shutdown(wait=finished, cancel_futures=True)
