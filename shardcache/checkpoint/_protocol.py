"""The files of the checkpoint directory protocol, shared by the trainer API and the agent.

The trainer (`shardcache.checkpoint`) and the sidecar's checkpoint agent talk only
through files in the checkpoint volume; this module reads and writes them, so both ends
parse them the same way. The layout is in `shardcache.checkpoint`'s docstring and
docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from shardcache import contract, errors

#: Version of the marker, status and pointer files of the directory protocol.
PROTOCOL_VERSION = 1
MARKER_NAME = ".shardcache-commit"
STATUS_DIR = ".shardcache-status"
LATEST_NAME = ".shardcache-latest"
RESTORE_NAME = ".shardcache-restore"
#: Written by the agent of a ranked pod at start: every rank's data state at the newest
#: step all ranks of its world size published, `{"version", "step", "states"}`, so a
#: job restarted at another world size resumes with `load_state_dict(states)`.
DATA_STATES_NAME = ".shardcache-data-states.json"
#: Names with this prefix belong to shardcache: never uploaded, never a checkpoint.
RESERVED_PREFIX = ".shardcache-"
#: Restore requests: `<root>/.shardcache-request-<id>.json`. Not `.shardcache-restore-…`:
#: the agent deletes names with that prefix at start as leftovers of a restore's staging.
REQUEST_PREFIX = f"{RESERVED_PREFIX}request-"
REQUEST_SUFFIX = ".json"
_REQUEST_ID = re.compile(r"[0-9a-z]{1,64}")

Phase = Literal["uploading", "uploaded", "restored", "failed"]
AnswerPhase = Literal["restored", "failed"]
DONE_PHASES = ("uploaded", "restored")


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
#: Largest protocol file read (markers, statuses, requests are a few hundred bytes; a
#: data_state may be larger): a bound on what the agent reads for the trainer.
MAX_PROTOCOL_FILE = 4 << 20


def read_small_text(path: Path) -> str:
    """The text of a protocol file, never through a symbolic link.

    The sidecar's agent reads these files for the trainer, which can write the volume:
    a link (to the sidecar's own files) or a special file is refused with an
    `InputError` naming the path, and nothing of what it points to is read.
    Missing files raise `FileNotFoundError` as usual.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise errors.InputError(
                f"{path}: is a symbolic link; shardcache's protocol files are never read "
                "through links: write the file itself"
            ) from None
        raise
    # The type is checked on the bare descriptor: os.fdopen itself refuses a directory,
    # with an IsADirectoryError that names the descriptor number instead of the path.
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            found = "a directory" if stat.S_ISDIR(info.st_mode) else "a special file"
            raise errors.InputError(
                f"{path}: expected a regular file, found {found}; refused: make it a file "
                "(or remove it)"
            )
        if info.st_size > MAX_PROTOCOL_FILE:
            raise errors.InputError(
                f"{path}: {info.st_size} bytes, over the {MAX_PROTOCOL_FILE} a protocol file "
                "may have"
            )
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        data = f.read(MAX_PROTOCOL_FILE + 1)
    return data.decode("utf-8")


def refuse_linked_dir(path: Path) -> None:
    """Raise `InputError` if `path` exists as anything but a real directory (a link
    to elsewhere, a file): nothing is written through it."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise errors.InputError(
            f"{path}: is a symbolic link or not a directory; shardcache writes its status "
            "files only into a real directory: remove it (the agent recreates it)"
        )


def encode_json(data: Mapping[str, Any]) -> bytes:
    """The bytes `write_json_atomic` writes for `data` (so a size can be checked first)."""
    return json.dumps(data, sort_keys=True).encode("utf-8")


def write_json_atomic(path: Path, data: Mapping[str, Any] | bytes) -> None:
    """Write JSON (or bytes from `encode_json`) so a reader sees the old file or the
    new one, never a torn one.

    Atomic (temp file + rename) but not fsynced: the checkpoint volume is pod-local and
    does not outlive the node, and an fsync while the node writes gigabytes can take
    long enough to show up in the trainer's step time.
    """
    payload = data if isinstance(data, bytes) else encode_json(data)
    tmp = path.with_name(f"{RESERVED_PREFIX}tmp-{os.getpid()}-{secrets.token_hex(4)}")
    # Exclusive and no-follow: a link planted under the temporary name is not written
    # through; the rename then replaces whatever `path` is (a link itself, not its target).
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "wb") as out:
            out.write(payload)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_step(step: object, *, what: str) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise errors.InputError(f"{what}: expected the step as an integer >= 0, found {step!r}")
    return step


#: A step written as text: ASCII digits only. str.isdigit() also takes other scripts'
#: digits and superscripts ('²'), which int() then refuses with a bare ValueError.
_STEP_TEXT = re.compile(r"[0-9]+")


def parse_step_text(text: str) -> int | None:
    """The step a text holds when it is a number in ASCII digits alone, else None."""
    return int(text) if _STEP_TEXT.fullmatch(text) else None


def normalise_data_state(state: Mapping[str, Any], *, what: str) -> dict[str, Any]:
    """`state` as every reader gets it back: through JSON, the format it is stored in.

    Tuples come back as lists. Keys must be strings: JSON turns a key 0 into "0", so
    `state[0]` would miss after a restore, and keys of mixed types cannot be sorted
    for the file at all. NaN and infinities are refused: they are not JSON, and NaN is
    not even equal to itself, so committing the same state again could not match.
    Raises InputError naming what is not JSON.
    """
    try:
        text = json.dumps(state, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise errors.InputError(
            f"{what}: data_state must be JSON-serialisable (pass Dataset.state_dict()), found {exc}"
        ) from exc
    # json.dumps accepted it, so it is finite and acyclic: this walk ends.
    pending: list[tuple[str, object]] = [("data_state", state)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise errors.InputError(
                        f"{what}: data_state keys must be strings (JSON object keys are "
                        f"text: {key!r} would come back as {json.dumps(str(key))}), found "
                        f"{type(key).__name__} key {key!r} in {where}"
                    )
                pending.append((f"{where}[{key!r}]", item))
        elif isinstance(value, list | tuple):
            pending.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    normal: dict[str, Any] = json.loads(text)
    return normal


def marker_bytes(marker: Marker, *, what: str) -> bytes:
    """The marker file's bytes; InputError when the agent could not read them back."""
    payload = encode_json(marker.to_json())
    if len(payload) > MAX_PROTOCOL_FILE:
        raise errors.InputError(
            f"{what}: the marker with this data_state is {len(payload)} bytes, over the "
            f"{MAX_PROTOCOL_FILE} bytes the checkpoint agent reads: keep data_state small "
            "(Dataset.state_dict() is a few hundred bytes) and save large state as a file "
            "of the checkpoint"
        )
    return payload


def parse_marker(text: str, *, where: str) -> Marker:
    """A marker file's content: JSON, or the step number alone (for shell trainers)."""
    stripped = text.strip()
    step = parse_step_text(stripped)
    if step is not None:
        return Marker(step=step)
    try:
        data = json.loads(stripped)
    except (ValueError, RecursionError):
        # The content is not echoed: it is the trainer's, but status files are read widely.
        # RecursionError: nested too deeply for json's recursive decoder, as bad as garbage.
        raise errors.InputError(
            f'{where}: expected JSON {{"step": N}} or a step number (ASCII digits), found '
            f"{len(stripped.encode('utf-8'))} bytes that are neither"
        ) from None
    if isinstance(data, int):
        return Marker(step=check_step(data, what=where))
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
        step=check_step(data.get("step"), what=where),
        data_state=state,
        committed_at=float(committed_at) if isinstance(committed_at, int | float) else None,
    )


