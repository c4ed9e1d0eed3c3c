"""The child process one manifest resolve runs in (`resolve_children` has it forked
from `resolve_forkserver`, which runs `main`; by hand: `python -m
shardcache_operator.resolve_child`). The request comes on stdin, one
JSON object (`uri`, `format`, `storage_options` with the Secret's credentials, which
must never show in `ps`, so never in argv or env; `memory`, the bytes it may map;
`retry`, the fields of its `source.RetryPolicy`; `hand`, whether to answer the manifest
to hand to the sidecars too, `Summary.handed`); the answer goes to stdout, one JSON
object: `{"summary": <Summary.to_json()>}`, what the operator pins of the manifest, or
`{"error": {"kind": ..., "message": ...}}` (`KINDS`, and `UNEXPECTED` with the class's
module and name for anything else).

Only the standard library is imported before the limits are in place: OpenBLAS sizes
its buffers to what the process may map, and a limit set after pyarrow's import would
meet a process already past it. (The fork server sets the same limits before its own
import of pyarrow; `main` sets them again, to the same values, in each child.)
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import resource
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any, TypeGuard

#: The error kinds the parent raises again as the same class (`resolve_children`), most
#: specific first: a subclass outside this list goes back as its nearest listed base.
KINDS = (
    "SourceRefused",
    "AccessDeniedError",
    "ManifestMismatchError",
    "InputError",
    "SourceError",
)
#: The child ran out of its memory limit (a MemoryError, pyarrow's included).
MEMORY = "MemoryError"
#: What CPython raises as a RuntimeError when the limit refuses a thread's stack or a
#: lock's memory: the limit too, not a bug.
OUT_OF_MEMORY_RUNTIME_ERRORS = frozenset({"can't start new thread", "can't allocate lock"})
#: What pyarrow raises (an ArrowException) when the limit refuses the stack of one of
#: its I/O or CPU threads, which it starts as a read first needs them: the limit too.
OUT_OF_MEMORY_ARROW_ERROR = "Failed to launch worker thread"
#: Any other exception: `module` and `name` say which.
UNEXPECTED = "Unexpected"
#: The environment the child adds. OpenBLAS (imported with pyarrow's numpy) reserves
#: buffers per CPU, and pyarrow's CPU pool starts a thread per CPU, each stack counted
#: by the limit whole: a share of it that would grow with the node, not the source.
#: pyarrow's default allocator, mimalloc, reserves arenas the limit counts as well: in
#: one comparison it went over 256 MiB listing 20,000 keys where the system allocator
#: held 30,000 (what the limit holds now: docs/operator.md, "Pinning").
ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "2",
    "ARROW_IO_THREADS": "8",
    "ARROW_DEFAULT_MEMORY_POOL": "system",
}
#: Stack of each thread the child starts, the resolve's inspecting threads and
#: pyarrow's own I/O and CPU pools alike: the limit counts a thread's whole stack,
#: touched or not, and glibc's default (RLIMIT_STACK, 8 MiB) for pyarrow's threads,
#: which use a few hundred KiB, left 200 one-row JSON Lines shards over 160 MiB
#: ("Failed to launch worker thread"); with 1 MiB they resolve in 128 MiB.
THREAD_STACK = 1 << 20
#: /proc/self/oom_score_adj: the kernel picks this process first when the operator's
#: cgroup runs out of memory, never the operator (and its webhook) itself.
OOM_SCORE_ADJ = 1000
_PR_SET_PDEATHSIG = 1


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class Shard:
    """A shard as a pin records it (status.largestShard)."""

    path: str
    size: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """What the operator pins of a resolved manifest (a `reconcile.ManifestLike`): the
    child's answer. The operator never parses the manifest itself (about 300 bytes a
    shard: 32 MiB for 100,000 shards, which capped what any `resolveMemory` could pin,
    and which the operator parsed into a few times that): it gets these few counts, and
    `handed`, the manifest's gzipped JSON in the parts it hands to the sidecars as they
    are (`shardcache.node.handed_manifests`: at most 3 MiB, else none, and the sidecars
    resolve the manifest themselves). The sidecars check either against the pin."""

    digest: str
    format: str
    shard_count: int
    total_rows: int
    total_bytes: int
    largest_shard: Shard | None
    handed: tuple[bytes, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def of(cls, manifest: Any, *, hand: bool = False) -> Summary:
        """The summary of a `manifests.Manifest`, with its handed parts where `hand`."""
        from shardcache.node import handed_manifests

        largest = manifest.largest_shard
        return cls(
            digest=manifest.digest,
            format=manifest.format,
            shard_count=manifest.shard_count,
            total_rows=manifest.total_rows,
            total_bytes=manifest.total_bytes,
            largest_shard=None if largest is None else Shard(largest.path, largest.size),
            handed=tuple((handed_manifests.encode(manifest) if hand else None) or ()),
        )

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["handed"] = [base64.b64encode(part).decode("ascii") for part in self.handed]
        return out

    @classmethod
    def from_json(cls, data: object) -> Summary:
        """The summary `to_json` wrote; ValueError saying what is not as expected."""
        if not isinstance(data, Mapping):
            raise ValueError(f"expected an object, found {type(data).__name__}")
        digest, fmt = data.get("digest"), data.get("format")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
            raise ValueError(f"expected a digest sha256:<64 hex digits>, found {digest!r:.80}")
        if not isinstance(fmt, str) or not fmt:
            raise ValueError(f"expected a format name, found {fmt!r:.80}")
        counts: list[int] = []
        for key in ("shard_count", "total_rows", "total_bytes"):
            value = data.get(key)
            if not is_count(value):
                raise ValueError(f"expected {key} an integer >= 0, found {value!r:.80}")
            counts.append(value)
        shard_count, rows, size = counts
        largest = data.get("largest_shard")
        shard: Shard | None = None
        if largest is not None:
            path = largest.get("path") if isinstance(largest, Mapping) else None
            stored = largest.get("size") if isinstance(largest, Mapping) else None
            if not isinstance(path, str) or not is_count(stored):
                raise ValueError(f"expected largest_shard a path and a size, found {largest!r:.80}")
            shard = Shard(path, stored)
        return cls(digest, fmt, shard_count, rows, size, shard, _handed(data.get("handed", [])))


def _handed(value: object) -> tuple[bytes, ...]:
    """The handed parts `Summary.to_json` wrote (base64); ValueError saying what is not
    as expected."""
    from shardcache.node import handed_manifests

    if not isinstance(value, list) or len(value) > handed_manifests.MAX_PARTS:
        raise ValueError(
            f"expected handed a list of at most {handed_manifests.MAX_PARTS} parts, "
            f"found {value!r:.80}"
        )
    parts: list[bytes] = []
    for text in value:
        try:
            part = base64.b64decode(text, validate=True) if isinstance(text, str) else None
        except (ValueError, TypeError):
            part = None
        if part is None or not 0 < len(part) <= handed_manifests.PART_BYTES:
            raise ValueError(
                f"expected each handed part base64 of 1 to {handed_manifests.PART_BYTES} "
                f"bytes, found {text!r:.80}"
            )
        parts.append(part)
    return tuple(parts)


def is_count(value: object) -> TypeGuard[int]:
    """An integer >= 0 (not a bool), as JSON brings counts and sizes."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _default_thread_stack(size: int) -> None:
    """Make `size` the stack of every thread started from now on without attributes of
    its own (glibc's `pthread_setattr_default_np`; OSError where it refuses)."""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.create_string_buffer(128)  # a pthread_attr_t is 56 bytes on x86-64 and arm64
    if libc.pthread_attr_init(attr) != 0:
        raise OSError("pthread_attr_init failed")
    try:
        if libc.pthread_attr_setstacksize(attr, ctypes.c_size_t(size)) != 0:
            raise OSError(f"pthread_attr_setstacksize({size}) failed")
        if libc.pthread_setattr_default_np(attr) != 0:
            raise OSError("pthread_setattr_default_np failed")
    finally:
        libc.pthread_attr_destroy(attr)


