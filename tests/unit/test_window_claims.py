"""Window claims: what one process's sample-mode readers hold, seen by the others that
share its memory tier, and forgotten once it is gone (docs/cache-format.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardcache.node import _locks, window_claims
from tests.support import forks

pytestmark = pytest.mark.unit

OTHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from shardcache.node import window_claims
    claims = window_claims.Claims(Path(sys.argv[1]))
    claims.publish({"rank 1": {"k1": 100, "k2": None}})
    print("published", flush=True)
    time.sleep(600)
    """
)


def files(memory: Path) -> list[str]:
    return sorted(p.name for p in (memory / window_claims.DIRECTORY).iterdir())


def test_another_processs_claims_are_seen_until_it_dies(tmp_path: Path) -> None:
    mine = window_claims.Claims(tmp_path)
    mine.publish({"rank 0": {"k0": 10}})
    with subprocess.Popen(
        [sys.executable, "-c", OTHER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as other:
        try:
            assert other.stdout is not None and other.stdout.readline() == "published\n"
            seen = mine.others()
            assert list(seen.values()) == [{"k1": 100, "k2": None}]
            [(name, _)] = seen.items()
            assert name.startswith(f"{other.pid}-") and name.endswith("/rank 1")
        finally:
            other.send_signal(signal.SIGKILL)
            other.wait()
            assert other.stdout is not None
            other.stdout.close()
    # Its lock went with it: its files are removed by the next look.
    assert mine.others() == {}
    assert [f for f in files(tmp_path) if not f.startswith(f"{os.getpid()}-")] == []
    mine.close()
    assert files(tmp_path) == []


def test_a_process_sees_none_of_its_own_and_rewrites_only_on_change(tmp_path: Path) -> None:
    claims = window_claims.Claims(tmp_path)
    claims.publish({"a": {"k": 1}})
    [data] = [f for f in files(tmp_path) if f.endswith(".json")]
    path = tmp_path / window_claims.DIRECTORY / data
    written = path.stat().st_mtime_ns, path.stat().st_ino
    claims.publish({"a": {"k": 1}})
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == written
    claims.publish({"a": {"k": 1, "j": 2}, "b": {}})  # a reader holding nothing: left out
    assert json.loads(path.read_text())["readers"] == {"a": {"k": 1, "j": 2}}
    assert claims.others() == {}
    claims.publish({})
    assert files(tmp_path) == []


def test_files_of_another_version_or_unreadable_count_nothing(tmp_path: Path) -> None:
    other = window_claims.Claims(tmp_path)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    # Written by "another process": a claims file whose lock a live process holds.
    writer = window_claims.Claims(theirs)
    writer.publish({"r": {"k": 5}})
    directory = tmp_path / window_claims.DIRECTORY
    directory.mkdir(exist_ok=True)
    for name in os.listdir(theirs / window_claims.DIRECTORY):
        os.link(theirs / window_claims.DIRECTORY / name, directory / name)
    [data] = directory.glob("*.json")
    data.write_text(json.dumps({"version": 2, "readers": {"r": {"k": 5}}}))
    assert other.others() == {}
    data.write_text("{not json")
    assert other.others() == {}
    data.write_text(json.dumps({"version": 1, "readers": {"r": {"k": 5, "j": "x"}}}))
    assert list(other.others().values()) == [{"k": 5, "j": None}]
    writer.close()


def test_a_forked_child_claims_in_a_file_of_its_own(tmp_path: Path) -> None:
    parent = window_claims.Claims(tmp_path)
    parent.publish({"parent": {"p": 1}})
    # The child: a DataLoader worker with readers of its own.
    pid = forks.child_that_stays(lambda: parent.publish({"child": {"c": 2}}))
    try:
        others = parent.others()
        assert list(others.values()) == [{"c": 2}]
        assert next(iter(others)).startswith(f"{pid}-")
        data = sorted(f for f in files(tmp_path) if f.endswith(".json"))
        assert len(data) == 2
    finally:
        forks.stop(pid)
    assert parent.others() == {}
    parent.close()
    assert files(tmp_path) == []


def test_a_parent_that_dies_before_its_forked_child_is_found_dead_while_the_child_runs(
    tmp_path: Path,
) -> None:
    parent = window_claims.Claims(tmp_path)
    parent.publish({"parent": {"p": 1}})
    # The child: a DataLoader worker that outlives its parent, claiming nothing.
    pid = forks.child_that_stays()
    try:
        # The parent's death as the kernel sees it: its descriptors closed, its file left.
        assert parent._lock_fd is not None
        _locks.close(parent._lock_fd)
        assert window_claims.Claims(tmp_path).others() == {}
        assert files(tmp_path) == []  # found dead, and removed
    finally:
        forks.stop(pid)
