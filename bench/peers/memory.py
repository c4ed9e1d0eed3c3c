"""Memory of a loader's process tree, and page-cache eviction of its input files.

Peak memory is sampled from /proc while the runner works: the summed PSS of the
runner and every descendant (DataLoader workers, a sidecar), so pages shared between
them count once. The runner's own peak RSS is its VmHWM, which it reports itself.
Eviction uses `posix_fadvise(DONTNEED)` on exactly the loader's input files, so a cold
pass reads from disk without dropping the whole machine's page cache under the other
processes sharing it; `fincore` (util-linux), where present, confirms it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterable
from pathlib import Path

SAMPLE_INTERVAL_S = 0.1


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants."""
    seen: list[int] = []
    stack = [pid]
    while stack and len(seen) < 10_000:
        p = stack.pop()
        seen.append(p)
        stack.extend(_children(p))
    return seen


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


class PeakSampler:
    """Samples the tree's summed PSS and a directory's size until `stop()`."""

    def __init__(self, pid: int, watch_dir: Path | None = None) -> None:
        self.peak_pss = 0
        self.peak_dir = 0
        self._pid = pid
        self._dir = watch_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.peak_pss = max(self.peak_pss, sum(pss_bytes(p) for p in tree(self._pid)))
            if self._dir is not None:
                self.peak_dir = max(self.peak_dir, dir_bytes(self._dir))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def files_under(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out.extend(sorted(q for q in p.rglob("*") if q.is_file()))
        elif p.is_file():
            out.append(p)
    return out


def evict(files: Iterable[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of `files` in the page cache, or None without `fincore`."""
    if not files or shutil.which("fincore") is None:
        return None
    done = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return None
    return sum(int(x) for x in done.stdout.split())