def limit(memory: int, *, die_with_parent: bool = True) -> None:
    """Hold this process to `memory` bytes of data (RLIMIT_DATA: heap and private
    mappings, what a listing grows; RLIMIT_AS would count the address space pyarrow
    and thread stacks reserve and never touch), first in line for the OOM killer, and
    (`die_with_parent`) killed with the thread that started it (the operator, or its
    read thread: a process that outlives that thread, a `read_worker`, watches for its
    parent itself)."""
    resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))
    threading.stack_size(THREAD_STACK)
    # pyarrow's C++ threads take glibc's default attributes, which `threading` does not
    # set: the default itself, before pyarrow's import starts any.
    with contextlib.suppress(OSError, AttributeError):
        _default_thread_stack(THREAD_STACK)
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as adj:
        adj.write(str(OOM_SCORE_ADJ))
    if die_with_parent:
        die_with_parent_thread()


def die_with_parent_thread() -> None:
    """Have the kernel SIGKILL this process when the thread that started it ends
    (PR_SET_PDEATHSIG; nothing where prctl is not at hand)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def error_answer(exc: BaseException) -> dict[str, Any]:
    """`exc` as the parent reads it back (`resolve_children.raised`)."""
    if (
        isinstance(exc, MemoryError)
        or (isinstance(exc, RuntimeError) and str(exc) in OUT_OF_MEMORY_RUNTIME_ERRORS)
        or (type(exc).__module__ == "pyarrow.lib" and OUT_OF_MEMORY_ARROW_ERROR in str(exc))
    ):
        return {"error": {"kind": MEMORY, "message": str(exc) or type(exc).__name__}}
    names = [cls.__name__ for cls in type(exc).__mro__]
    for kind in KINDS:
        if kind in names:
            return {"error": {"kind": kind, "message": str(exc)}}
    cls = type(exc)
    return {
        "error": {
            "kind": UNEXPECTED,
            "module": cls.__module__,
            "name": cls.__qualname__,
            "message": str(exc),
        }
    }


def resolve(request: Mapping[str, Any]) -> dict[str, Any]:
    """The answer to one request: the manifest's summary, or the error's kind and message."""
    try:
        from shardcache import manifests, source

        options = request.get("storage_options")
        manifest = manifests.resolve(
            str(request["uri"]),
            format=str(request["format"]),
            storage_options=dict(options) if options is not None else None,
            retry=source.RetryPolicy(**request["retry"]),
        )
        return {"summary": Summary.of(manifest, hand=bool(request.get("hand"))).to_json()}
    except BaseException as exc:  # every outcome goes back to the parent as an answer
        return error_answer(exc)


def main() -> int:
    request = json.loads(sys.stdin.buffer.read())
    limit(int(request["memory"]))
    answer = resolve(request)
    try:
        text = json.dumps(answer, separators=(",", ":"))
    except MemoryError as exc:
        text = json.dumps(error_answer(exc))
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    # A resolve may leave pyarrow's I/O threads blocked on a store; the answer is out,
    # nothing is left to clean up, and waiting for them would hold the slot.
    code = main()
    os._exit(code)
