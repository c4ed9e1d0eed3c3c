"""The checkpoint agent: restore at start, then publish every committed directory
and restore older published steps the trainer asks for.

It runs on one background thread (object store calls block; the pool threads of the
uploader do the parallel work). Its whole state is on disk — the markers and status
files in the checkpoint volume and the manifests in the store — so a restarted agent,
even after SIGKILL, continues where the last one stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

from shardcache import contract, errors, faultpoints, source, source_credentials
from shardcache.checkpoint import _protocol, layout
from shardcache_sidecar.checkpoint import (
    agent_config,
    metrics,
    restorer,
    retention,
    siblings,
    uploader,
)

log = logging.getLogger(__name__)
#: Seconds an answered restore request stays when the trainer never collects it (it
#: died while waiting); long enough for any trainer alive to read it.
ANSWER_TTL_S = 3600.0
#: Seconds before a checkpoint whose upload the store refused the credentials of is
#: tried again, reading the credentials files again (a key rotated in the Secret): not
#: every `retry_interval`, each try a request the store refuses.
CREDENTIALS_RETRY_S = 30.0


class Agent:
    def __init__(
        self,
        settings: agent_config.CheckpointSettings,
        *,
        observer: metrics.Observer | None = None,
        storage_options: dict[str, str] | None = None,
        on_readiness: Callable[[bool, str], None] | None = None,
    ) -> None:
        """`on_readiness(ready, reason)` is called as the restore progresses (the
        sidecar maps it to a /readyz gate); from the agent's thread."""
        self.settings = settings
        self._on_readiness = on_readiness
        self.root = settings.directory
        self.observer = observer or metrics.NullObserver()
        #: Where a filesystem with other credentials comes from when the store refuses
        #: these (`source_credentials`); None: such a refusal fails the upload for good.
        self._renewal: source_credentials.Renewable | None = None
        if storage_options is None and settings.credentials_dir is not None:
            self._renewal = source_credentials.Renewable(settings.uri, settings.credentials_dir)
            self.fs, self.prefix = self._renewal.fs, self._renewal.path
        else:
            self.fs, self.prefix = source.filesystem(settings.uri, storage_options=storage_options)
        self.prefix = self.prefix.rstrip("/")
        self._stop = threading.Event()
        #: The start-up restore's retries end when the agent is told to stop: nothing
        #: was restored, so nothing waits for it, and a stopped standalone agent would
        #: otherwise sit out the whole retry budget (a minute) before it exits. The
        #: drain after a stop keeps `settings.retry`: it publishes committed work.
        self._startup_retry = dataclasses.replace(settings.retry, stop=self._stop)
        self._ready = threading.Event()
        self._restore_error: str | None = None
        self._retry_at: dict[Path, float] = {}
        #: Published steps as last listed (restore, retention) plus those published since.
        self._published: list[int] = []
        self._thread: threading.Thread | None = None
        self.restored: restorer.RestoreResult | None = None
        #: Directories restored on a trainer's request, by name, with the time of the
        #: restore: kept off local retention until the trainer commits after that time.
        self._held: dict[str, float] = {}
        #: Request files that cannot even be answered (a directory, no permission):
        #: reported once, not at every scan.
        self._unanswerable: set[str] = set()

    # --- readiness ----------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        """(ready, why not): ready once the restore at start is done."""
        if self._ready.is_set() and self.restored is not None:
            return True, _restored_reason(self.restored)
        if self._restore_error is not None:
            return False, f"checkpoint restore failed: {self._restore_error}"
        return False, "restoring the checkpoint"

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    # --- restore ------------------------------------------------------------------
    def restore(self) -> restorer.RestoreResult:
        """Restore what the settings ask for; raises what the restorer raises."""
        started = time.monotonic()
        s = self.settings
        try:
            result = restorer.restore(
                self.fs,
                self.prefix,
                self.root,
                wanted=s.restore,
                fallback=s.restore_fallback,
                concurrency=s.upload_concurrency,
                retry=self._startup_retry,
                observer=self.observer,
            )
            result = self._gather_ranks(result)
        except (errors.ShardcacheError, OSError) as exc:
            # Tell the trainer too (checkpoint.restore() raises it), where the volume lets us.
            with contextlib.suppress(OSError):
                _protocol.write_json_atomic(
                    self.root / _protocol.RESTORE_NAME,
                    {"version": _protocol.PROTOCOL_VERSION, "phase": "failed", "error": str(exc)},
                )
            raise
        self.observer.restored(result.step, time.monotonic() - started, result.created_at)
        _protocol.write_json_atomic(self.root / _protocol.RESTORE_NAME, result.to_json())
        if result.step is not None:
            log.info(
                "%s into %s (%d bytes downloaded, %d reused)",
                _restored_reason(result),
                result.path,
                result.downloaded_bytes,
                result.reused_bytes,
            )
        self._note_published()
        self.restored = result
        self._ready.set()
        self._tell(True, _restored_reason(result))
        return result

    def _gather_ranks(self, result: restorer.RestoreResult) -> restorer.RestoreResult:
        """For a ranked pod restoring "latest": write every rank's data state at the
        newest step all ranks of its world size published (`siblings`), so the trainer
        resumes at another world size too. A rank with no checkpoint of its own (the job
        grew) restores that step from the lowest rank's prefix: data-parallel replicas
        hold the same weights (a sharded optimizer's state is not re-sharded here)."""
        path = self.root / _protocol.DATA_STATES_NAME
        path.unlink(missing_ok=True)
        s = self.settings
        if s.restore != "latest":
            return result
        gathered = source.with_retries(
            lambda: siblings.gather(self.fs, self.prefix),
            what=f"gathering the ranks' data states beside {self.prefix}",
            policy=self._startup_retry,
        )
        if gathered is None:
            return result
        if result.step is None:
            log.info(
                "no checkpoint of this rank; restoring step %d of %s (every rank's data "
                "state gathered for an elastic resume)",
                gathered.step,
                gathered.prefixes[0],
            )
            result = restorer.restore(
                self.fs,
                gathered.prefixes[0],
                self.root,
                wanted=str(gathered.step),
                fallback=False,
                concurrency=s.upload_concurrency,
                retry=self._startup_retry,
                observer=self.observer,
            )
        # A skip requested for the step (`shardcache skip`, one request per rank prefix)
        # is in every rank's state, as it is in the restored marker's.
        skipped = []
        for state, prefix in zip(gathered.states, gathered.prefixes, strict=True):
            request = source.with_retries(
                functools.partial(layout.read_skip_request, self.fs, prefix, gathered.step),
                what=f"reading the skip request of step {gathered.step} under {prefix}",
                policy=self._startup_retry,
            )
            where = layout.manifest_path(prefix, gathered.step)
            skipped.append(restorer.apply_skip(state, request, where=where)[0])
        _protocol.write_json_atomic(
            path,
            {"version": _protocol.PROTOCOL_VERSION, "step": gathered.step, "states": skipped},
        )
        return result

    def _tell(self, ready: bool, reason: str) -> None:
        if self._on_readiness is not None:
            self._on_readiness(ready, reason)

    def _note_published(self) -> None:
        """Tell the trainer (latest()) what the store holds; best effort: with
        `restore: none` an unreachable store must not hold the trainer back."""
        try:
            complete, _ = source.with_retries(
                lambda: layout.list_steps(self.fs, self.prefix),
                what=f"listing {self.settings.uri}",
                policy=self._startup_retry,
            )
        except errors.ShardcacheError as exc:
            log.warning("cannot list the published checkpoints: %s", exc)
            return
        self._published = complete
        self._write_latest(complete)
        self._repair_pointer(complete)

    def _repair_pointer(self, complete: list[int]) -> None:
        """Move `latest` to the newest complete step if a crash left it behind.

        A kill between a step's manifest and the pointer leaves the pointer on an older
        step; after the restart, the start-up restore may take that newest step from the
        node's own copy (marking it restored), so no publish follows that would move
        the pointer. Found by the crash soak (docs/faults.md).
        """
        if not complete:
            return
        s = self.settings
        newest = complete[-1]
        try:
            pointer = source.with_retries(
                lambda: layout.parse_pointer(
                    layout.read_json(self.fs, layout.pointer_path(self.prefix))
                ),
                what=f"reading the latest pointer under {s.uri}",
                policy=self._startup_retry,
            )
            if pointer is not None and pointer >= newest:
                return
            where = layout.manifest_path(self.prefix, newest)
            raw = source.with_retries(
                lambda: layout.read_json(self.fs, where),
                what=f"reading {where}",
                policy=self._startup_retry,
            )
            manifest = layout.CheckpointManifest.from_json(raw, where=where)
            retention.publish_pointer(self.fs, self.prefix, manifest, retry=self._startup_retry)
        except (errors.ShardcacheError, OSError) as exc:
            log.warning("cannot move the latest pointer to step %d: %s", newest, exc)
            return
        log.warning("the latest pointer named step %s; moved to step %d", pointer, newest)

    def _write_latest(self, published: list[int]) -> None:
        path = self.root / _protocol.LATEST_NAME
        # The newest step ever published under this URI, which retention and skips do
        # not lower: wait() tells a step removed by retention from one never committed.
        # Carried over from the file, which outlives an agent restart on the node.
        previous = _protocol.read_root_file(self.root, _protocol.LATEST_NAME) or {}
        known = [*published[-1:]]
        before = previous.get("highest_published")
        if previous.get("uri") == self.settings.uri and _is_step(before):
            known.append(before)
        _protocol.write_json_atomic(
            path,
            {
                "version": _protocol.PROTOCOL_VERSION,
                "step": published[-1] if published else None,
                "steps": published,
                "uri": self.settings.uri,
                "highest_published": max(known) if known else None,
            },
        )

    # --- restore on request ---------------------------------------------------------
    def serve_requests(self) -> list[int]:
        """Answer every unanswered restore request in the root; the steps restored."""
        try:
            names_ = sorted(e.name for e in os.scandir(self.root))
        except FileNotFoundError:
            return []
        restored: list[int] = []
        for name in names_:
            request_id = _protocol.request_id_of(name)
            if request_id is None or name in self._unanswerable:
                continue
            path = self.root / name
            try:
                text = _protocol.read_small_text(path)
                parsed = _protocol.parse_request(text, request_id=request_id, where=str(path))
            except FileNotFoundError:
                continue  # withdrawn by the trainer
            except (errors.InputError, OSError, UnicodeDecodeError) as exc:
                log.error("malformed checkpoint restore request: %s", exc)
                self._answer(path, _protocol.answer_json(request_id, None, error=str(exc)))
                continue
            if isinstance(parsed, _protocol.RestoreAnswer):
                self._forget_abandoned(path, parsed)
                continue
            try:
                served = self.serve_request(path, parsed)
            except Exception as exc:  # a bug or a hostile input no check foresaw
                # Answered, so the trainer hears why and the agent does not retry it at
                # every scan; the other requests are still served.
                log.exception("restoring checkpoint step %d on request failed", parsed.step)
                self._answer(
                    path,
                    _protocol.answer_json(
                        request_id,
                        parsed.step,
                        error=f"unexpected error ({exc!r}); see the sidecar's log",
                        requested_at=parsed.requested_at,
                    ),
                )
                continue
            if served:
                restored.append(parsed.step)
        return restored

    def serve_request(self, path: Path, request: _protocol.RestoreRequest) -> bool:
        """Restore the requested step with the start-up restore's verification."""
        s = self.settings
        step = request.step
        started = time.monotonic()
        try:
            complete, _ = source.with_retries(
                lambda: layout.list_steps(self.fs, self.prefix),
                what=f"listing {s.uri}",
                policy=s.retry,
            )
            if step not in complete:
                raise errors.InputError(
                    f"step {step} is not published under {s.uri} (published steps: "
                    f"{complete or 'none'}); request a published step"
                )
            # Retention runs on this thread too: it never sees the restore half-way.
            result = restorer.restore_step(
                self.fs,
                self.prefix,
                self.root,
                step,
                concurrency=s.upload_concurrency,
                retry=s.retry,
                observer=self.observer,
            )
        except (errors.ShardcacheError, OSError) as exc:
            log.error("checkpoint step %d requested by the trainer not restored: %s", step, exc)
            self._answer(
                path,
                _protocol.answer_json(
                    request.id, step, error=str(exc), requested_at=request.requested_at
                ),
            )
            return False
        assert result.path is not None
        faultpoints.reach("checkpoint.answer")
        self._held[result.path.name] = time.time()
        self.observer.restored(step, time.monotonic() - started, result.created_at)
        log.info(
            "restored checkpoint step %d on request into %s (%d bytes downloaded, %d reused)",
            step,
            result.path,
            result.downloaded_bytes,
            result.reused_bytes,
        )
        self._answer(
            path,
            _protocol.answer_json(
                request.id,
                step,
                name=result.path.name,
                path=result.path,
                requested_at=request.requested_at,
            ),
        )
        return True

    def _answer(self, path: Path, answer: dict[str, object]) -> None:
        if not path.exists():
            return  # withdrawn (the trainer timed out): nobody reads the answer
        try:
            _protocol.write_json_atomic(path, answer)
        except OSError as exc:
            log.warning("cannot answer the restore request %s: %s", path, exc)
            self._unanswerable.add(path.name)

    def _forget_abandoned(self, path: Path, answer: _protocol.RestoreAnswer) -> None:
        # An answer nobody collected (the trainer died while waiting) goes after a while.
        if answer.answered_at and time.time() - answer.answered_at > ANSWER_TTL_S:
            path.unlink(missing_ok=True)

    def _release_holds(self, marker: _protocol.Marker) -> None:
        """A commit made after an on-demand restore: the trainer has moved on from it."""
        if marker.committed_at is None:
            return
        for name, since in list(self._held.items()):
            if marker.committed_at > since:
                del self._held[name]

    # --- upload -------------------------------------------------------------------
    def pending(self) -> list[tuple[Path, _protocol.Marker]]:
        """Committed directories not yet published, oldest step first."""
        found: list[tuple[Path, _protocol.Marker]] = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        now = time.monotonic()
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            try:
                marker = self._pending_marker(path, now)
            except Exception as exc:  # a bug or a hostile input no check foresaw
                self._unexpected(path, -1, exc)
                continue
            if marker is not None:
                found.append((path, marker))
        found.sort(key=lambda item: (item[1].step, item[0].name))
        return found

    def _pending_marker(self, path: Path, now: float) -> _protocol.Marker | None:
        """The marker of `path` if it is to be published now, else None."""
        status = _protocol.read_status(path)
        try:
            marker = _protocol.read_marker(path)
        except errors.InputError as exc:
            if status is None or status.phase != "failed":
                log.error("%s", exc)
                self._set_failed(path, -1, str(exc), retryable=False)
            return None
        if marker is None:
            return None
        if status is not None and status.step == marker.step:
            if status.phase in ("uploaded", "restored"):
                return None
            if status.phase == "failed" and not status.retryable:
                return None
        if self._retry_at.get(path, 0.0) > now:
            return None
        return marker

    def _unexpected(self, path: Path, step: int, exc: Exception) -> None:
        """An error no check foresaw, in one directory: logged with its traceback,
        recorded as a retryable failure (wait() shows it), tried again later; the
        other directories go on."""
        log.error(
            "checkpoint step %d in %s: unexpected error, retrying in %.1fs",
            step,
            path,
            self.settings.retry_interval,
            exc_info=exc,
        )
        self._retry_at[path] = time.monotonic() + self.settings.retry_interval
        self._set_failed(
            path, step, f"unexpected error ({exc!r}); see the sidecar's log", retryable=True
        )

    def scan(self) -> list[int]:
        """Publish everything committed so far; the steps published."""
        published = []
        for path, marker in self.pending():
            try:
                done = self.publish(path, marker)
            except (errors.InputError, OSError) as exc:
                # The volume refuses what the agent writes (the trainer turned the status
                # directory into a link, or its status file into a directory): nothing is
                # written through it; tried again later, and the other directories go on.
                log.error("checkpoint step %d in %s is not uploaded: %s", marker.step, path, exc)
                self._retry_at[path] = time.monotonic() + self.settings.retry_interval
                continue
            except Exception as exc:  # a bug or a hostile input no check foresaw
                # One directory must not stop every later checkpoint from going up.
                self.observer.upload_failed(marker.step)
                self._unexpected(path, marker.step, exc)
                continue
            if done:
                published.append(marker.step)
        return published

    def publish(self, path: Path, marker: _protocol.Marker) -> bool:
        s = self.settings
        step = marker.step
        started = time.monotonic()
        # A retry keeps the last error visible, for wait()'s timeout message.
        previous = _protocol.read_status(path)
        last_error = previous.error if previous is not None and previous.step == step else None
        _protocol.write_status(
            path,
            _protocol.Status(
                "uploading", step, error=last_error, retryable=True, updated_at=time.time()
            ),
        )
        try:
            manifest = uploader.upload(
                self.fs,
                self.prefix,
                path,
                marker,
                concurrency=s.upload_concurrency,
                retry=s.retry,
                verify=s.verify_uploads,
                observer=self.observer,
                buffer_bytes=s.upload_buffer,
            )
            uploaded = time.monotonic()
            faultpoints.reach("checkpoint.latest")
            retention.publish_pointer(self.fs, self.prefix, manifest, retry=s.retry)
        except errors.AccessDeniedError as exc:
            if self._renewal is None:
                log.error("checkpoint step %d in %s is not uploaded: %s", step, path, exc)
                self.observer.upload_failed(step)
                self._set_failed(path, step, str(exc), retryable=False)
                return False
            # The Secret's files may hold new credentials now, or later (the kubelet
            # updates them): the checkpoint waits on the node meanwhile.
            renewed = self._renewal.renewed(self.fs)
            if renewed is not None:
                self.fs, wait = renewed, 0.0
            else:
                wait = max(s.retry_interval, CREDENTIALS_RETRY_S)
            log.warning(
                "checkpoint step %d: the store refused the credentials (%s); tried again "
                "in %.0f s with those in %s",
                step,
                exc,
                wait,
                self._renewal.directory,
            )
            self.observer.upload_failed(step)
            self._retry_at[path] = time.monotonic() + wait
            self._set_failed(path, step, str(exc), retryable=True)
            return False
        except errors.InputError as exc:
            log.error("checkpoint step %d in %s is not uploaded: %s", step, path, exc)
            self.observer.upload_failed(step)
            self._set_failed(path, step, str(exc), retryable=False)
            return False
        except (errors.SourceError, OSError) as exc:
            log.warning(
                "checkpoint step %d: upload failed, retrying in %.1fs: %s",
                step,
                s.retry_interval,
                exc,
            )
            self.observer.upload_failed(step)
            self._retry_at[path] = time.monotonic() + s.retry_interval
            self._set_failed(path, step, str(exc), retryable=True)
            return False
        faultpoints.reach("checkpoint.status")
        self._retry_at.pop(path, None)
        self._release_holds(marker)
        # The pointer file first: once wait() sees "uploaded", latest() agrees.
        self._published = sorted({*self._published, step})
        self._write_latest(self._published)
        _protocol.write_status(path, _protocol.Status("uploaded", step, updated_at=time.time()))
        seconds = time.monotonic() - started
        self.observer.published(step, seconds, manifest.created_at)
        log.info(
            "published checkpoint step %d (%d files, %d bytes) in %.2fs (files and "
            "manifest %.2fs, pointer and status %.3fs)",
            step,
            len(manifest.files),
            manifest.total_bytes,
            seconds,
            uploaded - started,
            time.monotonic() - uploaded,
        )
        self._prune()
        return True

    def _prune(self) -> None:
        """Retention, after publishing: the trainer never waits for deletes."""
        s = self.settings
        try:
            self._published = retention.prune_remote(
                self.fs, self.prefix, s.keep_last, retry=s.retry
            )
        except errors.ShardcacheError as exc:
            log.warning("retention failed (tried again after the next checkpoint): %s", exc)
            return
        self._write_latest(self._published)
        retention.prune_local(self.root, s.keep_last, held=set(self._held))

    def _set_failed(self, path: Path, step: int, error: str, *, retryable: bool) -> None:
        try:
            _protocol.write_status(
                path,
                _protocol.Status(
                    "failed", step, error=error, retryable=retryable, updated_at=time.time()
                ),
            )
        except (OSError, errors.InputError) as exc:  # the directory is gone, or a link
            log.warning("cannot record the failure in %s: %s", path, exc)

    # --- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Restore, then publish commits, on a background thread."""
        if self._thread is not None:
            raise RuntimeError("the checkpoint agent is already running")
        # Where the checkpoints go, as resolved (a local path is absolute here): the
        # first thing to check when they are not where expected.
        log.info(
            "checkpoint agent: publishing what is committed under %s to %s (%s filesystem, "
            "path %s)",
            self.root,
            self.settings.uri,
            self.fs.type_name,
            self.prefix,
        )
        self._thread = threading.Thread(target=self._run, name="checkpoint-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._restore_until_done()
        while not self._stop.is_set():
            self._serve_logged()
            self._scan_logged()
            self._stop.wait(self.settings.poll_interval)
        # Drain: what the trainer committed before the pod stopped still goes up.
        self._retry_at.clear()
        self._scan_logged()

    def _restore_until_done(self) -> None:
        while not self._stop.is_set():
            try:
                self.restore()
                return
            except errors.SourceError as exc:
                self._restore_error = str(exc)
                if self._stop.is_set():
                    log.info("checkpoint restore stopped: %s", exc)
                    return
                log.warning("checkpoint restore failed, retrying: %s", exc)
                self._tell(False, f"checkpoint restore failed, retrying: {exc}")
                self._stop.wait(self.settings.retry_interval)
            except (errors.ShardcacheError, OSError) as exc:
                # Corrupted or missing checkpoint, unusable volume: retrying cannot help;
                # stay unready with the reason in /readyz so the pod's events say why.
                self._restore_error = str(exc)
                log.error("checkpoint restore failed: %s", exc)
                self._tell(False, f"checkpoint restore failed: {exc}")
                return
            except Exception as exc:  # a bug or a hostile input no check foresaw
                # The thread must outlive it: keep serving commits and requests, and say
                # in /readyz what is wrong instead of "restoring" forever.
                self._restore_error = f"unexpected error ({exc!r}); see the sidecar's log"
                log.exception("checkpoint restore failed unexpectedly")
                self._tell(False, f"checkpoint restore failed: {self._restore_error}")
                return

    def _serve_logged(self) -> None:
        try:
            self.serve_requests()
        except Exception:  # the agent outlives any one bad request
            log.exception("serving checkpoint restore requests failed")

    def _scan_logged(self) -> None:
        try:
            self.scan()
        except Exception:  # the agent outlives any one bad directory
            log.exception("checkpoint scan failed")

    def stop(self, timeout: float | None = None) -> bool:
        """Stop after publishing what is already committed (bounded by `timeout`);
        False when the drain is still running at the timeout (an upload stuck on a
        store that does not answer): `unpublished()` then says what it left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def drain(self) -> bool:
        """Stop, publishing what is committed for at most `settings.drain_timeout`
        ($SHARDCACHE_CHECKPOINT_DRAIN_SECONDS). False when an upload was still running
        then (a store that stopped answering), after logging each step not uploaded
        (`cut_off`): past the pod's grace period the kubelet's SIGKILL would say nothing."""
        if self.stop(self.settings.drain_timeout):
            return True
        log.error("%s", self.cut_off())
        return False

    def cut_off(self) -> str:
        """What a drain cut short left: for the log and the termination message."""
        left = self.unpublished()
        return (
            f"checkpoint agent: drain cut off after {self.settings.drain_timeout:g}s "
            f"({contract.ENV_CHECKPOINT_DRAIN}); not uploaded: "
            + (", ".join(f"step {step} in {path}" for step, path in left) or "nothing committed")
        )

    def unpublished(self) -> list[tuple[int, Path]]:
        """(step, directory) of every commit not published, oldest step first: what a
        drain cut short leaves behind. Reads only, so it is safe beside a drain that
        is still running; a directory whose marker cannot be read is left out (the
        scan logged it and marked it failed)."""
        left: list[tuple[int, Path]] = []
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return []
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            try:
                marker = _protocol.read_marker(path)
                status = _protocol.read_status(path)
            except (errors.InputError, OSError):
                continue
            if marker is None:
                continue
            if (
                status is not None
                and status.step == marker.step
                and status.phase in ("uploaded", "restored")
            ):
                continue
            left.append((marker.step, path))
        return sorted(left, key=lambda item: (item[0], item[1].name))


def _is_step(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _restored_reason(result: restorer.RestoreResult) -> str:
    if result.step is None:
        return "no checkpoint to restore"
    if result.skip is not None:
        k = result.skip
        return (
            f"restored checkpoint step {result.step} with a skip of {k['batches']} batches "
            f"(rank {k['rank']}: epoch {k['epoch']} positions [{k['start']}, {k['stop']}))"
        )
    return f"restored checkpoint step {result.step}"
