"""Structured logging: one JSON object per line, extra fields included.

    log.info("reader registered", extra={"reader": reader_id, "rank": 3})

gives {"ts": ..., "level": "INFO", "logger": ..., "msg": "reader registered",
"reader": "...", "rank": 3}. "text" format is for humans at a terminal.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from shardcache import errors
from shardcache.contract import log_levels, parsers

# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(fmt: str, level: str) -> None:
    """Log to stderr in `fmt` at `level`: a level name, optionally followed by levels
    for single loggers, `INFO,shardcache.node.timeline=DEBUG`. Why per logger: the
    DEBUG lines a benchmark reads back (the cold path's timeline) are cheap, while the
    sidecar's own account of slow requests (`server.service_times`, on when its logger
    is at DEBUG) runs a watchdog and a sampling thread that cost what they measure."""
    root_level, loggers = levels(level)
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(root_level)
    # One line per probe would drown everything else.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    for name, named_level in loggers.items():
        logging.getLogger(name).setLevel(named_level)


def levels(text: str) -> tuple[str, dict[str, str]]:
    """`LEVEL[,logger=LEVEL...]` as (the root's level, levels by logger name); raises
    InputError naming the part that is not a level (`contract.log_levels`, which the
    contract row's parser uses too)."""
    try:
        return log_levels.split(text)
    except parsers.ParseError as exc:
        raise errors.InputError(f"log level {text!r}: {exc}") from None
