"""Files of the checkpoint volume opened without following symbolic links.

The checkpoint volume is written by the trainer, which the sidecar does not trust with
its own files: the sidecar's container holds the source's credentials and mounts the
node's disk tier, shared by every tenant on the node. A symlink the trainer plants
(`model.bin -> /var/cache/shardcache/...`, a directory `a -> /proc/self`) would make the
agent upload, hash or overwrite a file the trainer cannot reach itself. So every path
below the checkpoint root is walked one component at a time with `O_NOFOLLOW` (each
directory opened relative to its parent's descriptor, so a link swapped in between a
check and the open is refused too), and only regular files are read or written.

A refused path raises `SymlinkError` (an `InputError`), whose message names the path
and says why; the agent writes it into the checkpoint's status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from shardcache import errors

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SymlinkError(errors.InputError):
    """A path of the checkpoint volume is a symbolic link or not a regular file."""


def _refused(path: Path | str, what: str) -> SymlinkError:
    return SymlinkError(
        f"{str(path)!r} is {what}: the checkpoint agent never follows links or reads "
        "special files in the checkpoint volume; copy the file into the directory instead"
    )


@contextlib.contextmanager
def _parent_fd(root: Path, rel: str, *, create: bool) -> Iterator[tuple[int, str]]:
    """(descriptor of the directory holding `rel`, its last component), walked from
    `root` without following links; `create` makes missing directories."""
    parts = [p for p in rel.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise errors.InputError(f"{rel!r} is not a path inside {str(root)!r}")
    fd = os.open(root, _DIR_FLAGS)
    try:
        for i, part in enumerate(parts[:-1]):
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = root.joinpath(*parts[: i + 1])
                    raise _refused(where, "a symbolic link or not a directory") from None
                raise
            os.close(fd)
            fd = child
        yield fd, parts[-1]
    finally:
        os.close(fd)


def open_read(root: Path, rel: str) -> int:
    """A read-only descriptor of the regular file `root/rel` (links refused)."""
    with _parent_fd(root, rel, create=False) as (parent, name):
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(root / rel, "a symbolic link") from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(root / rel, "not a regular file")
    # O_NONBLOCK only kept a FIFO from blocking the open; reads of a file ignore it.
    return fd


def open_write(root: Path, rel: str, *, create: bool = False) -> int:
    """A write descriptor of `root/rel`, a regular file (made empty with `create`,
    its directories too); links refused."""
    with _parent_fd(root, rel, create=create) as (parent, name):
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if create:
            flags |= os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(root / rel, "a symbolic link") from None
            raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(root / rel, "not a regular file")
    return fd


def make_parents(root: Path, rel: str) -> None:
    """Create the directories of `root/rel` below `root`, following no link."""
    with _parent_fd(root, rel, create=True):
        pass


def make_dir(root: Path, rel: str) -> None:
    """Create the directory `root/rel` and its parents below `root`, following no link."""
    with _parent_fd(root, rel, create=True) as (parent, name):
        try:
            os.mkdir(name, 0o755, dir_fd=parent)
        except FileExistsError:
            if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                raise _refused(root / rel, "a symbolic link or not a directory") from None


@dataclasses.dataclass(frozen=True)
class Listing:
    """What a checkpoint directory holds, as the manifest records it."""

    #: (relative '/'-path, size) of every regular file, sorted.
    files: list[tuple[str, int]]
    #: Relative '/'-paths of the directories that hold nothing (no file the listing
    #: keeps, no subdirectory), sorted: all a restore needs to recreate the tree.
    empty_dirs: list[str]


def regular_files(directory: Path, *, skip_prefix: str) -> Listing:
    """Every file below `directory` and every empty directory; files whose name starts
    with `skip_prefix` (the protocol's own) are left out.

    Raises `SymlinkError` naming the first symbolic link or special file found: a
    checkpoint with one is refused whole, never uploaded without it. Raises
    `InputError` naming a file whose name is not UTF-8: object keys and the manifest
    are UTF-8 text, so it could not be stored under its name.
    """
    found: list[tuple[str, int]] = []
    empty: list[str] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        holds = False
        with os.scandir(directory / rel_dir if rel_dir else directory) as entries:
            for entry in entries:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                info = entry.stat(follow_symlinks=False)
                if entry.name.startswith(skip_prefix) and not stat.S_ISDIR(info.st_mode):
                    continue
                _check_utf8(rel)
                holds = True
                if stat.S_ISLNK(info.st_mode):
                    raise _refused(rel, "a symbolic link")
                if stat.S_ISDIR(info.st_mode):
                    pending.append(rel)
                elif stat.S_ISREG(info.st_mode):
                    found.append((rel, info.st_size))
                else:
                    raise _refused(rel, "not a regular file")
        if rel_dir and not holds:
            empty.append(rel_dir)
    return Listing(sorted(found), sorted(empty))


def _check_utf8(rel: str) -> None:
    # os.scandir decodes a name that is not UTF-8 with surrogate escapes; such a str
    # cannot be encoded back to UTF-8 (pyarrow would fail on it mid-upload).
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.InputError(
            f"{os.fsencode(rel)!r}: the file name is not UTF-8; object keys and the "
            "checkpoint's manifest are UTF-8 text, so it cannot be stored under its name: "
            "rename it (encode names as UTF-8)"
        ) from None
