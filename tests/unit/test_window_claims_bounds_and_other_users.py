"""Window claims files are read within bounds, and another user's files never stop the
reader (docs/cache-format.md, "Window claims").

A claims file was read whole whatever its size (a few GiB written under `.windows/`
were read and parsed at every room check), and a `.lock` of another uid, mode 0600
(a release that honoured a umask of 077; several users' ranks on one node's tier),
raised PermissionError out of `Claims.others()`, so out of every room check of a
sample-mode reader. Now a file over `MAX_BYTES` counts nothing with a WARNING, and an
unopenable lock is replaced as the tiers replace one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardcache.node import _locks, window_claims

pytestmark = pytest.mark.unit

SETPRIV = shutil.which("setpriv")
OLD_UID, NEW_UID = 2001, 2002
REPO = Path(__file__).resolve().parents[2]
STEM = "4242-0badcafe"

READER = r"""
import json, logging, sys
from pathlib import Path
from shardcache.node import window_claims
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
try:
    out = window_claims.Claims(Path(sys.argv[1])).others()
except Exception as exc:
    out = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def claims_file(directory: Path, stem: str, readers: dict[str, dict[str, int]]) -> Path:
    path = directory / (stem + ".json")
    path.write_text(json.dumps({"version": window_claims.VERSION, "pid": 1, "readers": readers}))
    return path


def held_lock(directory: Path, stem: str) -> int:
    """A lock held as its live writer holds it (another open file description)."""
    fd = _locks.acquire(directory / (stem + ".lock"), _locks.EXCLUSIVE, create=True)
    assert fd is not None
    return fd


def test_a_claims_file_over_the_size_cap_counts_nothing_and_the_others_still_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(window_claims, "MAX_BYTES", 4096)
    directory = tmp_path / window_claims.DIRECTORY
    directory.mkdir()
    huge = {f"k{i}": 1 for i in range(1000)}  # valid JSON, ~10 KB
    claims_file(directory, "1-aaaaaaaa", {"r": huge})
    claims_file(directory, "2-bbbbbbbb", {"r": {"small": 5}})
    locks = [held_lock(directory, "1-aaaaaaaa"), held_lock(directory, "2-bbbbbbbb")]
    try:
        claims = window_claims.Claims(tmp_path)
        with caplog.at_level(logging.WARNING, logger=window_claims.__name__):
            assert claims.others() == {"2-bbbbbbbb/r": {"small": 5}}
            assert claims.others() == {"2-bbbbbbbb/r": {"small": 5}}
    finally:
        for fd in locks:
            _locks.close(fd)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once per file, not at every room check
    assert "expected a regular file of at most 4096 bytes" in warned[0]
    assert "expected at most 4096" in warned[0] and "It counts nothing" in warned[0]


@pytest.mark.timeout(30)
def test_a_fifo_at_a_claims_files_name_is_not_waited_on(tmp_path: Path) -> None:
    directory = tmp_path / window_claims.DIRECTORY
    directory.mkdir()
    os.mkfifo(directory / "1-aaaaaaaa.json")
    fd = held_lock(directory, "1-aaaaaaaa")
    try:
        assert window_claims.Claims(tmp_path).others() == {}
    finally:
        _locks.close(fd)


def test_claims_are_written_readable_by_the_directorys_other_users(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        claims = window_claims.Claims(tmp_path)
        claims.publish({"r": {"k": 1}})
    finally:
        os.umask(old)
    directory = tmp_path / window_claims.DIRECTORY
    assert stat.S_IMODE(directory.stat().st_mode) == 0o777
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    claims.close()


@pytest.fixture
def shared() -> Iterator[Path]:
    """A memory-tier directory whose `.windows` holds another user's 0600 lock."""
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv (util-linux) to read claims as another user")
    top = Path(tempfile.mkdtemp(prefix="claims-users-", dir="/tmp"))  # searchable by all
    os.chmod(top, 0o755)
    directory = top / window_claims.DIRECTORY
    directory.mkdir()
    os.chmod(directory, 0o777)
    data = claims_file(directory, STEM, {"r": {"k": 7}})
    lock = directory / (STEM + ".lock")
    lock.touch()
    for path, mode in ((data, 0o644), (lock, 0o600)):
        os.chown(path, OLD_UID, OLD_UID)
        os.chmod(path, mode)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def read_as_new_user(top: Path) -> tuple[object, str]:
    assert SETPRIV is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    done = subprocess.run(
        [SETPRIV, f"--reuid={NEW_UID}", f"--regid={NEW_UID}", "--clear-groups",
         sys.executable, "-c", READER, str(top)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(done.stdout), done.stderr


def test_another_users_unopenable_claim_lock_is_replaced_not_raised(shared: Path) -> None:
    directory = shared / window_claims.DIRECTORY
    found, logged = read_as_new_user(shared)
    assert found == {}, found
    assert sorted(os.listdir(directory)) == []
    assert "window claims: removed" in logged and f"owned by uid {OLD_UID}" in logged, logged


def test_an_unremovable_claim_lock_of_another_user_counts_nothing_and_says_why(
    shared: Path,
) -> None:
    directory = shared / window_claims.DIRECTORY
    os.chmod(directory, 0o1777)  # sticky: another user's files stay
    found, logged = read_as_new_user(shared)
    assert found == {}, found
    assert sorted(os.listdir(directory)) == [STEM + ".json", STEM + ".lock"]
    assert "nor remove it" in logged and "with the sticky bit" in logged, logged
    assert f"remove it as uid {OLD_UID} or root" in logged, logged
