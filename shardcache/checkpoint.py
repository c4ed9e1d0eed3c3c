"""Checkpoints: commit a directory, and the sidecar uploads it without stalling the step.

    path = ckpt_root / f"step-{step}"
    torch.save(model.state_dict(), path / "model.pt")          # write the directory...
    shardcache.checkpoint.commit(path, step=step, data_state=ds.state_dict())  # ...then commit

`commit` only writes a small marker file into the directory and returns; the sidecar's
checkpoint agent (or the same agent started locally) notices the marker, uploads the
directory, verifies it and publishes it. Trainer and agent talk only through files in
the checkpoint directory, so a trainer that cannot import this library commits by
writing the marker itself (see docs/checkpoints.md, "Committing without the library").

Files of the directory protocol (all names start with `.shardcache-`, never uploaded):

* `<checkpoint>/.shardcache-commit`  the marker: JSON `{"version", "step", "data_state"}`
  or just the step number as text. Written last, atomically (tmp + rename).
* `<root>/.shardcache-status/<name>.json`  written by the agent per checkpoint directory:
  uploading, uploaded, restored or failed (with the error). Kept outside the trainer's
  directories, which the sidecar (another user) may not be allowed to write into.
* `<root>/.shardcache-latest`        written by the agent: the newest step published in
  the object store and the steps retained there.
* `<root>/.shardcache-restore`       written by the agent at start: what it restored.
* `<root>/.shardcache-request-<id>.json`  written by `restore(step)` for a published step
  not on the node: `{"version", "kind": "restore", "id", "step", "requested_at"}`; the
  agent restores the step and rewrites the same file with the outcome (`phase`
  restored + `name`, or failed + `error`); the trainer reads it and removes the file.

The checkpoint root is $SHARDCACHE_CHECKPOINT_DIR (the volume shared with the sidecar);
each checkpoint is a direct subdirectory of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from shardcache import errors
from shardcache.node import names

#: Version of the marker, status and pointer files of the directory protocol.
PROTOCOL_VERSION = 1
MARKER_NAME = ".shardcache-commit"
STATUS_DIR = ".shardcache-status"
LATEST_NAME = ".shardcache-latest"
RESTORE_NAME = ".shardcache-restore"
#: Names with this prefix belong to shardcache: never uploaded, never a checkpoint.
RESERVED_PREFIX = ".shardcache-"
#: Restore requests: `<root>/.shardcache-request-<id>.json`. Not `.shardcache-restore-…`:
#: the agent deletes names with that prefix at start as leftovers of a restore's staging.
REQUEST_PREFIX = f"{RESERVED_PREFIX}request-"
REQUEST_SUFFIX = ".json"
_REQUEST_ID = re.compile(r"[0-9a-z]{1,64}")

Phase = Literal["uploading", "uploaded", "restored", "failed"]
AnswerPhase = Literal["restored", "failed"]
_DONE_PHASES = ("uploaded", "restored")
# wait(): poll the status file this often; a poll is a readdir and a few small reads.
_WAIT_POLL_S = 0.02


@dataclasses.dataclass(frozen=True)
class Marker:
    """What a trainer committed: the step and the data loader's state at that step."""

    step: int
    data_state: dict[str, Any] | None = None
    committed_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "step": self.step,
            "data_state": self.data_state,
            "committed_at": self.committed_at,
        }


@dataclasses.dataclass(frozen=True)
class Status:
    """The agent's view of one checkpoint directory."""

    phase: Phase
    step: int
    #: For failures: what went wrong and what to do, and whether retrying may help.
    error: str | None = None
    retryable: bool = False
    updated_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"version": PROTOCOL_VERSION, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class LocalCheckpoint:
    path: Path
    marker: Marker
    status: Status | None

    @property
    def step(self) -> int:
        return self.marker.step


