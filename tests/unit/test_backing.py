"""Which filesystem, and which page size, backs a cache directory."""

from __future__ import annotations

import pytest

from shardcache.node import backings

pytestmark = pytest.mark.unit

MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 253:0 / / rw,relatime - ext4 /dev/vda rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1024k,huge=within_size
42 27 0:39 / /mnt/huge\\040pages rw,relatime - tmpfs tmpfs rw,size=8388608k,huge=always
43 27 0:40 / /var/run/shardcache rw,relatime - tmpfs tmpfs rw,size=2097152k
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/var/run/shardcache/data/mem", backings.Backing("/var/run/shardcache", "tmpfs", "never")),
        ("/var/cache/shardcache", backings.Backing("/", "ext4", None)),
        ("/mnt/huge pages/mem", backings.Backing("/mnt/huge pages", "tmpfs", "always")),
        # The later of two mounts at one point is the one that is visible.
        ("/dev/shm/x", backings.Backing("/dev/shm", "tmpfs", "within_size")),
        # A sibling whose name starts alike is not inside.
        ("/var/run/shardcachex", backings.Backing("/", "ext4", None)),
    ],
)
def test_the_deepest_latest_mount_covering_a_path_backs_it(
    path: str, expected: backings.Backing
) -> None:
    assert backings.parse(path, MOUNTINFO) == expected


def test_only_a_tmpfs_without_huge_pages_counts_as_small_pages() -> None:
    small = backings.parse("/var/run/shardcache/m", MOUNTINFO)
    huge = backings.parse("/mnt/huge pages", MOUNTINFO)
    disk = backings.parse("/var/cache", MOUNTINFO)
    assert small is not None and small.small_pages
    assert small.describe() == "tmpfs at /var/run/shardcache, 4 KiB pages"
    assert huge is not None and not huge.small_pages
    assert huge.describe() == "tmpfs at /mnt/huge pages, huge pages (huge=always)"
    assert disk is not None and not disk.small_pages
    assert disk.describe() == "ext4 at / (page cache)"
    assert disk.to_json() == {
        "mount_point": "/",
        "filesystem": "ext4",
        "huge": None,
        "small_pages": False,
    }


def test_no_mount_table_means_unknown_not_an_error() -> None:
    assert backings.parse("/anything", "") is None
    assert backings.parse("/anything", "garbage line\n") is None


def test_this_machines_dev_shm_is_a_tmpfs() -> None:
    found = backings.of("/dev/shm")
    assert found is not None and found.fstype == "tmpfs"
