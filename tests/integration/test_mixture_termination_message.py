"""A multi-source sidecar runs one server per source in one process, and each wrote
its own reason to the one termination message, replacing the others': `kubectl describe`
showed whichever stopped last. Now every source's reason is there, the first to come
first, within the kubelet's 4096 bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from pathlib import Path

import pytest
from shardcache_sidecar import configuration, termination
from shardcache_sidecar.server import lifecycle, running

from shardcache import errors
from shardcache.contract import mixture_sources, protocol, variables
from tests.support import datasets

pytestmark = pytest.mark.integration

WRONG = "sha256:" + "0" * 64


def settings_of(tmp_path: Path, message: Path) -> configuration.Settings:
    roots = datasets.write_sources(tmp_path, {"web": [50], "code": [40]}, first_uids={})
    mixture = mixture_sources.Mixture(
        tuple(
            mixture_sources.Source(name=name, weight=1, uri=f"file://{root}", digest=WRONG)
            for name, root in roots.items()
        ),
        seed=1,
    )
    env = {
        variables.MIXTURE.env: variables.MIXTURE.render(mixture),
        variables.TERMINATION_MESSAGE_PATH.env: str(message),
    }
    return configuration.from_env(
        env,
        overrides={
            "source_uri": f"file://{roots['web']}",
            "manifest_digest": WRONG,
            "run_dir": str(tmp_path / "run"),
            "disk_dir": str(tmp_path / "disk"),
            "metrics_host": "127.0.0.1",
            "metrics_port": 0,
            "ui_port": 0,
        },
    )


async def test_every_sources_refusal_is_in_the_termination_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = tmp_path / "termination-log"
    message.write_text("")
    started: list[lifecycle.Sidecar] = []
    original = lifecycle.Sidecar.start

    def start(self: lifecycle.Sidecar) -> None:
        started.append(self)
        original(self)

    monkeypatch.setattr(lifecycle.Sidecar, "start", start)
    stop = asyncio.Event()
    serving = asyncio.create_task(running.serve(settings_of(tmp_path, message), stop))
    for _ in range(300):
        refused = [s for s in started if s.problem and s.problem.kind == protocol.KIND_INPUT]
        if len(refused) == 2:
            break
        await asyncio.sleep(0.05)
    assert len(refused) == 2, [s.problem for s in started]
    stop.set()
    await asyncio.wait_for(serving, 30)
    lines = message.read_text().splitlines()
    assert sorted(line.split(":")[0] for line in lines) == ["source code", "source web"], lines
    assert all("the sidecar refused to serve: " in line for line in lines), lines


def test_reasons_past_the_kubelets_limit_are_counted_whole_lines_first_first() -> None:
    reasons = [f"source s{i}: " + "x" * 1500 for i in range(5)]
    text = termination.joined(reasons)
    assert len(text.encode()) <= termination.LIMIT_BYTES
    lines = text.splitlines()
    assert lines[:2] == reasons[:2]
    assert lines[2] == "(and 3 more: see the log)"
    assert termination.joined(["one", "two\nlines"]) == "one\ntwo lines"


async def test_a_source_refused_at_start_stops_the_others_and_is_the_message(
    tmp_path: Path,
) -> None:
    message = tmp_path / "termination-log"
    message.write_text("")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        settings = dataclasses.replace(settings_of(tmp_path, message), metrics_port=port)
        stop = asyncio.Event()
        with pytest.raises(termination.Written) as refused:
            await asyncio.wait_for(running.serve(settings, stop), 30)
    assert isinstance(refused.value, errors.InputError)  # the CLI exits 2 with it
    text = message.read_text()
    assert text.startswith(f"source web: cannot start: cannot listen on 127.0.0.1:{port}"), text
    assert stop.is_set()  # the other source was told to stop, and did
