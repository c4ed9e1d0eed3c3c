"""Bounded fuzzing of a real sidecar's control API (Unix socket) and /ui API (loopback).

The invariants (issue 13, "Tests"): every request gets an answer below 500 (a 4xx that
says what is wrong, or a 2xx), and the process keeps serving: /healthz answers after
every batch of hostile requests, and the process is still running.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardcache.contract import protocol
from tests.support import inspect_data
from tests.support.sidecar import HOST, SidecarProcess

pytestmark = pytest.mark.integration

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture
def sidecar(sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path) -> SidecarProcess:
    proc = sidecar_factory(
        inspect_data.write(tmp_path / "ds").as_uri(), args=["--block-size", "16"]
    )
    proc.start(wait="ready")
    return proc


numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["", "abc", "1e9", "-1", "0", "1", "999999999999", "nan", "true", "\x00"]),
)
query_values = st.one_of(numbers, st.text(max_size=30))
UI_PARAMS = [
    "epoch",
    "rank",
    "world_size",
    "step",
    "batch_size",
    "seed",
    "shuffle",
    "block_size",
    "columns",
    "expr",
    "epochs",
    "shard",
    "row",
    "column",
]
UI_PATHS = ["/ui/api/info", "/ui/api/step", "/ui/api/image", "/ui/api/stats", "/ui/api/where"]


def ui_get(proc: SidecarProcess, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{proc.ui_port}{path}", timeout=60) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as err:
        body = err.read()
        assert "json" in (err.headers.get("Content-Type") or ""), body[:200]
        return int(err.code)


def test_ui_api_answers_hostile_queries_with_4xx_and_keeps_serving(
    sidecar: SidecarProcess,
) -> None:
    @FUZZ
    @given(st.sampled_from(UI_PATHS), st.dictionaries(st.sampled_from(UI_PARAMS), query_values))
    def check(path: str, query: dict[str, str]) -> None:
        status = ui_get(sidecar, f"{path}?{urllib.parse.urlencode(query)}")
        assert status < 500, (path, query)

    check()
    assert sidecar.running
    assert sidecar.http_get("/healthz")[0] == 200


json_bodies = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.text(max_size=20),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=10,
)
reader_bodies = st.fixed_dictionaries(
    {},
    optional={
        "seed": numbers.map(lambda t: int(t) if t.lstrip("-").isdigit() else t),
        "epoch": st.integers(min_value=-5, max_value=2**64),
        "rank": st.integers(min_value=-5, max_value=2**64),
        "world_size": st.integers(min_value=-5, max_value=2**64),
        "block_size": st.integers(min_value=-5, max_value=2**64),
        "shuffle": st.one_of(st.booleans(), st.integers()),
        "position": st.integers(min_value=-5, max_value=2**64),
        "digest": st.text(max_size=20),
        "shard": st.integers(min_value=-5, max_value=2**40),
        "timeout": st.floats(allow_nan=True, allow_infinity=True),
    },
)
reader_ids = st.one_of(st.sampled_from(["r0", "r1"]), st.text(min_size=1, max_size=20))


def control_routes(reader_id: str) -> list[tuple[str, str]]:
    quoted = urllib.parse.quote(reader_id, safe="")
    return [
        ("PUT", protocol.reader_path(quoted)),
        ("POST", protocol.position_path(quoted)),
        ("POST", protocol.pinned_path(quoted)),
        ("DELETE", protocol.reader_path(quoted)),
        ("DELETE", protocol.lease_path(quoted)),
        ("GET", protocol.MANIFEST),
        ("GET", protocol.STATUS),
    ]


def test_control_api_answers_hostile_bodies_with_4xx_and_keeps_serving(
    sidecar: SidecarProcess,
) -> None:
    @FUZZ
    @given(reader_ids, st.integers(min_value=0, max_value=6), st.one_of(json_bodies, reader_bodies))
    def check(reader_id: str, route: int, body: Any) -> None:
        method, path = control_routes(reader_id)[route]
        status, answer = sidecar.control(method, path, None if method == "GET" else body)
        assert status < 500, (method, path, body, answer)

    check()

    @FUZZ
    @given(st.binary(max_size=200))
    def raw(payload: bytes) -> None:
        status, _ = sidecar.control("PUT", protocol.reader_path("r0"), raw=payload)
        assert status < 500

    raw()
    assert sidecar.running
    assert sidecar.control("GET", protocol.STATUS)[0] == 200
    assert json.dumps(sidecar.http_get("/healthz")[1])
