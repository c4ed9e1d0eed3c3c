"""Manifest resolves of tenants' sources, each in a child process the operator bounds
and kills (docs/security.md, "Starve other namespaces through the operator's reads").

A resolve lists the tenant's prefix whole (`manifests._list`) and reads every shard:
in the operator's own process a prefix of millions of keys, or an endpoint whose list
pages never end, grew the operator's memory until it was OOM-killed, and its webhook
(failurePolicy Fail) with it, for every namespace; and a thread blocked in a read could
not be stopped, so it kept its namespace's read slot past the timeout. Here each
resolve is a `resolve_child` process with a data limit of its own (`memory`), first in
line for the kernel's OOM killer, killed when its caller stops waiting (the read's
timeout: `source_reads.remaining`) and when the operator stops (`close`). What comes
back is what the operator pins of the manifest (`resolve_child.Summary`: its digest,
counts and largest shard, whatever the shard count) or the error, raised again as the
class an in-process resolve raises (`raised`).

Each child is forked from one warm process (`resolve_forkserver`), which paid the
interpreter and pyarrow's import once: a child started as a fresh interpreter paid
them at every resolve, about 0.25 s of CPU on the 2-core machine (docs/benchmarks.md,
"The operator's child processes, counted", and "Resolve children forked from a warm
process"), at each create, source change and retry. Forking the operator itself, a
process with threads and an event loop, would not be safe.

A store that hangs fails a resolve slowly; the namespace's other resolves of it then
fail at once for a while (`quiet_stores`), holding no slot.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from shardcache import errors, source, uris
from shardcache_operator import (
    quiet_stores,
    reconcile,
    resolve_child,
    resolve_forks,
    resolve_slots,
    source_reads,
    sources,
)

#: Bytes of a child's answer read at most: a summary or an error is a few hundred bytes
#: (a shard's path, a message), whatever the shard count, and the manifest's handed
#: parts at most 3 MiB, 4 MiB in base64 (`shardcache.node.handed_manifests`).
MAX_ANSWER_BYTES = 5 << 20
#: Seconds before its caller's timeout that a resolve stops waiting for a slot: time
#: for its `AllBusy` to cross from its thread to the event loop.
_ANSWER_MARGIN = 0.5
#: The first and the last bytes of a child's stderr kept for a message about its death:
#: Python's fatal error ("Cannot recover from MemoryErrors") comes first, then every
#: thread's stack (the resolve runs 8), well over 4 KiB; a C++ abort's line comes last.
STDERR_KEPT_BYTES = 4096
_CHUNK = 1 << 16
#: What a resolve that `Resolver.close` ended says.
_STOPPED = "the operator stopped while resolving: resolved again at its start"


class Resolver:
    """A `reconcile.Resolver` that resolves in child processes (`resolve_child`).

    `memory`: each child's data limit in bytes (chart value operator.settings.resolveMemory);
    `timeout`: seconds a child may run when not called on a `source_reads.Gate` thread,
    whose caller's own timeout applies otherwise, waiting for a slot included;
    `children`: children at once across namespaces (`resolve_slots`; None: no cap).
    Called from any thread."""

    def __init__(
        self,
        *,
        memory: int,
        timeout: float,
        access: sources.Access | None = None,
        retry: source.RetryPolicy = sources.RETRY,
        setting: str = "operator.settings.resolveMemory",
        children: int | None = None,
        quiet: quiet_stores.Quiet | None = None,
        hand_namespaces: frozenset[str] = frozenset(),
    ) -> None:
        self.memory = memory
        #: Namespaces whose resolves answer the manifest to hand to the sidecars too
        #: (`Settings.manifest_namespaces`): elsewhere its encoding would be thrown away.
        self.hand_namespaces = hand_namespaces
        self.slots = resolve_slots.Slots(children)
        self.timeout = timeout
        self.access = access or sources.Access()
        self.retry = retry
        self.quiet = quiet or quiet_stores.Quiet()
        #: How the limit is named in messages (the chart value, or the env variable).
        self.setting = setting
        self._children: dict[int, resolve_forks.Forked] = {}
        self._forks = resolve_forks.Forkserver(memory=memory)
        self._lock = threading.Lock()
        self._closed = False

    def running(self) -> list[int]:
        """The pids of the children resolving now."""
        with self._lock:
            return list(self._children)

    def close(self) -> None:
        """Kill every child and refuse new resolves: the operator is stopping."""
        with self._lock:
            self._closed = True
            children = list(self._children.values())
        for child in children:
            child.kill()
        self._forks.close()

    def __call__(
        self, uri: str, fmt: str, storage_options_: Mapping[str, str] | None
    ) -> resolve_child.Summary:
        # The policy is the operator's, judged here: a refused source starts no child.
        options = sources.storage_options(uri, storage_options_, self.access)
        namespace = source_reads.namespace() or ""
        request = {
            "uri": uri,
            "format": fmt,
            "storage_options": dict(options) if options is not None else None,
            "memory": self.memory,
            "retry": self.retry.to_json(),
            "hand": namespace in self.hand_namespaces,
        }
        left = source_reads.remaining()
        timeout = self.timeout if left is None else min(self.timeout, left)
        deadline = time.monotonic() + timeout
        what = f"resolving the manifest of {uris.redact(uri)}"
        # The wait for a slot ends a little before the caller's own timeout, so that
        # `AllBusy` (the operator is busy) reaches it rather than its TimeoutError (the
        # store is slow). Off a gate thread (tests, tools) the caller is a namespace of
        # its own.
        wait = max(0.0, timeout - min(_ANSWER_MARGIN, timeout / 10))
        store = self.quiet.key(namespace, uri, options)
        self.quiet.check(store, what)  # before any slot: a hanging store holds none
        with self.slots.held(namespace, timeout=wait, what=what):
            left = max(0.0, deadline - time.monotonic())
            sent = time.monotonic()
            code, answer, stderr = self._run(json.dumps(request).encode(), left)
            held = time.monotonic() - sent
        try:
            summary = self._manifest(code, answer, stderr)
        except errors.SourceError as exc:
            # The store unreachable through the child's retries, slowly: one that hangs
            # (`quiet_stores`). Not what it holds (an InputError), nor a resolve past its
            # timeout, which may be a large listing on a store that answers.
            if type(exc) is errors.SourceError:
                self.quiet.failed(store, held, f"failed after {held:.0f} s")
            raise
        self.quiet.answered(store)
        return summary

    def _run(self, request: bytes, timeout: float) -> tuple[int, bytes, bytes]:
        """Fork a child, hand it `request`, and read its answer until it exits, or
        kill it at `timeout` (TimeoutError) or when its answer is over the cap."""
        deadline = time.monotonic() + timeout
        if self._closed:
            raise errors.SourceError("the operator is stopping: resolved again at its start")
        try:
            child = self._forks.fork(timeout)
        except resolve_forks.ServerEnded as exc:
            raise self._server_ended(exc) from None
        with self._lock:
            self._children[child.pid] = child
            closed = self._closed
        try:
            if closed:  # `close` ran while the child was forked: it missed this one
                raise errors.SourceError(_STOPPED)
            answer = self._exchange(child, request, deadline, timeout)
            if self._closed:  # killed by `close`, not by the kernel: no verdict on memory
                raise errors.SourceError(_STOPPED)
            return answer
        except resolve_forks.ServerEnded as exc:
            raise self._server_ended(exc) from None
        finally:
            child.kill()
            with contextlib.suppress(resolve_forks.ServerEnded):
                child.wait()
            child.close()
            with self._lock:
                self._children.pop(child.pid, None)

    def _server_ended(self, exc: resolve_forks.ServerEnded) -> Exception:
        """What a resolve whose fork server ended says: killed by the kernel (most
        likely out of memory), as a child is, or the server's own failure."""
        if self._closed:
            return errors.SourceError(_STOPPED)
        code = self._forks.exit_code()
        if code == -signal.SIGKILL:
            return self._died(code, b"")
        return RuntimeError(f"{exc} (its exit status: {code})")

    def _exchange(
        self, child: resolve_forks.Forked, request: bytes, deadline: float, timeout: float
    ) -> tuple[int, bytes, bytes]:
        assert child.stdin is not None and child.stdout is not None and child.stderr is not None
        # The child reads its whole request before it writes: no deadlock, and a few
        # hundred bytes fit the pipe.
        with contextlib.suppress(BrokenPipeError):
            child.stdin.write(request)
        with contextlib.suppress(BrokenPipeError):
            child.stdin.close()
        answer = bytearray()
        stderr = bytearray()
        with selectors.DefaultSelector() as selector:
            selector.register(child.stdout, selectors.EVENT_READ, answer)
            selector.register(child.stderr, selectors.EVENT_READ, stderr)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the resolve did not finish within {timeout:g} s")
                for key, _ in selector.select(left):
                    chunk = os.read(key.fd, _CHUNK)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    kept(stderr)
                    if len(answer) > MAX_ANSWER_BYTES:
                        raise RuntimeError(
                            f"the resolve's process answered more than "
                            f"{MAX_ANSWER_BYTES >> 20} MiB: expected a summary of a few "
                            "hundred bytes and at most 4 MiB of handed manifest"
                        )
        left = max(0.0, deadline - time.monotonic())
        try:
            code = child.wait(left)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the resolve did not finish within {timeout:g} s") from None
        return code, bytes(answer), bytes(stderr)

    def _manifest(self, code: int, answer: bytes, stderr: bytes) -> resolve_child.Summary:
        try:
            data = json.loads(answer) if answer else None
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise self._died(code, stderr)
        if "summary" in data:
            try:
                return resolve_child.Summary.from_json(data["summary"])
            except ValueError as exc:
                raise RuntimeError(
                    f"the resolve's process answered another summary: {exc}"
                ) from None
        error = data.get("error")
        if not isinstance(error, dict):
            raise self._died(code, stderr)
        raise raised(error, over_memory=self._over_memory)

    def _over_memory(self, found: str) -> reconcile.ResolveOverMemory:
        return reconcile.ResolveOverMemory(
            f"the resolve went over its memory limit of {self.memory >> 20} MiB ({found}): "
            f"the source's listing or shards need more; raise {self.setting} (and the "
            "operator's memory limit with it, docs/operator.md), or split the prefix"
        )

    def _died(self, code: int, stderr: bytes) -> Exception:
        return died(
            code,
            stderr,
            over_memory=self._over_memory,
            killed=(
                "the resolve's process was killed (SIGKILL), most likely by the kernel's OOM "
                "killer: the operator's container ran out of memory with resolves running; "
                f"raise the operator's memory limit, or lower {self.setting} "
                f"({self.memory >> 20} MiB a resolve, 4 at once per namespace), or set "
                "operator.settings.resolveChildren lower"
            ),
        )


