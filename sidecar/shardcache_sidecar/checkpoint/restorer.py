"""Restore a published checkpoint into the checkpoint volume before the trainer starts.

Every restored byte is hashed and compared with the manifest; a file already on the
node (same name, size and sha256) is reused instead of downloaded. The checkpoint is
assembled in a hidden staging directory and renamed into place, so the trainer never
sees a half-restored directory; it gets the marker of the step it was published with,
so `shardcache.checkpoint.restore()` and `resume_from=` find it.

A skip requested for the step (`shardcache skip`, `layout.SkipRequest`) is applied to
the marker's data state, so the trainer resumes with the skip already recorded; every
restore of that step applies it again, identically.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path

import pyarrow.fs as pafs

from shardcache import contract, errors, faultpoints, source, states
from shardcache.checkpoint import _protocol, layout
from shardcache_sidecar.checkpoint import agent_config, metrics, nofollow, uploader

log = logging.getLogger(__name__)
#: Piece size of parallel ranged downloads: large enough that a request's latency is
#: small next to its transfer, small enough that a 1 GiB file is 32 requests at once.
RANGE = 32 << 20
STAGING_PREFIX = f"{_protocol.RESERVED_PREFIX}restore-"
TRASH_PREFIX = f"{_protocol.RESERVED_PREFIX}trash-"


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
    #: The skip applied to the restored data state (epoch, start, stop, batches), if any.
    skip: dict[str, int] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "version": _protocol.PROTOCOL_VERSION,
            "phase": "restored" if self.step is not None else "clean",
            "step": self.step,
            "path": str(self.path) if self.path is not None else None,
            "downloaded_bytes": self.downloaded_bytes,
            "reused_bytes": self.reused_bytes,
            "skipped": [list(s) for s in self.skipped],
            "skip": self.skip,
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
    observer: metrics.Observer | None = None,
) -> RestoreResult:
    """Restore what `wanted` ("latest", "none" or a step) names into `root`.

    Raises CorruptCheckpointError when the chosen checkpoint does not match its
    manifest (unless `fallback`, which then tries the next older one), InputError for
    a pinned step that is not published, SourceError when the store keeps failing.
    """
    choice = agent_config.parse_restore(wanted)
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
                    f"step (spec.checkpoint.restore), or set spec.checkpoint.restoreFallback "
                    f"({contract.ENV_CHECKPOINT_RESTORE_FALLBACK}=1) to fall back to the "
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
    observer: metrics.Observer | None = None,
) -> RestoreResult:
    obs = observer or metrics.NullObserver()
    where = layout.manifest_path(prefix, step)
    raw = source.with_retries(
        lambda: layout.read_json(fs, where), what=f"reading {where}", policy=retry
    )
    if raw is None:
        raise errors.SourceError(f"{where} disappeared while restoring (deleted by retention?)")
    manifest = layout.CheckpointManifest.from_json(raw, where=where)
    request = source.with_retries(
        lambda: layout.read_skip_request(fs, prefix, step),
        what=f"reading the skip request of step {step}",
        policy=retry,
    )
    data_state, applied = apply_skip(manifest.data_state, request, where=where)
    dest = destination(root, manifest.name, step)
    staging = root / f"{STAGING_PREFIX}{dest.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()

    def intact(entry: layout.FileEntry) -> bool:
        return _intact(dest, entry)

    def fetch(task: tuple[layout.FileEntry, int, int]) -> None:
        entry, offset, length = task
        remote = layout.data_path(prefix, step, entry.path)
        source.with_retries(
            lambda: _fetch_range(fs, remote, staging, entry, offset, length),
            what=f"downloading {remote} [{offset}, {offset + length})",
            policy=retry,
        )
        obs.transferred("download", length)
        faultpoints.reach("checkpoint.restore.fetch")

    def verify(entry: layout.FileEntry) -> None:
        found = uploader.sha256_file(staging, entry.path)
        if found != entry.sha256:
            remote = layout.data_path(prefix, step, entry.path)
            raise layout.CorruptCheckpointError(
                f"{remote}: expected sha256 {entry.sha256} ({entry.size} bytes) as the "
                f"manifest says, found {found}"
            )

    entries = sorted(manifest.files, key=lambda f: -f.size)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, concurrency)) as pool:
            flags = list(pool.map(intact, entries))
            reused = [e for e, ok in zip(entries, flags, strict=True) if ok]
            missing = [e for e, ok in zip(entries, flags, strict=True) if not ok]
            for entry in reused:
                obs.transferred("reused", entry.size)
            for entry in missing:
                # The trainer can write the volume: no link below staging is followed.
                fd = nofollow.open_write(staging, entry.path, create=True)
                try:
                    os.ftruncate(fd, entry.size)
                finally:
                    os.close(fd)
            # Large files as parallel ranged reads, all files' ranges on one pool.
            tasks = [(e, off, n) for e in missing for off, n in ranges(e.size)]
            list(pool.map(fetch, tasks))
            list(pool.map(verify, missing))
        for rel in manifest.dirs:
            nofollow.make_dir(staging, rel)
        faultpoints.reach("checkpoint.restore.assemble")
        _assemble(
            dest, staging, reused, wanted={f.path for f in manifest.files}, dirs=set(manifest.dirs)
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _protocol.write_marker(
        dest,
        _protocol.Marker(step=step, data_state=data_state, committed_at=manifest.created_at),
    )
    _protocol.write_status(
        dest, _protocol.Status(phase="restored", step=step, updated_at=time.time())
    )
    if request is not None and applied is not None:
        record_applied(fs, prefix, request, applied)
    reused_bytes = sum(e.size for e in reused)
    return RestoreResult(
        step=step,
        path=dest,
        downloaded_bytes=manifest.total_bytes - reused_bytes,
        reused_bytes=reused_bytes,
        created_at=manifest.created_at,
        skip=applied,
    )


#: Most names tried beside a directory a restore must not replace (`destination`).
_MAX_OTHER_NAMES = 100


def destination(root: Path, name: str, step: int) -> Path:
    """Where checkpoint `step`, named `name` in its manifest, is restored.

    `root/name`, unless that directory holds a commit that is not in the store: a
    checkpoint of another step not yet uploaded (a trainer reusing its directory names
    committed a newer step there), one the agent refused (a duplicate step), or one
    whose marker cannot be read. The restore never deletes such a commit; it goes to
    `<name>.restored-<step>` instead (`-2`, `-3`, … if that is taken too), and the
    caller gets that path.
    """
    for i in range(_MAX_OTHER_NAMES):
        candidate = name if i == 0 else f"{name}.restored-{step}" + (f"-{i}" if i > 1 else "")
        path = root / candidate
        if not _holds_unpublished_commit(path, step):
            if i:
                log.warning(
                    "restoring checkpoint step %d into %s: %s holds a commit that is not in "
                    "the store, which a restore never replaces",
                    step,
                    path,
                    root / name,
                )
            return path
    raise errors.InputError(
        f"cannot restore checkpoint step {step}: {str(root / name)!r} and "
        f"{_MAX_OTHER_NAMES - 1} other names beside it hold commits that are not in the "
        "store; remove some or let them upload, then ask again"
    )


def _holds_unpublished_commit(path: Path, step: int) -> bool:
    """Whether a restore of `step` into `path` would delete a commit not in the store."""
    if not path.is_dir() or path.is_symlink():
        return False  # nothing there, or not a checkpoint directory (replaced as before)
    try:
        marker = _protocol.read_marker(path)
    except errors.InputError:
        return True  # the trainer's commit, refused by the agent: not ours to delete
    if marker is None:
        return False  # not committed: leftovers a restore may reuse
    status = _protocol.read_status(path)
    if status is not None and status.step == marker.step:
        if status.phase in _protocol.DONE_PHASES:
            return False  # in the store: the restore loses nothing
        if status.phase == "failed" and not status.retryable:
            return True  # refused for good (a duplicate step): the store does not have it
    # The same step not yet uploaded is the node's own copy of it (a restart after a
    # crash between the manifest and the status): its intact files are reused.
    return marker.step != step


def apply_skip(
    data_state: dict[str, object] | None, request: layout.SkipRequest | None, *, where: str
) -> tuple[dict[str, object] | None, dict[str, int] | None]:
    """The data state the trainer gets, with the requested skip recorded, and the skip.

    The state keeps the version the trainer saved it as (`states.rewritten`): the
    trainer's image may be of an older release than this sidecar's, and refuses a
    version it does not read. The agent does not know the dataset, so a skip past the
    end of the epoch is cut when the dataset loads the state (`states.clamp`). Raises
    InputError when the checkpoint has no data state to skip in, or no batch size is
    known.
    """
    if request is None:
        return data_state, None
    if data_state is None:
        raise errors.InputError(
            f"{where}: a skip of {request.batches} batches is requested, but the checkpoint "
            "has no data state: commit with data_state=dataset.state_dict()"
        )
    state = states.parse(data_state, where=f"{where} data_state")
    try:
        new, skip = states.skip_batches(
            state, request.batches, batch_size=request.batch_size, rank_samples=None
        )
    except errors.InputError as exc:
        raise errors.InputError(
            f"{where}: cannot apply the requested skip: {exc}; request it again with "
            "shardcache skip --batch-size B"
        ) from exc
    assert skip is not None
    log.warning(
        "restoring step %d with a skip of %d batches: epoch %d positions [%d, %d) of rank %d",
        request.step,
        request.batches,
        skip.epoch,
        skip.start,
        skip.stop,
        state.rank,
    )
    # At the version the trainer wrote: it may be of an older release than this agent.
    return states.rewritten(new, saved=data_state), {
        **skip.to_json(),
        "batches": request.batches,
        "rank": state.rank,
    }


def record_applied(
    fs: pafs.FileSystem, prefix: str, request: layout.SkipRequest, applied: dict[str, int]
) -> None:
    """Say in the store that the skip was applied (the operator reports it). Best
    effort: the trainer already has its state, and a lost record only loses a report."""
    record = {
        "version": layout.LAYOUT_VERSION,
        "step": request.step,
        "requested_at": request.requested_at,
        "reason": request.reason,
        "applied_at": time.time(),
        **applied,
    }
    try:
        layout.write_json(fs, layout.skip_applied_path(prefix, request.step), record)
    except (OSError, errors.ShardcacheError) as exc:
        log.warning("could not record the applied skip of step %d: %s", request.step, exc)


def _intact(dest: Path, entry: layout.FileEntry) -> bool:
    """Whether `dest/entry.path` is a regular file (reached without links) with the
    entry's size and sha256: a link the trainer planted is never reused."""
    try:
        fd = nofollow.open_read(dest, entry.path)
    except (OSError, errors.InputError):
        return False
    try:
        if os.fstat(fd).st_size != entry.size:
            return False
    finally:
        os.close(fd)
    try:
        return uploader.sha256_file(dest, entry.path) == entry.sha256
    except (OSError, errors.InputError):
        return False


def ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) pieces of a file downloaded in parallel."""
    return [(off, min(RANGE, size - off)) for off in range(0, size, RANGE)] or [(0, 0)]


def _fetch_range(
    fs: pafs.FileSystem,
    remote: str,
    staging: Path,
    entry: layout.FileEntry,
    offset: int,
    length: int,
) -> None:
    try:
        opened = fs.open_input_file(remote)
    except FileNotFoundError:
        # Not a fault of this request: the manifest promises the object. The store lost
        # it (a lifecycle rule, a person, a writer's retention), so the checkpoint is
        # damaged, and restoreFallback applies.
        raise layout.CorruptCheckpointError(
            f"{remote}: the object named in the manifest is missing from the store (expected "
            f"{entry.size} bytes, sha256 {entry.sha256})"
        ) from None
    with opened as src:
        if src.size() != entry.size:
            raise layout.CorruptCheckpointError(
                f"{remote}: expected {entry.size} bytes as the manifest says, found {src.size()}"
            )
        data = src.read_at(length, offset) if length else b""
    if len(data) != length:
        raise errors.SourceError(f"{remote}: short read at {offset}: {len(data)} of {length}")
    fd = nofollow.open_write(staging, entry.path)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _assemble(
    dest: Path,
    staging: Path,
    reused: list[layout.FileEntry],
    *,
    wanted: set[str],
    dirs: set[str],
) -> None:
    """Make `dest` hold exactly the checkpoint's files and empty directories: reused
    files plus what is in staging."""
    if dest.is_dir() and len(reused) == len(wanted) and _tree(dest) == (wanted, dirs):
        return  # the copy on the node is the checkpoint already
    for entry in reused:
        target = staging / entry.path
        nofollow.make_parents(staging, entry.path)
        os.replace(dest / entry.path, target)
    if dest.exists():
        trash = dest.with_name(f"{TRASH_PREFIX}{dest.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(dest, trash)
        os.replace(staging, dest)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, dest)


def _tree(directory: Path) -> tuple[set[str], set[str]] | None:
    """(files, empty directories) of `directory`; None when it must be rebuilt."""
    try:
        listing = uploader.list_files(directory)
    except errors.InputError:
        return None  # a link or special file in it: the directory is rebuilt
    return {rel for rel, _ in listing.files}, set(listing.empty_dirs)