# --- files of the protocol ------------------------------------------------------------
def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    """Write JSON so a reader sees the old file or the new one, never a torn one.

    Atomic (temp file + rename) but not fsynced: the checkpoint volume is pod-local and
    does not outlive the node, and an fsync while the node writes gigabytes can take
    long enough to show up in the trainer's step time.
    """
    tmp = path.with_name(f"{RESERVED_PREFIX}tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(data, out, sort_keys=True)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_step(step: object, *, what: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise errors.InputError(f"{what}: expected the step as an integer >= 0, found {step!r}")
    return step


def parse_marker(text: str, *, where: str) -> Marker:
    """A marker file's content: JSON, or the step number alone (for shell trainers)."""
    stripped = text.strip()
    if stripped.isdigit():
        return Marker(step=int(stripped))
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise errors.InputError(
            f'{where}: expected JSON {{"step": N}} or a step number, found {stripped[:80]!r}'
        ) from exc
    if isinstance(data, int):
        return Marker(step=_check_step(data, what=where))
    if not isinstance(data, dict):
        raise errors.InputError(f"{where}: expected a JSON object, found {type(data).__name__}")
    version = data.get("version", PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION:
        raise errors.InputError(
            f"{where}: marker version {version!r} is not supported: expected {PROTOCOL_VERSION}"
        )
    state = data.get("data_state")
    if state is not None and not isinstance(state, dict):
        raise errors.InputError(f"{where}: data_state must be an object, found {state!r}")
    committed_at = data.get("committed_at")
    return Marker(
        step=_check_step(data.get("step"), what=where),
        data_state=state,
        committed_at=float(committed_at) if isinstance(committed_at, int | float) else None,
    )


def read_marker(checkpoint: Path) -> Marker | None:
    """The marker of a checkpoint directory, or None while it is not committed."""
    path = checkpoint / MARKER_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    return parse_marker(text, where=str(path))


def write_marker(checkpoint: Path, marker: Marker) -> None:
    write_json_atomic(checkpoint / MARKER_NAME, marker.to_json())


def status_path(checkpoint: Path) -> Path:
    return checkpoint.parent / STATUS_DIR / f"{checkpoint.name}.json"


def read_status(checkpoint: Path) -> Status | None:
    try:
        data = json.loads(status_path(checkpoint).read_text(encoding="utf-8"))
        return Status(
            phase=data["phase"],
            step=int(data["step"]),
            error=data.get("error"),
            retryable=bool(data.get("retryable", False)),
            updated_at=float(data.get("updated_at", 0.0)),
        )
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (ValueError, KeyError, TypeError):
        # A status from another version: the agent rewrites it; treat as unknown.
        return None


def write_status(checkpoint: Path, status: Status) -> None:
    path = status_path(checkpoint)
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, status.to_json())


def remove_status(checkpoint: Path) -> None:
    status_path(checkpoint).unlink(missing_ok=True)


def read_root_file(root: Path, name: str) -> dict[str, Any] | None:
    try:
        data = json.loads((root / name).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint root: `root`, else $SHARDCACHE_CHECKPOINT_DIR."""
    if root is not None:
        return Path(root)
    env = os.environ.get(names.ENV_CHECKPOINT_DIR)
    if not env:
        raise errors.InputError(
            f"no checkpoint directory: ${names.ENV_CHECKPOINT_DIR} is not set (set "
            "spec.checkpoint in the DatasetMount, or pass root=)"
        )
    return Path(env)


def local_checkpoints(root: Path) -> list[LocalCheckpoint]:
    """Committed checkpoint directories under `root`, oldest step first.

    A directory with an unreadable marker is skipped here; the agent reports it in the
    directory's status file.
    """
    found: list[LocalCheckpoint] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            marker = read_marker(path)
        except errors.InputError:
            continue
        if marker is not None:
            found.append(LocalCheckpoint(path, marker, read_status(path)))
    found.sort(key=lambda c: (c.step, c.path.name))
    return found


# --- restore requests -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RestoreRequest:
    """A trainer's request to restore a published step that is not on the node."""

    id: str
    step: int
    requested_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "kind": "restore",
            "id": self.id,
            "step": self.step,
            "requested_at": self.requested_at,
        }


@dataclasses.dataclass(frozen=True)
class RestoreAnswer:
    """The agent's outcome of a restore request, written into the request's file."""

    phase: AnswerPhase
    step: int | None
    #: The restored directory's name in the checkpoint root (restored only).
    name: str | None = None
    #: What went wrong and what to do (failed only).
    error: str | None = None
    answered_at: float = 0.0


def request_path(root: Path, request_id: str) -> Path:
    return root / f"{REQUEST_PREFIX}{request_id}{REQUEST_SUFFIX}"


def request_id_of(name: str) -> str | None:
    """The request id in a file name of the root, or None for any other file."""
    if name.startswith(REQUEST_PREFIX) and name.endswith(REQUEST_SUFFIX):
        return name[len(REQUEST_PREFIX) : -len(REQUEST_SUFFIX)]
    return None


def parse_request(text: str, *, request_id: str, where: str) -> RestoreRequest | RestoreAnswer:
    """A request file's content: the request, or the agent's answer once it is there.

    Raises InputError for a file that is neither, naming what was expected.
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise errors.InputError(
            f'{where}: expected a JSON restore request {{"version": {PROTOCOL_VERSION}, '
            f'"kind": "restore", "id", "step"}}, found {text.strip()[:80]!r}'
        ) from exc
    if not isinstance(data, dict):
        raise errors.InputError(f"{where}: expected a JSON object, found {type(data).__name__}")
    if data.get("version") != PROTOCOL_VERSION:
        raise errors.InputError(
            f"{where}: request version {data.get('version')!r} is not supported: expected "
            f"{PROTOCOL_VERSION}"
        )
    if data.get("kind") != "restore":
        raise errors.InputError(f"{where}: expected kind 'restore', found {data.get('kind')!r}")
    phase = data.get("phase")
    if phase in ("restored", "failed"):
        return parse_answer(data, where=where)
    # Checked for requests only: the agent answers a bad name too, and must read that
    # answer back as answered.
    if not _REQUEST_ID.fullmatch(request_id) or data.get("id") != request_id:
        raise errors.InputError(
            f"{where}: expected the id {request_id!r} of the file name (1-64 characters "
            f"0-9 a-z) in the file, found {data.get('id')!r}"
        )
    if phase is not None:
        raise errors.InputError(
            f"{where}: expected phase restored or failed (or none), found {phase!r}"
        )
    requested_at = data.get("requested_at")
    return RestoreRequest(
        id=request_id,
        step=_check_step(data.get("step"), what=where),
        requested_at=float(requested_at) if isinstance(requested_at, int | float) else 0.0,
    )


def parse_answer(data: Mapping[str, Any], *, where: str) -> RestoreAnswer:
    step = data.get("step")
    answered_at = data.get("answered_at")
    phase = data.get("phase")
    name = data.get("name")
    error = data.get("error")
    if phase == "restored":
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise errors.InputError(
                f"{where}: a restored answer needs the directory name, found {name!r}"
            )
        return RestoreAnswer(
            "restored",
            step if isinstance(step, int) else None,
            name=name,
            answered_at=float(answered_at) if isinstance(answered_at, int | float) else 0.0,
        )
    if phase == "failed":
        return RestoreAnswer(
            "failed",
            step if isinstance(step, int) and not isinstance(step, bool) else None,
            error=str(error) if error is not None else "no reason given",
            answered_at=float(answered_at) if isinstance(answered_at, int | float) else 0.0,
        )
    raise errors.InputError(f"{where}: expected phase restored or failed, found {phase!r}")


def answer_json(
    request_id: str,
    step: object,
    *,
    name: str | None = None,
    path: Path | None = None,
    error: str | None = None,
    requested_at: object = None,
) -> dict[str, Any]:
    """The file the agent writes over a request: restored (`name`) or failed (`error`)."""
    return {
        "version": PROTOCOL_VERSION,
        "kind": "restore",
        "id": request_id,
        "step": step,
        "requested_at": requested_at,
        "phase": "failed" if error is not None else "restored",
        "name": name,
        "path": str(path) if path is not None else None,
        "error": error,
        "answered_at": time.time(),
    }


# --- the trainer's API ----------------------------------------------------------------
def commit(
    path: str | os.PathLike[str],
    *,
    step: int,
    data_state: Mapping[str, Any] | None = None,
) -> None:
    """Mark the finished checkpoint directory `path` for upload, and return at once.

    Write every file of the checkpoint first: the agent uploads the directory as it is
    when the marker appears. `data_state` is `Dataset.state_dict()` at this step, so
    `shardcache.open(..., resume_from=...)` resumes the data stream with the model.
    Raises InputError for a missing directory, a directory outside the checkpoint
    root, a step that is already committed, or a data_state that is not JSON.
    """
    step = _check_step(step, what="checkpoint.commit()")
    directory = Path(path)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise errors.InputError(
            f"checkpoint.commit(): {str(directory)!r} {what}: write the checkpoint "
            "directory first, then commit it"
        )
    directory = directory.resolve()
    if directory.name.startswith("."):
        raise errors.InputError(
            f"checkpoint.commit(): {str(directory)!r} is hidden; the agent ignores names "
            "starting with '.': choose another name"
        )
    env_root = os.environ.get(names.ENV_CHECKPOINT_DIR)
    root = Path(env_root).resolve() if env_root else directory.parent
    if directory.parent != root:
        raise errors.InputError(
            f"checkpoint.commit(): {str(directory)!r} is not a direct subdirectory of the "
            f"checkpoint directory {str(root)!r} (${names.ENV_CHECKPOINT_DIR}), the only "
            "place the sidecar uploads from: write checkpoints there"
        )
    state = dict(data_state) if data_state is not None else None
    if state is not None:
        try:
            json.dumps(state)
        except (TypeError, ValueError) as exc:
            raise errors.InputError(
                f"checkpoint.commit(): data_state must be JSON-serialisable (pass "
                f"Dataset.state_dict()), found {exc}"
            ) from exc
    existing = read_marker(directory)
    if existing is not None:
        if existing.step == step and existing.data_state == state:
            return  # committing the same thing twice is harmless
        raise errors.InputError(
            f"checkpoint.commit(): {str(directory)!r} is already committed as step "
            f"{existing.step}; a committed directory is immutable: write a new one"
        )
    for other in local_checkpoints(root):
        if other.step == step and other.path != directory:
            raise errors.InputError(
                f"checkpoint.commit(): step {step} is already committed as "
                f"{str(other.path)!r}; each checkpoint needs its own step"
            )
    write_marker(directory, Marker(step=step, data_state=state, committed_at=time.time()))


def _find(root: Path, step: int) -> LocalCheckpoint | None:
    for ckpt in local_checkpoints(root):
        if ckpt.step == step:
            return ckpt
    return None


def latest(*, root: str | os.PathLike[str] | None = None) -> int | None:
    """The newest step the agent has published in the object store, or None."""
    data = read_root_file(checkpoint_root(root), LATEST_NAME)
    if data is None or not isinstance(data.get("step"), int):
        return None
    return int(data["step"])


def wait(
    step: int, timeout: float | None = None, *, root: str | os.PathLike[str] | None = None
) -> None:
    """Block until checkpoint `step` is published in the object store.

    Raises TimeoutError after `timeout` seconds, InputError when the agent refused the
    checkpoint for good (a duplicate step, unreadable files) or for a step that was never
    committed here. While the object store fails, the agent retries and this waits.
    """
    step = _check_step(step, what="checkpoint.wait()")
    base = checkpoint_root(root)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ckpt = _find(base, step)
        status = ckpt.status if ckpt is not None else None
        if status is not None and status.step == step:
            if status.phase in _DONE_PHASES:
                return
            if status.phase == "failed" and not status.retryable:
                raise errors.InputError(f"checkpoint step {step} was not uploaded: {status.error}")
            # A retryable failure: the agent tries again with backoff; keep waiting.
        if ckpt is None:
            published = read_root_file(base, LATEST_NAME) or {}
            if step in published.get("steps", ()):
                return  # uploaded, and since removed from the node by retention
            raise errors.InputError(
                f"checkpoint.wait(): no checkpoint with step {step} under {str(base)!r}: "
                "commit it first"
            )
        if deadline is not None and time.monotonic() >= deadline:
            phase = status.phase if status is not None else "not picked up by the agent yet"
            last = f"; last error: {status.error}" if status is not None and status.error else ""
            raise TimeoutError(
                f"checkpoint step {step} was not uploaded within {timeout}s (state: {phase}"
                f"{last}); is the sidecar's checkpoint agent running?"
            )
        time.sleep(_WAIT_POLL_S)


def restore(
    step: int | None = None,
    *,
    timeout: float | None = None,
    root: str | os.PathLike[str] | None = None,
) -> Path | None:
    """The local directory of checkpoint `step` (default: the newest), or None if none.

    The sidecar restores the pinned checkpoint into the volume before the trainer
    starts; this finds it (or any checkpoint committed since) on the node. A `step`
    that is not on the node but published in the object store (going back after a
    loss spike) is asked of the checkpoint agent, which restores it, every byte
    verified, into the volume; this waits up to `timeout` seconds (None: no limit).

    Raises InputError for a step neither here nor published, or when the agent could
    not restore it (with its reason); TimeoutError when the agent does not answer.
    """
    base = checkpoint_root(root)
    restored = read_root_file(base, RESTORE_NAME) or {}
    if restored.get("phase") == "failed":
        raise errors.InputError(f"the checkpoint restore failed: {restored.get('error')}")
    available = [c for c in local_checkpoints(base) if not _failed(c)]
    if step is None:
        return available[-1].path if available else None
    step = _check_step(step, what="checkpoint.restore()")
    for ckpt in available:
        if ckpt.step == step:
            return ckpt.path
    published = (read_root_file(base, LATEST_NAME) or {}).get("steps")
    published = published if isinstance(published, list) else []
    if step not in published:
        raise errors.InputError(
            f"checkpoint step {step} is not on this node (have {[c.step for c in available]}) "
            f"and not published in the object store (published steps: {published or 'none'}):"
            " restore one of those"
        )
    return _request_restore(base, step, timeout)


def _request_restore(base: Path, step: int, timeout: float | None) -> Path:
    request = RestoreRequest(id=secrets.token_hex(8), step=step, requested_at=time.time())
    path = request_path(base, request.id)
    write_json_atomic(path, request.to_json())
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        answer = _read_answer(path, request)
        if answer is not None:
            path.unlink(missing_ok=True)
            if answer.phase == "failed":
                raise errors.InputError(f"checkpoint step {step} was not restored: {answer.error}")
            assert answer.name is not None
            return base / answer.name
        if deadline is not None and time.monotonic() >= deadline:
            # Withdrawn: an agent started later must not restore a step nobody waits for.
            path.unlink(missing_ok=True)
            raise TimeoutError(
                f"checkpoint step {step} was not restored within {timeout}s (state: request "
                f"{path.name} not answered by the agent); is the sidecar's checkpoint agent "
                "running?"
            )
        time.sleep(_WAIT_POLL_S)


def _read_answer(path: Path, request: RestoreRequest) -> RestoreAnswer | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise errors.InputError(
            f"checkpoint step {request.step}: the restore request {str(path)!r} was removed "
            "before the agent answered it; call checkpoint.restore() again"
        ) from None
    parsed = parse_request(text, request_id=request.id, where=str(path))
    return parsed if isinstance(parsed, RestoreAnswer) else None


def _on_node(step: int, *, root: str | os.PathLike[str] | None) -> Path:
    """Checkpoint `step` on the node; never asks the agent (a data loader opened with
    resume_from= must not block on a download nobody bounded)."""
    step = _check_step(step, what="resume_from")
    base = checkpoint_root(root)
    available = [c for c in local_checkpoints(base) if not _failed(c)]
    for ckpt in available:
        if ckpt.step == step:
            return ckpt.path
    raise errors.InputError(
        f"resume_from: checkpoint step {step} is not on this node (have "
        f"{[c.step for c in available]}); fetch a published step with "
        f"checkpoint.restore({step}) first"
    )


def _failed(ckpt: LocalCheckpoint) -> bool:
    # A directory the agent refused for good (a duplicate step) is not a checkpoint.
    s = ckpt.status
    return s is not None and s.phase == "failed" and not s.retryable


def data_state(
    resume_from: str | int | os.PathLike[str], *, root: str | os.PathLike[str] | None = None
) -> dict[str, Any] | None:
    """The data loader state saved with a checkpoint: `"latest"`, a step, or a path.

    None when there is nothing to resume from ("latest" on a fresh start).
    """
    if isinstance(resume_from, str) and resume_from == "latest":
        path = restore(root=root)
        if path is None:
            return None
    elif isinstance(resume_from, int) and not isinstance(resume_from, bool):
        path = _on_node(resume_from, root=root)
    elif isinstance(resume_from, str) and resume_from.isdigit():
        path = _on_node(int(resume_from), root=root)
    elif isinstance(resume_from, os.PathLike | str):
        path = Path(resume_from)
    else:
        raise errors.InputError(
            f'resume_from: expected "latest", a step or a checkpoint path, found {resume_from!r}'
        )
    assert path is not None
    marker = read_marker(path)
    if marker is None:
        raise errors.InputError(
            f"resume_from: {str(path)!r} is not a committed checkpoint (no {MARKER_NAME})"
        )
    if marker.data_state is None:
        raise errors.InputError(
            f"resume_from: checkpoint step {marker.step} at {str(path)!r} has no data state: "
            "commit it with data_state=dataset.state_dict()"
        )
    return marker.data_state
