"""Sample-mode windows claimed in the memory tier's directory, for every process that
shares it (docs/cache-format.md, "Window claims").

A sample-mode reader holds every shard of its current and next window at once
(`windows.held_at`), and the memory tier's check that every reader's windows fit
(`CacheNode._window_room_check`) counted the readers of its own process only. Embedded
caches of several trainer processes sharing one directory (the ranks a launcher starts
on one machine, each calling `shardcache.open()`) then waited for room the others held
until the tier's wait ran out, five minutes. So each such process writes what its
readers hold to a file of its own, and the check adds what the others wrote.

`.windows/<pid>-<token>.json` under the memory tier's directory, replaced whole
(written beside it and renamed) when its process's readers' windows change; its writer
holds an exclusive `flock` on `.windows/<pid>-<token>.lock` for as long as it lives, so
a file whose lock can be taken belongs to a dead process (across PID namespaces, as a
tier's temp files are told apart) and is removed by whoever finds it. Advisory: a file
that cannot be read counts nothing this time.

Processes of different users may share the directory (ranks started under different
uids on one node's tier): the directory and every file are made readable by all
whatever the umask, and a lock file this process cannot open (another user's 0600,
left by a release that honoured a umask of 077) is handled as the tiers handle one
(`tiers._other_users`): replaced, its claims file removed with it, with a WARNING;
where it cannot be removed either (a sticky directory), its file counts nothing.
Until 2026-11-28 it raised PermissionError out of every room check.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from shardcache import errors
from shardcache.node import _locks, after_fork, nested_json, regular_files
from shardcache.node.tiers import _other_users

log = logging.getLogger(__name__)

#: The subdirectory of the memory tier's directory (a dot name: tiers ignore it).
DIRECTORY = ".windows"
#: `version` of a claims file; a reader skips files of another version.
VERSION = 1
_DATA = ".json"
_LOCK = ".lock"
#: A claims file nests 3 deep (the file, its readers, a claim); a deeper one is not
#: parsed (`nested_json`: it would raise RecursionError) but skipped as unreadable.
MAX_DEPTH = 3
#: Bytes of a claims file a reader reads; a larger one counts nothing (it was read
#: whole). A claim lists the keys of two windows of each of the process's readers, a
#: key and its size in under 100 bytes: 16 MiB is over 150,000 held shards, more than
#: any memory tier holds at once.
MAX_BYTES = 16 << 20
#: Anyone using the memory tier's directory makes and removes claims here (its own
#: mode bounds who), as in the tiers' `.limits`.
_DIRECTORY_MODE = 0o777
_FILE_MODE = 0o644

#: A reader's claim: each memory-tier key it holds, with its decoded bytes where known.
Claim = Mapping[str, int | None]


class Claims:
    """This process's claims file in `memory_dir`, and a view of the other processes'."""

    def __init__(self, memory_dir: Path) -> None:
        self._dir = memory_dir / DIRECTORY
        self._pid = -1
        self._name = ""
        self._lock_fd: int | None = None
        self._written: dict[str, dict[str, int | None]] | None = None
        #: The files a WARNING was logged for: they are looked at on every room check.
        self._warned: set[str] = set()
        after_fork.register(self)

    def publish(self, readers: Mapping[str, Claim]) -> None:
        """Make this process's file say `readers` (reader id -> its claim); nothing is
        written when it already does. None of them: the file is removed."""
        wanted = {reader: dict(claim) for reader, claim in readers.items() if claim}
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker): its readers are its own, and the
            # parent's lock it inherited is the parent's (`after_fork` let go of it).
            self._pid, self._lock_fd, self._written = os.getpid(), None, None
            self._name = f"{self._pid}-{secrets.token_hex(4)}"
        if wanted == (self._written or {}):
            return
        if not wanted:
            self._remove()
            return
        try:
            if self._lock_fd is None:
                if not self._dir.is_dir():
                    with contextlib.suppress(FileExistsError):
                        self._dir.mkdir(_DIRECTORY_MODE)
                        os.chmod(self._dir, _DIRECTORY_MODE)  # whatever the umask
                self._lock_fd = _locks.acquire(
                    self._dir / (self._name + _LOCK), _locks.EXCLUSIVE, create=True
                )
            body = json.dumps({"version": VERSION, "pid": self._pid, "readers": wanted})
            tmp = self._dir / f".tmp-{self._name}"
            tmp.write_text(body)
            os.chmod(tmp, _FILE_MODE)  # readable by the directory's other users
            os.replace(tmp, self._dir / (self._name + _DATA))
        except OSError as exc:
            # Advisory: without it, this process's windows go uncounted elsewhere.
            log.warning("could not write the window claims under %s: %s", self._dir, exc)
            return
        self._written = wanted

    def others(self) -> dict[str, dict[str, int | None]]:
        """Every other live process's readers' claims, by `<file>/<reader>`; files of
        dead processes are removed."""
        found: dict[str, dict[str, int | None]] = {}
        try:
            names = [p.name for p in os.scandir(self._dir) if p.name.endswith(_DATA)]
        except FileNotFoundError:
            return found
        except OSError as exc:
            self._warn_once(str(self._dir), "cannot list the window claims in %s: %s", exc)
            return found
        for name in names:
            stem = name[: -len(_DATA)]
            if stem == self._name and os.getpid() == self._pid:
                continue
            if self._dead(stem):
                continue
            try:
                # Never through a link or into a FIFO, and never more than a claims
                # file can hold: it was read whole, whatever its size.
                raw, _ = regular_files.read_capped(self._dir / name, MAX_BYTES)
                nesting = nested_json.depth(raw)
                if nesting > MAX_DEPTH:
                    # Advisory, and looked at on every room check: not a warning each time.
                    log.debug(
                        "window claims file %s: expected JSON nested at most %d deep, "
                        "found %d deep; it counts nothing",
                        self._dir / name,
                        MAX_DEPTH,
                        nesting,
                    )
                    continue
                doc = json.loads(raw)
            except errors.CacheError as exc:
                self._warn_once(
                    name,
                    "window claims file: expected a regular file of at most %d bytes; %s. "
                    "It counts nothing",
                    MAX_BYTES,
                    exc,
                )
                continue
            except (OSError, ValueError):
                continue
            if not isinstance(doc, dict) or doc.get("version") != VERSION:
                continue
            readers = doc.get("readers")
            if not isinstance(readers, dict):
                continue
            for reader, claim in readers.items():
                if isinstance(claim, dict):
                    found[f"{stem}/{reader}"] = {
                        str(k): v if isinstance(v, int) and not isinstance(v, bool) else None
                        for k, v in claim.items()
                    }
        return found

    def _dead(self, stem: str) -> bool:
        """Whether the file `stem` belongs to a process that is gone; if so, removed."""
        lock = self._dir / (stem + _LOCK)
        try:
            fd = _locks.acquire(lock, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
        except PermissionError:
            return self._replace_unopenable(stem, lock)
        except errors.CacheError as exc:  # something else at its name that stays
            self._warn_once(stem, "window claims lock %s: %s; its file counts nothing", lock, exc)
            return True
        if fd is None:
            if lock.exists():
                return False  # held by its live writer
            # A live writer holds its lock until it has removed its file: this one was
            # being removed by whoever found its writer dead.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / (stem + _DATA))
            return True
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._dir / (stem + _DATA))
            _locks.unlink_held(fd, lock)
        finally:
            _locks.close(fd)
        return True

    def _replace_unopenable(self, stem: str, lock: Path) -> bool:
        """The lock of `stem` is another user's that this process may not open, so
        whether its writer lives cannot be told: removed with its claims file, as the
        tiers replace such a lock (`_other_users`). True: its file counts nothing."""
        try:
            st = os.lstat(lock)
        except OSError:
            return True  # gone, or not even to be looked at: counts nothing
        if _other_users.readable(st):
            # Refused for another reason (the directory's mode): its writer may live.
            self._warn_once(
                stem, "window claims lock %s cannot be opened; its file counts nothing", lock
            )
            return True
        try:
            os.unlink(lock)
        except FileNotFoundError:
            pass
        except PermissionError as exc:
            self._warn_once(
                stem,
                "window claims: cannot open the lock file %s (%s) nor remove it (%s): %s. "
                "Its claims count nothing; remove it as uid %d or root",
                lock,
                _other_users.describe(st),
                exc.strerror,
                _other_users.directory(self._dir),
                st.st_uid,
            )
            return True
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(self._dir / (stem + _DATA))
        log.warning(
            "window claims: removed %s and its claims file, which this process could not "
            "open (%s; made by a process of another user with a restrictive umask). Should "
            "that process still run, its windows are no longer counted here",
            lock,
            _other_users.describe(st),
        )
        return True

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        # Each room check looks again: one WARNING per file, then DEBUG.
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, message, *args)

    def _remove(self) -> None:
        if self._lock_fd is None:
            self._written = None
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._dir / (self._name + _DATA))
        _locks.unlink_held(self._lock_fd, self._dir / (self._name + _LOCK))
        _locks.close(self._lock_fd)
        self._lock_fd, self._written = None, None

    def close(self) -> None:
        """Remove this process's file (its readers are closed)."""
        if os.getpid() == self._pid:
            self._remove()

    def after_fork(self) -> None:
        """In a forked child: the parent's lock is the parent's. The copy of its
        descriptor here let go of it at the fork (`_locks`: kept, it would keep the
        parent's file looking alive after the parent died, for as long as the child
        ran, whether or not the child claims anything); what stands in for it is closed.
        """
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                _locks.close(self._lock_fd)
        self._lock_fd, self._written = None, None
