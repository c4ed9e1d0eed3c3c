"""A sidecar beside another process of the node (a sidecar frozen by a debugger, the
freezer cgroup, a hung volume) that holds the shared disk tier's `.tier.lock` and does
not run.

A flock stays with its process for as long as that lives. The sidecar's start-up check
waited for the lock forever, with /readyz naming no cause, and every metrics scrape
waited in its size count (each holding a thread for good). Now the check gives up after
a bounded wait and /readyz's `tiers` gate names the lock and the holder's pid and
state; a scrape answers with the disk tier unusable; and once the holder is gone the
same sidecar goes on and becomes ready.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.support import datasets, waiting
from tests.support.locks import StoppedHolder
from tests.support.sidecar import SidecarProcess, metric_value, readiness_check

pytestmark = pytest.mark.integration


def test_a_sidecar_names_the_stopped_holder_of_the_tier_lock_and_goes_on_once_it_is_gone(
    tmp_path: Path,
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(tmp_path / "ds"), [100, 80, 60])
    proc = SidecarProcess(f"file://{tmp_path / 'ds'}", workdir=tmp_path / "sidecar")
    proc.disk_dir.mkdir(parents=True)
    lock = proc.disk_dir / ".tier.lock"
    holder = StoppedHolder(lock)
    try:
        proc.start()

        def reason() -> str | None:
            status, body = proc.http_get("/readyz")
            text = str(readiness_check(body, "tiers")["reason"])
            return text if status == 503 and "not usable" in text else None

        found = waiting.wait_until("the tiers gate to name the held lock", reason)
        for part in (
            f"the disk tier {proc.disk_dir} is not usable now",
            f"locking {lock} failed (LockTimeout: could not lock {lock} within 10 s: held by "
            f"pid {holder.pid} (python",
            "stopped), exclusive",
            "Resume or end that process",
        ):
            assert part in found, (part, found)

        status, text = proc.http_get("/metrics")
        assert status == 200, text
        assert metric_value(text, 'shardcache_cache_tier_usable{tier="disk"}') == 0
        assert metric_value(text, "shardcache_ready") == 0

        pid = proc.process.pid if proc.process is not None else None
        holder.kill()
        ready = proc.wait_for("/readyz", timeout=120)
        assert ready["ready"] is True and readiness_check(ready, "tiers")["ok"] is True
        assert proc.process is not None and proc.process.pid == pid  # no restart

        # Stopped again while the sidecar runs: a scrape still answers, the disk tier
        # marked unusable (its size could not be read), instead of waiting with it.
        holder = StoppedHolder(lock)
        status, text = proc.http_get("/metrics")
        assert status == 200, text
        assert metric_value(text, 'shardcache_cache_tier_usable{tier="disk"}') == 0
        assert metric_value(text, 'shardcache_cache_resident_bytes{tier="disk"}') is None
        assert f"held by pid {holder.pid} (python" in proc.log_tail()
        holder.kill()
        status, text = proc.http_get("/metrics")
        assert metric_value(text, 'shardcache_cache_tier_usable{tier="disk"}') == 1
        assert "Traceback" not in proc.log_tail(), proc.log_tail()
    finally:
        holder.kill()
        if proc.running:
            assert proc.kill(signal.SIGTERM) == 0
