"""Restore a published checkpoint into the checkpoint volume before the trainer starts.

Every restored byte is hashed and compared with the manifest; a file already on the
node (same name, size and sha256) is reused instead of downloaded. The checkpoint is
assembled in a hidden staging directory and renamed into place, so the trainer never
sees a half-restored directory; it gets the marker of the step it was published with,
so `shardcache.checkpoint.restore()` and `resume_from=` find it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import pyarrow.fs as pafs

from shardcache import checkpoint, errors, source
from shardcache_sidecar.checkpoint import layout, uploader
from shardcache_sidecar.checkpoint import metrics as metrics_mod
from shardcache_sidecar.checkpoint import settings as settings_mod

log = logging.getLogger(__name__)
STAGING_PREFIX = f"{checkpoint.RESERVED_PREFIX}restore-"
TRASH_PREFIX = f"{checkpoint.RESERVED_PREFIX}trash-"


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    #: The restored step; None when nothing was restored (restore none, empty bucket).
    step: int | None = None
    path: Path | None = None
    downloaded_bytes: int = 0
    reused_bytes: int = 0
    #: Steps skipped because they were corrupted (only with fallback), with the reason.
    skipped: tuple[tuple[int, str], ...] = ()
    created_at: float | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "version": checkpoint.PROTOCOL_VERSION,
            "phase": "restored" if self.step is not None else "clean",
            "step": self.step,
            "path": str(self.path) if self.path is not None else None,
            "downloaded_bytes": self.downloaded_bytes,
            "reused_bytes": self.reused_bytes,
            "skipped": [list(s) for s in self.skipped],
        }


def candidates(
    fs: pafs.FileSystem, prefix: str, wanted: str | int, complete: list[int]
) -> list[int]:
    """Steps to try, first choice first; the rest are the fallbacks (older steps)."""
    if wanted == "latest":
        pointer = layout.parse_pointer(layout.read_json(fs, layout.pointer_path(prefix)))
        if pointer is not None and (not complete or pointer != complete[-1]):
            # The pointer lags after a crash between the manifest and the pointer write;
            # the newest published manifest is the truth.
            log.warning(
                "the latest pointer names step %s; newest published is %s", pointer, complete
            )
        return sorted(complete, reverse=True)
    assert isinstance(wanted, int)
    if wanted not in complete:
        raise errors.InputError(
            f"cannot restore step {wanted}: it is not published under {prefix} (published "
            f"steps: {complete or 'none'}); pin a published step or use latest"
        )
    return [wanted, *sorted((s for s in complete if s < wanted), reverse=True)]


def restore(
    fs: pafs.FileSystem,
    prefix: str,
    root: Path,
    *,
    wanted: str,
    fallback: bool,
    concurrency: int,
    retry: source.RetryPolicy,
    observer: metrics_mod.Observer | None = None,
) -> RestoreResult:
    """Restore what `wanted` ("latest", "none" or a step) names into `root`.

    Raises CorruptCheckpointError when the chosen checkpoint does not match its
    manifest (unless `fallback`, which then tries the next older one), InputError for
    a pinned step that is not published, SourceError when the store keeps failing.
    """
    choice = settings_mod.parse_restore(wanted)
    try:
        root.mkdir(parents=True, exist_ok=True)
        clean_leftovers(root)
    except OSError as exc:
        raise errors.InputError(
            f"cannot use the checkpoint volume {str(root)!r}: {exc}; expected a writable "
            "directory (spec.checkpoint.mountPath)"
        ) from exc
    if choice is None:
        return RestoreResult()
    complete, _ = source.with_retries(
        lambda: layout.list_steps(fs, prefix),
        what=f"listing checkpoints under {prefix}",
        policy=retry,
    )
    steps = source.with_retries(
        lambda: candidates(fs, prefix, choice, complete),
        what="reading the latest pointer",
        policy=retry,
    )
    skipped: list[tuple[int, str]] = []
    for step in steps:
        try:
            result = restore_step(
                fs, prefix, root, step, concurrency=concurrency, retry=retry, observer=observer
            )
        except layout.CorruptCheckpointError as exc:
            if not fallback:
                raise layout.CorruptCheckpointError(
                    f"{exc}; the store holds a damaged copy of step {step}. Restore another "
                    f"step (spec.checkpoint.restore), or set "
                    f"{settings_mod.ENV_CHECKPOINT_RESTORE_FALLBACK}=1 to fall back to the "
                    "previous checkpoint"
                ) from exc
            log.error("checkpoint step %d is corrupted, falling back: %s", step, exc)
            skipped.append((step, str(exc)))
            continue
        return dataclasses.replace(result, skipped=tuple(skipped))
    if skipped:
        raise layout.CorruptCheckpointError(
            "every published checkpoint is corrupted: "
            + "; ".join(f"step {s}: {why}" for s, why in skipped)
        )
    return RestoreResult()


def clean_leftovers(root: Path) -> None:
    """Remove staging and trash directories of a restore that died."""
    for entry in os.scandir(root):
        if entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(entry.path, ignore_errors=True)


def restore_step(
    fs: pafs.FileSystem,
    prefix: str,
    root: Path,
    step: int,
    *,
    concurrency: int,
    retry: source.RetryPolicy,
    observer: metrics_mod.Observer | None = None,
) -> RestoreResult:
    obs = observer or metrics_mod.NullObserver()
    where = layout.manifest_path(prefix, step)
    raw = source.with_retries(
        lambda: layout.read_json(fs, where), what=f"reading {where}", policy=retry
    )
    if raw is None:
        raise errors.SourceError(f"{where} disappeared while restoring (deleted by retention?)")
    manifest = layout.CheckpointManifest.from_json(raw, where=where)
    dest = root / manifest.name
    staging = root / f"{STAGING_PREFIX}{manifest.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()

    def fetch(entry: layout.FileEntry) -> tuple[layout.FileEntry, bool]:
        local = dest / entry.path
        if _intact(local, entry):
            obs.transferred("reused", entry.size)
            return entry, True
        remote = layout.data_path(prefix, step, entry.path)
        target = staging / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        obs.file_started()
        try:
            source.with_retries(
                lambda: _download(fs, remote, target, entry, obs),
                what=f"downloading {remote}",
                policy=retry,
            )
        finally:
            obs.file_finished()
        return entry, False

    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool:
            outcomes = list(pool.map(fetch, sorted(manifest.files, key=lambda f: -f.size)))
        reused = [e for e, was_reused in outcomes if was_reused]
        _assemble(dest, staging, reused, {f.path for f in manifest.files})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    checkpoint.write_marker(
        dest,
        checkpoint.Marker(
            step=step, data_state=manifest.data_state, committed_at=manifest.created_at
        ),
    )
    checkpoint.write_status(
        dest, checkpoint.Status(phase="restored", step=step, updated_at=time.time())
    )
    reused_bytes = sum(e.size for e in reused)
    return RestoreResult(
        step=step,
        path=dest,
        downloaded_bytes=manifest.total_bytes - reused_bytes,
        reused_bytes=reused_bytes,
        created_at=manifest.created_at,
    )


def _intact(local: Path, entry: layout.FileEntry) -> bool:
    try:
        if not local.is_file() or local.stat().st_size != entry.size:
            return False
        return uploader.sha256_file(local) == entry.sha256
    except OSError:
        return False


def _download(
    fs: pafs.FileSystem,
    remote: str,
    target: Path,
    entry: layout.FileEntry,
    obs: metrics_mod.Observer,
) -> None:
    h = hashlib.sha256()
    size = 0
    with fs.open_input_stream(remote) as src, open(target, "wb") as out:
        while chunk := src.read(uploader.CHUNK):
            h.update(chunk)
            out.write(chunk)
            size += len(chunk)
            obs.transferred("download", len(chunk))
    found = h.hexdigest()
    if (found, size) != (entry.sha256, entry.size):
        raise layout.CorruptCheckpointError(
            f"{remote}: expected sha256 {entry.sha256} ({entry.size} bytes) as the manifest "
            f"says, found {found} ({size} bytes)"
        )


def _assemble(dest: Path, staging: Path, reused: list[layout.FileEntry], wanted: set[str]) -> None:
    """Make `dest` hold exactly the checkpoint's files: reused ones plus those in staging."""
    if dest.is_dir() and len(reused) == len(wanted) and _files(dest) == wanted:
        return  # the copy on the node is the checkpoint already
    for entry in reused:
        target = staging / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(dest / entry.path, target)
    if dest.exists():
        trash = dest.with_name(f"{TRASH_PREFIX}{dest.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(dest, trash)
        os.replace(staging, dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, dest)


def _files(directory: Path) -> set[str]:
    return {rel for rel, _ in uploader.list_files(directory)}
