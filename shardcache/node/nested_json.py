"""How deep a JSON document nests, told without parsing it.

Any process of a pod can write the files under the node's tiers that readers here
parse (a memory-tier entry's meta, the window claims, a kept pinned manifest), and
`json.loads` recurses once per level: "[" repeated a few thousand times, a few KiB,
raises `RecursionError` in the reader, which is no `ValueError` and would crash the
trainer or the sidecar instead of counting as one more corrupt file. Each of those
formats nests a fixed few levels, so a reader measures the depth first and refuses a
deeper file with its usual error.
"""

from __future__ import annotations

import re

#: A JSON string, escapes included: its brackets are text, not nesting. UTF-8 never
#: puts an ASCII byte inside a multi-byte character, so bytes are scanned as they are.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = frozenset(b"[{")
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text `raw`: 0 for a
    scalar, 1 for `{"a": 1}`, 2 for `{"a": [1]}`. Text that is not JSON gets some
    count at least as deep as what a parser would reach before refusing it."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    level = deepest = 0
    for byte in brackets:
        if byte in _OPEN:
            level += 1
            deepest = max(deepest, level)
        elif level == 0:
            break  # a "]" that closes nothing: a parser refuses the text right there
        else:
            level -= 1
    return deepest
