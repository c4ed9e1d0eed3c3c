"""A multi-source mount through a real `shardcache sidecar`: it serves every source, and
the trainer opens the mixture with `shardcache.open_mixture()`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardcache
import shardcache.numpy
from shardcache import errors
from shardcache.contract import mixture_sources, variables
from tests.support import datasets
from tests.support.sidecar import SidecarProcess, UnixHTTPConnection

pytestmark = pytest.mark.integration

SHARDS = {"web": [120, 80, 95], "code": [60, 150]}
CODE_UIDS = 100_000
BATCH = 16


@pytest.fixture
def uris(tmp_path: Path) -> dict[str, str]:
    written = datasets.write_sources(tmp_path, SHARDS, first_uids={"code": CODE_UIDS})
    return {name: f"file://{root}" for name, root in written.items()}


def mixture_env(uris: dict[str, str], *, weights: dict[str, int]) -> str:
    mixture = mixture_sources.Mixture(
        tuple(
            mixture_sources.Source(name=name, weight=weights[name], uri=uri)
            for name, uri in uris.items()
        ),
        seed=11,
    )
    return variables.MIXTURE.render(mixture)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus text exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            series, value = line.rsplit(" ", 1)
            got = ",".join(sorted(series[len(name) + 1 : -1].split(",")))
            if got == want:
                return float(value)
    raise AssertionError(f"no series {name}{{{want}}} in:\n{text}")


def status_of(socket: Path) -> dict[str, Any]:
    conn = UnixHTTPConnection(socket)
    try:
        conn.request("GET", "/v1/status")
        return json.loads(conn.getresponse().read())  # type: ignore[no-any-return]
    finally:
        conn.close()


def test_the_sidecar_serves_every_source_and_the_trainer_mixes_them(
    uris: dict[str, str], sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path
) -> None:
    proc = sidecar_factory(
        uris["web"],
        env={variables.MIXTURE.env: mixture_env(uris, weights={"web": 1, "code": 1})},
    )
    proc.start(wait="ready")
    ready = proc.http_get("/readyz")[1]
    assert any(c["name"] == "mixture-sources" and c["ok"] for c in ready["checks"]), ready
    env = proc.client_env()
    with shardcache.open_mixture(environ=env, seed=3, block_size=8) as mixed:
        got = list(mixed.batches(BATCH, steps=40))
        snap = mixed.snapshot()
        state = mixed.state_dict()
    assert all(b.num_rows == BATCH for b in got)
    read: dict[str, list[int]] = {"web": [], "code": []}
    for b in got:
        for u in b.column("uid").to_pylist():
            read["code" if u >= CODE_UIDS else "web"].append(u)
    for name, uri in uris.items():
        # Each source read through the sidecar follows the plan an embedded read has.
        with shardcache.open(uri, cache_dir=tmp_path / f"plain-{name}", seed=3, block_size=8) as ds:
            plain: list[int] = []
            epoch = 0
            while len(plain) < len(read[name]):
                ds.set_epoch(epoch)
                plain += [u for b in ds.batches(64) for u in b.column("uid").to_pylist()]
                epoch += 1
        assert read[name] == plain[: len(read[name])]
        assert snap["sources"][name]["rows"] == len(read[name])
    assert min(len(r) for r in read.values()) > 0
    # The second source has a socket and memory tier of its own below the mount's.
    code_socket = mixture_sources.source_dir(proc.socket_path.parent, "code") / "control.sock"
    assert status_of(code_socket)["manifest"]["digest"] == state["sources"]["code"]["digest"]
    # The pod's one scraped port counts each source.
    text = proc.http_get("/metrics")[1]
    for name in SHARDS:
        fetched = metric(text, "shardcache_mixture_source_fetched_bytes_total", source=name)
        assert fetched > 0, name
        assert metric(text, "shardcache_mixture_source_resident_bytes", source=name, tier="memory")


def test_resume_through_the_sidecar_continues_row_by_row(
    uris: dict[str, str], sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    proc = sidecar_factory(
        uris["web"],
        env={variables.MIXTURE.env: mixture_env(uris, weights={"web": 2, "code": 1})},
    )
    proc.start(wait="ready")
    env = proc.client_env()
    with shardcache.open_mixture(environ=env, block_size=8) as mixed:
        reference = [b.column("uid").to_pylist() for b in mixed.batches(BATCH, steps=30)]
    with shardcache.open_mixture(environ=env, block_size=8) as mixed:
        first = [b.column("uid").to_pylist() for b in mixed.batches(BATCH, steps=17)]
        state = json.loads(json.dumps(mixed.state_dict()))
    with shardcache.open_mixture(environ=env, block_size=8) as mixed:
        mixed.load_state_dict(state)
        rest = [b.column("uid").to_pylist() for b in mixed.batches(BATCH, steps=13)]
    assert first + rest == reference


def test_open_mixture_on_a_single_source_mount_says_to_use_open(
    uris: dict[str, str], sidecar_factory: Callable[..., SidecarProcess]
) -> None:
    proc = sidecar_factory(uris["web"])
    proc.start(wait="ready")
    with pytest.raises(errors.InputError, match=r"serves one source.*use shardcache.open\(\)"):
        shardcache.open_mixture(environ=proc.client_env())


def test_the_adapters_read_the_mounts_mixture_as_open_mixture_does(
    uris: dict[str, str],
    sidecar_factory: Callable[..., SidecarProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proc = sidecar_factory(
        uris["web"],
        env={variables.MIXTURE.env: mixture_env(uris, weights={"web": 2, "code": 1})},
    )
    proc.start(wait="ready")
    env = proc.client_env()
    with shardcache.open_mixture(environ=env, seed=3, block_size=8) as mixed:
        want = [b.column("uid").to_pylist() for b in mixed.batches(BATCH, steps=30)]
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # mixture=True: the pod's spec.mixture, with the mount's weights and seed.
    options: dict[str, Any] = {"mixture": True, "seed": 3, "block_size": 8, "columns": ["uid"]}
    with shardcache.numpy.Batches(batch_size=BATCH, **options) as it:
        got = [b["uid"].tolist() for _, b in zip(range(12), it, strict=False)]
        state = it.state_dict()
    with shardcache.numpy.Batches(batch_size=BATCH, **options) as resumed:
        resumed.load_state_dict(state)
        got += [b["uid"].tolist() for _, b in zip(range(18), resumed, strict=False)]
    assert got == want
