"""`make bench-node --profile`: where the sidecar's CPU goes during the warm passes.

py-spy (not a project dependency: `pip install py-spy`) samples the sidecar process
while it holds the GIL (`--gil`: Python work, not waits), at 1 kHz, from the first warm
pass to the last; the collapsed stacks are written for flame-graph tools and summarised
here: the share of samples per thread kind, per innermost function, and per frame
anywhere on the stack. Sampling pauses the process, so the run's CPU-per-request figure
is inflated while profiling; the shares are what count.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

#: Seconds py-spy takes to attach before samples are taken.
ATTACH_S = 1.5


def py_spy() -> str:
    """The py-spy executable: beside this interpreter, else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return found


@contextlib.contextmanager
def sampling(pid: int, out: Path) -> Iterator[None]:
    """Samples `pid` into `out` (py-spy's raw collapsed stacks) while the block runs."""
    log = out.with_suffix(".log")
    with open(log, "w") as err:
        spy = subprocess.Popen(
            [py_spy(), "record", "--gil", "-r", "1000", "-f", "raw", "-o", str(out),
             "-p", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )  # fmt: skip
    time.sleep(ATTACH_S)
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    if not out.exists():
        raise SystemExit(f"py-spy wrote no profile:\n{log.read_text()[-2000:]}")


def _frame(text: str) -> str:
    # "name (/path/to/file.py:123)" -> "name (file.py)"
    return re.sub(r" \((?:.*/)?([^/:]+)(?::\d+)?\)", r" (\1)", text)


def summary(path: Path, top: int = 20) -> str:
    leaf: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        total += n
        threads["event loop (main thread)" if "runpy" in frames[0] else "other threads"] += n
        leaf[frames[-1]] += n
        for f in set(frames[1:]):
            anywhere[f] += n
    if not total:
        return f"profile {path}: no samples"
    lines = [f"sidecar profile ({total} samples holding the GIL), {path}:"]
    lines += [f"   {n / total:6.1%} {name}" for name, n in threads.most_common()]
    lines.append("   innermost function:")
    lines += [f"   {n / total:6.1%} {name}" for name, n in leaf.most_common(top)]
    lines.append("   anywhere on the stack:")
    lines += [f"   {n / total:6.1%} {name}" for name, n in anywhere.most_common(top * 3)]
    return "\n".join(lines)
