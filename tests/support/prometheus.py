"""A real Prometheus (built from its Go module by `make tools-prometheus`) on loopback.

The tests give it static targets that stand for what the chart's PodMonitors select
(the operator's `metrics` port, each sidecar's `shardcache` port) with the labels the
Prometheus Operator would attach (`namespace`, `pod`, `container`), and the rule groups
of the chart's rendered PrometheusRule, then ask its HTTP API.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from shardcache_sidecar.listening import free_port

from tests.support import processes, toolpaths, waiting

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 10.0


def binary(name: str) -> Path:
    """`prometheus` or `promtool`, as `make tools-prometheus` built them."""
    return toolpaths.tool_binary("prometheus", "PROMETHEUS_VERSION", name)


def rule_file(prometheus_rule: Mapping[str, Any]) -> dict[str, Any]:
    """A PrometheusRule object's spec as a Prometheus rule file (`groups:`)."""
    return {"groups": prometheus_rule["spec"]["groups"]}


@dataclasses.dataclass(frozen=True)
class Target:
    """One scrape target: what a PodMonitor endpoint becomes for one pod."""

    job: str
    address: str  # host:port
    labels: Mapping[str, str]
    #: The operator's own `namespace` label wins (the PodMonitor's honorLabels).
    honor_labels: bool = False


class Prometheus:
    def __init__(
        self,
        targets: Sequence[Target],
        rules: Mapping[str, Any],
        *,
        interval: str = "1s",
    ) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="prom-", dir="/tmp"))
        self.port = free_port()
        self.log_path = self.workdir / "prometheus.log"
        (self.workdir / "rules.yaml").write_text(yaml.safe_dump(dict(rules)))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(self.workdir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": f"{t.job}-{i}",
                    "honor_labels": t.honor_labels,
                    "static_configs": [{"targets": [t.address], "labels": dict(t.labels)}],
                }
                for i, t in enumerate(targets)
            ],
        }
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    str(binary("prometheus")),
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address={HOST}:{self.port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def ready() -> bool:
            assert self._process is not None
            if self._process.poll() is not None:
                raise AssertionError(f"prometheus exited; its log:\n{self.logs()}")
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=5) as response:
                    return int(response.status) == 200
            except OSError:
                return False

        waiting.wait_until("prometheus /-/ready", ready, describe=self.logs)

    def stop(self) -> None:
        """Stop the server and remove its configuration, data and log (a failing test
        has shown the log already, through `logs` in its waits)."""
        process, self._process = self._process, None
        processes.stop(process, STOP_TIMEOUT_S)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def url(self, path: str, **params: str) -> str:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return f"http://{HOST}:{self.port}{path}{query}"

    def api(self, path: str, **params: str) -> Any:
        """The `data` of an API answer; an error answer fails with Prometheus's message."""
        try:
            with urllib.request.urlopen(self.url(path, **params), timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{path} {params}: {err.code} {err.read().decode()}") from err
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) `expr` evaluates to now."""
        data = self.api("/api/v1/query", query=expr)
        if data["resultType"] == "vector":
            return list(data["result"])
        return [{"metric": {}, "value": data["result"]}]

    def targets_up(self) -> list[dict[str, Any]]:
        active = self.api("/api/v1/targets")["activeTargets"]
        return [t for t in active if t["health"] == "up"]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("/api/v1/alerts")["alerts"])
