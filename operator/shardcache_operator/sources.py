"""The source I/O the reconcile core is given: manifest resolution and a cheap probe.

Both block (pyarrow filesystems); the core runs them in threads with a timeout.
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow.fs as pafs

from shardcache import errors, manifests, source, uris
from shardcache_operator import reconcile


def resolve_manifest(
    uri: str, fmt: str, storage_options: Mapping[str, str] | None
) -> reconcile.ManifestLike:
    return manifests.resolve(uri, format=fmt, storage_options=storage_options)


def probe_source(uri: str, storage_options: Mapping[str, str] | None) -> None:
    """Two metadata requests at most: does the dataset's root still exist, non-empty?"""
    fs, root = source.filesystem(uri, storage_options=storage_options)

    def present() -> bool:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.File:
            return True
        if info.type == pafs.FileType.NotFound:
            return False
        # Object stores may keep an empty "directory" marker after the data is gone.
        selector = pafs.FileSelector(root, recursive=False, allow_not_found=True)
        return bool(fs.get_file_info(selector))

    if not source.with_retries(present, what=f"checking {uris.redact(uri)}"):
        raise errors.InputError(
            f"nothing found at {uris.redact(uri)!r} any more: the pinned data is gone"
        )
