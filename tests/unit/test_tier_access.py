"""Whether a process can use a tier directory (`tiers.unusable`), what the sidecar says
when it cannot (`tier_checks`), and the metrics of a tier it cannot read."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from shardcache_sidecar import metrics, tier_checks

from shardcache.node import caches, regular_files, tiers

pytestmark = pytest.mark.unit


def sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_a_usable_tier_directory_is_made_and_left_with_only_its_tier_lock(tmp_path: Path) -> None:
    root = tmp_path / "a" / "disk"
    assert tiers.unusable(root) is None
    # The probe's temp file is gone; the tier lock is what any tier makes first.
    assert sorted(os.listdir(root)) == [tiers.TIER_LOCK_NAME]


def refuse_opening(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Opening `path` fails with EACCES, as for a user that may not read it. (Root may
    open anything; a directory or a FIFO in its place is removed and made again as a
    regular lock file, `regular_files`, so neither makes a lock unopenable.)"""
    real = os.open

    def refusing(name: str | bytes | os.PathLike[str], *args: object, **kw: object) -> int:
        if os.fspath(name) == os.fspath(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(regular_files.os, "open", refusing)


def test_a_tier_whose_lock_cannot_be_opened_is_unusable_naming_the_lock_owner_and_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    os.chmod(root, 0o2770)
    refuse_opening(monkeypatch, root / tiers.TIER_LOCK_NAME)
    found = tiers.unusable(root)
    assert found is not None
    assert found.step == f"opening {root / tiers.TIER_LOCK_NAME}"
    assert isinstance(found.error, PermissionError)
    assert (found.uid, found.gid) == (os.geteuid(), os.getegid())
    assert found.owner is not None and found.owner.path == root
    text = found.describe()
    assert f"opening {root / tiers.TIER_LOCK_NAME} failed (PermissionError:" in text
    assert f"this process runs as uid {os.geteuid()}, gid {os.getegid()}" in text
    st = os.stat(root)
    assert f"owned by uid {st.st_uid}, gid {st.st_gid}, mode 2770 (drwxrws---)" in text


def test_a_tier_directory_that_cannot_be_made_names_what_lies_above_it(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    found = tiers.unusable(blocker / "disk")
    assert found is not None
    assert found.step == f"creating the directory {blocker / 'disk'}"
    assert found.owner is not None and found.owner.path == blocker
    assert f"it does not exist and {blocker} is owned by" in found.describe()


def unusable_as_nobody(path: Path) -> tiers.Unusable:
    """What a sidecar running as 65534 finds in a root-owned 0755 directory."""
    return tiers.Unusable(
        path=path,
        step=f"opening {path / tiers.TIER_LOCK_NAME}",
        error=PermissionError(13, "Permission denied"),
        uid=65534,
        gid=65534,
        groups=(),
        owner=tiers.Owner(path, 0, 0, stat.S_IFDIR | 0o755),
    )


def test_the_disk_reason_names_directory_user_owner_mode_and_the_fix() -> None:
    path = Path("/var/cache/shardcache/ns-team")
    text = tier_checks.disk_reason(unusable_as_nobody(path), retry_s=2.0)
    for part in (
        f"the disk tier {path} is not usable",
        "(PermissionError: Permission denied)",
        "this process runs as uid 65534, gid 65534, no other groups",
        "it is owned by uid 0, gid 0, mode 0755 (drwxr-xr-x)",
        "node-cache DaemonSet",
        "nodeCache.uid and nodeCache.gid must be 65534 and 65534",
        "checks again every 2 s",
        "chown 65534:65534 DIR && chmod 2770 DIR",
        'docs/operator.md, "The node disk tier"',
    ):
        assert part in text, part


def test_the_memory_reason_says_which_setting_moves_the_memory_tier() -> None:
    text = tier_checks.memory_reason(unusable_as_nobody(Path("/run/m/mem")), retry_s=2.0)
    assert text.startswith("the memory tier /run/m/mem is not usable: opening")
    assert "SHARDCACHE_MEMORY_DIR (--memory-dir)" in text and "uid 65534" in text


def test_problems_names_only_the_tier_that_is_unusable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    refuse_opening(monkeypatch, disk / tiers.TIER_LOCK_NAME)
    found = tier_checks.problems(tmp_path / "mem", disk, retry_s=2.0)
    assert list(found) == ["disk"]
    assert found["disk"].startswith(f"the disk tier {disk} is not usable: opening")


def test_metrics_say_which_tier_the_start_up_check_found_unusable_before_any_node() -> None:
    m = metrics.Metrics()
    problems: list[dict[str, str] | None] = [None]
    m.watch(lambda: None, lambda: False, lambda: problems[0])
    # Before the first check: no sample, rather than a guess.
    assert "shardcache_cache_tier_usable" not in m.render().decode()
    problems[0] = {"disk": "the disk tier /d is not usable: ..."}
    text = m.render().decode()
    assert sample(text, 'shardcache_cache_tier_usable{tier="disk"}') == 0
    assert sample(text, 'shardcache_cache_tier_usable{tier="memory"}') == 1
    problems[0] = {}
    assert sample(m.render().decode(), 'shardcache_cache_tier_usable{tier="disk"}') == 1


def test_metrics_of_a_tier_whose_size_could_not_be_read_have_no_resident_sample() -> None:
    m = metrics.Metrics()
    stats = caches.NodeStats(
        disk_resident_bytes=0,
        disk_limit_bytes=100,
        memory_resident_bytes=5,
        memory_limit_bytes=50,
        tier_errors={"disk": "disk tier /d: PermissionError: ..."},
    )
    m.watch(lambda: stats, lambda: True, lambda: {})
    mixture = metrics.MixtureCollector(lambda: {"a": stats})
    m.registry.register(mixture)
    text = m.render().decode()
    assert sample(text, 'shardcache_cache_tier_usable{tier="disk"}') == 0
    assert sample(text, 'shardcache_cache_tier_usable{tier="memory"}') == 1
    # Not a false 0: the disk tier's size is unknown.
    assert sample(text, 'shardcache_cache_resident_bytes{tier="disk"}') is None
    assert sample(text, 'shardcache_cache_resident_bytes{tier="memory"}') == 5
    assert sample(text, 'shardcache_cache_limit_bytes{tier="disk"}') == 100
    assert sample(text, 'shardcache_mixture_source_resident_bytes{source="a",tier="disk"}') is None
    assert sample(text, 'shardcache_mixture_source_resident_bytes{source="a",tier="memory"}') == 5
