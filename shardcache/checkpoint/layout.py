"""Where checkpoints live in the bucket, and the manifest that makes one visible.

In the client library because both ends read it: the sidecar's agent publishes and
restores, and `shardcache lineage`, `diff` and `skip` read the published data states.

Specified in docs/checkpoints.md (`LAYOUT_VERSION`). Under the checkpoint URI:

    latest                              pointer to the newest published step
    step-000000000042/data/<path>       the checkpoint's files
    step-000000000042/checkpoint.json   its manifest, written last

A checkpoint exists exactly when its manifest does. Everything here is pure except the
small helpers at the bottom that read and write one object.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow.fs as pafs

from shardcache import errors

#: Version of the bucket layout, the manifest and the pointer (docs/checkpoints.md):
#: a reader refuses another one.
LAYOUT_VERSION = 1
#: Additions within LAYOUT_VERSION that a reader of an older minor ignores without
#: harm (docs/checkpoints.md, "Versions"). The manifest's `minor` (absent: 0).
#: 1: `dirs`, the checkpoint's empty directories.
LAYOUT_MINOR = 1
MANIFEST_NAME = "checkpoint.json"
POINTER_NAME = "latest"
DATA_DIR = "data"
_STEP_DIGITS = 12
#: Longest object key S3 and GCS take, in UTF-8 bytes; longer ones are refused with a
#: 400 on every try, so the uploader refuses such a file before sending it.
MAX_KEY_BYTES = 1024
#: For `fullmatch` (a `$` with `match` would take "step-1\n" for step 1); ASCII digits
#: only, as `\d` would take other scripts' digits, which int() reads too.
_STEP_DIR = re.compile(r"step-([0-9]+)")


class CorruptCheckpointError(errors.InputError):
    """A published checkpoint's bytes differ from its manifest."""


class DuplicateStepError(errors.InputError):
    """A checkpoint with this step is already published with other content."""


