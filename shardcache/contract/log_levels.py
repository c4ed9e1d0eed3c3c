"""A sidecar's log level as `$SHARDCACHE_LOG_LEVEL` and `--log-level` give it.

`LEVEL[,logger=LEVEL...]`: the root logger's level, then levels for single loggers,
`INFO,shardcache.node.timeline=DEBUG`. Parsed here, with the rest of the contract, so
a typo is refused where every other setting is (the variable or flag named, exit 2)
rather than when logging is set up.
"""

from __future__ import annotations

import logging

from shardcache.contract import parsers

#: What the refusal says a level may be (logging also knows WARN, FATAL and NOTSET).
LEVEL_NAMES = "DEBUG, INFO, WARNING, ERROR"
EXPECTED = f"LEVEL or LEVEL,logger=LEVEL,... with each LEVEL one of {LEVEL_NAMES}"


def split(text: str) -> tuple[str, dict[str, str]]:
    """`text` as (the root's level, levels by logger name), upper-cased; raises
    `parsers.ParseError` naming the part that is not a level."""
    root, *named = (part.strip() for part in text.split(","))
    loggers: dict[str, str] = {}
    for part in named:
        name, equals, level = (item.strip() for item in part.partition("="))
        if not equals or not name:
            raise parsers.ParseError(EXPECTED, f"{part!r} in {text!r}")
        loggers[name] = _level(level, text)
    return _level(root, text), loggers


def _level(name: str, text: str) -> str:
    if not isinstance(logging.getLevelName(name.upper()), int):
        where = repr(name) if name == text else f"{name!r} in {text!r}"
        raise parsers.ParseError(EXPECTED, where)
    return name.upper()


def _checked(text: str) -> str:
    split(text)
    return text


#: The row's parser: the text as given, once `split` accepts it.
PARSER: parsers.Parser[str] = parsers.Parser("LEVEL[,logger=LEVEL...]", _checked)
