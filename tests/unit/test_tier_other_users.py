"""A disk tier shared by sidecars of different users: the chart's `nodeCache.uid`
changed between releases, or a sidecar restarted under another user, over files the
old user wrote.

Tier files are made mode 0644 whatever the umask, so the directory's other users can
read them. Files an older release left readable by their owner only (umask 077) used to
wedge the new user: every lookup of such a key raised PermissionError on its lease lock
file, and an eviction that chose it raised the same at every insert (the tier full for
good). Now such an entry is removed and produced again, and a lock file the process
cannot open is replaced, each with a WARNING naming the owner and mode.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardcache.node import tiers

pytestmark = pytest.mark.unit

SETPRIV = shutil.which("setpriv")
OLD_UID, NEW_UID, GROUP = 2001, 2002, 3000
REPO = Path(__file__).resolve().parents[2]

# Run as NEW_UID: `op` on each key of a 300-byte tier whose entries are 100 bytes.
WORKER = r"""
import json, sys
from pathlib import Path
from shardcache.node import tiers
root, op, *keys = sys.argv[1:]
tier = tiers.Tier(Path(root), limit_bytes=300, name="disk", verify="never", wait_timeout=2)
out = {}
for key in keys:
    def produce(path, key=key):
        Path(path).write_bytes(key.encode().ljust(100, b"x"))
    try:
        if op == "get":
            entry, hit = tier.get_or_insert(key, 100, produce)
        else:
            entry, hit = tier.insert(key, 100, produce, evict=False), False
        out[key] = [Path(entry.path).read_bytes().decode(), hit]
        entry.release()
    except Exception as exc:
        out[key] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def body(key: str) -> str:
    return key.ljust(100, "x")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A tier directory as the chart makes it: mode 2770, the sidecars' group."""
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv (util-linux) to run a tier as other users")
    top = Path(tempfile.mkdtemp(prefix="tier-users-", dir="/tmp"))  # searchable by all
    os.chmod(top, 0o755)
    root = top / "disk"
    root.mkdir()
    os.chown(root, 0, GROUP)
    os.chmod(root, 0o2770)
    yield root
    shutil.rmtree(top, ignore_errors=True)


def as_new_user(root: Path, op: str, *keys: str) -> dict[str, object]:
    return as_new_user_logging(root, op, *keys)[0]


def as_new_user_logging(root: Path, op: str, *keys: str) -> tuple[dict[str, object], str]:
    """What the worker answered, and what it logged."""
    assert SETPRIV is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    done = subprocess.run(
        [SETPRIV, f"--reuid={NEW_UID}", f"--regid={GROUP}", "--clear-groups",
         sys.executable, "-c", WORKER, str(root), op, *keys],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    return result, done.stderr


def left_by_old_user(root: Path, *keys: str, mode: int = 0o600) -> None:
    """Entries as an older release running as OLD_UID with umask 077 left them (`mode`)."""
    tier = tiers.Tier(root, limit_bytes=300, name="disk", verify="never")
    for key in keys:
        tier.insert(key, 100, lambda path, key=key: Path(path).write_text(body(key))).release()
    for path in root.iterdir():
        os.chown(path, OLD_UID, GROUP)
        # The tier lock made readable by whoever made it first (a sidecar with the
        # usual umask): one nobody else may open makes the tier unusable, which the
        # sidecar's start-up check says (`tiers.unusable`).
        os.chmod(path, 0o644 if path.name == tiers.TIER_LOCK_NAME else mode)


def test_files_a_tier_makes_are_readable_by_its_other_users_whatever_the_umask(
    tmp_path: Path,
) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=300, name="disk", verify="never")
    before = os.umask(0o077)
    try:
        tier.insert("k1", 100, lambda path: Path(path).write_text(body("k1"))).release()
        with tier.get_or_insert("k2", 100, lambda path: Path(path).write_text(body("k2")))[0]:
            pass
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir() if p.is_file()}
    assert modes == {
        name: 0o644
        for name in (".tier.lock", "k1", "k1.meta.json", "k1.lock", "k2", "k2.meta.json", "k2.lock")
    }


def test_an_entry_another_user_left_unreadable_is_produced_again_not_an_error(
    shared: Path,
) -> None:
    left_by_old_user(shared, "k1")
    got = as_new_user(shared, "get", "k1", "k1")
    assert got == {"k1": [body("k1"), True]}  # produced again, then a hit of its own
    for name in ("k1", "k1.meta.json", "k1.lock"):
        st = os.stat(shared / name)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NEW_UID, 0o644)


def test_an_eviction_that_meets_a_lock_file_it_cannot_open_still_makes_room(
    shared: Path,
) -> None:
    left_by_old_user(shared, "k1", "k2", "k3")  # the tier is full of them
    got = as_new_user(shared, "get", "k4", "k5", "k6")
    assert got == {key: [body(key), False] for key in ("k4", "k5", "k6")}
    assert tiers.Tier(shared, limit_bytes=300, name="disk").keys() == ["k4", "k5", "k6"]


def test_a_fill_lock_another_user_left_unreadable_does_not_fail_the_key(shared: Path) -> None:
    left_by_old_user(shared)
    fill = shared / f"k9{tiers.FILL_LOCK_SUFFIX}"  # its producer was killed
    fill.touch()
    os.chown(fill, OLD_UID, GROUP)
    os.chmod(fill, 0o600)
    assert as_new_user(shared, "get", "k9") == {"k9": [body("k9"), False]}


