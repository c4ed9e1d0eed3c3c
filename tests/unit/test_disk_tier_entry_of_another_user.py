"""A disk-tier entry of another user that this process may neither use nor remove
(a sidecar's user changed, and the directory has the sticky bit, like /tmp).

A readable entry with the wrong bytes failed its check against the manifest (never
served), could not be evicted, and the reader was told the shard was "in use elsewhere;
retry once it is released", which no wait fixes. An unreadable one made the commit of
the fetched bytes fail (`Unremovable`). The bytes can still be served correctly: the
shard is fetched (checked against the manifest's sha256) into a reservation that is
never committed, decoded into the memory tier, and the reservation removed; a WARNING
says what is in the way and the fix, once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from shardcache import manifests
from shardcache.node import tiers
from tests.support import datasets

pytestmark = pytest.mark.unit

SETPRIV = shutil.which("setpriv")
OLD_UID, NEW_UID, GROUP = 2001, 2002, 3000
REPO = Path(__file__).resolve().parents[2]

# Run as NEW_UID: acquire shard 0 twice through a node cache; rows, files left.
WORKER = r"""
import json, logging, sys
from pathlib import Path
import pyarrow as pa
from shardcache import manifests
from shardcache.node import caches
logging.basicConfig(level=logging.WARNING)
ds, disk, mem = sys.argv[1:]
manifest = manifests.resolve(f"file://{ds}")
settings = caches.NodeSettings(
    disk_dir=Path(disk), memory_dir=Path(mem), prefetch_depth=0, disk_limit=1 << 20
)
node = caches.CacheNode(manifest, settings)
out = {}
try:
    rows = []
    for _ in range(2):
        with node.acquire(0) as entry:
            with pa.memory_map(str(entry.path)) as f:
                rows.append(pa.ipc.open_file(f).read_all().num_rows)
        node.memory.evict(entry.key)  # the second load goes to the disk tier again
    out["rows"] = rows
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
finally:
    node.close()
out["left"] = sorted(p.name for p in Path(disk).iterdir() if not p.name.startswith(".limits"))
print(json.dumps(out))
"""


@pytest.fixture
def top() -> Iterator[Path]:
    """A dataset of one 10-row shard, a disk tier as the chart makes it but with the
    sticky bit (mode 3770, the sidecars' group), and NEW_UID's memory tier."""
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv (util-linux) to run a node cache as other users")
    top = Path(tempfile.mkdtemp(prefix="disk-users-", dir="/tmp"))  # searchable by all
    os.chmod(top, 0o755)
    datasets.write_dataset(pafs.LocalFileSystem(), str(top / "ds"), [10])
    for path in (top / "ds", *(top / "ds").rglob("*")):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    (top / "disk").mkdir()
    os.chown(top / "disk", 0, GROUP)
    os.chmod(top / "disk", 0o3770)
    (top / "mem").mkdir()
    os.chown(top / "mem", NEW_UID, GROUP)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def left_by_old_user(top: Path, content: bytes, *, mode: int) -> str:
    """The shard's disk-tier entry with `content` (its meta file consistent with it),
    as a process of OLD_UID left it; its key."""
    manifest = manifests.resolve(f"file://{top / 'ds'}")
    key = manifest.source_key(0)
    size = manifest.shards[0].size
    assert len(content) == size
    disk = top / "disk"
    tier = tiers.Tier(disk, limit_bytes=1 << 20, name="disk", verify="never")
    tier.insert(key, size, lambda path: Path(path).write_bytes(content)).release()
    for path in disk.iterdir():
        if path.name.startswith(".limits"):
            continue
        os.chown(path, OLD_UID, GROUP)
        os.chmod(path, 0o644 if path.name == tiers.TIER_LOCK_NAME else mode)
    return key


def as_new_user(top: Path) -> tuple[dict[str, object], str]:
    assert SETPRIV is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    done = subprocess.run(
        [SETPRIV, f"--reuid={NEW_UID}", f"--regid={GROUP}", "--clear-groups",
         sys.executable, "-c", WORKER, str(top / "ds"), str(top / "disk"), str(top / "mem")],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    return result, done.stderr


def shard_size(top: Path) -> int:
    return manifests.resolve(f"file://{top / 'ds'}").shards[0].size


def test_a_wrong_entry_of_another_user_that_cannot_be_removed_is_served_around_and_named(
    top: Path,
) -> None:
    key = left_by_old_user(top, b"\0" * shard_size(top), mode=0o644)
    got, logged = as_new_user(top)
    assert got.get("rows") == [10, 10], got  # served correctly, twice
    # The forged entry is left (it may not be removed), and nothing of this process's.
    assert got["left"] == sorted([tiers.TIER_LOCK_NAME, key, f"{key}.lock", f"{key}.meta.json"])
    what = logged.split("is served without caching it on disk: ", 1)[-1]
    assert what.startswith(
        "its entry there is another user's, fails its check against the manifest's "
        f"sha256, and cannot be removed: disk tier: cannot evict {key} from {top / 'disk'} "
        "(the directory is owned by uid 0, "
    ), logged
    assert f"owned by uid {OLD_UID}, gid {GROUP}, mode 0644" in what, logged
    assert f"mode 2770 without the sticky bit: chmod -t {top / 'disk'}" in what, logged
    assert "in use elsewhere" not in logged
    assert logged.count("is served without caching it on disk") == 1  # said once


def test_a_private_entry_of_another_user_in_the_way_of_the_commit_is_served_around(
    top: Path,
) -> None:
    key = left_by_old_user(top, b"\0" * shard_size(top), mode=0o600)
    got, logged = as_new_user(top)
    assert got.get("rows") == [10, 10], got
    left = got["left"]
    assert isinstance(left, list) and key in left  # left alone
    assert not [name for name in left if name.startswith(".tmp-")]
    what = logged.split("is served without caching it on disk: ", 1)[-1]
    # Its lease lock file, the first of its files this process may not open.
    lock = top / "disk" / f"{key}.lock"
    assert what.startswith(f"disk tier: cannot open the lock file {lock}"), logged
    assert f"(owned by uid {OLD_UID}, gid {GROUP}, mode 0600; " in what, logged
    assert "with the sticky bit. Remove it as uid 2001 or root" in what, logged


def test_an_uncommitted_reservation_counts_while_held_and_goes_at_its_release(
    tmp_path: Path,
) -> None:
    tier = tiers.Tier(tmp_path, limit_bytes=300, name="disk", verify="never", wait_timeout=0.2)
    entry = tier.uncommitted("k", 200, lambda path: Path(path).write_bytes(b"k" * 200))
    assert Path(entry.path).read_bytes() == b"k" * 200
    assert tier.keys() == [] and not tier.contains("k")  # never served to anyone else
    with pytest.raises(tiers.TierFullError, match="has 100 of 300 bytes free"):
        tier.insert("j", 200, lambda path: Path(path).write_bytes(b"j" * 200), evict=False)
    entry.release()
    assert not Path(entry.path).exists()
    tier.insert("j", 200, lambda path: Path(path).write_bytes(b"j" * 200), evict=False).release()
