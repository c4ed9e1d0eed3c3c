"""Sidecar mode: a `ShardProvider` that asks the pod's sidecar for shards.

The sidecar runs the node cache; this client speaks the control protocol
(docs/wire-format.md, `shardcache.contract.protocol`) over the Unix socket in the shared volume with
nothing but the standard library: HTTP/1.1 over an AF_UNIX socket (`unix_http`), JSON bodies.

Every acquired shard is handed over to this process (`node.lease`): the trainer holds a
shared file lock on the memory-tier entry, so the pin dies with the trainer and
outlives a sidecar restart. When the sidecar is killed and restarted (the kubelet does
that to a native sidecar), calls retry with backoff for up to `reconnect_timeout`
seconds, re-register the reader where it left off and carry on; the reading position
lives in `Dataset`, so no row is lost or repeated.

A warm shard costs no round trip: when the sidecar says an entry may be reused, the
provider remembers it and, the next time that shard is asked for, pins it directly and
tells the sidecar afterwards, off the read path (`SidecarProvider.acquire`). Nor does a
shard the sidecar granted ahead: an acquire asks for leases on the reader's next
resident shards too (and a registration for its first ones), and the provider pins
them at once and hands them out as the reader gets there. What the sidecar is told afterwards (shards pinned, holds dropped)
goes in one batched request per reader where the sidecar serves it (`notes`), over
connections kept alive between requests.
"""

from __future__ import annotations

import dataclasses
import functools
import http.client
import json
import logging
import os
import queue
import random
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shardcache import contract, errors, manifests, plans, stalls, unix_http
from shardcache.contract import protocol, variables
from shardcache.node import after_fork, leases, reader_locks, tiers

log = logging.getLogger(__name__)

# AF_UNIX paths are limited to 108 bytes including the terminating NUL (Linux).
MAX_SOCKET_PATH_BYTES = 107
#: Seconds between two batches of notes to the sidecar. A reader taking warm shards
#: back to back (hundreds a second on a fast node) then costs the sidecar one request
#: per interval rather than one per shard; prefetch learns where the reader is at most
#: this much later, a small fraction of the time one shard takes to decode.
NOTES_INTERVAL = 0.01
#: Seconds between two reports of a reader's data-stall totals. They ride on the next
#: batch of notes (one more only when none is due): a request a second per reader,
#: whatever the batch rate, and well inside Prometheus's usual 15-60 s scrape interval.
STALLS_INTERVAL = 1.0


@dataclasses.dataclass(frozen=True)
class ClientSettings:
    socket_path: Path
    #: The memory-tier directory as mounted in this container; the sidecar's answers
    #: name files relative to it, so the two containers may mount it at different paths.
    memory_dir: Path
    #: Seconds to keep retrying while the sidecar does not answer
    #: ($SHARDCACHE_RECONNECT_TIMEOUT_SECONDS; the contract table says why two minutes).
    reconnect_timeout: float = variables.RECONNECT_TIMEOUT.required_default
    #: Seconds one short control call (register, release, ...) may take.
    request_timeout: float = 30.0
    #: Seconds one acquire may wait for its shard. A cold shard of a few GiB from a slow
    #: store takes minutes; ten of them is a store that is not coming back.
    acquire_timeout: float = 600.0
    #: Shards an acquire asks the sidecar to grant ahead (it grants fewer: those resident,
    #: within its prefetch depth and a share of its memory tier). Each saves a round trip;
    #: eight cover the default prefetch depth twice over. 0 asks for none.
    ahead: int = 8

    def __post_init__(self) -> None:
        size = len(os.fsencode(self.socket_path))
        if size > MAX_SOCKET_PATH_BYTES:
            raise errors.InputError(
                f"control socket path {str(self.socket_path)!r} is {size} bytes long; Unix "
                f"sockets allow at most {MAX_SOCKET_PATH_BYTES}: use a shorter run directory"
            )
        for name in ("reconnect_timeout", "request_timeout", "acquire_timeout"):
            if getattr(self, name) <= 0:
                raise errors.InputError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.ahead <= protocol.MAX_AHEAD:
            raise errors.InputError(
                f"ahead must be in [0, {protocol.MAX_AHEAD}] shards, got {self.ahead}"
            )

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        mount: str | None = None,
        socket_path: str | Path | None = None,
        memory_dir: str | Path | None = None,
        reconnect_timeout: float | None = None,
        acquire_timeout: float | None = None,
        ahead: int | None = None,
    ) -> ClientSettings:
        """Where the sidecar is, from explicit arguments or the webhook's variables.

        Precedence: `socket_path` argument, $SHARDCACHE_SOCKET, then the run directory
        ($SHARDCACHE_RUN_DIR, default /var/run/shardcache) and the mount (`mount`
        argument or $SHARDCACHE_MOUNT). The memory directory is the `mem` directory
        beside the socket unless given. `reconnect_timeout` defaults to
        $SHARDCACHE_RECONNECT_TIMEOUT_SECONDS, else 120 s.
        """
        env = os.environ if environ is None else environ
        if socket_path is None:
            socket_path = variables.SOCKET.get(env)
        if socket_path is None:
            mount = mount or variables.MOUNT.get(env)
            if mount is None:
                raise errors.InputError(
                    "no dataset URI was given and this process is not set up for a sidecar: "
                    f"expected ${contract.ENV_MOUNT} (set by the shardcache webhook) or "
                    f"${contract.ENV_SOCKET}; pass a URI such as 's3://bucket/prefix' for "
                    "embedded mode, or label the pod with shardcache.io/mount"
                )
            run_dir = variables.RUN_DIR.get(env) or contract.DEFAULT_RUN_DIR
            socket_path = contract.socket_path(run_dir, mount)
        socket_path = Path(socket_path)
        memory = (
            Path(memory_dir)
            if memory_dir is not None
            else socket_path.parent / contract.MEMORY_SUBDIR
        )
        options: dict[str, Any] = {}
        if reconnect_timeout is None:
            reconnect_timeout = variables.RECONNECT_TIMEOUT.get(env)
        if reconnect_timeout is not None:
            options["reconnect_timeout"] = reconnect_timeout
        if acquire_timeout is not None:
            options["acquire_timeout"] = acquire_timeout
        if ahead is not None:
            options["ahead"] = ahead
        return cls(socket_path=socket_path, memory_dir=memory, **options)


