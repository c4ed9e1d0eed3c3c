"""Mounts of one namespace with different disk limits share its node disk tier.

Every DatasetMount of a namespace has the namespace's directory as its disk tier, each
sidecar with the mount's `cache.disk` as its limit. A mount with a smaller limit used
to evict the others' entries down to its own limit at every insert, and while their
readers leased more than that, inserted nothing: it waited out the tier's wait and
failed, holding nothing itself. Now each inserting process declares its limit in the
directory and every insert counts against the largest live one (`tiers._limits`).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import tiers

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def fill(path: Path) -> None:
    path.write_bytes(b"x" * 100)


def small_mount_inserts(root: Path, *keys: str) -> str:
    """Another process (another mount's sidecar) with a 300-byte limit inserts `keys`."""
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from shardcache.node import tiers
        tier = tiers.Tier(Path({str(root)!r}), limit_bytes=300, name="disk", wait_timeout=0.5)
        for key in {list(keys)!r}:
            try:
                tier.insert(key, 100, lambda p: p.write_bytes(b"s" * 100)).release()
                print("inserted", key)
            except Exception as exc:
                print(type(exc).__name__, exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_mount_with_a_smaller_limit_inserts_beside_one_with_a_larger_limit(
    tmp_path: Path,
) -> None:
    big = tiers.Tier(tmp_path, limit_bytes=1000, name="disk", wait_timeout=0.5)
    held = [big.insert(f"b{i}", 100, fill) for i in range(8)]
    for entry in held[4:]:
        entry.release()  # its readers still lease b0..b3: more than the small limit
    assert small_mount_inserts(tmp_path, "s0", "s1") == "inserted s0\ninserted s1\n"
    # Nothing of the big mount's was evicted: the directory was under its limit.
    assert big.keys() == [f"b{i}" for i in range(8)] + ["s0", "s1"]
    # Full at the largest limit: evicting least recently used, whoever's it is.
    assert small_mount_inserts(tmp_path, "s2") == "inserted s2\n"
    assert big.used_bytes() == 1000
    assert "b4" not in set(big.keys())  # the least recently used, leased by none
    for entry in held[:4]:
        entry.release()


def test_a_dead_process_limit_no_longer_counts(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from shardcache.node import tiers
        tier = tiers.Tier(Path({str(tmp_path)!r}), limit_bytes=1000, name="disk")
        tier.insert("b0", 100, lambda p: p.write_bytes(b"b" * 100)).release()
        os._exit(0)  # as if killed: its declaration is left behind, unlocked
        """
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    assert len(list((tmp_path / ".limits").iterdir())) == 1
    small = tiers.Tier(tmp_path, limit_bytes=150, name="disk", wait_timeout=0.2)
    small.insert("s0", 100, fill).release()  # evicts b0: its own limit is the largest
    assert small.keys() == ["s0"]
    assert [p.name.split("-")[0] for p in (tmp_path / ".limits").iterdir()] == ["150"]


def test_a_full_tier_names_the_largest_limit_and_its_own(tmp_path: Path) -> None:
    big = tiers.Tier(tmp_path, limit_bytes=300, name="disk")
    held = [big.insert(f"b{i}", 100, fill) for i in range(3)]
    small = tiers.Tier(tmp_path, limit_bytes=200, name="disk", wait_timeout=0.1)
    with pytest.raises(errors.CacheError) as caught:
        small.insert("s0", 100, fill)
    assert (
        "limit 300 bytes (the largest limit of the processes sharing the directory; "
        "this one's is 200), 300 bytes held by leases" in str(caught.value)
    )
    for entry in held:
        entry.release()
