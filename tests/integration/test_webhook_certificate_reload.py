"""The webhook serves a renewed certificate without a restart (cert-manager mode).

Files are laid out as kubelet mounts a Secret: tls.crt -> ..data/tls.crt, with ..data a
symlink swapped atomically to a new timestamped directory on each refresh.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from shardcache_operator import certs, configuration, context, tls_reload, webhook

from tests.support.s3server import free_port

pytestmark = pytest.mark.integration

NAMES = ("ca.crt", "tls.crt", "tls.key")
#: A short check interval; the product default is tls_reload.CHECK_INTERVAL_SECONDS.
INTERVAL = 0.1


def kubelet_write(volume: Path, generation: str, bundle: certs.Bundle) -> None:
    """What kubelet does for a Secret volume: a new directory, then one rename."""
    payload = volume / f"..{generation}"
    certs.write(bundle, payload)
    link = volume / "..data_tmp"
    link.symlink_to(payload.name)
    os.replace(link, volume / "..data")  # the atomic swap
    for name in NAMES:
        if not (volume / name).is_symlink():
            (volume / name).symlink_to(f"..data/{name}")


def der(bundle: certs.Bundle) -> bytes:
    return ssl.PEM_cert_to_DER_cert(bundle.cert_pem.decode())


async def served(port: int) -> bytes:
    """The leaf certificate a new TLS connection to the webhook gets."""
    client = ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        peer = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert isinstance(peer, bytes)
        return peer
    finally:
        writer.close()


async def until_served(port: int, wanted: bytes, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (now := await served(port)) != wanted:
        assert asyncio.get_running_loop().time() < deadline, "the renewed certificate is not served"
        await asyncio.sleep(0.05)
    assert now == wanted


class Running:
    def __init__(self, port: int, volume: Path, release: asyncio.Event) -> None:
        self.port = port
        self.volume = volume
        #: Reviews to /slow wait for this: requests in flight across a reload.
        self.release = release


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    volume = tmp_path / "tls"
    volume.mkdir()
    kubelet_write(volume, "2025_01_01_00_00_00.1", certs.generate(["127.0.0.1"]))
    port = free_port()
    settings = configuration.Settings(
        webhook_addr="127.0.0.1",
        webhook_port=port,
        webhook_cert_file=str(volume / "tls.crt"),
        webhook_key_file=str(volume / "tls.key"),
        webhook_ca_file=str(volume / "ca.crt"),
    )
    memo = context.Context(settings=settings, api=None)  # no review here reads a mount
    release = asyncio.Event()

    async def slow(request: Any, *, webhook: str | None = None, **_: Any) -> Any:
        await release.wait()
        return {"answered": webhook}

    serving = webhook.Server(webhook.server(settings, reload_interval=INTERVAL), memo)(slow)
    await serving.__anext__()
    try:
        yield Running(port, volume, release)
    finally:
        await serving.aclose()


async def test_a_renewed_certificate_is_served_without_a_restart(running: Running) -> None:
    first = (running.volume / "tls.crt").read_bytes()
    assert await served(running.port) == ssl.PEM_cert_to_DER_cert(first.decode())
    renewed = certs.generate(["127.0.0.1"])
    kubelet_write(running.volume, "2025_02_01_00_00_00.2", renewed)
    await until_served(running.port, der(renewed))
    again = certs.generate(["127.0.0.1"])
    kubelet_write(running.volume, "2025_03_01_00_00_00.3", again)
    await until_served(running.port, der(again))


async def test_a_review_in_flight_across_a_reload_is_answered(running: Running) -> None:
    """The listening socket and open connections stay: only new handshakes change."""
    client = ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    async with aiohttp.ClientSession() as session:
        url = f"https://127.0.0.1:{running.port}/slow"
        in_flight = asyncio.create_task(session.post(url, json={}, ssl=client))
        await asyncio.sleep(0.2)  # the request reached the handler and waits there
        renewed = certs.generate(["127.0.0.1"])
        kubelet_write(running.volume, "2025_02_01_00_00_00.2", renewed)
        await until_served(running.port, der(renewed))
        assert not in_flight.done()
        running.release.set()
        async with await in_flight as response:
            assert response.status == 200
            assert await response.json() == {"answered": "slow"}


async def test_files_copied_one_by_one_are_loaded_once_they_match(
    running: Running, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy in place (not kubelet's swap) is a certificate with the old key for a
    moment: the old pair stays served, with one warning, until the key follows."""
    old = await served(running.port)
    renewed = certs.generate(["127.0.0.1"])
    staged = certs.write(renewed, tmp_path / "staged")
    target = running.volume / "..data"
    with caplog.at_level(logging.WARNING, logger=tls_reload.__name__):
        shutil.copy(staged.cert_file, target / "tls.crt")
        await asyncio.sleep(INTERVAL * 5)
        assert await served(running.port) == old
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "still serving the certificate loaded before" in warnings[0]
        shutil.copy(staged.key_file, target / "tls.key")
        await until_served(running.port, der(renewed))


def test_reloader_keeps_the_served_pair_when_the_new_one_does_not_load(tmp_path: Path) -> None:
    files = certs.write(certs.generate(["127.0.0.1"]), tmp_path)
    reloader = tls_reload.Reloader(files.cert_file, files.key_file)
    served_before = reloader.context.current
    assert reloader.check() is False  # nothing changed
    files.key_file.write_bytes(certs.generate(["127.0.0.1"]).key_pem)  # not its certificate
    assert reloader.check() is False
    assert reloader.context.current is served_before
    files.cert_file.unlink()
    assert reloader.check() is False
    assert reloader.context.current is served_before
    renewed = certs.write(certs.generate(["127.0.0.1"]), tmp_path)
    assert renewed.cert_file == files.cert_file
    assert reloader.check() is True
    assert reloader.context.current is not served_before
