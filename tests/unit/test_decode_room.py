"""The room a sidecar decodes in: its cgroup's memory limit less its memory volume and
itself, not the memory tier's limit (explorer D2: a 20 MB shard decoding to 800 MB
OOM-killed the sidecar during warm-up under the webhook's default limit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shardcache_operator import specs

from shardcache.contract import variables
from shardcache.node import decode_budgets, quotas

MiB = 1 << 20
GiB = 1 << 30
#: The webhook's default sizing: tier 2Gi, sidecar limit 1Gi + the 2560Mi run volume.
TIER = 2 * GiB
LIMIT = GiB + variables.run_volume_bytes(TIER)


def quota(memory_limit: int | None, cpus: int = 2) -> quotas.Quota:
    return quotas.Quota(affinity=cpus, cpu_limit=None, memory_limit=memory_limit)


@pytest.mark.parametrize("tier", [16 * MiB, 64 * MiB, 2 * GiB, 3 * GiB + 1, 100 * GiB])
def test_the_contract_run_volume_is_the_one_the_webhook_sizes(tier: int) -> None:
    assert variables.run_volume_bytes(tier) == specs.run_volume_bytes(tier)
    assert variables.RUN_VOLUME_HEADROOM == specs.RUN_VOLUME_HEADROOM


def test_decode_room_is_the_limit_less_the_run_volume_and_the_process() -> None:
    volume = quotas.volume_bytes(TIER, tmpfs_size=None, memory_limit=LIMIT)
    assert volume == 2560 * MiB
    room = quotas.decode_room(quota(LIMIT), volume_bytes=volume)
    assert room == GiB - quotas.BASE_MEMORY_BYTES == 768 * MiB


def test_decode_room_without_a_memory_limit_is_none_and_never_negative() -> None:
    assert quotas.decode_room(quota(None), volume_bytes=TIER) is None
    assert quotas.decode_room(quota(GiB), volume_bytes=2 * GiB) == 0


def test_a_sized_tmpfs_counts_its_own_size_an_unsized_one_the_webhooks() -> None:
    # A tmpfs smaller than the limit is the pod's sized volume: its size bounds its pages.
    assert quotas.volume_bytes(TIER, tmpfs_size=3 * GiB, memory_limit=4 * GiB) == 3 * GiB
    assert quotas.volume_bytes(TIER, tmpfs_size=GiB, memory_limit=LIMIT) == GiB
    # As large as the limit or larger (half the node's memory), or no tmpfs: the webhook's.
    assert quotas.volume_bytes(TIER, tmpfs_size=64 * GiB, memory_limit=LIMIT) == 2560 * MiB
    assert quotas.volume_bytes(TIER, tmpfs_size=None, memory_limit=LIMIT) == 2560 * MiB


def test_fetch_concurrency_counts_decode_peaks_of_the_decoded_size() -> None:
    room = 768 * MiB
    # The explorer's shard: 20 MB of source, 800 MB decoded. It was allowed 2 (4 x source).
    assert quotas.fetch_concurrency(quota(LIMIT), decoded_bytes=800_000_000, room=room) == 1
    # Two peaks of a 100 MiB shard fit 768 MiB; the CPUs cap it.
    assert quotas.fetch_concurrency(quota(LIMIT, 8), decoded_bytes=100 * MiB, room=room) == 2
    assert quotas.fetch_concurrency(quota(LIMIT, 1), decoded_bytes=MiB, room=room) == 1
    assert quotas.fetch_concurrency(quota(None, 4), decoded_bytes=GiB, room=None) == 4


def test_the_decode_budget_is_the_room_where_that_is_less_than_the_tier() -> None:
    capacity, what = decode_budgets.capacity(TIER, 768 * MiB)
    assert capacity == 768 * MiB
    assert "memory limit leaves to decode in" in what
    # Without a limit (a laptop), a shard as large as the tier still decodes.
    capacity, what = decode_budgets.capacity(TIER, None)
    assert capacity == quotas.decode_peak(TIER)
    assert "memory tier's limit" in what
    assert decode_budgets.capacity(64 * MiB, 768 * MiB)[0] == quotas.decode_peak(64 * MiB)


def test_a_decode_that_cannot_fit_the_budget_is_a_clear_error_at_once() -> None:
    capacity, what = decode_budgets.capacity(TIER, 768 * MiB)
    budget = decode_budgets.DecodeBudget(capacity, what=what)
    with pytest.raises(decode_budgets.DecodeRoomError) as caught:
        with budget.reserve(quotas.decode_peak(800_000_000)):
            pass
    message = str(caught.value)
    assert str(quotas.decode_peak(800_000_000)) in message  # what was found
    assert str(768 * MiB) in message  # what fits
    assert caught.value.room == 768 * MiB
    assert budget.held == 0
    with budget.reserve(quotas.decode_peak(200 * MiB)):
        assert budget.held == 600 * MiB


def test_tmpfs_size_reads_the_mount_holding_the_path(tmp_path: Path) -> None:
    inner = tmp_path / "run" / "m"
    inner.mkdir(parents=True)
    stat = os.statvfs(inner)
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n"
        f"90 22 0:50 / {tmp_path / 'run'} rw shared:9 - tmpfs tmpfs rw,size=1024k\n"
        f"91 22 0:51 / {tmp_path / 'runner'} rw shared:9 - ext4 /dev/sdb rw\n"
    )
    assert quotas.tmpfs_size(inner, mountinfo) == stat.f_blocks * stat.f_frsize
    mountinfo.write_text("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n")
    assert quotas.tmpfs_size(inner, mountinfo) is None
    assert quotas.tmpfs_size(tmp_path / "missing", mountinfo) is None


def test_the_process_base_is_what_it_holds_plus_growth_never_over_the_constant(
    tmp_path: Path,
) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    statm = tmp_path / "statm"
    statm.write_text(f"100000 {(120 << 20) // page} 5000 100 0 20000 0\n")
    assert quotas.process_base(statm) == (120 << 20) + quotas.GROWTH_BYTES
    # A sidecar given 256Mi (the node tier's limits test) keeps room to decode in:
    # with the constant alone, 256Mi + a 20Mi volume left none, and every shard was
    # refused.
    room = quotas.decode_room(
        quota(276 << 20), volume_bytes=20 << 20, base=quotas.process_base(statm)
    )
    assert room == (256 - 120 - 64) << 20
    statm.write_text(f"100000 {(400 << 20) // page} 5000 100 0 20000 0\n")
    assert quotas.process_base(statm) == quotas.BASE_MEMORY_BYTES
    assert quotas.process_base(tmp_path / "missing") == quotas.BASE_MEMORY_BYTES
    assert 0 < quotas.process_base() <= quotas.BASE_MEMORY_BYTES
