"""Tier files of another user that this process may not open.

The disk tier is shared by the sidecars of a namespace on a node, and their user can
change (the chart's `nodeCache.uid` between releases; a sidecar restarted under
another user). Files are made mode 0644 whatever the umask (`regular_files`), so
every user of the directory's group reads them; but a release that honoured a umask of
077 left files only their owner may open. The directory (2770, the sidecar's group)
lets the new user remove them, nothing more: a lease lock it cannot open made every
lookup of the key raise `PermissionError`, and an eviction that chose it raised the
same at every insert for good (the tier full forever).

So such a file is handled as what it is to this process, a file in the way: an entry
whose meta or data file it cannot read is a bad entry (removed, produced again), a lock
file it cannot open is replaced by one it can (`replace_lock`), with a WARNING naming
the file, its owner and mode, and this process's user. Removing files a process of the
old user may still use costs no data: entries are immutable and replaced by rename, so
an open or mapped file stays valid; only that process's lease is no longer seen here.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from pathlib import Path

from shardcache import errors

logger = logging.getLogger("shardcache.node.tiers")


@functools.cache
def _user() -> tuple[int, frozenset[int]]:
    # Asked once: a lookup checks every entry it serves, and a process's user stays.
    return os.geteuid(), frozenset((os.getegid(), *os.getgroups()))


def readable(st: os.stat_result) -> bool:
    """Whether this process may read a file of this `stat`, by its mode bits (root may
    read anything); the user and groups are those at the first call."""
    euid, groups = _user()
    if euid == 0:
        return True
    if st.st_uid == euid:
        return bool(st.st_mode & stat.S_IRUSR)
    if st.st_gid in groups:
        return bool(st.st_mode & stat.S_IRGRP)
    return bool(st.st_mode & stat.S_IROTH)


def describe(st: os.stat_result) -> str:
    """Who owns a file and may read it, and who this process is, in words."""
    return (
        f"owned by uid {st.st_uid}, gid {st.st_gid}, mode {stat.S_IMODE(st.st_mode):04o}; "
        f"this process runs as uid {os.geteuid()}, gid {os.getegid()}"
    )


def unreadable_why(path: Path, what: str) -> str:
    """Why a file that could not be opened is not this process's to read."""
    try:
        st = os.lstat(path)
    except OSError:
        return f"its {what} {path} cannot be opened by this process (uid {os.geteuid()})"
    return (
        f"its {what} {path} cannot be read by this process: {describe(st)} (made by a "
        "process of another user with a restrictive umask)"
    )


class Unremovable(errors.CacheError):
    """A file of another user this process may neither open nor remove."""


def directory(root: Path) -> str:
    """The directory's owner and mode, in words, for a message about removing files."""
    try:
        st = os.stat(root)
    except OSError as exc:
        return f"{root} cannot be examined: {exc.strerror}"
    sticky = ", with the sticky bit" if st.st_mode & stat.S_ISVTX else ""
    return (
        f"the directory is owned by uid {st.st_uid}, gid {st.st_gid}, mode "
        f"{stat.S_IMODE(st.st_mode):04o}{sticky}"
    )


def removal_fix(root: Path) -> str:
    """What lets this process remove another user's files in the tier directory `root`,
    in words (the sticky bit keeps them: only their owner or root may)."""
    return (
        "the directory must let its users remove each other's files (mode 2770 without "
        f"the sticky bit: chmod -t {root}), or remove the files of other users by hand"
    )


def replace_lock(path: Path, *, tier: str) -> None:
    """Remove the lock file `path` this process could not open, so that the next
    acquisition makes one it can; call under the tier lock held exclusively (every
    removal of a lock file is, so none removes the one made here).

    Left alone if what is there now is readable (another process replaced it first).
    Unremovable (a CacheError) if it cannot be removed (a directory with the sticky
    bit keeps another user's files).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode) or readable(st):
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    except PermissionError as exc:
        raise Unremovable(
            f"{tier} tier: cannot open the lock file {path} ({describe(st)}) nor remove it "
            f"({exc.strerror}): {directory(path.parent)}. "
            f"Remove it as uid {st.st_uid} or root, and make the directory mode 2770 "
            '(docs/operator.md, "The node disk tier")'
        ) from exc
    logger.warning(
        "%s tier: replaced the lock file %s, which this process could not open (%s; made "
        "by a process of another user with a restrictive umask). A process of uid %d "
        "that holds a lock on the old file is no longer seen here (its lease does not "
        "keep the entry from eviction); the files it has open stay valid",
        tier, path, describe(st), st.st_uid,
    )  # fmt: skip
