"""The web inspector as its tests meet it: `shardcache web` as a real process, Debian's
headless chromium driven by selenium through Debian's chromedriver (nothing downloads a
browser), its JSON API, and a run whose ranks skipped batches and published checkpoints
for the lineage view to follow.

The `browser` fixture is registered in tests/conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pyarrow.fs as pafs
import pytest

import shardcache
from shardcache.checkpoint import layout
from tests.support import processes

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# As root in a container: no sandbox; no GPU; and nothing that reaches the network.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
START_TIMEOUT_S = 60.0
WAIT_S = 30.0
#: What `shardcache web` prints once it serves; the URL follows.
SERVING = "serving the inspector at "

#: The recorded run (`record_run`): each rank takes this many batches, skips
#: `SKIPPED_BATCHES` after step `SKIP_AFTER`, and publishes a checkpoint after each
#: step of `CHECKPOINTS`.
STEPS = 5
SKIP_AFTER = 3
SKIPPED_BATCHES = 2
CHECKPOINTS = (2, 5)


@contextlib.contextmanager
def serving(args: Sequence[str], log: Path) -> Iterator[str]:
    """`shardcache web <args> --port 0` while the block runs; its base URL (without
    `/ui`). Its stderr goes to `log`, which a failed start shows."""
    cmd = [sys.executable, "-m", "shardcache", "web", *args, "--port", "0"]
    with (
        log.open("w") as stderr,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True) as proc,
    ):
        try:
            assert proc.stdout is not None
            deadline = time.monotonic() + START_TIMEOUT_S
            line = ""
            while time.monotonic() < deadline and proc.poll() is None:
                line = proc.stdout.readline()
                if line.startswith(SERVING):
                    break
            assert line.startswith(SERVING), (
                f"shardcache web did not start: {line!r} {log.read_text()}"
            )
            yield line.split()[-1].removesuffix("/ui")
        finally:
            processes.stop(proc, timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        pytest.fail(f"{missing} not installed: `make test` installs them (mk/browser.mk)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not fetch anything
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def get_json(server: str, path: str, **params: Any) -> Any:
    """The inspector's JSON answer to `path` (which may carry its own query) with
    `params` as the query string."""
    url = f"{server}{path}" + (f"?{urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=WAIT_S) as response:
        return json.load(response)


def publish(store: Path, rank: int, step: int, state: dict[str, object]) -> None:
    """A checkpoint manifest of no files carrying `state`, where the agent of `rank`
    would publish it under `store`."""
    manifest = layout.CheckpointManifest(
        step=step, name=f"step-{step}", files=(), data_state=state, created_at=float(step)
    )
    prefix = str(store / f"rank-{rank}")
    layout.write_json(
        pafs.LocalFileSystem(), layout.manifest_path(prefix, step), manifest.to_json()
    )


def record_run(
    uri: str,
    *,
    cache: Path,
    store: Path,
    world_size: int,
    batch_size: int,
    **open_kwargs: Any,
) -> dict[int, list[list[int]]]:
    """Each rank's handed-out batches (uids) over `STEPS` steps of a run that skips and
    publishes checkpoints as the constants above say; `open_kwargs` go to
    `shardcache.open`."""
    handed: dict[int, list[list[int]]] = {}
    for rank in range(world_size):
        with shardcache.open(
            uri, cache_dir=cache, rank=rank, world_size=world_size, **open_kwargs
        ) as ds:
            batches = ds.batches(batch_size)
            got: list[list[int]] = []
            for step in range(1, STEPS + 1):
                got.append(next(batches).column("uid").to_pylist())
                if step == SKIP_AFTER:
                    ds.skip_batches(SKIPPED_BATCHES)
                if step in CHECKPOINTS:
                    publish(store, rank, step, ds.state_dict())
            handed[rank] = got
    return handed
