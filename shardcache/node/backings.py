"""What backs a cache directory: the filesystem type and, for tmpfs, its page size.

The memory tier's warm read speed depends on it (docs/benchmarks.md, "What backs the
memory tier"): a tmpfs with 4 KiB pages costs the reading loop a TLB miss every 4 KiB,
while a huge-page tmpfs or the page cache of a filesystem with large folios (ext4, xfs)
reads at process-memory speed. The sidecar reports what it found (log, status,
metric), so a slow warm pass can be traced to its medium.

`parse` is pure (it takes the text of /proc/self/mountinfo); `of` reads the live table.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")


@dataclasses.dataclass(frozen=True)
class Backing:
    #: The mount point holding the directory.
    mount_point: str
    #: Filesystem type as the kernel names it (tmpfs, ext4, xfs, overlay, ...).
    fstype: str
    #: For tmpfs, its `huge=` mount option ("never" when absent, the kernel's default
    #: for tmpfs mounts); None for other filesystems.
    huge: str | None

    @property
    def small_pages(self) -> bool:
        """True for a tmpfs that hands out 4 KiB pages only."""
        return self.fstype == "tmpfs" and self.huge in ("never", "deny")

    def describe(self) -> str:
        if self.fstype == "tmpfs":
            pages = "4 KiB pages" if self.small_pages else f"huge pages (huge={self.huge})"
            return f"tmpfs at {self.mount_point}, {pages}"
        return f"{self.fstype} at {self.mount_point} (page cache)"

    def to_json(self) -> dict[str, object]:
        return {
            "mount_point": self.mount_point,
            "filesystem": self.fstype,
            "huge": self.huge,
            "small_pages": self.small_pages,
        }


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse(path: str, mountinfo: str) -> Backing | None:
    """The backing of absolute, symlink-free `path` from mountinfo text; None if no
    mount covers it (not a Linux mount table)."""
    best: Backing | None = None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 1:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        # Later lines are mounted later, so they cover earlier ones at the same point.
        if not inside or (best is not None and len(point) < len(best.mount_point)):
            continue
        fstype = tail[0]
        huge = None
        if fstype == "tmpfs":
            options = tail[2].split(",") if len(tail) > 2 else []
            huge = next((o.split("=", 1)[1] for o in options if o.startswith("huge=")), "never")
        best = Backing(mount_point=point, fstype=fstype, huge=huge)
    return best


def of(directory: str | os.PathLike[str]) -> Backing | None:
    """The backing of `directory` on this machine; None where /proc is not available."""
    try:
        text = MOUNTINFO.read_text()
    except OSError:
        return None
    return parse(os.path.realpath(directory), text)
