"""A TCP listener the sidecar cannot open is refused like a bad setting: one line naming
the address, the flag and variable that chose it, and the system's reason."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest
from aiohttp import web
from shardcache_sidecar import listening

from shardcache import errors

pytestmark = pytest.mark.unit


def test_a_port_in_use_names_the_address_and_the_port_setting() -> None:
    exc = OSError(
        errno.EADDRINUSE,
        "error while attempting to bind on address ('127.0.0.1', 8470): address already in use",
    )
    assert listening.cannot_listen("127.0.0.1", 8470, exc, "metrics_port", "metrics_host") == (
        "cannot listen on 127.0.0.1:8470 (--metrics-port / $SHARDCACHE_METRICS_PORT): "
        "Address already in use"
    )


def test_a_host_that_does_not_resolve_names_the_host_setting() -> None:
    exc = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert listening.cannot_listen("nohost.invalid", 8470, exc, "metrics_port", "metrics_host") == (
        "cannot listen on nohost.invalid:8470 (--metrics-host / $SHARDCACHE_METRICS_HOST): "
        "Name or service not known"
    )


def test_an_address_not_on_this_machine_names_the_host_setting() -> None:
    exc = OSError(errno.EADDRNOTAVAIL, "cannot assign requested address")
    message = listening.cannot_listen("fd00::1", 8470, exc, "metrics_port", "metrics_host")
    assert message.startswith("cannot listen on [fd00::1]:8470 (--metrics-host / ")


def test_the_inspector_port_in_use_is_refused_naming_it() -> None:
    async def start_on_a_held_port() -> None:
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            runner = web.AppRunner(web.Application())
            await runner.setup()
            try:
                with pytest.raises(errors.InputError) as info:
                    await listening.start_tcp(
                        runner, "127.0.0.1", port, port_field="ui_port", host_field=None
                    )
            finally:
                await runner.cleanup()
        assert str(info.value) == (
            f"cannot listen on 127.0.0.1:{port} (--ui-port / $SHARDCACHE_UI_PORT): "
            "Address already in use"
        )

    asyncio.run(start_on_a_held_port())