def test_an_unreadable_temp_file_counts_while_fresh_and_is_reclaimed_once_stale(
    shared: Path,
) -> None:
    left_by_old_user(shared, "k1", "k2")
    tmp = shared / ".tmp-77-0badf00d-100-k3"  # an insert of the old user, 100 bytes
    tmp.touch()
    os.chown(tmp, OLD_UID, GROUP)
    os.chmod(tmp, 0o600)
    got = as_new_user(shared, "insert", "k4")  # no eviction: the room is the point
    assert str(got["k4"]).startswith("TierFullError: disk tier has 0 of 300 bytes free")
    assert tmp.exists()
    stale = time.time() - tiers_directory_stale_s() - 60
    os.utime(tmp, (stale, stale), follow_symlinks=False)
    assert as_new_user(shared, "insert", "k4") == {"k4": [body("k4"), False]}
    assert not tmp.exists()


def tiers_directory_stale_s() -> int:
    from shardcache.node.tiers import _directory

    return _directory.UNREADABLE_TMP_STALE_S


def test_a_tier_lock_another_user_left_unreadable_is_named_with_the_fix(shared: Path) -> None:
    lock = shared / tiers.TIER_LOCK_NAME
    lock.touch()
    os.chown(lock, OLD_UID, GROUP)
    os.chmod(lock, 0o600)
    assert SETPRIV is not None
    probe = "import sys; from shardcache.node import tiers; print(tiers.unusable(sys.argv[1]).describe())"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    text = subprocess.run(
        [SETPRIV, f"--reuid={NEW_UID}", f"--regid={GROUP}", "--clear-groups",
         sys.executable, "-c", probe, str(shared)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert f"opening {lock} failed (PermissionError:" in text
    assert f"the tier lock {lock} is owned by uid {OLD_UID}, gid {GROUP}, mode 0600" in text
    assert f"Remove that file (rm {lock}): safe once no process of uid {OLD_UID}" in text


def test_an_eviction_skips_entries_it_may_not_remove_and_says_why(shared: Path) -> None:
    # A directory with the sticky bit (prepared by hand like /tmp): another user's
    # files cannot be removed. Each insert that chose one raised PermissionError.
    os.chmod(shared, 0o3770)
    left_by_old_user(shared, "k1", "k2", mode=0o644)
    got, logged = as_new_user_logging(shared, "get", "k4", "k5")
    assert got == {"k4": [body("k4"), False], "k5": [body("k5"), False]}
    assert tiers.Tier(shared, limit_bytes=300, name="disk").keys() == ["k1", "k2", "k5"]
    assert f"disk tier: cannot evict k1 from {shared} (the directory is owned by uid 0, " in logged
    assert "mode 3770, with the sticky bit)" in logged
    assert f"chmod -t {shared}" in logged
    assert logged.count("cannot evict k1") == 1  # said once


def test_a_tier_full_of_entries_it_may_not_remove_says_so_not_leases(shared: Path) -> None:
    os.chmod(shared, 0o3770)
    left_by_old_user(shared, "k1", "k2", "k3", mode=0o644)
    got, _ = as_new_user_logging(shared, "get", "k4")
    message = str(got["k4"])
    assert message.startswith("CacheError: disk tier cannot make room for k4"), message
    assert "0 bytes held by leases" in message, message
    assert "300 bytes of other users' entries this process may not remove" in message, message
    assert "mode 3770, with the sticky bit" in message, message


def test_the_sidecar_names_an_unreadable_tier_lock_not_the_directory_as_the_fix() -> None:
    from shardcache_sidecar import tier_checks

    root = Path("/var/cache/shardcache/ns-team")
    lock = root / tiers.TIER_LOCK_NAME
    found = tiers.Unusable(
        path=root,
        step=f"opening {lock}",
        error=PermissionError(13, "Permission denied"),
        uid=NEW_UID,
        gid=GROUP,
        groups=(),
        owner=tiers.Owner(root, 0, GROUP, stat.S_IFDIR | 0o2770),
        lock_owner=tiers.Owner(lock, OLD_UID, GROUP, stat.S_IFREG | 0o600),
    )
    reason = tier_checks.disk_reason(found, retry_s=2)
    assert f"the tier lock {lock} is owned by uid {OLD_UID}, gid {GROUP}, mode 0600" in reason
    assert f"Remove that file (rm {lock})" in reason
    assert "chmod 2770" not in reason  # the directory is right


def test_another_users_private_entry_in_a_sticky_directory_is_named_not_served(
    shared: Path,
) -> None:
    # Another user's files at an entry's names, mode 0600, in a directory with the
    # sticky bit: this process may neither read nor replace them. Its insert's commit
    # failed with a bare PermissionError on a temp file's rename.
    os.chmod(shared, 0o3770)
    left_by_old_user(shared)
    for name, text in (("k2", "not k2's bytes".ljust(100)), ("k2.meta.json", "{}")):
        (shared / name).write_text(text)
        os.chown(shared / name, OLD_UID, GROUP)
        os.chmod(shared / name, 0o600)
    got = as_new_user(shared, "get", "k2", "k3")
    message = str(got["k2"])
    assert message.startswith(
        f"Unremovable: disk tier: cannot replace {shared / 'k2'} (owned by uid {OLD_UID}, "
        f"gid {GROUP}, mode 0600; this process runs as uid {NEW_UID}"
    ), message
    assert "mode 3770, with the sticky bit" in message and f"chmod -t {shared}" in message
    assert got["k3"] == [body("k3"), False]  # the rest of the tier still works
    assert (shared / "k2").read_text() == "not k2's bytes".ljust(100)  # left alone
    assert not [p.name for p in shared.iterdir() if p.name.startswith(".tmp-")]
