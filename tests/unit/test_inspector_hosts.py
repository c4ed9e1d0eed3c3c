"""The inspector's allowed Host names are defined once (`routes.LOOPBACK_NAMES` and
`allowed_hosts`): the DNS-rebinding guard's 403 says exactly what the check takes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from shardcache_sidecar.ui import routes

pytestmark = pytest.mark.unit

STARTED_FOR = ("inspector.example",)


def test_every_name_the_refusal_lists_is_one_the_check_takes() -> None:
    for word in routes.allowed_hosts(STARTED_FOR):
        if word == "an IP address":
            examples = ["10.1.2.3", "[::1]:8471"]
        elif word.startswith("*."):
            examples = [f"pod{word[1:]}"]
        else:
            examples = [word, f"{word.upper()}:8471"]
        for host in examples:
            assert routes.host_allowed(host, STARTED_FOR), host
    assert not routes.host_allowed("evil.example", STARTED_FOR)


def test_the_refusal_names_the_allowed_hosts_from_the_one_list() -> None:
    async def refused() -> tuple[int, dict[str, Any]]:
        app = web.Application()
        routes.mount(app, lambda: None, routes.Defaults(batch_size=4), hosts=STARTED_FOR)  # type: ignore[arg-type,return-value]
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            response = await client.get("/ui/api/info", headers={"Host": "evil.example"})
            return response.status, json.loads(await response.text())

    status, body = asyncio.run(refused())
    assert status == 403
    assert (
        f"Host 'evil.example' is not a name this inspector serves: expected "
        f"{', '.join(routes.allowed_hosts(STARTED_FOR))} (a guard against DNS rebinding"
    ) in body["error"]
    assert "*.localhost" in body["error"]
