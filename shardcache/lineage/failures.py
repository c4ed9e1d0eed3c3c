"""How `shardcache skip`, `lineage` and `diff` end on an error: one line on stderr, exit
status 2, whatever failed (bad input, the dataset, the checkpoint store). Status 1 is
kept for an answer: `diff`'s "the runs differ", `lineage --where`'s "no sample matches";
a script must never read a store outage as one of those."""

from __future__ import annotations

import sys

#: The exit status of every error of these commands.
EXIT_ERROR = 2


def report(command: str, exc: BaseException) -> int:
    """Print `exc` as `shardcache COMMAND: …` on one line; return `EXIT_ERROR`. An
    OSError here escaped the store wrappers (a cache directory, say): it is still a
    line, not a traceback."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"shardcache {command}: {text}", file=sys.stderr)
    return EXIT_ERROR
