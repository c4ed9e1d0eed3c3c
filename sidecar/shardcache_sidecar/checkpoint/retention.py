"""Keep the newest N checkpoints, in the store and on the node, and move `latest`.

Order matters for readers: a checkpoint is deleted manifest first, so it stops being
a checkpoint before any of its files go; the pointer only ever moves forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
from collections.abc import Set
from pathlib import Path

import pyarrow.fs as pafs

from shardcache import faultpoints, source
from shardcache.checkpoint import _protocol, layout

log = logging.getLogger(__name__)


def publish_pointer(
    fs: pafs.FileSystem,
    prefix: str,
    manifest: layout.CheckpointManifest,
    *,
    retry: source.RetryPolicy,
) -> None:
    """Point `latest` at `manifest` unless it already names a newer published step."""
    where = layout.pointer_path(prefix)

    def move() -> None:
        current = layout.parse_pointer(layout.read_json(fs, where))
        if current is not None and current > manifest.step:
            still_there = fs.get_file_info(layout.manifest_path(prefix, current))
            if still_there.type == pafs.FileType.File:
                return
        layout.write_json(fs, where, layout.pointer_json(manifest))

    source.with_retries(move, what=f"updating {where}", policy=retry)


def prune_remote(
    fs: pafs.FileSystem, prefix: str, keep_last: int, *, retry: source.RetryPolicy
) -> list[int]:
    """Delete all but the newest `keep_last` published checkpoints; the kept steps."""
    complete, incomplete = source.with_retries(
        lambda: layout.list_steps(fs, prefix), what=f"listing {prefix}", policy=retry
    )
    dropped, orphans = layout.retention_plan(complete, incomplete, keep_last)
    for step in dropped:
        log.info("retention: deleting checkpoint step %d (keeping the last %d)", step, keep_last)
        source.with_retries(
            functools.partial(_delete_published, fs, prefix, step),
            what=f"deleting step {step}",
            policy=retry,
        )
    for step in orphans:
        log.info("retention: deleting the unfinished upload of step %d", step)
        source.with_retries(
            functools.partial(fs.delete_dir, layout.step_dir(prefix, step)),
            what=f"deleting step {step}",
            policy=retry,
        )
    return [s for s in complete if s not in dropped]


def _delete_published(fs: pafs.FileSystem, prefix: str, step: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.delete_file(layout.manifest_path(prefix, step))
    faultpoints.reach("checkpoint.retention")
    fs.delete_dir(layout.step_dir(prefix, step))


def prune_local(root: Path, keep_last: int, *, held: Set[str] = frozenset()) -> list[Path]:
    """Delete published checkpoint directories on the node beyond the newest `keep_last`.

    Only directories whose status says uploaded or restored are counted or deleted: a
    checkpoint not yet in the store is never removed. Directories named in `held` (an
    older step a trainer just asked for) are neither counted nor deleted.
    """
    done = [
        c
        for c in _protocol.local_checkpoints(root)
        if c.path.name not in held
        and c.status is not None
        and c.status.step == c.step
        and c.status.phase in ("uploaded", "restored")
    ]
    removed = [c.path for c in done[:-keep_last]]
    for path in removed:
        log.info("retention: removing %s from the node", path)
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            # The trainer runs as another user and may keep its files to itself: then
            # the volume's sizeLimit, not retention, bounds what stays on the node.
            log.warning("retention: cannot remove all of %s from the node", path)
        else:
            _protocol.remove_status(path)
    return removed
