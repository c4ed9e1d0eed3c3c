"""Reader locks: the sidecar finds a reader's process dead exactly when nobody holds the
reader's lock file, however the process died, and never because it was silent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardcache.node import reader_locks
from tests.support import forks
from tests.support.locks import exclusively_lockable

pytestmark = pytest.mark.unit

Found = reader_locks.Found


def found(memory_dir: Path, reader_id: str) -> Found:
    return reader_locks.probe(memory_dir, [reader_id])[reader_id]


def test_a_lock_held_by_a_live_process_is_held_and_free_once_it_is_sigkilled(
    tmp_path: Path,
) -> None:
    holder = textwrap.dedent(
        f"""
        import signal
        from pathlib import Path
        from shardcache.node import reader_locks
        held = reader_locks.hold(Path({str(tmp_path)!r}), "r1")
        print("held", flush=True)
        signal.pause()
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen(
        [sys.executable, "-c", holder], env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        path = reader_locks.path_of(tmp_path, "r1")
        assert found(tmp_path, "r1") is Found.HELD
        assert found(tmp_path, "r1") is Found.HELD  # a probe takes nothing away
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert found(tmp_path, "r1") is Found.FREE
    assert not path.exists()  # removed by the probe that found it free
    assert found(tmp_path, "r1") is Found.MISSING


def test_a_forked_child_does_not_keep_its_parents_reader_alive(tmp_path: Path) -> None:
    held = reader_locks.hold(tmp_path, "parent")
    child = forks.child_that_stays()
    try:
        assert found(tmp_path, "parent") is Found.HELD
        # The parent dies (its descriptor closes) while its DataLoader worker runs on.
        held.forget()
        assert found(tmp_path, "parent") is Found.FREE
    finally:
        forks.stop(child)


def test_a_closed_reader_leaves_no_file_and_a_reader_registered_again_takes_a_new_one(
    tmp_path: Path,
) -> None:
    held = reader_locks.hold(tmp_path, "r")
    path = reader_locks.path_of(tmp_path, "r")
    assert held.held() and not exclusively_lockable(path)
    # Removed by hand (or by a sidecar that found it free): the lock is on no file.
    path.unlink()
    assert not held.held()
    again = reader_locks.hold(tmp_path, "r")
    assert again.held() and found(tmp_path, "r") is Found.HELD
    held.forget()
    assert found(tmp_path, "r") is Found.HELD
    again.release()
    again.release()  # idempotent
    assert not path.exists()
    assert found(tmp_path, "r") is Found.MISSING


def test_a_lock_file_is_readable_by_the_sidecars_user_whatever_the_trainers_umask(
    tmp_path: Path,
) -> None:
    old = os.umask(0o077)
    try:
        reader_locks.hold(tmp_path, "r")
    finally:
        os.umask(old)
    assert reader_locks.path_of(tmp_path, "r").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / reader_locks.DIRECTORY).stat().st_mode & 0o7777 == 0o1777


def test_the_sidecar_at_start_removes_the_files_nobody_holds_and_keeps_the_held_ones(
    tmp_path: Path,
) -> None:
    live = reader_locks.hold(tmp_path, "live")
    reader_locks.hold(tmp_path, "dead").forget()  # its process died unwatched
    assert reader_locks.prepare(tmp_path) == 1
    names = sorted(p.name for p in (tmp_path / reader_locks.DIRECTORY).iterdir())
    assert names == ["live.lock"]
    assert live.held()


def test_a_linked_directory_of_lock_files_is_never_followed(tmp_path: Path) -> None:
    # The trainer writes the memory directory; a link must not make the sidecar remove
    # unlocked `.lock` files elsewhere (a tier's lease locks).
    elsewhere = tmp_path / "disk-tier"
    elsewhere.mkdir()
    (elsewhere / "key.lock").write_text("")
    memory = tmp_path / "mem"
    memory.mkdir()
    (memory / reader_locks.DIRECTORY).symlink_to(elsewhere)
    with pytest.raises(OSError):
        reader_locks.prepare(memory)
    assert found(memory, "key") is Found.UNKNOWN
    assert (elsewhere / "key.lock").exists()


def test_a_lock_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target.lock"
    target.write_text("")
    directory = tmp_path / reader_locks.DIRECTORY
    directory.mkdir()
    (directory / "r.lock").symlink_to(target)
    assert found(tmp_path, "r") is Found.UNKNOWN
    assert target.exists() and (directory / "r.lock").is_symlink()