class Rejected(Exception):
    """The sidecar answered with an error body (see `wire`)."""

    def __init__(self, wire: protocol.WireError) -> None:
        super().__init__(wire.message)
        self.wire = wire


# What a sidecar that is down or restarting looks like from here: no socket file,
# nobody listening, the connection cut mid-request, or no answer in time.
_DOWN = (OSError, http.client.HTTPException)


class Transport:
    """JSON requests on kept-alive connections, retried while the sidecar is unreachable."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self._connections = unix_http.Connections(settings.socket_path)

    def close(self) -> None:
        self._connections.close()

    def _once(
        self, method: str, path: str, body: Mapping[str, Any] | None, timeout: float
    ) -> tuple[int, Any]:
        payload = None if body is None else json.dumps(body).encode()
        status, raw = unix_http.exchange(
            self.settings.socket_path,
            method,
            path,
            payload,
            timeout,
            connections=self._connections,
        )
        try:
            decoded = json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            # Not the JSON the protocol answers (too deeply nested for json's recursive
            # decoder, too): kept as text, so the error names what came back.
            decoded = raw.decode(errors="replace")
        return status, decoded

    def call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        retry: bool = True,
    ) -> Any:
        """The decoded JSON of a 2xx answer; raises `Rejected` for an error answer.

        With `retry`, a sidecar that is down, restarting, or up but still starting is
        retried with capped exponential backoff until `reconnect_timeout` has passed
        since the first failure; then `SidecarUnavailableError` says how long it waited.
        """
        timeout = self.settings.request_timeout if timeout is None else timeout
        started: float | None = None
        delay = 0.05
        while True:
            cause: BaseException
            try:
                status, payload = self._once(method, path, body, timeout)
            except _DOWN as exc:
                cause = exc
            else:
                if 200 <= status < 300:
                    if started is not None:
                        log.info(
                            "sidecar on %s answers again after %.1f s",
                            self.settings.socket_path,
                            time.monotonic() - started,
                        )
                    return payload
                wire = protocol.WireError.from_body(status, payload)
                if wire.kind != protocol.KIND_UNAVAILABLE:
                    raise Rejected(wire)
                cause = wire.to_exception()
            if not retry:
                raise self._unavailable(0.0, cause)
            now = time.monotonic()
            if started is None:
                started = now
                log.warning(
                    "sidecar on %s is not answering (%s); retrying for up to %.0f s",
                    self.settings.socket_path,
                    cause,
                    self.settings.reconnect_timeout,
                )
            waited = now - started
            if waited >= self.settings.reconnect_timeout:
                raise self._unavailable(waited, cause)
            pause = min(delay, self.settings.reconnect_timeout - waited)
            time.sleep(pause * random.uniform(0.5, 1.0))  # jitter: ranks reconnect apart
            delay = min(delay * 2, 2.0)

    def _unavailable(self, waited: float, cause: BaseException) -> errors.SidecarUnavailableError:
        exc = errors.SidecarUnavailableError(
            f"the shardcache sidecar did not answer on {self.settings.socket_path} "
            f"(waited {waited:.1f} s, last error: {cause}); check that the sidecar "
            "container is running and read its log for why it is not serving"
        )
        exc.__cause__ = cause
        return exc


@dataclasses.dataclass
class _ReaderState:
    params: plans.PlanParams
    position: int
    #: How often the reader moved (`_move`): every request that carries its position
    #: carries the count it was built at (`protocol.FEATURE_SEQ`), so the sidecar can
    #: tell a position built before another but arriving after it.
    seq: int = 0


@dataclasses.dataclass
class _Notes:
    """What to tell the sidecar about one reader in the next batch (`notes`)."""

    pinned: list[int] = dataclasses.field(default_factory=list)
    released: list[str] = dataclasses.field(default_factory=list)
    stalls: protocol.Stalls | None = None


@dataclasses.dataclass(frozen=True)
class _Handed:
    """A memory-tier entry the sidecar handed over and said may be pinned again."""

    path: Path
    lock: Path
    size: int


class _Notifier:
    """Runs calls to the sidecar in the order queued, off the read path, on a thread
    of its own: dropping the sidecar's holds once this process has its own lock, and
    telling it about shards pinned without asking. Waiting for either would add a round
    trip to every shard. They follow within milliseconds, and `close()` drains the queue.

    A queued call must not raise: the trainer is not there to catch it. One that does
    anyway is logged, and the thread goes on with the next.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            # is_alive: after a fork (DataLoader workers) the child has no such thread.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="shardcache-notifier", daemon=True
                )
                self._thread.start()
        self._queue.put(call)

    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                call()
            except Exception:
                log.exception("a background call to the sidecar failed; dropping it")

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the calls queued so far; whether they ran."""
        done = threading.Event()
        self.submit(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join()


def _totals(meter: stalls.StallMeter, base: protocol.Stalls | None = None) -> protocol.Stalls:
    """A meter's totals as notes carry them (`FEATURE_STALLS`), less `base`: what of
    them the sidecar counted for the meter before this registration of the reader."""
    return protocol.Stalls(
        wait_seconds=max(0.0, meter.wait_seconds - (base.wait_seconds if base else 0.0)),
        step_seconds=max(0.0, meter.step_seconds - (base.step_seconds if base else 0.0)),
        batches=max(0, meter.batches - (base.batches if base else 0)),
        recent_fraction=min(1.0, max(0.0, meter.recent_fraction)),
    )


_NO_STALLS = protocol.Stalls(wait_seconds=0.0, step_seconds=0.0, batches=0, recent_fraction=0.0)


class SidecarProvider:
    """`ShardProvider` backed by the pod's sidecar. Thread-safe."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self._transport = Transport(settings)
        self._readers: dict[str, _ReaderState] = {}
        self._lock = threading.Lock()
        self._notifier = _Notifier()
        #: Entries handed over with reuse allowed, by shard index (see `acquire`).
        self._handed: dict[int, _Handed] = {}
        #: Shards granted ahead and pinned, not yet handed out: reader -> shard -> pin.
        self._ahead: dict[str, dict[int, leases.PinnedEntry]] = {}
        #: Notes not sent yet, by reader; a flush is queued on the notifier while any are.
        self._notes: dict[str, _Notes] = {}
        #: What the sidecar serves beyond the first v1 routes (`protocol.FEATURES`), from
        #: its answer to the last registration.
        self._features: frozenset[str] = frozenset()
        self._notes_sent = 0.0  # time.monotonic() of the last batch (on the notifier)
        #: time.monotonic() of each reader's last stall report (`note_stalls`).
        self._stalls_noted: dict[str, float] = {}
        #: Each reader's stall meter, from `note_stalls`: its final totals go to the
        #: sidecar when the reader closes (`close_reader`).
        self._meters: dict[str, stalls.StallMeter] = {}
        #: What of each meter's totals readers registered before counted at a sidecar:
        #: a reader registered again (a restarted sidecar, or a Dataset's reader for its
        #: new plan after an elastic resume) reports what grew since, or the sidecar's
        #: counters added the meter's whole past again (a spike in every stall rate).
        self._counted: weakref.WeakKeyDictionary[stalls.StallMeter, protocol.Stalls] = (
            weakref.WeakKeyDictionary()
        )
        #: Each reader's `_counted` as it was at its registration (from its first report).
        self._stall_base: dict[str, protocol.Stalls] = {}
        #: Each open reader's lock (`reader_locks`): the sidecar drops the reader once
        #: nobody holds it, when this process dies. Taken and let go under their own
        #: mutex: the provider's lock is on the read path, this is file I/O.
        self._reader_locks: dict[str, reader_locks.ReaderLock] = {}
        self._reader_locks_mutex = threading.Lock()
        self._warned_no_reader_lock = False
        # A forked child (DataLoader workers) drops the parent's pins granted ahead and
        # pending notes, and takes a lock of its own (`after_fork`; the pins' lock
        # descriptors already let go of the parent's locks at the fork, `_locks`).
        after_fork.register(self)
        self._manifest = self._fetch_manifest()

    @classmethod
    def from_env(
        cls,
        *,
        mount: str | None = None,
        socket_path: str | Path | None = None,
        memory_dir: str | Path | None = None,
        reconnect_timeout: float | None = None,
        acquire_timeout: float | None = None,
        ahead: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> SidecarProvider:
        """The provider for this pod's sidecar (precedence: `ClientSettings.from_env`)."""
        settings = ClientSettings.from_env(
            environ,
            mount=mount,
            socket_path=socket_path,
            memory_dir=memory_dir,
            reconnect_timeout=reconnect_timeout,
            acquire_timeout=acquire_timeout,
            ahead=ahead,
        )
        return cls(settings)

    @property
    def manifest(self) -> manifests.Manifest:
        return self._manifest

    def _call(
        self, method: str, path: str, body: Mapping[str, Any] | None = None, **kw: Any
    ) -> Any:
        try:
            return self._transport.call(method, path, body, **kw)
        except Rejected as rejected:
            raise rejected.wire.to_exception() from None

    def _fetch_manifest(self) -> manifests.Manifest:
        payload = self._call("GET", protocol.MANIFEST)
        if not isinstance(payload, Mapping):
            raise errors.CacheError(f"sidecar sent a manifest that is not an object: {payload!r}")
        skew = manifests.served_version_note(payload.get("version"))
        if skew is not None:
            raise errors.CacheError(skew)
        # from_json recomputes the digest: what the sidecar serves is what it claims.
        return manifests.Manifest.from_json(payload)

    # --- readers ----------------------------------------------------------------
    def open_reader(self, params: plans.PlanParams, *, position: int) -> str:
        reader_id = uuid.uuid4().hex
        state = _ReaderState(params, position)
        with self._lock:
            self._readers[reader_id] = state
        try:
            self._register(reader_id, state)
        except BaseException:
            # No id reaches the caller, so nobody could close it: nothing may stay.
            with self._lock:
                self._readers.pop(reader_id, None)
                ahead = self._ahead.pop(reader_id, {})
            for pinned in ahead.values():
                pinned.release()
            self._release_reader_lock(reader_id)
            raise
        return reader_id

    def _register(self, reader_id: str, state: _ReaderState) -> None:
        meter = self._meters.get(reader_id)
        if meter is not None:
            # Registered again (the sidecar forgot it): what it counted is in its past.
            self._counted_so_far(reader_id, meter)
        with self._lock:
            params, position, seq = state.params, state.position, state.seq
        body: dict[str, Any] = {
            **protocol.params_to_json(params),
            "position": position,
            protocol.SEQ_FIELD: seq,
            "digest": self._manifest.digest,
        }
        # Locked before the sidecar hears of the reader, so no check of the sidecar's
        # ever finds a live reader's lock free. Sent whatever the sidecar: an older one
        # ignores the field (unknown fields are), and the lock is let go below.
        if self._hold_reader_lock(reader_id):
            body[protocol.READER_LOCK_FIELD] = True
        # Feature `skip_handed`: this client pins again, itself, whatever it was handed
        # with `reuse` (`_pin_again`), so grants of those would cost both ends a lease
        # and its release for nothing. Sent whatever the sidecar: an older one ignores
        # the field and grants them, which is what it always did.
        body[protocol.SKIP_HANDED_FIELD] = True
        if self.settings.ahead:
            # Feature `open_ahead`: the reader's first resident shards come with the
            # answer, so the first acquire costs no round trip. A sidecar without it
            # ignores the field (unknown fields are) and grants nothing.
            body["ahead"] = self.settings.ahead
        answer = self._call("PUT", protocol.reader_path(reader_id), body)
        features = answer.get("features") if isinstance(answer, Mapping) else None
        with self._lock:
            self._features = frozenset(
                f for f in (features if isinstance(features, list) else []) if isinstance(f, str)
            )
        if not self._has(protocol.FEATURE_READER_LOCKS):
            self._release_reader_lock(reader_id)  # nobody looks at it: no file left behind
        if protocol.FEATURE_OPEN_AHEAD in self._features and isinstance(answer, Mapping):
            self._take_ahead(reader_id, answer)
        if params.segments is not None and protocol.FEATURE_SEGMENTS not in self._features:
            warnings.warn(
                "the sidecar does not know elastic-resume segments (an older version): "
                "data is still exact, but it reads ahead along the wrong plan until the "
                "next epoch; upgrade the sidecar image",
                RuntimeWarning,
                stacklevel=3,
            )

    def _hold_reader_lock(self, reader_id: str) -> bool:
        """Hold the reader's lock (`reader_locks`), taking it anew if its file went away
        (the sidecar removes the file of a reader it found dead, and a reader it dropped
        so while this process lives registers again here); whether it is held."""
        with self._reader_locks_mutex:
            held = self._reader_locks.get(reader_id)
            if held is not None and held.held():
                return True
            if held is not None:
                held.forget()  # the file is gone: removing it again could remove another
            try:
                self._reader_locks[reader_id] = reader_locks.hold(
                    self.settings.memory_dir, reader_id
                )
            except OSError as exc:
                self._reader_locks.pop(reader_id, None)
                if not self._warned_no_reader_lock:
                    self._warned_no_reader_lock = True
                    log.warning(
                        "cannot hold a reader lock under %s (%s): if this process dies, the "
                        "sidecar keeps its readers until the sidecar restarts",
                        self.settings.memory_dir,
                        exc,
                    )
                return False
        return True

    def _release_reader_lock(self, reader_id: str) -> None:
        with self._reader_locks_mutex:
            held = self._reader_locks.pop(reader_id, None)
        if held is not None:
            held.release()

    def _state(self, reader_id: str) -> _ReaderState:
        with self._lock:
            state = self._readers.get(reader_id)
        if state is None:
            raise errors.InputError(f"unknown reader {reader_id!r}: open_reader() returns ids")
        return state

    def _reader_call(self, reader_id: str, path: str, body: Mapping[str, Any], **kw: Any) -> Any:
        """A call on a reader; re-registers it first if the sidecar forgot it (restart)."""
        state = self._state(reader_id)
        for _ in range(3):
            try:
                return self._transport.call("POST", path, body, **kw)
            except Rejected as rejected:
                if rejected.wire.code != protocol.CODE_UNKNOWN_READER:
                    raise rejected.wire.to_exception() from None
                log.info(
                    "sidecar does not know reader %s (restarted?); registering again", reader_id
                )
                self._register(reader_id, state)
                meter = self._meters.get(reader_id)
                if "stalls" in body and meter is not None:
                    # Totals of the registration the sidecar forgot: counted anew they
                    # would count its past twice.
                    stalls_now = self._reported(reader_id, meter)
                    body = {**body, "stalls": protocol.stalls_to_json(stalls_now)}
        raise errors.CacheError(
            f"the sidecar keeps forgetting reader {reader_id!r} right after registering it"
        )

    def _move(self, reader_id: str, epoch: int, position: int) -> int:
        """Move the reader here; the `seq` of this position, for the request that says so."""
        state = self._state(reader_id)
        with self._lock:
            if epoch != state.params.epoch:
                state.params = state.params.with_epoch(epoch)
            state.position = position
            state.seq += 1
            return state.seq

    def readahead(self, reader_id: str, *, epoch: int, position: int) -> None:
        """Tell the sidecar where the reader is, so it prefetches from there."""
        seq = self._move(reader_id, epoch, position)
        self._reader_call(
            reader_id,
            protocol.position_path(reader_id),
            {"epoch": epoch, "position": position, protocol.SEQ_FIELD: seq},
        )

    def acquire(
        self, reader_id: str, shard: int, *, epoch: int, position: int
    ) -> leases.PinnedEntry:
        """Pin `shard` in the memory tier for this process.

        A shard the sidecar granted ahead is already pinned; one handed over before
        with `reuse` (a later epoch, a resumed reader) is pinned directly (`_pin_again`).
        Either way the sidecar is told afterwards. Any other, or one whose entry went
        away, costs a round trip to the sidecar, which makes the shard resident, hands
        it over, and grants the reader's next resident shards ahead.
        """
        seq = self._move(reader_id, epoch, position)
        with self._lock:
            pinned = self._ahead.get(reader_id, {}).pop(shard, None)
        if pinned is None:
            pinned = self._pin_again(shard)
        if pinned is not None:
            self._note_pinned(reader_id, shard)
            return pinned
        body: dict[str, Any] = {
            "shard": shard,
            "epoch": epoch,
            "position": position,
            protocol.SEQ_FIELD: seq,
            "timeout_s": self.settings.acquire_timeout,
        }
        with self._lock:
            if protocol.FEATURE_AHEAD in self._features and self.settings.ahead:
                body["ahead"] = self.settings.ahead
        # The socket waits a little longer than the sidecar, so a slow shard comes back
        # as the sidecar's own timeout error rather than a cut connection.
        socket_timeout = self.settings.acquire_timeout + self.settings.request_timeout
        for _ in range(5):
            answer = self._reader_call(
                reader_id, protocol.acquire_path(reader_id), body, timeout=socket_timeout
            )
            pinned = self._take_over(reader_id, shard, answer)
            if pinned is not None:
                self._take_ahead(reader_id, answer)
                return pinned
            # Only when the entry went away between the answer and our lock: the sidecar
            # restarted and evicted it. Asking again makes it resident again.
            log.info("shard %d left the memory tier before it was pinned; asking again", shard)
        raise errors.CacheError(
            f"shard {shard} kept leaving the memory tier before this process could pin it; "
            "the memory limit is likely too small for the readers on this node"
        )

    def _pin_again(self, shard: int) -> leases.PinnedEntry | None:
        """Pin the entry an earlier acquire of `shard` handed over, without the sidecar.

        Safe without asking, because:

        * eviction needs an exclusive flock on the entry's lock file, and `pin` takes a
          shared one, then checks the lock file is still the one at that path and the
          data file is there with the size handed over: an entry evicted before we
          locked it fails the check, and one we locked cannot be evicted;
        * a memory-tier key names immutable content (the source object's identity and
          the decode version: `Manifest.decoded_key`), and a data file appears only by
          rename once complete, so an entry evicted and made again under the same key
          has the same bytes;
        * the sidecar said `reuse`: its own lookup checks no more than this (it does not
          verify checksums in the memory tier).

        Returns None (and forgets the entry) when the pin fails: the caller asks the
        sidecar, which makes the shard resident again.
        """
        with self._lock:
            handed = self._handed.get(shard)
        if handed is None:
            return None
        pinned = leases.pin(handed.path, handed.lock, handed.size)
        if pinned is not None:
            try:
                tiers.mark_used(handed.path)  # what the sidecar's lookup would do
            except FileNotFoundError:
                pinned.release()
                pinned = None
        if pinned is None:
            log.debug("shard %d: the entry handed over before went away; asking", shard)
            with self._lock:
                if self._handed.get(shard) == handed:
                    del self._handed[shard]
        return pinned

    def after_fork(self) -> None:
        """In a forked child: drop the parent's pins granted ahead and pending notes.
        A fresh lock first: another thread of the parent may have held it at the fork."""
        self._lock = threading.Lock()
        ahead, self._ahead, self._notes = self._ahead, {}, {}
        self._meters = {}  # the parent's loops, not this process's
        self._counted, self._stall_base = weakref.WeakKeyDictionary(), {}
        for pins in ahead.values():
            for pinned in pins.values():
                pinned.release()  # closes this process's descriptor; no unlock
        # The parent's readers live as long as the parent: their locks and files stay
        # the parent's (`_locks` let go of this process's copies at the fork).
        self._reader_locks_mutex = threading.Lock()
        locks, self._reader_locks = self._reader_locks, {}
        for held in locks.values():
            held.forget()

    def _take_ahead(self, reader_id: str, answer: Mapping[str, Any]) -> None:
        """Pin the shards granted ahead in `answer`; they replace the reader's earlier
        ones (a new round trip means the reader is past those, or moved elsewhere)."""
        grants = answer.get("ahead")
        taken: dict[int, leases.PinnedEntry] = {}
        for grant in grants if isinstance(grants, list) else []:
            shard = grant.get("shard") if isinstance(grant, Mapping) else None
            try:
                if type(shard) is not int:
                    raise errors.CacheError(f"sidecar sent a bad grant ahead: {grant!r}")
                pinned = self._take_over(reader_id, shard, {**grant, "reuse": answer.get("reuse")})
            except errors.ShardcacheError as exc:
                # A grant only saves a round trip: without it the shard is asked for
                # when the reader gets there. Its hold, if any, expires at the sidecar.
                log.warning("not taking a shard granted ahead: %s", exc)
                continue
            if pinned is not None:
                taken[shard] = pinned
        with self._lock:
            stale = self._ahead.pop(reader_id, {})
            if reader_id in self._readers:
                self._ahead[reader_id] = taken
            else:  # closed meanwhile (another thread): nothing will take them
                stale.update(taken)
        for old in stale.values():
            old.release()

    def _note_pinned(self, reader_id: str, shard: int) -> None:
        if self._has(protocol.FEATURE_NOTES):
            self._note(reader_id, pinned=shard)
        else:
            self._notifier.submit(functools.partial(self._notify_pinned, reader_id, shard))

    def _note_released(self, reader_id: str, lease_id: str) -> None:
        if self._has(protocol.FEATURE_NOTES):
            self._note(reader_id, released=lease_id)
        else:
            self._notifier.submit(functools.partial(self._drop_sidecar_lease, lease_id))

    def _has(self, feature: str) -> bool:
        with self._lock:
            return feature in self._features

    def note_stalls(self, reader_id: str, meter: stalls.StallMeter) -> None:
        """Put the reader's stall totals in its next batch of notes, at most every
        `STALLS_INTERVAL` seconds (called after every batch: one clock read otherwise)."""
        self._meters[reader_id] = meter
        now = time.monotonic()
        if now - self._stalls_noted.get(reader_id, 0.0) < STALLS_INTERVAL:
            return
        self._stalls_noted[reader_id] = now
        if not self._has(protocol.FEATURE_STALLS):
            return  # an older sidecar: nothing exports them there
        self._note(reader_id, stalls=self._reported(reader_id, meter))

    def _reported(self, reader_id: str, meter: stalls.StallMeter) -> protocol.Stalls:
        with self._lock:
            base = self._stall_base.get(reader_id)
            if base is None:
                base = self._stall_base[reader_id] = self._counted.get(meter, _NO_STALLS)
        return _totals(meter, base)

    def _counted_so_far(self, reader_id: str, meter: stalls.StallMeter) -> None:
        """The sidecar has counted `meter`'s totals up to now (the reader closed, or a
        sidecar forgot it): a reader registered after reports only what grows."""
        with self._lock:
            self._counted[meter] = _totals(meter)
            self._stall_base.pop(reader_id, None)

    def _note(
        self,
        reader_id: str,
        *,
        pinned: int | None = None,
        released: str = "",
        stalls: protocol.Stalls | None = None,
    ) -> None:
        """Add to the reader's next batch; queue a flush unless one is queued already."""
        with self._lock:
            queued = bool(self._notes)
            notes = self._notes.setdefault(reader_id, _Notes())
            if pinned is not None:
                notes.pinned.append(pinned)
            if released:
                notes.released.append(released)
            if stalls is not None:
                notes.stalls = stalls
        if not queued:
            self._notifier.submit(self._send_notes)

    def _send_notes(self) -> None:
        """Send every reader's batch (on the notifier): one request per reader for all
        that piled up while the previous batch was on its way.

        Sends the reader's latest epoch and position with their `seq`: a request that
        carries a later position (an acquire, a readahead hint, a registration on the
        trainer's thread) may reach the sidecar between building a batch and sending it,
        and the sidecar applies no position older than the last it applied
        (`protocol.FEATURE_SEQ`), so the late batch does not move its view of the reader
        back; the batch's shards and holds are applied all the same. (A sidecar without
        the feature moves the reader back until its next call: prefetch and status
        follow the old position meanwhile, while leases keep every row read exact.)
        Failures are dropped: the next acquire's position corrects the sidecar, and a
        hold not dropped expires there.
        """
        pause = self._notes_sent + NOTES_INTERVAL - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # notes queued meanwhile go in this batch
        with self._lock:
            batches, self._notes = self._notes, {}
            bodies = []
            for reader_id, notes in batches.items():
                state = self._readers.get(reader_id)
                if state is None:  # closed meanwhile: unregistering drops its holds
                    continue
                body: dict[str, Any] = {
                    "epoch": state.params.epoch,
                    "position": state.position,
                    protocol.SEQ_FIELD: state.seq,
                    "pinned": notes.pinned,
                    "released": notes.released,
                }
                if notes.stalls is not None:
                    body["stalls"] = protocol.stalls_to_json(notes.stalls)
                bodies.append((reader_id, body))
        for reader_id, body in bodies:
            try:
                self._reader_call(reader_id, protocol.notes_path(reader_id), body, retry=False)
            except errors.ShardcacheError as exc:
                log.info("telling the sidecar about reader %s: %s", reader_id, exc)
        self._notes_sent = time.monotonic()

    def _notify_pinned(self, reader_id: str, shard: int) -> None:
        """Tell the sidecar a reader took `shard` without asking (on the notifier).

        Sends the reader's latest epoch and position rather than those at the pin, with
        their `seq`, so a late notification never moves the sidecar's view of the reader
        back (`_send_notes`). Failures are dropped: the next acquire's position corrects
        the sidecar.
        """
        with self._lock:
            state = self._readers.get(reader_id)
            if state is None:  # closed meanwhile
                return
            body = {
                "shard": shard,
                "epoch": state.params.epoch,
                "position": state.position,
                protocol.SEQ_FIELD: state.seq,
            }
        try:
            self._reader_call(reader_id, protocol.pinned_path(reader_id), body, retry=False)
        except errors.ShardcacheError as exc:
            # Down or restarting (it re-learns the position at the next call), or an
            # older sidecar without the route.
            log.info("telling the sidecar reader %s pinned shard %d: %s", reader_id, shard, exc)

    def _inside_memory_dir(self, relative: object, what: str) -> Path:
        if not isinstance(relative, str) or not relative:
            raise errors.CacheError(f"sidecar sent a bad {what} path: {relative!r}")
        path = self.settings.memory_dir / relative
        if ".." in Path(relative).parts or Path(relative).is_absolute():
            raise errors.CacheError(
                f"sidecar sent {what} path {relative!r}, expected one inside the memory dir"
            )
        return path

    def _take_over(self, reader_id: str, shard: int, answer: Any) -> leases.PinnedEntry | None:
        if not isinstance(answer, Mapping):
            raise errors.CacheError(
                f"sidecar sent an acquire answer that is not an object: {answer!r}"
            )
        path = self._inside_memory_dir(answer.get("path"), "shard")
        lock = self._inside_memory_dir(answer.get("lock"), "lock")
        lease_id = str(answer.get("lease", ""))
        if not self.settings.memory_dir.is_dir():
            raise errors.CacheError(
                f"the memory tier directory {self.settings.memory_dir} does not exist in this "
                f"container (the sidecar has it at {answer.get('memory_dir')}): mount the "
                "sidecar's memory volume into the trainer container"
            )
        try:
            pinned = leases.pin(path, lock)
        except BaseException:
            self._drop_sidecar_lease(lease_id)
            raise
        # Our own lock (or the entry's absence) makes the sidecar's hold unneeded.
        if pinned is None:
            self._drop_sidecar_lease(lease_id)
        else:
            self._note_released(reader_id, lease_id)
            self._remember(shard, pinned, answer)
        return pinned

    def _remember(self, shard: int, pinned: leases.PinnedEntry, answer: Mapping[str, Any]) -> None:
        size = answer.get("size")
        handed = None
        # An older sidecar sends no `reuse`: never pinned without asking.
        if answer.get("reuse") is True and type(size) is int and size >= 0:
            handed = _Handed(pinned.path, pinned.lock_path, size)
        with self._lock:
            if handed is not None:
                self._handed[shard] = handed
            else:
                self._handed.pop(shard, None)

    def _drop_sidecar_lease(self, lease_id: str) -> None:
        if not protocol.LEASE_ID_PATTERN.fullmatch(lease_id):
            return
        try:
            self._transport.call("DELETE", protocol.lease_path(lease_id), retry=False)
        except (Rejected, errors.SidecarUnavailableError) as exc:
            # A sidecar that went away took its hold with it; one that forgot the lease
            # already expired it. Either way nothing stays pinned on our behalf.
            log.debug("dropping sidecar lease %s: %s", lease_id, exc)

    def close_reader(self, reader_id: str) -> None:
        with self._lock:
            meter = self._meters.pop(reader_id, None)
            registered = reader_id in self._readers
        if meter is not None and registered and self._has(protocol.FEATURE_STALLS):
            # The loop's last totals, sent while the reader is still registered (notes
            # of a closed reader are dropped): reports go at most once a second, so
            # without this the sidecar's counters lost up to a second of every reader,
            # and all of one that read for less.
            self._note(reader_id, stalls=self._reported(reader_id, meter))
            self._notifier.flush(self.settings.request_timeout)
        if meter is not None:
            self._counted_so_far(reader_id, meter)
        with self._lock:
            state = self._readers.pop(reader_id, None)
            ahead = self._ahead.pop(reader_id, {})
            self._stalls_noted.pop(reader_id, None)
        # Shards granted ahead that the reader never got to: unpinned now, not at exit.
        for pinned in ahead.values():
            pinned.release()
        if state is None:
            self._release_reader_lock(reader_id)
            return
        # A notification already under way may register the reader again (a restarted
        # sidecar answers it with unknown_reader); unregister after it, not before.
        self._notifier.flush(self.settings.request_timeout)
        try:
            self._transport.call("DELETE", protocol.reader_path(reader_id), retry=False)
        except (Rejected, errors.SidecarUnavailableError) as exc:
            # A restarted sidecar never knew this reader: nothing to undo.
            log.debug("unregistering reader %s: %s", reader_id, exc)
        # After the DELETE: let go first, and a check in between would count the reader
        # as dead, a warning in the sidecar's log for a reader closed as it should be.
        self._release_reader_lock(reader_id)

    def close(self) -> None:
        with self._lock:
            reader_ids = list(self._readers)
        # Readers first: closing one sends its last notes on the notifier.
        for reader_id in reader_ids:
            self.close_reader(reader_id)
        self._notifier.close()
        self._transport.close()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what this provider queued for the sidecar has been sent (pinned
        shards, dropped holds); whether it was within `timeout` seconds (default: the
        request timeout). For tools and tests that read the sidecar's statistics."""
        return self._notifier.flush(self.settings.request_timeout if timeout is None else timeout)

    def status(self) -> Any:
        """The sidecar's status document (readers, cache statistics); for tools and tests."""
        return self._call("GET", protocol.STATUS)
