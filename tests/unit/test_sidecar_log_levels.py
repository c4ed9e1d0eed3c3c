"""The sidecar's log level names the root's level and, optionally, single loggers'."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from shardcache_sidecar import logs
from shardcache_sidecar.server import service_times

from shardcache import errors

pytestmark = pytest.mark.unit

NAMED = ("shardcache_sidecar.slow", "shardcache.node.timeline", "aiohttp.access")


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = root.level, list(root.handlers), {n: logging.getLogger(n).level for n in NAMED}
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_a_single_logger_can_be_at_debug_while_the_rest_is_at_info() -> None:
    logs.configure("json", "INFO,shardcache.node.timeline=debug")
    assert logging.getLogger().level == logging.INFO
    assert logging.getLogger("shardcache.node.timeline").isEnabledFor(logging.DEBUG)
    # The sidecar's own account of slow requests stays off: it costs what it measures.
    assert not service_times.enabled()
    logs.configure("json", "INFO, shardcache_sidecar.slow = DEBUG")
    assert service_times.enabled()


def test_a_plain_level_still_sets_every_logger() -> None:
    logs.configure("text", "DEBUG")
    assert logging.getLogger().level == logging.DEBUG
    assert service_times.enabled()


@pytest.mark.parametrize("text", ["LOUD", "INFO,shardcache=LOUD", "INFO,DEBUG", "INFO,=DEBUG"])
def test_a_level_that_is_not_one_is_refused_with_the_part_named(text: str) -> None:
    with pytest.raises(errors.InputError, match="log level"):
        logs.configure("json", text)
