"""A long-lived child process that runs the operator's periodic reads of tenants'
stores (`read_workers` starts and reuses it): the check that a pinned source is still
there (`sources.probe`) and the skips applied under a checkpoint prefix
(`skips.read_applied`).

Run as `python -m shardcache_operator.read_worker MEMORY`. Requests come on stdin, one
JSON object a line (`op`: "probe" or "applied_skips"; `uri`; `storage_options`, the
Secret's keys, which must never show in `ps`, so never in argv or env; `retry`, a
`source.RetryPolicy`'s fields; `shard`, a probe's pinned shard as [path, size], or
none); each answer goes to stdout, one JSON object a line: `{"ok": true}` for a probe,
`{"records": [...]}` for the skips, or `{"error": {...}}` as
`resolve_child.error_answer` writes it. One request at a time: the next comes only
after its answer.

The same limits as a resolve child (`resolve_child.limit`: data limit, 1 MiB thread
stacks, first for the OOM killer), set before pyarrow's import. Unlike a resolve child
it outlives the thread that started it, so it is not tied to that thread
(PR_SET_PDEATHSIG would kill it when that read's thread returns): it ends when its
parent does (a watch of its parent's pid), when stdin closes, after `IDLE_EXIT_SECONDS`
without a request, and after an answer that says it ran out of memory (what is left of
its heap is not worth keeping).
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from shardcache_operator import resolve_child

#: The requests a worker serves.
OPS = ("probe", "applied_skips")
#: Seconds a worker waits for a request before it ends by itself: longer than the pool
#: keeps an idle worker (`read_workers.IDLE_SECONDS`), so the pool never hands out one
#: that is ending. It ends the workers the pool stopped handing reads to: those of a
#: pool that stopped calling, and the spare ones when fewer reads run at once than before
#: (the pool hands out its most recently used worker first).
IDLE_EXIT_SECONDS = 120.0
#: Seconds between looks at whether the parent is still the same process.
_PARENT_POLL_SECONDS = 1.0


def serve(request: Mapping[str, Any]) -> dict[str, Any]:
    """The answer to one request."""
    try:
        from shardcache import errors, source
        from shardcache_operator import skips, sources

        op = request.get("op")
        uri = str(request["uri"])
        options = request.get("storage_options")
        options = dict(options) if options is not None else None
        retry = source.RetryPolicy(**request["retry"])
        if op == "probe":
            sources.probe(uri, options, retry=retry, shard=_shard(request.get("shard")))
            return {"ok": True}
        if op == "applied_skips":
            return {"records": skips.read_applied(uri, options)}
        raise errors.InputError(f"expected a request op of {list(OPS)}, found {op!r}")
    except BaseException as exc:  # every outcome goes back to the parent as an answer
        return resolve_child.error_answer(exc)


def _shard(value: object) -> tuple[str, int] | None:
    """A request's pinned shard: [path, size], or none."""
    if value is None:
        return None
    if isinstance(value, list) and len(value) == 2:
        path, size = value
        if isinstance(path, str) and resolve_child.is_count(size):
            return path, size
    from shardcache import errors

    raise errors.InputError(f"expected a request's shard as [path, size], found {value!r:.80}")


def _watch_parent(parent: int) -> None:
    """End this process once its parent is gone (re-parented: `getppid` changes)."""
    while os.getppid() == parent:
        time.sleep(_PARENT_POLL_SECONDS)
    os._exit(0)


def main(argv: list[str]) -> int:
    parent = os.getppid()
    resolve_child.limit(int(argv[1]), die_with_parent=False)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    stdin = sys.stdin.buffer
    while True:
        # One request at a time, and no request before its answer: nothing is ever
        # buffered in `stdin` past the line read, so `select` on it tells the truth.
        ready, _, _ = select.select([stdin], [], [], IDLE_EXIT_SECONDS)
        if not ready:
            return 0
        line = stdin.readline()
        if not line:
            return 0
        try:
            request = json.loads(line)
        except ValueError as exc:
            request = {"op": f"unreadable: {exc}", "uri": "", "retry": {}}
        answer = serve(request if isinstance(request, dict) else {})
        try:
            text = json.dumps(answer, separators=(",", ":"))
        except MemoryError as exc:
            answer = resolve_child.error_answer(exc)
            text = json.dumps(answer)
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        if answer.get("error", {}).get("kind") == resolve_child.MEMORY:
            return 0


if __name__ == "__main__":
    # As a resolve child: a read may leave pyarrow's I/O threads blocked on a store.
    code = main(sys.argv)
    sys.stdout.flush()
    os._exit(code)