def died(
    code: int,
    stderr: bytes,
    *,
    over_memory: Callable[[str], Exception],
    killed: str,
    process: str = "the resolve's process",
) -> Exception:
    """Why a child that gave no answer ended: killed by the kernel (`killed`, a message
    saying what to change), out of memory where no MemoryError could be raised (a C++
    `std::bad_alloc`, a thread's memory refused: the process aborts; `over_memory`), or
    crashed (a RuntimeError naming `process`, with the last lines of its `stderr`)."""
    lines = stderr.decode(errors="replace").strip().splitlines()
    if code == -signal.SIGKILL:
        return reconcile.ResolveOverMemory(killed)
    said = [line for line in lines if any(m in line.lower() for m in _OUT_OF_MEMORY)]
    if said:
        return over_memory(said[0].strip())
    tail = "; ".join(line.strip() for line in lines[-3:]) or "nothing on stderr"
    return RuntimeError(f"{process} ended with exit status {code}: {tail}")


def kept(stderr: bytearray) -> None:
    """Trim `stderr` (read so far) to its first and last `STDERR_KEPT_BYTES`."""
    if len(stderr) > 2 * STDERR_KEPT_BYTES:
        del stderr[STDERR_KEPT_BYTES:-STDERR_KEPT_BYTES]