def read_marker(checkpoint: Path) -> Marker | None:
    """The marker of a checkpoint directory, or None while it is not committed.

    Raises `InputError` naming the marker for one that cannot be read or parsed: the
    callers skip or refuse that one directory and go on with the others.
    """
    path = checkpoint / MARKER_NAME
    try:
        text = read_small_text(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except UnicodeDecodeError:
        raise errors.InputError(f"{path}: expected UTF-8 text") from None
    except OSError as exc:
        # No permission, an I/O error: a fault of this one directory, not of the scan.
        raise errors.InputError(f"{path}: cannot read the marker: {exc.strerror or exc}") from None
    return parse_marker(text, where=str(path))


def write_marker(checkpoint: Path, marker: Marker) -> None:
    path = checkpoint / MARKER_NAME
    write_json_atomic(path, marker_bytes(marker, what=str(path)))


def status_path(checkpoint: Path) -> Path:
    return checkpoint.parent / STATUS_DIR / f"{checkpoint.name}.json"


def read_status(checkpoint: Path) -> Status | None:
    try:
        refuse_linked_dir(status_path(checkpoint).parent)
        data = json.loads(read_small_text(status_path(checkpoint)))
        return Status(
            phase=data["phase"],
            step=int(data["step"]),
            error=data.get("error"),
            retryable=bool(data.get("retryable", False)),
            updated_at=float(data.get("updated_at", 0.0)),
        )
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (ValueError, KeyError, TypeError, RecursionError, OSError, errors.InputError):
        # A status from another version, a link, a directory, unreadable: the agent
        # rewrites it; unknown.
        return None


def write_status(checkpoint: Path, status: Status) -> None:
    path = status_path(checkpoint)
    refuse_linked_dir(path.parent)
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, status.to_json())


