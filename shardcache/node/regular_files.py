"""Opening the files of a directory that others may have replaced with anything.

A tier directory is written by more than one party: every sidecar of a namespace on
the node shares its disk tier (and anyone with `pods/exec` into one of them), and the
trainer's processes write the pod's memory volume. Whatever they put at a tier's file
name must cost at most that entry, never the process:

* a FIFO with no writer blocks an `open` for reading forever (one at `<key>.lock`
  froze every cache operation of a sidecar, the tier lock being taken under a
  process-wide lock around that open);
* a symbolic link leads anywhere: to a 300 MiB file read whole as a meta file, or to
  /dev/zero, read until the OOM killer came;
* a directory cannot be unlinked, nor renamed over by a file: one in an entry's place
  made every later insert of the key fail.

So every tier file is opened with `O_NOFOLLOW | O_NONBLOCK` (never through a link, never
waiting for a FIFO's writer) and used only if `fstat` says it is a regular file;
anything else is `NotRegularFile`, which the tier treats as a bad entry and removes
(`remove`, a directory too). Reads of small files are capped (`read_capped`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

from shardcache import errors

#: Every tier file is opened so: never through a link, never waiting for a writer.
SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISREG, "a regular file"),
)


def kind(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words ("a FIFO")."""
    return next((words for test, words in _KINDS if test(mode)), f"a file of mode {mode:o}")


class NotRegularFile(errors.CacheError):
    """A name where a regular file was expected holds something else."""

    def __init__(self, path: Path | str, what: str, ident: tuple[int, int] | None) -> None:
        super().__init__(f"{path} is {what}, expected a regular file")
        self.path = Path(path)
        self.what = what
        #: (st_dev, st_ino) of what was found, so that only it is ever removed.
        self.ident = ident


def _found(path: Path | str) -> NotRegularFile | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st.st_mode):
        return None
    return NotRegularFile(path, kind(st.st_mode), (st.st_dev, st.st_ino))


def open_regular(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a regular file, never through a link and never blocking.

    With `O_CREAT`, a file of this process's user gets `mode` exactly (not masked by
    the umask). Raises NotRegularFile for anything else at `path` (a link, a FIFO, a
    directory, a device, a socket), FileNotFoundError if nothing is there (without
    `O_CREAT`), and other OSErrors as `os.open` does. The descriptor keeps `O_NONBLOCK`, which changes
    nothing for a regular file (nor for `flock`, which blocks or not by its own flag).
    """
    try:
        fd = os.open(path, flags | SAFE_FLAGS, mode)
    except OSError as exc:
        # ELOOP: a link (O_NOFOLLOW); EISDIR: a directory opened for writing; ENXIO: a
        # FIFO opened for writing without a reader, or a socket.
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV):
            found = _found(path)
            if found is not None:
                raise found from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(path, kind(st.st_mode), (st.st_dev, st.st_ino))
    if flags & os.O_CREAT and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        # `mode` whatever the umask: a tier directory is shared by processes of other
        # users (sidecars of another release's uid, trainers reading the memory tier),
        # and a lock or entry file only its owner may open wedged them (`PermissionError`
        # on every lookup and eviction of the key). Only the owner may change it.
        with contextlib.suppress(OSError):
            os.fchmod(fd, mode)
    return fd


def read_capped(path: Path | str, limit: int) -> tuple[bytes, os.stat_result]:
    """The contents of the regular file `path` and its `fstat`, if at most `limit`
    bytes; CacheError naming its size otherwise (NotRegularFile for a link, a FIFO...)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise errors.CacheError(f"{path} is {st.st_size} bytes, expected at most {limit}")
        data = os.read(fd, limit + 1)
        if len(data) > limit:  # grew since the fstat
            raise errors.CacheError(f"{path} is over {limit} bytes, expected at most {limit}")
        return data, st
    finally:
        os.close(fd)


def remove(path: Path | str) -> bool:
    """Remove what is at `path`: a file, a link (not what it points to), a FIFO, or a
    directory with everything in it. Whether something was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        # fd-based on Linux: a link inside is removed, never followed.
        shutil.rmtree(path, ignore_errors=True)
    return True


def remove_found(bad: NotRegularFile) -> bool:
    """Remove what `bad` found, if the name still holds that very file (a regular file
    put there since is left alone); whether it was removed."""
    try:
        st = os.lstat(bad.path)
    except FileNotFoundError:
        return False
    if bad.ident is not None and (st.st_dev, st.st_ino) != bad.ident:
        return False
    if stat.S_ISREG(st.st_mode):
        return False
    return remove(bad.path)
