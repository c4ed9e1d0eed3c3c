"""The operator's periodic reads of tenants' stores, in worker processes it bounds,
reuses and kills (docs/security.md, "Starve other namespaces through the operator's
reads").

Two reads run on timers, per DatasetMount: the check that a pinned source is still
there (`sources.probe`, every `sourceCheckSeconds`) and the look for skips applied under
a checkpoint prefix (`skips.read_applied`, every `skipsIntervalSeconds`). Each lists a
prefix the tenant controls, whole (the source's first level; the checkpoint's rank
prefixes and each rank's steps), and pyarrow builds a listing in one piece: in the
operator's own process, a tenant that put a few million keys there grew the operator
past its memory limit at its next timer, and the kernel killed it, its webhook
(failurePolicy Fail) with it, for every namespace, at every restart. Here each read runs
in a `read_worker` process with the resolve children's data limit
(`operator.settings.resolveMemory`, which holds a first level as large as a resolve
does), first in line for the OOM killer, and killed when its caller stops waiting (the
read's timeout): a read over its limit fails its own check, `CheckOverMemory`.

A worker serves one read at a time and is kept for the next (`IDLE_SECONDS` at most):
the timers of many mounts would otherwise pay an interpreter and pyarrow's import
(about 0.25 s of CPU) per read, every minute per mount with checkpoints. At most
`workers` reads run at once across namespaces (`resolve_slots.Slots`), one of them a
namespace's (its reads are periodic and small: they can wait their turn), a freed
worker going to the namespace served least recently; a read that gets none within its
timeout fails `resolve_slots.AllBusy`, which changes no status
(`reconcile.check_source`). A read takes at most `TIMEOUT`, so a namespace whose store
never answers holds one worker for that long a read. A worker that timed out, died or
answered out of memory is never reused.

A store that hangs is then left alone for its namespace (`quiet_stores`): after a read
of it held its worker 10 s or more and failed (its timeout, or the store unreachable
through the worker's own retries), the namespace's further reads of the same store fail
at once for a while. Without it, every mount of a namespace whose store hangs held a
worker for a whole timeout at each of its checks: two such namespaces held both default
workers all the time, and the other namespaces' checks got none (`ChecksBusy`, their
status unchanged).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from shardcache import errors, source, uris
from shardcache_operator import (
    quiet_stores,
    read_worker,
    reconcile,
    resolve_child,
    resolve_children,
    resolve_slots,
    source_reads,
    sources,
)

#: Reads at once across namespaces, by default (operator.settings.readWorkers): two, so
#: that one namespace whose store never answers holds one (its share) and the others
#: take turns at the other.
WORKERS = 2
#: Seconds one periodic read may take, waiting for a worker included: a source check is
#: one metadata request (an older pin's: two and a listing of one level), retried for
#: 30 s (`sources.RETRY`);
#: the applied skips list each rank's steps, one request a rank. What a store that never
#: answers holds a worker for, at each of its mounts' timers.
TIMEOUT = 120.0
#: Seconds an idle worker is kept for the next read: longer than the applied skips'
#: timer (`skipsIntervalSeconds`, 60 s), so that one mount with a checkpoint store
#: finds its worker warm every minute instead of starting one (about 0.25 s of CPU:
#: 0.4 % of a core, per such mount, for nothing). It costs no memory: an idle worker is
#: ended only when a later read finds it stale, or by itself (`read_worker
#: .IDLE_EXIT_SECONDS`, 120 s), so with 30 s here it lived on, 90 MiB, until the next
#: read ended it and started another.
IDLE_SECONDS = 100.0
#: Bytes of one answer read at most: a probe's is a dozen bytes, and the applied skips
#: are one small record per restore that applied a skip.
MAX_ANSWER_BYTES = 4 << 20
#: Seconds before its caller's timeout that a read stops waiting for a worker
#: (`resolve_children._ANSWER_MARGIN`'s reason).
_ANSWER_MARGIN = 0.5
_CHUNK = 1 << 16

READS = resolve_slots.Kind(
    work="periodic reads",
    holders="read workers",
    then="tried again at the next check (from a spec update's reconcile: with backoff)",
    sizing=(
        "operator.settings.readWorkers sizes them: docs/operator.md, "
        '"Source checks and applied skips"'
    ),
)


class _Worker:
    """One `read_worker` process, and when it last finished a read."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.idle_since = time.monotonic()
        self.stderr = bytearray()