def remove_status(checkpoint: Path) -> None:
    status_path(checkpoint).unlink(missing_ok=True)


def read_root_file(root: Path, name: str) -> dict[str, Any] | None:
    """A JSON object the agent writes into the root, or None when there is none.

    Anything else in its place (another version, a directory, a link) reads as none:
    the agent rewrites these files, and the trainer's calls must not fail on them.
    """
    try:
        data = json.loads(read_small_text(root / name))
    except (ValueError, RecursionError, OSError, errors.InputError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_root(root: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint root: `root`, else $SHARDCACHE_CHECKPOINT_DIR.

    A root that does not exist yet is returned (nothing committed); one that exists as
    anything but a directory raises `InputError`.
    """
    if root is not None:
        path = Path(root)
        what = "the root= argument"
    else:
        env = os.environ.get(contract.ENV_CHECKPOINT_DIR)
        if not env:
            raise errors.InputError(
                f"no checkpoint directory: ${contract.ENV_CHECKPOINT_DIR} is not set (set "
                "spec.checkpoint in the DatasetMount, or pass root=)"
            )
        path = Path(env)
        what = f"${contract.ENV_CHECKPOINT_DIR}"
    if path.exists() and not path.is_dir():
        raise errors.InputError(
            f"checkpoint directory {str(path)!r} ({what}): expected a directory, found a file"
        )
    return path


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
    except NotADirectoryError:
        raise errors.InputError(
            f"checkpoint directory {str(root)!r}: expected a directory, found a file"
        ) from None
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


def refused_checkpoints(root: Path) -> list[tuple[Path, str]]:
    """Directories under `root` with a marker that cannot be read, each with why: the
    agent's error from the directory's status file where it wrote one, else the read
    error. `local_checkpoints` skips these; `wait()` names them instead of saying
    "commit it first" to a trainer that did commit."""
    refused: list[tuple[Path, str]] = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            read_marker(path)
        except errors.InputError as exc:
            status = read_status(path)
            why = status.error if status is not None and status.error else str(exc)
            refused.append((path, why))
    refused.sort()
    return refused


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
    except (ValueError, RecursionError):  # RecursionError: nested too deeply to decode
        raise errors.InputError(
            f'{where}: expected a JSON restore request {{"version": {PROTOCOL_VERSION}, '
            f'"kind": "restore", "id", "step"}}, found {len(text)} bytes that are not JSON'
        ) from None
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
        step=check_step(data.get("step"), what=where),
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
