"""`shardcache sidecar` as a real subprocess, for integration tests.

`SidecarProcess` keeps its directories, socket and port across `kill()` / `start()`, so
a test can SIGKILL it and start it again the way the kubelet restarts a native sidecar.
The run directory is short and under /tmp: Unix socket paths are limited to 107 bytes.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from shardcache_sidecar.listening import free_port

from shardcache import contract

HOST = "127.0.0.1"
MOUNT = "m"
# Start-up is an interpreter plus aiohttp and pyarrow imports: about a second, far
# more on two cores shared with builds.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(os.fspath(self._path))
        self.sock = sock


class SidecarProcess:
    def __init__(
        self,
        source_uri: str,
        *,
        workdir: Path | None = None,
        env: Mapping[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="scs-", dir="/tmp"))
        self.run_dir = self.workdir / "run"
        self.disk_dir = self.workdir / "disk"
        self.log_path = self.workdir / "sidecar.log"
        self.port = free_port()
        #: The web inspector's loopback port.
        self.ui_port = free_port()
        self.source_uri = source_uri
        self.extra_env = dict(env or {})
        self.args = list(args or [])
        self.process: subprocess.Popen[bytes] | None = None
        #: What the sidecar's command runs under (e.g. setpriv, to run it as another user).
        self.command_prefix: list[str] = []

    @property
    def socket_path(self) -> Path:
        return contract.socket_path(self.run_dir, MOUNT)

    @property
    def memory_dir(self) -> Path:
        return contract.memory_dir(self.run_dir, MOUNT)

    def client_env(self) -> dict[str, str]:
        """What the webhook gives a trainer container."""
        return {contract.ENV_RUN_DIR: str(self.run_dir), contract.ENV_MOUNT: MOUNT}

    def start(self, *, wait: str = "healthy") -> None:
        env = {
            **os.environ,
            contract.ENV_SOURCE_URI: self.source_uri,
            contract.ENV_RUN_DIR: str(self.run_dir),
            contract.ENV_MOUNT: MOUNT,
            contract.ENV_DISK_DIR: str(self.disk_dir),
            contract.ENV_METRICS_PORT: str(self.port),
            contract.ENV_UI_PORT: str(self.ui_port),
            "SHARDCACHE_METRICS_HOST": HOST,
            **self.extra_env,
        }
        command = [*self.command_prefix, sys.executable, "-m", "shardcache", "sidecar", *self.args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if wait == "healthy":
            self.wait_for("/healthz")
        elif wait == "ready":
            self.wait_for("/readyz")

    def wait_for(self, path: str, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(
                    f"the sidecar exited while starting; its log:\n{self.log_tail()}"
                )
            try:
                status, body = self.http_get(path)
                if status == 200:
                    return body  # type: ignore[no-any-return]
                last = body
            except OSError as exc:
                last = exc
            time.sleep(0.05)
        if self.process is not None and self.process.poll() is None:
            # The sidecar dumps every thread's stack into its log on SIGUSR1.
            self.process.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        raise RuntimeError(
            f"the sidecar's {path} was not 200 within {timeout}s (last: {last}); "
            f"its log:\n{self.log_tail()}"
        )

    def http_get(self, path: str) -> tuple[int, Any]:
        """GET on the TCP port; returns (status, JSON body or text)."""
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.port}{path}", timeout=10) as r:
                status, raw, ctype = r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:
            status, raw, ctype = err.code, err.read(), err.headers.get("Content-Type", "")
        return status, json.loads(raw) if "json" in ctype else raw.decode()

    def control(
        self, method: str, path: str, body: object = None, *, raw: bytes | None = None
    ) -> tuple[int, Any]:
        """One request on the control socket; returns (status, decoded body)."""
        conn = UnixHTTPConnection(self.socket_path)
        try:
            payload = (
                raw if raw is not None else None if body is None else json.dumps(body).encode()
            )
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            data = response.read()
            ctype = response.headers.get("Content-Type", "")
            return response.status, json.loads(data) if "json" in ctype else data.decode()
        finally:
            conn.close()

    def holds_drain(self, timeout: float = 10.0) -> int:
        """The sidecar's holds once the client's asynchronous hand-over drops settle
        (polled until zero or `timeout`); returns the last count seen."""
        deadline = time.monotonic() + timeout
        while True:
            holds = int(self.control("GET", "/v1/status")[1]["holds"])
            if holds == 0 or time.monotonic() > deadline:
                return holds
            time.sleep(0.02)

    def kill(self, sig: int = signal.SIGKILL) -> int:
        process, self.process = self.process, None
        if process is None:
            return 0
        if process.poll() is None:
            process.send_signal(sig)
        return process.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> int:
        return self.kill(signal.SIGTERM)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 200) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def cleanup(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def sidecar_factory() -> Iterator[Any]:
    """Make `SidecarProcess`es; every one is killed and its directory removed at the end."""
    made: list[SidecarProcess] = []

    def make(source_uri: str, **kwargs: Any) -> SidecarProcess:
        proc = SidecarProcess(source_uri, **kwargs)
        made.append(proc)
        return proc

    yield make
    for proc in made:
        proc.cleanup()


def readiness_check(body: Any, name: str) -> dict[str, Any]:
    """The check called `name` of a /readyz answer's `checks`."""
    checks = {check["name"]: check for check in body["checks"]}
    return checks[name]  # type: ignore[no-any-return]


def metric_value(text: str, name: str) -> float | None:
    """The value of the sample `name` (labels included, as exposed) in a /metrics text;
    None when it is not exposed."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return None if match is None else float(match.group(1))
