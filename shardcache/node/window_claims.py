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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from shardcache.node import _locks, after_fork, nested_json

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
                self._dir.mkdir(exist_ok=True)
                self._lock_fd = _locks.acquire(
                    self._dir / (self._name + _LOCK), _locks.EXCLUSIVE, create=True
                )
            body = json.dumps({"version": VERSION, "pid": self._pid, "readers": wanted})
            tmp = self._dir / f".tmp-{self._name}"
            tmp.write_text(body)
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
        for name in names:
            stem = name[: -len(_DATA)]
            if stem == self._name and os.getpid() == self._pid:
                continue
            if self._dead(stem):
                continue
            try:
                raw = (self._dir / name).read_bytes()
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
        fd = _locks.acquire(lock, _locks.EXCLUSIVE | _locks.NONBLOCKING, create=False)
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
