"""The disk tier's limit is clamped to its volume's size. The clamp warned at every
start of every sidecar on a node whose volume is under the default 50 GiB, a warning
nobody chose and few act on; now the default's clamp is said at INFO and a limit that
was set at WARNING. `shardcache.open()` took a `disk_limit` it was given as it came,
larger than its volume or not; now it is clamped the same way, with a WARNING."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from shardcache_sidecar import configuration
from shardcache_sidecar.server import running

import shardcache
from shardcache import _open
from shardcache.contract import variables
from shardcache.node import tiers
from tests.support import datasets

pytestmark = pytest.mark.unit

GiB = 1 << 30
SMALL = tiers.Volume(total=20 * GiB, free=12 * GiB)


@pytest.fixture
def small_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tiers, "volume_under", lambda _path: SMALL)


def settings(tmp_path: Path, **overrides: object) -> configuration.Settings:
    return configuration.from_env(
        {},
        overrides={
            "source_uri": "file:///data",
            "run_dir": str(tmp_path / "run"),
            "disk_dir": str(tmp_path / "disk"),
            **overrides,
        },
    )


def clamp_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if "exceeds its volume" in r.getMessage()]


@pytest.mark.usefixtures("small_volume")
def test_the_default_limit_clamped_is_said_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    given = settings(tmp_path)
    assert given.disk_limit == variables.DISK_LIMIT.required_default
    with caplog.at_level(logging.DEBUG):
        clamped = running.disk_limit_within_volume(given)
    assert clamped.disk_limit == SMALL.total
    (record,) = clamp_records(caplog)
    assert record.levelno == logging.INFO
    assert "the default of --disk-limit / $SHARDCACHE_DISK_LIMIT_BYTES" in record.getMessage()


@pytest.mark.usefixtures("small_volume")
def test_a_limit_that_was_set_clamped_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        clamped = running.disk_limit_within_volume(settings(tmp_path, disk_limit=30 * GiB))
    assert clamped.disk_limit == SMALL.total
    (record,) = clamp_records(caplog)
    assert record.levelno == logging.WARNING
    assert f"disk tier limit {30 * GiB} bytes (--disk-limit" in record.getMessage()


@pytest.mark.usefixtures("small_volume")
def test_a_limit_the_volume_holds_is_kept_and_not_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        kept = running.disk_limit_within_volume(settings(tmp_path, disk_limit=5 * GiB))
    assert kept.disk_limit == 5 * GiB
    assert not clamp_records(caplog) and not [
        r for r in caplog.records if "disk_limit" in r.getMessage()
    ]


@pytest.mark.usefixtures("small_volume")
def test_open_clamps_a_disk_limit_it_is_given_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [40])
    with caplog.at_level(logging.DEBUG, logger=_open.__name__):
        with shardcache.open(
            str(tmp_path / "ds"), cache_dir=tmp_path / "c", disk_limit=64 * GiB
        ) as ds:
            limit = ds.provider.node.settings.disk_limit  # type: ignore[attr-defined]
        with shardcache.open(str(tmp_path / "ds"), cache_dir=tmp_path / "c", disk_limit=GiB) as ds:
            small = ds.provider.node.settings.disk_limit  # type: ignore[attr-defined]
    assert (limit, small) == (SMALL.total, GiB)
    (record,) = [r for r in caplog.records if "exceeds the volume" in r.getMessage()]
    assert record.levelno == logging.WARNING
    assert f"disk_limit {64 * GiB} bytes exceeds the volume of {tmp_path / 'c'}" in (
        record.getMessage()
    )