#: What a child that ran out of memory outside Python says on stderr before it aborts.
#: CPython's "Cannot recover from stack overflow" comes from the same place: the limit hit
#: while it reports an exception (`sys.unraisablehook` failing, recursively; seen about
#: once in 20 resolves over their limit), never from the resolve's own code, which does
#: not recurse.
_OUT_OF_MEMORY = (
    "memoryerror",
    "bad_alloc",
    "cannot allocate memory",
    "out of memory",
    "cannot recover from stack overflow",
)


def raised(error: Mapping[str, Any], *, over_memory: Callable[[str], Exception]) -> Exception:
    """The exception a child's `error` answer stands for: the class an in-process
    resolve raises for the kinds the reconcile tells apart (`resolve_child.KINDS`,
    `resolve_child.MEMORY`), with its message; a RuntimeError naming the class else."""
    kind = error.get("kind")
    message = str(error.get("message", ""))
    classes: dict[str, type[Exception]] = {
        "SourceRefused": reconcile.SourceRefused,
        "AccessDeniedError": errors.AccessDeniedError,
        "ManifestMismatchError": errors.ManifestMismatchError,
        "InputError": errors.InputError,
        "SourceError": errors.SourceError,
    }
    if kind in classes:
        return classes[str(kind)](message)
    if kind == resolve_child.MEMORY:
        return over_memory(message or "MemoryError")
    # Anything else is a bug or an unforeseen library error, which the reconcile
    # reports as `ResolveFailed` whatever its class: the class's name goes in the message.
    return RuntimeError(f"{error.get('module')}.{error.get('name')}: {message}")
