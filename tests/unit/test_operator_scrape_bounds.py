"""The operator's DataStarved scrape reads a bounded part of what a pod answers
(docs/security.md, "Exhaust the operator's memory through a pod's /metrics").

The scrape's answer comes from the tenant's pod: a server of the pod author's own on the
sidecar's port (a native sidecar listed before the injected one binds it first) can
answer without end. Before, `response.text()` kept all of it for the whole scrape
timeout: gigabytes in an operator whose memory limit is 512Mi. Real HTTP on loopback.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from shardcache_operator import starvation

pytestmark = pytest.mark.unit

PIECE = 1024 * 1024
#: What the hostile pod offers: far more than any sidecar's /metrics.
OFFERED = 96 * PIECE
#: The last line of its answer, so that a scrape that read it all finds a value.
LAST_LINE = b'\nshardcache_reader_stall_fraction{reader="r0",rank="0"} 0.9\n'


class Answers:
    """A /metrics server on loopback; counts the bytes it managed to hand over."""

    def __init__(self, body: bytes | None = None) -> None:
        self.body = body
        self.sent = 0

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        if self.body is not None:
            return web.Response(body=self.body, content_type="text/plain")
        response = web.StreamResponse()
        await response.prepare(request)
        filler = b"#" * (PIECE - 1) + b"\n"
        try:
            while self.sent < OFFERED - PIECE:
                await response.write(filler)
                self.sent += len(filler)
            await response.write(LAST_LINE)
            self.sent += len(LAST_LINE)
        except (ConnectionError, RuntimeError):
            pass  # the scrape stopped reading
        return response


@contextlib.asynccontextmanager
async def serve(answers: Answers) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/metrics", answers.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


async def scrape(url: str) -> dict[str, float | None]:
    # A generous timeout: what is bounded here is the bytes read, not the time.
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await starvation.scrape(session, [starvation.Endpoint("hostile-0", url)])


async def test_an_endless_metrics_answer_is_not_read_past_the_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    answers = Answers()
    async with serve(answers) as url:
        with caplog.at_level(logging.WARNING, logger="shardcache_operator.starvation"):
            found = await scrape(url)
    assert found == {"hostile-0": None}
    # What the server handed over: the limit, and what the sockets' buffers took.
    assert answers.sent < OFFERED // 2
    assert "pod hostile-0 answered" in caplog.text
    assert f"more than {starvation.SCRAPE_MAX_BYTES} bytes" in caplog.text


async def test_an_answer_whose_length_is_over_the_limit_is_not_read() -> None:
    answers = Answers(b"#" * (8 * PIECE) + LAST_LINE)  # its Content-Length says so
    async with serve(answers) as url:
        assert await scrape(url) == {"hostile-0": None}


async def test_a_sidecars_answer_under_the_limit_is_read() -> None:
    answers = Answers(b"# a sidecar's /metrics\n" + LAST_LINE)
    async with serve(answers) as url:
        assert await scrape(url) == {"hostile-0": 0.9}