@dataclasses.dataclass(frozen=True)
class FileEntry:
    #: Path inside the checkpoint directory, '/'-separated.
    path: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class CheckpointManifest:
    step: int
    #: Name of the checkpoint directory; restored under the same name.
    name: str
    files: tuple[FileEntry, ...]
    data_state: dict[str, Any] | None
    created_at: float
    #: Directories of the checkpoint that hold nothing (no file, no subdirectory),
    #: '/'-separated, sorted: a restore recreates them (layout 1.1; empty before).
    dirs: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def same_content(self, other: CheckpointManifest) -> bool:
        # Empty directories are left out: a step published by an agent of layout 1.0
        # (no `dirs`) and uploaded again after an upgrade is the same checkpoint, not a
        # duplicate step; they hold no bytes that could differ.
        return (self.step, self.name, self.files) == (other.step, other.name, other.files)

    def _body(self) -> dict[str, Any]:
        return {
            "version": LAYOUT_VERSION,
            "minor": LAYOUT_MINOR,
            "step": self.step,
            "name": self.name,
            "created_at": self.created_at,
            "total_bytes": self.total_bytes,
            "data_state": self.data_state,
            "files": [dataclasses.asdict(f) for f in self.files],
            "dirs": list(self.dirs),
        }

    def to_json(self) -> dict[str, Any]:
        body = self._body()
        return {**body, "digest": _digest(body)}

    @classmethod
    def from_json(cls, data: object, *, where: str) -> CheckpointManifest:
        if not isinstance(data, dict):
            raise CorruptCheckpointError(f"{where}: expected a JSON object")
        if data.get("version") != LAYOUT_VERSION:
            raise errors.InputError(
                f"{where}: checkpoint layout version {data.get('version')!r} is not "
                f"supported: expected {LAYOUT_VERSION} (written by another shardcache version)"
            )
        raw_files = data.get("files")
        if not isinstance(raw_files, list):
            raise CorruptCheckpointError(f"{where}: expected 'files' to be a list")
        minor = data.get("minor", 0)
        if isinstance(minor, bool) or not isinstance(minor, int) or minor < 0:
            raise CorruptCheckpointError(
                f"{where}: expected 'minor' to be an integer >= 0, found {minor!r}"
            )
        # Optional (layout 1.1): a manifest of layout 1.0 records no empty directories.
        raw_dirs = data.get("dirs", [])
        if not isinstance(raw_dirs, list):
            raise CorruptCheckpointError(f"{where}: expected 'dirs' to be a list of paths")
        try:
            manifest = cls(
                step=int(data["step"]),
                name=str(data["name"]),
                files=tuple(
                    _entry(f, where=f"{where}: files[{i}]") for i, f in enumerate(raw_files)
                ),
                data_state=data.get("data_state"),
                created_at=float(data["created_at"]),
                dirs=tuple(
                    _dir_entry(d, where=f"{where}: dirs[{i}]") for i, d in enumerate(raw_dirs)
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({exc!r})") from exc
        body = {k: v for k, v in data.items() if k != "digest"}
        if data.get("digest") != _digest(body):
            raise CorruptCheckpointError(
                f"{where}: the manifest does not match its digest: it was altered or torn"
            )
        check_name(manifest.name, where=where)
        for f in manifest.files:
            check_relpath(f.path, where=where)
        for d in manifest.dirs:
            check_relpath(d, where=where)
        _check_tree(manifest.files, manifest.dirs, where=where)
        return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _entry(raw: object, *, where: str) -> FileEntry:
    """One `files` entry, checked so a hostile manifest fails here, naming the entry,
    and never deeper (a NUL byte in a path, a negative size)."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"{where}: expected an object with path, size, sha256")
    path, size, digest = raw.get("path"), raw.get("size"), raw.get("sha256")
    if not _usable_path(path):
        raise CorruptCheckpointError(
            f"{where}: path {path!r} is not a usable file name (empty, not text, a NUL "
            "byte, or not UTF-8)"
        )
    assert isinstance(path, str)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CorruptCheckpointError(
            f"{where} {path!r}: size {size!r} is not a byte count (an integer >= 0)"
        )
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise CorruptCheckpointError(
            f"{where} {path!r}: sha256 {digest!r} is not 64 lowercase hex digits"
        )
    return FileEntry(path, size, digest)


def _usable_path(path: object) -> bool:
    if not isinstance(path, str) or not path or "\x00" in path:
        return False
    try:
        # JSON can spell a lone surrogate ("\ud800"), which no file name can hold.
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _dir_entry(raw: object, *, where: str) -> str:
    """One `dirs` entry: a usable relative path."""
    if not _usable_path(raw):
        raise CorruptCheckpointError(
            f"{where}: {raw!r} is not a usable directory name (empty, not text, a NUL "
            "byte, or not UTF-8)"
        )
    assert isinstance(raw, str)
    return raw


def _check_tree(files: tuple[FileEntry, ...], dirs: tuple[str, ...], *, where: str) -> None:
    """No path twice, and none that is both a file and a directory ("a" and "a/b")."""
    paths = {f.path for f in files}
    if len(paths) != len(files):
        seen: set[str] = set()
        for f in files:
            if f.path in seen:
                raise CorruptCheckpointError(f"{where}: file {f.path!r} is listed twice")
            seen.add(f.path)
    if len(set(dirs)) != len(dirs):
        raise CorruptCheckpointError(f"{where}: a directory is listed twice in 'dirs'")
    for path, kind in [*((f.path, "file") for f in files), *((d, "directory") for d in dirs)]:
        parts = path.split("/")
        # A directory entry is itself a directory; a file's parents all are.
        for i in range(1, len(parts) + (kind == "directory")):
            parent = "/".join(parts[:i])
            if parent in paths:
                raise CorruptCheckpointError(
                    f"{where}: {parent!r} is listed as a file and as the directory of "
                    f"{path!r}; a path cannot be both"
                )


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def check_name(name: str, *, where: str) -> None:
    if not _usable_path(name) or "/" in name or name.startswith(".") or name in ("..",):
        raise CorruptCheckpointError(f"{where}: invalid checkpoint directory name {name!r}")


def check_relpath(path: str, *, where: str) -> None:
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpointError(f"{where}: file path {path!r} escapes the checkpoint")


# --- names -------------------------------------------------------------------------------
def step_dir(prefix: str, step: int) -> str:
    return f"{prefix}/step-{step:0{_STEP_DIGITS}d}"


def manifest_path(prefix: str, step: int) -> str:
    return f"{step_dir(prefix, step)}/{MANIFEST_NAME}"


def data_path(prefix: str, step: int, rel: str) -> str:
    return f"{step_dir(prefix, step)}/{DATA_DIR}/{rel}"


def pointer_path(prefix: str) -> str:
    return f"{prefix}/{POINTER_NAME}"


def parse_step_dir(base_name: str) -> int | None:
    match = _STEP_DIR.fullmatch(base_name)
    return int(match.group(1)) if match else None


def pointer_json(manifest: CheckpointManifest) -> dict[str, Any]:
    return {"version": LAYOUT_VERSION, "step": manifest.step, "name": manifest.name}


def parse_pointer(data: object) -> int | None:
    """The step a pointer names; None for a pointer this version cannot read."""
    if isinstance(data, dict) and data.get("version") == LAYOUT_VERSION:
        step = data.get("step")
        if isinstance(step, int) and step >= 0:
            return step
    return None


def retention_plan(
    complete: Iterable[int], incomplete: Iterable[int], keep_last: int
) -> tuple[list[int], list[int]]:
    """(complete steps to delete, incomplete step directories to delete).

    Keeps the newest `keep_last` complete steps. An incomplete directory (no manifest:
    an upload that died) is deleted only when it is older than every kept step; a newer
    one may be an upload in flight.
    """
    if keep_last < 1:
        raise errors.InputError(f"keep_last must be >= 1, found {keep_last}")
    steps = sorted(set(complete))
    kept, dropped = steps[-keep_last:], steps[:-keep_last]
    oldest_kept = kept[0] if kept else None
    orphans = sorted(s for s in set(incomplete) if oldest_kept is not None and s < oldest_kept)
    return dropped, orphans


# --- one object at a time ---------------------------------------------------------------------
def read_json(fs: pafs.FileSystem, path: str) -> object | None:
    """A small JSON object, or None when it does not exist."""
    try:
        with fs.open_input_stream(path) as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        data: object = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise CorruptCheckpointError(f"{path}: not JSON ({exc})") from exc
    return data


def write_json(fs: pafs.FileSystem, path: str, data: Mapping[str, Any]) -> None:
    """Write a small JSON object so readers see all of it or nothing.

    One PUT on object stores is atomic; on filesystems with directories, write a temp
    file and rename it into place.
    """
    payload = json.dumps(data, sort_keys=True, indent=1).encode()
    if has_directories(fs):
        ensure_parent(fs, path)
        tmp = f"{path}.tmp-{hashlib.sha256(payload).hexdigest()[:12]}"
        with fs.open_output_stream(tmp) as out:
            out.write(payload)
        fs.move(tmp, path)
        return
    with fs.open_output_stream(path) as out:
        out.write(payload)


def has_directories(fs: pafs.FileSystem) -> bool:
    # Object stores have no directories to create and rename atomically on one PUT.
    return isinstance(fs, pafs.LocalFileSystem | pafs.SubTreeFileSystem)


def ensure_parent(fs: pafs.FileSystem, path: str) -> None:
    """Create the parent directory of `path` where the filesystem needs one."""
    if has_directories(fs) and "/" in path:
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)


def list_steps(fs: pafs.FileSystem, prefix: str) -> tuple[list[int], list[int]]:
    """(published steps, step directories without a manifest), each sorted.

    A missing prefix (an empty bucket) is no checkpoints, not an error.
    """
    infos = fs.get_file_info(pafs.FileSelector(prefix, allow_not_found=True, recursive=False))
    steps = sorted(
        step
        for info in infos
        if info.type == pafs.FileType.Directory
        and (step := parse_step_dir(info.base_name)) is not None
    )
    if not steps:
        return [], []
    manifests = fs.get_file_info([manifest_path(prefix, s) for s in steps])
    complete = [s for s, m in zip(steps, manifests, strict=True) if m.type == pafs.FileType.File]
    incomplete = [s for s, m in zip(steps, manifests, strict=True) if m.type != pafs.FileType.File]
    return complete, incomplete


# --- skip requests ------------------------------------------------------------------------
#: `step-…/skip-request.json`: the data state of this checkpoint, as restored, skips the
#: next `batches` batches (`shardcache skip`). Beside the checkpoint, not in its manifest:
#: a published manifest is immutable and covered by its digest.
SKIP_REQUEST_NAME = "skip-request.json"
#: `step-…/skip-applied.json`: written by the agent each time it restored the step with
#: the skip (the request, the range it recorded, when); the operator reports the newest
#: in the DatasetMount's status.
SKIP_APPLIED_NAME = "skip-applied.json"
#: Where `shardcache skip` sets aside the manifest of a checkpoint newer than the one a
#: run is rewound to: no longer a checkpoint (restore, retention and the rewound run's
#: uploads of the same step ignore it), still there for lineage and forensics.
DISCARDED_NAME = "checkpoint.discarded.json"


@dataclasses.dataclass(frozen=True)
class SkipRequest:
    """Restore checkpoint `step` with its data state skipping the next `batches` batches
    of `batch_size` rows (None: the batch size recorded in the data state)."""

    step: int
    batches: int
    batch_size: int | None = None
    requested_at: float = 0.0
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"version": LAYOUT_VERSION, "kind": "skip", **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: object, *, where: str) -> SkipRequest:
        if not isinstance(data, dict) or data.get("kind") != "skip":
            raise errors.InputError(f'{where}: expected a skip request {{"kind": "skip", …}}')
        if data.get("version") != LAYOUT_VERSION:
            raise errors.InputError(
                f"{where}: skip request version {data.get('version')!r} is not supported: "
                f"expected {LAYOUT_VERSION}"
            )
        step, batches, size = data.get("step"), data.get("batches"), data.get("batch_size")
        for name, value, low in (("step", step, 0), ("batches", batches, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise errors.InputError(
                    f"{where}: {name} must be an integer >= {low}, found {value!r}"
                )
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise errors.InputError(f"{where}: batch_size must be null or >= 1, found {size!r}")
        assert isinstance(step, int) and isinstance(batches, int)
        return cls(
            step=step,
            batches=batches,
            batch_size=size,
            requested_at=float(data.get("requested_at") or 0.0),
            reason=str(data.get("reason") or ""),
        )


def skip_request_path(prefix: str, step: int) -> str:
    return f"{step_dir(prefix, step)}/{SKIP_REQUEST_NAME}"


def skip_applied_path(prefix: str, step: int) -> str:
    return f"{step_dir(prefix, step)}/{SKIP_APPLIED_NAME}"


def discarded_path(prefix: str, step: int) -> str:
    return f"{step_dir(prefix, step)}/{DISCARDED_NAME}"


def read_skip_request(fs: pafs.FileSystem, prefix: str, step: int) -> SkipRequest | None:
    where = skip_request_path(prefix, step)
    data = read_json(fs, where)
    return None if data is None else SkipRequest.from_json(data, where=where)
