"""Publish one committed checkpoint directory: files in parallel, manifest last.

pyarrow's S3 output streams upload a large file as a multipart upload whose parts are
sent in the background while the next part is read (`background_writes`), so a big
file is itself parallel; several files go at once on a thread pool. Each file's sha256
is computed over exactly the bytes sent. The manifest is written only after every
object is in place with its expected size, so a checkpoint whose upload died is never
visible; an upload that restarts simply writes its objects again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs

from shardcache import errors, faultpoints, source
from shardcache.checkpoint import _protocol, layout
from shardcache_sidecar.checkpoint import metrics, nofollow

log = logging.getLogger(__name__)
#: Read size when streaming a file: a multiple of pyarrow's multipart part size
#: (10 MB and up), so each write hands whole parts to the background writer.
CHUNK = 16 << 20
#: Bytes of queued parts the agent allows across all files being uploaded (see
#: `Window`). 512 MiB: a file uploading alone (the usual large model file at the end)
#: waits for its parts only every 512 MiB, so its upload hardly ever drains; eight at
#: once get 64 MiB each, six parts of pyarrow's 10 MiB.
DEFAULT_BUFFER = 512 << 20
#: No file is held to less than this, however many are in flight.
MIN_WINDOW = 32 << 20


class Window:
    """How many bytes one file may queue before it waits for its parts.

    pyarrow keeps every part of a multipart upload in memory until it is sent, so a
    fast reader and a slow store would buffer whole files. Each file flushes (waits
    for its queued parts) after its share of the budget: the budget split between the
    files in flight, so memory stays about `budget` while a lone large file still
    keeps many parts in flight. A flush drains the pipeline, so fewer is faster.
    """

    def __init__(self, budget: int = DEFAULT_BUFFER) -> None:
        self._budget = budget
        self._active = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self._active += 1

    def leave(self) -> None:
        with self._lock:
            self._active -= 1

    def share(self) -> int:
        with self._lock:
            return max(MIN_WINDOW, self._budget // max(1, self._active))


def list_files(directory: Path, *, key_prefix: str | None = None) -> nofollow.Listing:
    """Every file of a checkpoint (relative path, size), sorted, protocol files left
    out, and its empty directories.

    A symbolic link or special file anywhere in the directory refuses the checkpoint
    (`nofollow.SymlinkError`, named in its status): the agent never follows one. So
    does a name that is not UTF-8, and, with `key_prefix` (the object key the relative
    paths are appended to, where the store limits keys), a file whose key would be
    longer than `layout.MAX_KEY_BYTES`: the store would refuse it on every try.
    """
    if not directory.is_dir() or directory.is_symlink():
        raise errors.InputError(
            f"checkpoint directory {str(directory)!r} disappeared before it was uploaded"
        )
    try:
        directory.name.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.InputError(
            f"checkpoint directory {os.fsencode(directory.name)!r}: the name is not UTF-8; "
            "it is recorded in the manifest, which is UTF-8 text: rename it"
        ) from None
    try:
        listing = nofollow.regular_files(directory, skip_prefix=_protocol.RESERVED_PREFIX)
    except errors.InputError as exc:
        # The same class (SymlinkError stays one), with the checkpoint named.
        raise type(exc)(f"checkpoint {directory.name!r}: {exc}") from None
    except OSError as exc:
        raise errors.InputError(
            f"cannot list checkpoint directory {str(directory)!r}: {exc}"
        ) from exc
    if key_prefix is not None:
        used = len(key_prefix.encode("utf-8"))
        for rel, _ in listing.files:
            key_bytes = used + len(rel.encode("utf-8"))
            if key_bytes > layout.MAX_KEY_BYTES:
                shown = rel if len(rel) <= 120 else f"{rel[:70]}…{rel[-40:]}"
                raise errors.InputError(
                    f"checkpoint {directory.name!r}: file {shown!r} would be stored as an "
                    f"object key of {key_bytes} bytes ({key_prefix!r} + its path), over the "
                    f"{layout.MAX_KEY_BYTES} bytes the object store takes: shorten its "
                    f"path to at most {max(layout.MAX_KEY_BYTES - used, 0)} bytes (or the "
                    "checkpoint URI's prefix)"
                )
    return listing


def key_prefix(fs: pafs.FileSystem, path: str) -> str | None:
    """The object key `path` names where the store limits key length (S3, GCS: the
    path after the bucket), else None (a filesystem: its own limits apply)."""
    if fs.type_name not in ("s3", "gcs"):
        return None
    return path.partition("/")[2]


def sha256_file(root: Path, rel: str) -> str:
    """sha256 of the regular file `root/rel`, opened without following links."""
    h = hashlib.sha256()
    with os.fdopen(nofollow.open_read(root, rel), "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_object(fs: pafs.FileSystem, path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def put_file(
    fs: pafs.FileSystem,
    directory: Path,
    rel: str,
    remote: str,
    *,
    expected_size: int,
    observer: metrics.Observer,
    window: Window | None = None,
) -> str:
    """Stream one file to the store; its sha256. Raises InputError if it changed size.

    The stream is flushed whenever the file has queued its share of `window`.
    """
    window = window or Window()
    local = directory / rel
    h = hashlib.sha256()
    sent = 0
    unflushed = 0
    try:
        src = os.fdopen(nofollow.open_read(directory, rel), "rb")
    except nofollow.SymlinkError:
        raise
    except OSError as exc:
        raise errors.InputError(f"cannot read checkpoint file {str(local)!r}: {exc}") from exc
    layout.ensure_parent(fs, remote)
    with src, fs.open_output_stream(remote) as out:
        while chunk := src.read(CHUNK):
            h.update(chunk)
            out.write(chunk)
            sent += len(chunk)
            unflushed += len(chunk)
            observer.transferred("upload", len(chunk))
            if unflushed >= window.share():
                out.flush()
                unflushed = 0
    if sent != expected_size:
        raise errors.InputError(
            f"checkpoint file {str(local)!r} changed while it was uploaded ({expected_size} "
            f"bytes when listed, {sent} read): write the whole directory before committing it"
        )
    return h.hexdigest()


def upload(
    fs: pafs.FileSystem,
    prefix: str,
    directory: Path,
    marker: _protocol.Marker,
    *,
    concurrency: int,
    retry: source.RetryPolicy,
    verify: bool = False,
    observer: metrics.Observer | None = None,
    buffer_bytes: int = DEFAULT_BUFFER,
) -> layout.CheckpointManifest:
    """Upload `directory` as checkpoint `marker.step` and publish its manifest.

    Raises DuplicateStepError when the step is already published with other content
    (the published one is left alone), InputError for unreadable local files,
    SourceError when the store keeps failing.
    """
    obs = observer or metrics.NullObserver()
    step = marker.step
    listing = list_files(directory, key_prefix=key_prefix(fs, layout.data_path(prefix, step, "")))
    files = listing.files
    manifest_at = layout.manifest_path(prefix, step)
    existing_raw = source.with_retries(
        lambda: layout.read_json(fs, manifest_at), what=f"reading {manifest_at}", policy=retry
    )
    if existing_raw is not None:
        existing = layout.CheckpointManifest.from_json(existing_raw, where=manifest_at)
        local = _local_manifest(directory, listing, marker, existing.created_at)
        if local.same_content(existing):
            log.info("checkpoint step %d is already published: nothing to upload", step)
            return existing
        raise layout.DuplicateStepError(
            f"step {step} is already published at {manifest_at} as {existing.name!r} with "
            f"other content; the published checkpoint is kept: commit under a new step"
        )

    window = Window(buffer_bytes)

    def one(item: tuple[str, int]) -> layout.FileEntry:
        rel, size = item
        remote = layout.data_path(prefix, step, rel)
        obs.file_started()
        window.enter()
        try:
            digest = source.with_retries(
                lambda: put_file(
                    fs, directory, rel, remote, expected_size=size, observer=obs, window=window
                ),
                what=f"uploading {remote}",
                policy=retry,
            )
            _check_size(fs, remote, size, retry)
            if verify:
                found, found_size = source.with_retries(
                    lambda: sha256_object(fs, remote), what=f"verifying {remote}", policy=retry
                )
                if (found, found_size) != (digest, size):
                    raise errors.SourceError(
                        f"{remote}: read back sha256 {found} ({found_size} bytes), expected "
                        f"{digest} ({size} bytes): the store did not keep the bytes sent"
                    )
            faultpoints.reach("checkpoint.upload.file")
        finally:
            window.leave()
            obs.file_finished()
        return layout.FileEntry(rel, size, digest)

    with concurrent.futures.ThreadPoolExecutor(max(1, min(concurrency, len(files) or 1))) as pool:
        # Largest first: the long multipart uploads start at once, small files fill in.
        order = sorted(files, key=lambda f: -f[1])
        entries = {e.path: e for e in pool.map(one, order)}
    manifest = layout.CheckpointManifest(
        step=step,
        name=directory.name,
        files=tuple(entries[rel] for rel, _ in files),
        data_state=marker.data_state,
        created_at=marker.committed_at if marker.committed_at is not None else time.time(),
        dirs=tuple(listing.empty_dirs),
    )
    faultpoints.reach("checkpoint.upload.manifest")
    source.with_retries(
        lambda: layout.write_json(fs, manifest_at, manifest.to_json()),
        what=f"writing {manifest_at}",
        policy=retry,
    )
    return manifest


def _local_manifest(
    directory: Path, listing: nofollow.Listing, marker: _protocol.Marker, created_at: float
) -> layout.CheckpointManifest:
    return layout.CheckpointManifest(
        step=marker.step,
        name=directory.name,
        files=tuple(
            layout.FileEntry(rel, size, sha256_file(directory, rel)) for rel, size in listing.files
        ),
        data_state=marker.data_state,
        created_at=created_at,
        dirs=tuple(listing.empty_dirs),
    )


def _check_size(fs: pafs.FileSystem, remote: str, size: int, retry: source.RetryPolicy) -> None:
    """The object is in the store with its size: checked before the manifest is written."""
    info = source.with_retries(
        lambda: fs.get_file_info(remote), what=f"checking {remote}", policy=retry
    )
    if info.type != pafs.FileType.File or info.size != size:
        found = f"{info.size} bytes" if info.type == pafs.FileType.File else "no object"
        raise errors.SourceError(
            f"{remote}: expected an object of {size} bytes after upload, found {found}"
        )
