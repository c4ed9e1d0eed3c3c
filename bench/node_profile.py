"""`make bench-node --profile`: where the sidecar's CPU goes during the warm passes.

py-spy (not a project dependency: `pip install py-spy`) samples the sidecar process
while it holds the GIL (`--gil`: Python work, not waits), at 1 kHz, from the first warm
pass to the last; the collapsed stacks are written for flame-graph tools and summarised
here: the share of samples per thread kind, per innermost function, and per frame
anywhere on the stack. Sampling pauses the process, so the run's CPU-per-request figure
is inflated while profiling; the shares are what count.

`--profile-cold` samples the cold epoch's sidecar the same way (`--gil`, 250 Hz) from
as soon as its process exists (`sampling_child`: py-spy attaches while the sidecar
imports, before it serves), so the profile holds its start-up and fill too. The share
of the epoch's wall time some thread held the GIL says whether the Python parts of the
cold path (fetch threads between pyarrow calls, the event loop) queue on it.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def sampling_child(
    find: Callable[[], int], out: Path, *, rate: int = 250, timeout: float = 60.0
) -> Iterator[None]:
    """Samples the child process `find` returns (it raises LookupError until the child
    exists) into `out`, from as soon as it exists until the block ends. Start the
    child inside the block."""
    log = out.with_suffix(".log")
    spies: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()

    def attach() -> None:
        deadline = time.monotonic() + timeout
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                pid = find()
            except LookupError:
                time.sleep(0.005)
                continue
            with open(log, "w") as err:
                spies.append(
                    subprocess.Popen(
                        [py_spy(), "record", "--gil", "-r", str(rate), "-f", "raw", "-o",
                         str(out), "-p", str(pid)],
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                    )
                )  # fmt: skip
            return

    watcher = threading.Thread(target=attach, name="py-spy-attach", daemon=True)
    py_spy()  # fails early if missing
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT only
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()


#: A frame of every stack sampled while a module was being imported.
IMPORTING = "_find_and_load"


def gil_share(path: Path, *, rate: int, seconds: float, skip: str | None = None) -> float | None:
    """Share of `seconds` some thread held the GIL, from a `--gil` profile at `rate`;
    stacks with a frame containing `skip` (e.g. `IMPORTING`) not counted."""
    if not path.exists() or seconds <= 0:
        return None
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit() and not (skip and skip in stack):
            samples += int(count)
    return samples / (rate * seconds)


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
