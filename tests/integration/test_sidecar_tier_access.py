"""A non-root sidecar whose disk tier it cannot write: a node directory the chart's
node-cache DaemonSet has not prepared yet (the kubelet made it root's, 0755), or
prepared for another user.

It used to stay unready for good with /readyz saying only "waiting for the first 2
shard(s)", /metrics failing with HTTP 500 (PermissionError on `.tier.lock`), and the
cause only in per-shard warnings. Now /readyz's `tiers` gate names the directory, the
user, the owner and mode and the fix, /metrics answers with the tier marked unusable,
and once the directory is prepared the same process goes on and becomes ready.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.support import datasets
from tests.support.sidecar import SidecarProcess, free_port, metric_value, readiness_check

pytestmark = pytest.mark.integration

NOBODY = 65534
SETPRIV = shutil.which("setpriv")


@pytest.fixture
def workdir() -> Iterator[Path]:
    if os.geteuid() != 0 or SETPRIV is None:
        pytest.skip("needs root and setpriv (util-linux) to run the sidecar as another user")
    # Under /tmp, searchable by NOBODY (pytest's tmp_path is 0700).
    path = Path(tempfile.mkdtemp(prefix="scs-tier-", dir="/tmp"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def nobody_sidecar(source_uri: str, *, workdir: Path) -> SidecarProcess:
    """The sidecar as NOBODY, as the webhook's securityContext runs it (non-root)."""
    assert SETPRIV is not None
    proc = SidecarProcess(source_uri, workdir=workdir)
    proc.command_prefix = [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return proc


def test_a_sidecar_that_cannot_write_its_disk_tier_says_why_and_goes_on_once_it_is_prepared(
    workdir: Path,
) -> None:
    datasets.write_dataset(pafs.LocalFileSystem(), str(workdir / "ds"), [100, 80, 60])
    proc = nobody_sidecar(f"file://{workdir / 'ds'}", workdir=workdir)
    proc.port, proc.ui_port = free_port(), free_port()
    proc.run_dir.mkdir()
    os.chown(proc.run_dir, NOBODY, NOBODY)
    proc.disk_dir.mkdir(mode=0o755)  # root's, as the kubelet makes a missing hostPath
    os.chmod(proc.disk_dir, 0o755)
    try:
        proc.start()
        deadline = time.monotonic() + 60
        while True:
            status, body = proc.http_get("/readyz")
            reason = readiness_check(body, "tiers")["reason"]
            if "not usable" in reason or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status == 503
        assert readiness_check(body, "tiers")["ok"] is False
        for part in (
            f"the disk tier {proc.disk_dir} is not usable",
            f"opening {proc.disk_dir}/.tier.lock failed (PermissionError",
            f"this process runs as uid {NOBODY}, gid {NOBODY}, no other groups",
            "it is owned by uid 0, gid 0, mode 0755 (drwxr-xr-x)",
            "node-cache DaemonSet",
            "nodeCache.uid",
            f"chown {NOBODY}:{NOBODY} DIR && chmod 2770 DIR",
        ):
            assert part in reason, (part, reason)
        assert "the memory tier" not in reason  # usable: only the disk tier is named

        status, text = proc.http_get("/metrics")
        assert status == 200, text
        assert metric_value(text, 'shardcache_cache_tier_usable{tier="disk"}') == 0
        assert metric_value(text, 'shardcache_cache_tier_usable{tier="memory"}') == 1
        assert metric_value(text, "shardcache_ready") == 0

        log = proc.log_tail()
        assert "Traceback" not in log, log
        errors = [line for line in log.splitlines() if str(proc.disk_dir) in line]
        # Said once at ERROR, not at every check.
        assert len(errors) == 1 and "ERROR" in errors[0], log

        # What the DaemonSet does once it runs on the node: the sidecar's, mode 2770.
        pid = proc.process.pid if proc.process is not None else None
        os.chown(proc.disk_dir, NOBODY, NOBODY)
        os.chmod(proc.disk_dir, 0o2770)
        ready = proc.wait_for("/readyz", timeout=60)
        assert ready["ready"] is True
        assert readiness_check(ready, "tiers")["ok"] is True
        assert proc.process is not None and proc.process.pid == pid  # no restart
        status, text = proc.http_get("/metrics")
        assert status == 200
        assert metric_value(text, 'shardcache_cache_tier_usable{tier="disk"}') == 1
        assert (metric_value(text, 'shardcache_cache_resident_bytes{tier="disk"}') or 0) > 0
        assert "the tier directories are usable now" in proc.log_tail()
    finally:
        if proc.running:
            assert proc.kill(signal.SIGTERM) == 0