class Pool:
    """`probe` and `applied_skips` as `sources` has them, run in `read_worker` processes.

    `memory`: each worker's data limit in bytes (operator.settings.resolveMemory);
    `timeout`: seconds a read may take, waiting for a worker included, or less where
    its caller (a `source_reads.Gate` thread) waits less;
    `workers`: reads at once across namespaces. Called from any thread."""

    def __init__(
        self,
        *,
        memory: int,
        timeout: float = TIMEOUT,
        access: sources.Access | None = None,
        retry: source.RetryPolicy = sources.RETRY,
        workers: int = WORKERS,
        idle_seconds: float = IDLE_SECONDS,
        setting: str = "operator.settings.resolveMemory",
        quiet: quiet_stores.Quiet | None = None,
    ) -> None:
        self.memory = memory
        self.timeout = timeout
        self.access = access or sources.Access()
        self.retry = retry
        self.slots = resolve_slots.Slots(workers, READS, share=1)
        self.idle_seconds = idle_seconds
        self.quiet = quiet or quiet_stores.Quiet()
        #: How the limit is named in messages (the chart value, or the env variable).
        self.setting = setting
        self._idle: list[_Worker] = []
        self._processes: dict[int, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def running(self) -> list[int]:
        """The pids of the workers alive, busy or idle."""
        with self._lock:
            return list(self._processes)

    def close(self) -> None:
        """Kill every worker and refuse new reads: the operator is stopping."""
        with self._lock:
            self._closed = True
            processes = list(self._processes.values())
            self._processes.clear()
            self._idle.clear()
        for process in processes:
            _end(process)

    def probe(
        self,
        uri: str,
        storage_options_: Mapping[str, str] | None,
        /,
        *,
        shard: reconcile.PinnedShard | None = None,
    ) -> None:
        """`sources.probe_source`, in a worker (a `reconcile.Prober`)."""
        # The policy is the operator's, judged here: a refused source reaches no worker.
        options = sources.storage_options(uri, storage_options_, self.access)
        extra = {"shard": list(shard)} if shard is not None else {}
        self._call("probe", uri, options, what=f"checking {uris.redact(uri)}", **extra)

    def applied_skips(
        self, uri: str, storage_options_: Mapping[str, str] | None
    ) -> list[dict[str, Any]]:
        """`sources.applied_skips`, in a worker."""
        options = sources.storage_options(uri, storage_options_, self.access)
        answer = self._call(
            "applied_skips", uri, options, what=f"reading the applied skips of {uris.redact(uri)}"
        )
        records = answer.get("records")
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise RuntimeError(
                f"a read worker answered the applied skips with {type(records).__name__}, "
                "expected a list of records"
            )
        return records

    def _call(
        self, op: str, uri: str, options: Mapping[str, str] | None, *, what: str, **extra: Any
    ) -> dict[str, Any]:
        request = {
            "op": op,
            "uri": uri,
            "storage_options": dict(options) if options is not None else None,
            "retry": self.retry.to_json(),
            **extra,
        }
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        namespace = source_reads.namespace() or ""
        store = self.quiet.key(namespace, uri, options)
        self.quiet.check(store, what)  # before any worker: a hanging store holds none
        left = source_reads.remaining()
        timeout = self.timeout if left is None else min(self.timeout, left)
        deadline = time.monotonic() + timeout
        wait = max(0.0, timeout - min(_ANSWER_MARGIN, timeout / 10))
        with self.slots.held(namespace, timeout=wait, what=what):
            worker = self._take()
            kept = False
            sent = time.monotonic()
            try:
                try:
                    answer = self._exchange(worker, line, deadline, timeout)
                except TimeoutError:
                    self.quiet.failed(
                        store, time.monotonic() - sent, f"did not answer within {timeout:g} s"
                    )
                    raise
                error = answer.get("error")
                if error is None:
                    self.quiet.answered(store)
                elif isinstance(error, dict) and error.get("kind") == "SourceError":
                    # The store failed the worker's retries (an unreachable store; not
                    # what it holds, nor the read's memory): slowly, a hanging one.
                    held = time.monotonic() - sent
                    self.quiet.failed(store, held, f"failed after {held:.0f} s")
                kept = error is None or (
                    isinstance(error, dict) and error.get("kind") != resolve_child.MEMORY
                )
            finally:
                self._done(worker, keep=kept)
        if "error" in answer:
            error = answer["error"]
            if not isinstance(error, dict):
                raise RuntimeError(f"a read worker answered an error of {type(error).__name__}")
            raise resolve_children.raised(error, over_memory=self._over_memory)
        return answer

    def _take(self) -> _Worker:
        """An idle worker still alive and not kept too long, else a new one."""
        now = time.monotonic()
        stale: list[_Worker] = []
        found: _Worker | None = None
        with self._lock:
            if self._closed:
                raise errors.SourceError("the operator is stopping: checked again at its start")
            while self._idle:
                worker = self._idle.pop()  # the most recently used: the rest may expire
                if worker.process.poll() is None and now - worker.idle_since < self.idle_seconds:
                    found = worker
                    break
                stale.append(worker)
            stale += [w for w in self._idle if now - w.idle_since >= self.idle_seconds]
            self._idle = [w for w in self._idle if w not in stale]
            for worker in stale:
                self._processes.pop(worker.process.pid, None)
        for worker in stale:
            _end(worker.process)
        if found is not None:
            return found
        # Started outside the lock: other threads need not wait for its fork and exec.
        process = subprocess.Popen(
            [sys.executable, "-m", read_worker.__name__, str(self.memory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, **resolve_child.ENV},
            close_fds=True,
        )
        with self._lock:
            if self._stopping():  # closed meanwhile: `close` has not seen this one
                _end(process)
                raise errors.SourceError("the operator is stopping: checked again at its start")
            self._processes[process.pid] = process
        return _Worker(process)

    def _stopping(self) -> bool:
        """Whether `close` was called (a call, which mypy does not narrow as it narrows
        `self._closed` after a first look)."""
        return self._closed

    def _done(self, worker: _Worker, *, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed and worker.process.poll() is None:
                worker.idle_since = time.monotonic()
                worker.stderr.clear()
                self._idle.append(worker)
                return
            self._processes.pop(worker.process.pid, None)
        _end(worker.process)

    def _exchange(
        self, worker: _Worker, line: bytes, deadline: float, timeout: float
    ) -> dict[str, Any]:
        """Send `line` and read one answer line, within `deadline`."""
        process = worker.process
        assert process.stdin is not None and process.stdout is not None
        assert process.stderr is not None
        try:
            process.stdin.write(line)
            process.stdin.flush()
        except BrokenPipeError:
            raise self._dead(worker, deadline) from None
        answer = bytearray()
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ, answer)
            selector.register(process.stderr, selectors.EVENT_READ, worker.stderr)
            while b"\n" not in answer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the read did not finish within {timeout:g} s")
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        if key.data is answer:
                            raise self._dead(worker, deadline)
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    resolve_children.kept(worker.stderr)
                    if len(answer) > MAX_ANSWER_BYTES:
                        raise errors.InputError(
                            f"the answer of a read worker is larger than the "
                            f"{MAX_ANSWER_BYTES >> 20} MiB the operator reads back"
                        )
        try:
            data = json.loads(answer[: answer.index(b"\n")])
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise RuntimeError("a read worker answered something other than a JSON object")
        return data

    def _dead(self, worker: _Worker, deadline: float) -> Exception:
        """What a worker that closed its stdout without an answer died of."""
        process = worker.process
        assert process.stderr is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(OSError, ValueError):
            os.set_blocking(process.stderr.fileno(), False)
            while chunk := os.read(process.stderr.fileno(), _CHUNK):
                worker.stderr.extend(chunk)
                resolve_children.kept(worker.stderr)
        if self._closed:  # killed by `close`, not by the kernel: no verdict on memory
            return errors.SourceError(
                "the operator stopped while reading: checked again at its start"
            )
        code = process.returncode if process.returncode is not None else -1
        return resolve_children.died(
            code,
            bytes(worker.stderr),
            over_memory=self._over_memory,
            killed=(
                "the read's worker process was killed (SIGKILL), most likely by the kernel's "
                "OOM killer: the operator's container ran out of memory; raise the "
                f"operator's memory limit, or lower {self.setting} ({self.memory >> 20} MiB "
                "a worker)"
            ),
            process="the read's worker process",
        )

    def _over_memory(self, found: str) -> reconcile.ResolveOverMemory:
        return reconcile.ResolveOverMemory(
            f"the read went over its memory limit of {self.memory >> 20} MiB ({found}): "
            f"the prefix lists more keys than that holds; raise {self.setting} (and the "
            "operator's memory limit with it, docs/operator.md), or move what is not the "
            "dataset's out of its prefix"
        )


def _end(process: subprocess.Popen[bytes]) -> None:
    """Kill `process`, reap it and close its pipes."""
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
