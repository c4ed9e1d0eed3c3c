"""Namespaces' disk tiers share the node volume: a full one says whose bytes fill it.

Every namespace's tier lies below the same nodePath (`<nodePath>/ns-<namespace>`), on
one volume. A tier far below its own limit that hits ENOSPC has nothing of its own to
evict; its error must tell the on-call engineer that other namespaces' tiers filled the
volume and which chart values bound them, not to raise its own limit. On a real tmpfs
standing in for the node's disk (root only, like test_memory_volume_full.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.node import tiers
from tests.support import mounts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]

MiB = 1 << 20


def _write(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(b"x" * MiB)


def test_a_tier_below_its_limit_on_a_volume_another_namespace_filled_names_them(
    tmp_path: Path,
) -> None:
    with mounts.tmpfs(tmp_path / "node", 8 * MiB) as volume:
        # Team a's limit is far above the volume: it fills it, evicting its own at ENOSPC.
        a = tiers.Tier(volume / "ns-a", limit_bytes=1 << 40, name="disk", fsync=False)
        held = [a.insert(f"a{i}", MiB, _write) for i in range(7)]  # its readers hold them
        b = tiers.Tier(
            volume / "ns-b", limit_bytes=4 * MiB, name="disk", fsync=False, wait_timeout=0.2
        )
        with pytest.raises(errors.CacheError) as caught:
            b.insert("b0", MiB, _write)
        for entry in held:
            entry.release()
        message = str(caught.value)
        assert "holds only 0 of its 4194304 bytes" in message, message
        assert "other namespaces' disk tiers" in message, message
        assert "policy.maxCacheDisk" in message, message
        assert not any(p.name.startswith(".tmp-") for p in b.root.iterdir())
