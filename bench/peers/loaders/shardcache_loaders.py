"""shardcache, embedded (cache in the trainer process) and through a sidecar process.

Both read the same Parquet files as the pyarrow peer via `file://`, decode each shard
once into uncompressed Arrow IPC in a memory tier on /dev/shm, and hand the loop
zero-copy slices. The sidecar is started the way the operator runs it (its own
process, `shardcache sidecar`, configured by the same environment variables the webhook
writes) with `ready_shards=0`, so the cold pass includes every fetch and decode; the
trainer finds it through $SHARDCACHE_SOCKET as an injected pod does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import shardcache
from bench.peers.loaders import base
from shardcache import control_protocol, sidecar_client
from shardcache import plan as plan_mod
from shardcache.node import names

#: Seconds to wait for the sidecar to report ready on its control socket.
SIDECAR_START_TIMEOUT = 60.0


class EmbeddedLoader:
    kind: base.Kind = "arrow"

    def __init__(self, setup: base.Setup) -> None:
        self._setup = setup
        self._uri = (setup.root / "parquet").resolve().as_uri()
        self._ds: shardcache.Dataset | None = None
        self.settings = (
            f"shardcache.open('file://…/parquet', shuffle=True, block_size="
            f"{plan_mod.DEFAULT_BLOCK_SIZE}, memory_dir=/dev/shm/…).batches("
            f"{setup.batch_size}), cache in the trainer process"
        )

    def _open(self) -> shardcache.Dataset:
        return shardcache.open(
            self._uri,
            cache_dir=self._setup.scratch / "cache",
            memory_dir=self._setup.shm_scratch / "mem",
            shuffle=True,
            seed=self._setup.seed,
        )

    def _dataset(self) -> shardcache.Dataset:
        if self._ds is None:
            self._ds = self._open()
        return self._ds

    def epoch(self, epoch: int) -> Iterator[Any]:
        ds = self._dataset()
        ds.set_epoch(epoch)
        yield from ds.batches(self._setup.batch_size)

    def state(self, consumed: int) -> Any | None:
        return self._dataset().state_dict()

    def resume(self, state: Any) -> Iterator[Any]:
        if self._ds is not None:
            self._ds.close()
        self._ds = ds = self._open()
        ds.load_state_dict(state)
        yield from ds.batches(self._setup.batch_size)

    def close(self) -> None:
        if self._ds is not None:
            self._ds.close()
            self._ds = None


class SidecarLoader(EmbeddedLoader):
    def __init__(self, setup: base.Setup) -> None:
        super().__init__(setup)
        run = setup.shm_scratch / "run"
        run.mkdir(parents=True, exist_ok=True)
        self._socket = run / names.SOCKET_NAME
        self._log = (setup.scratch / "sidecar.log").open("wb")
        env = {
            **os.environ,
            names.ENV_SOURCE_URI: self._uri,
            names.ENV_MEMORY_DIR: str(run / names.MEMORY_SUBDIR),
            names.ENV_DISK_DIR: str(setup.scratch / "disk"),
            names.ENV_SOCKET: str(self._socket),
            names.ENV_READY_SHARDS: "0",
            names.ENV_SEED: str(setup.seed),
            names.ENV_SHUFFLE: "true",
            names.ENV_METRICS_PORT: "0",
            "SHARDCACHE_METRICS_HOST": "127.0.0.1",
            "SHARDCACHE_LOG_FORMAT": "text",
        }
        shardcache_cli = Path(sys.executable).with_name("shardcache")
        self._proc = subprocess.Popen(
            [str(shardcache_cli), "sidecar"], env=env, stdout=self._log, stderr=self._log
        )
        self._wait_ready(run / names.MEMORY_SUBDIR)
        self.settings = (
            f"`shardcache sidecar` process (ready_shards=0, memory tier on /dev/shm); trainer: "
            f"shardcache.open() via $SHARDCACHE_SOCKET, shuffle=True, .batches({setup.batch_size})"
        )

    def _wait_ready(self, memory_dir: Path) -> None:
        """Block until /readyz answers 200, as a native sidecar's startup probe does."""
        settings = sidecar_client.ClientSettings(
            socket_path=self._socket,
            memory_dir=memory_dir,
            reconnect_timeout=SIDECAR_START_TIMEOUT,
        )
        transport = sidecar_client.Transport(settings)
        deadline = time.monotonic() + SIDECAR_START_TIMEOUT
        try:
            while True:
                try:
                    # Retries while the socket is absent or the sidecar is starting; a
                    # 503 from /readyz (gates still closed) is polled here.
                    transport.call("GET", control_protocol.READYZ)
                    return
                except sidecar_client.Rejected:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        except Exception:
            self.close()
            raise

    def _open(self) -> shardcache.Dataset:
        os.environ[names.ENV_SOCKET] = str(self._socket)
        return shardcache.open(shuffle=True, seed=self._setup.seed)

    def close(self) -> None:
        super().close()
        self._proc.terminate()
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
