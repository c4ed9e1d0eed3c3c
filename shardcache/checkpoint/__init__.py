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
  the object store, the steps retained there, and the newest step ever published
  (`highest_published`, which retention does not lower).
* `<root>/.shardcache-restore`       written by the agent at start: what it restored.
* `<root>/.shardcache-data-states.json`  written by a ranked pod's agent at start: every
  rank's data state at the newest step that all ranks of its world size published
  (`{"version", "step", "states"}`); `data_state("latest", world_size=W)` returns that
  list when it is the restored step and W is another world size, so a job restarted
  at another world size resumes elastically.
* `<root>/.shardcache-request-<id>.json`  written by `restore(step)` for a published step
  not on the node: `{"version", "kind": "restore", "id", "step", "requested_at"}`; the
  agent restores the step and rewrites the same file with the outcome (`phase`
  restored + `name`, or failed + `error`); the trainer reads it and removes the file.

The checkpoint root is $SHARDCACHE_CHECKPOINT_DIR (the volume shared with the sidecar);
each checkpoint is a direct subdirectory of it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache import contract, errors
from shardcache.checkpoint import _protocol

__all__ = ["commit", "data_state", "latest", "restore", "wait"]

# wait(): poll the status file this often; a poll is a readdir and a few small reads.
_WAIT_POLL_S = 0.02


def commit(
    path: str | os.PathLike[str],
    *,
    step: int,
    data_state: Mapping[str, Any] | None = None,
) -> None:
    """Mark the finished checkpoint directory `path` for upload, and return at once.

    Write every file of the checkpoint first: the agent uploads the directory as it is
    when the marker appears. `data_state` is `Dataset.state_dict()` at this step, so
    `shardcache.open(..., resume_from=...)` resumes the data stream with the model. It
    is stored as JSON and read back so: tuples come back as lists; keys must be strings.
    Raises InputError for a missing directory, a directory outside the checkpoint
    root, a step that is already committed, or a data_state that is not JSON or is too
    large for the marker (`_protocol.MAX_PROTOCOL_FILE`).
    """
    step = _protocol.check_step(step, what="checkpoint.commit()")
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
    try:
        directory.name.encode("utf-8")
    except UnicodeEncodeError:
        # The name goes into the manifest, which is JSON: UTF-8 text.
        raise errors.InputError(
            f"checkpoint.commit(): the directory name {os.fsencode(directory.name)!r} is not "
            "UTF-8: rename it"
        ) from None
    env_root = os.environ.get(contract.ENV_CHECKPOINT_DIR)
    root = Path(env_root).resolve() if env_root else directory.parent
    if directory.parent != root:
        raise errors.InputError(
            f"checkpoint.commit(): {str(directory)!r} is not a direct subdirectory of the "
            f"checkpoint directory {str(root)!r} (${contract.ENV_CHECKPOINT_DIR}), the only "
            "place the sidecar uploads from: write checkpoints there"
        )
    if data_state is not None and not isinstance(data_state, Mapping):
        raise errors.InputError(
            f"checkpoint.commit(): data_state must be a JSON object (a dict, as "
            f"Dataset.state_dict() returns), found {type(data_state).__name__}"
        )
    # As it will be read back (tuples as lists): written so, and compared so below.
    state = (
        _protocol.normalise_data_state(data_state, what="checkpoint.commit()")
        if data_state is not None
        else None
    )
    marker = _protocol.Marker(step=step, data_state=state, committed_at=time.time())
    # Refused here, where the trainer can still act on it, not by the agent later.
    payload = _protocol.marker_bytes(marker, what="checkpoint.commit()")
    existing = _protocol.read_marker(directory)
    if existing is not None:
        if existing.step == step and existing.data_state == state:
            return  # committing the same thing twice is harmless
        raise errors.InputError(
            f"checkpoint.commit(): {str(directory)!r} is already committed as step "
            f"{existing.step}; a committed directory is immutable: write a new one"
        )
    for other in _protocol.local_checkpoints(root):
        if other.step == step and other.path != directory:
            raise errors.InputError(
                f"checkpoint.commit(): step {step} is already committed as "
                f"{str(other.path)!r}; each checkpoint needs its own step"
            )
    _protocol.write_json_atomic(directory / _protocol.MARKER_NAME, payload)


def _find(root: Path, step: int) -> _protocol.LocalCheckpoint | None:
    for ckpt in _protocol.local_checkpoints(root):
        if ckpt.step == step:
            return ckpt
    return None


def latest(*, root: str | os.PathLike[str] | None = None) -> int | None:
    """The newest step the agent has published in the object store, or None."""
    data = _protocol.read_root_file(_protocol.checkpoint_root(root), _protocol.LATEST_NAME)
    if data is None or not isinstance(data.get("step"), int):
        return None
    return int(data["step"])


def wait(
    step: int, timeout: float | None = None, *, root: str | os.PathLike[str] | None = None
) -> None:
    """Block until checkpoint `step` is published in the object store.

    Raises TimeoutError after `timeout` seconds, InputError when the agent refused the
    checkpoint for good (a duplicate step, unreadable files, a marker it cannot read)
    or for a step that was never committed here. While the object store fails, the
    agent retries and this waits. A step no longer on the node or in the store but
    older than a step the agent published was published and since removed by
    retention (keepLast): this returns.
    """
    step = _protocol.check_step(step, what="checkpoint.wait()")
    base = _protocol.checkpoint_root(root)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ckpt = _find(base, step)
        status = ckpt.status if ckpt is not None else None
        if status is not None and status.step == step:
            if status.phase in _protocol.DONE_PHASES:
                return
            if status.phase == "failed" and not status.retryable:
                raise errors.InputError(f"checkpoint step {step} was not uploaded: {status.error}")
            # A retryable failure: the agent tries again with backoff; keep waiting.
        if ckpt is None:
            published = _protocol.read_root_file(base, _protocol.LATEST_NAME) or {}
            if step in published.get("steps", ()):
                return  # uploaded, and since removed from the node by retention
            highest = published.get("highest_published")
            if isinstance(highest, int) and not isinstance(highest, bool) and step <= highest:
                # Neither on the node nor kept in the store, but the agent has published
                # a later step: published, then removed by retention (keepLast). Unpublished
                # directories are never removed, so a step still uploading is found above.
                return
            refused = _protocol.refused_checkpoints(base)
            if refused:
                listed = "; ".join(f"{p.name!r}: {why}" for p, why in refused)
                raise errors.InputError(
                    f"checkpoint.wait(): no readable checkpoint with step {step} under "
                    f"{str(base)!r}; the agent cannot read the marker of {listed}. Fix or "
                    f"remove that marker, or commit step {step}"
                )
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
    base = _protocol.checkpoint_root(root)
    restored = _protocol.read_root_file(base, _protocol.RESTORE_NAME) or {}
    if restored.get("phase") == "failed":
        raise errors.InputError(f"the checkpoint restore failed: {restored.get('error')}")
    available = [c for c in _protocol.local_checkpoints(base) if not _failed(c)]
    if step is None:
        return available[-1].path if available else None
    step = _protocol.check_step(step, what="checkpoint.restore()")
    for ckpt in available:
        if ckpt.step == step:
            return ckpt.path
    published = (_protocol.read_root_file(base, _protocol.LATEST_NAME) or {}).get("steps")
    published = published if isinstance(published, list) else []
    if step not in published:
        raise errors.InputError(
            f"checkpoint step {step} is not on this node (have {[c.step for c in available]}) "
            f"and not published in the object store (published steps: {published or 'none'}):"
            " restore one of those"
        )
    return _request_restore(base, step, timeout)


def _request_restore(base: Path, step: int, timeout: float | None) -> Path:
    request = _protocol.RestoreRequest(id=secrets.token_hex(8), step=step, requested_at=time.time())
    path = _protocol.request_path(base, request.id)
    _protocol.write_json_atomic(path, request.to_json())
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


def _read_answer(path: Path, request: _protocol.RestoreRequest) -> _protocol.RestoreAnswer | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise errors.InputError(
            f"checkpoint step {request.step}: the restore request {str(path)!r} was removed "
            "before the agent answered it; call checkpoint.restore() again"
        ) from None
    parsed = _protocol.parse_request(text, request_id=request.id, where=str(path))
    return parsed if isinstance(parsed, _protocol.RestoreAnswer) else None


def _on_node(step: int, *, root: str | os.PathLike[str] | None) -> Path:
    """Checkpoint `step` on the node; never asks the agent (a data loader opened with
    resume_from= must not block on a download nobody bounded)."""
    step = _protocol.check_step(step, what="resume_from")
    base = _protocol.checkpoint_root(root)
    available = [c for c in _protocol.local_checkpoints(base) if not _failed(c)]
    for ckpt in available:
        if ckpt.step == step:
            return ckpt.path
    raise errors.InputError(
        f"resume_from: checkpoint step {step} is not on this node (have "
        f"{[c.step for c in available]}); fetch a published step with "
        f"checkpoint.restore({step}) first"
    )


def _failed(ckpt: _protocol.LocalCheckpoint) -> bool:
    # A directory the agent refused for good (a duplicate step) is not a checkpoint.
    s = ckpt.status
    return s is not None and s.phase == "failed" and not s.retryable


def data_state(
    resume_from: str | int | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    world_size: int | None = None,
) -> dict[str, Any] | list[dict[str, Any]] | None:
    """The data loader state saved with a checkpoint: `"latest"`, a step, or a path.

    None when there is nothing to resume from ("latest" on a fresh start). For
    "latest" in a ranked pod whose job now runs at `world_size`, another world size
    than the checkpoint's: the list of every old rank's state at the restored step, as
    the agent gathered them (`Dataset.load_state_dict` resumes such a list at the new
    world size). Otherwise this rank's own state, a dict: the same world size, or
    `world_size` not given.
    """
    if isinstance(resume_from, str) and resume_from == "latest":
        path = restore(root=root)
        if path is None:
            return None
    elif isinstance(resume_from, int) and not isinstance(resume_from, bool):
        path = _on_node(resume_from, root=root)
    elif isinstance(resume_from, str) and _protocol.parse_step_text(resume_from) is not None:
        path = _on_node(int(resume_from), root=root)
    elif isinstance(resume_from, os.PathLike | str):
        path = Path(resume_from)
    else:
        raise errors.InputError(
            f'resume_from: expected "latest", a step or a checkpoint path, found {resume_from!r}'
        )
    assert path is not None
    marker = _protocol.read_marker(path)
    if marker is None:
        raise errors.InputError(
            f"resume_from: {str(path)!r} is not a committed checkpoint (no {_protocol.MARKER_NAME})"
        )
    if marker.data_state is None:
        raise errors.InputError(
            f"resume_from: checkpoint step {marker.step} at {str(path)!r} has no data state: "
            "commit it with data_state=dataset.state_dict()"
        )
    if resume_from == "latest" and world_size is not None:
        gathered = _gathered(_protocol.checkpoint_root(root), marker.step)
        if gathered is not None and _world_size_of(gathered) not in (None, world_size):
            return gathered
    return marker.data_state


def _world_size_of(gathered: list[dict[str, Any]]) -> int | None:
    """The world size the gathered states were saved at (the agent checked they agree)."""
    sizes = {s.get("world_size") for s in gathered}
    size = sizes.pop() if len(sizes) == 1 else None
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _gathered(base: Path, step: int) -> list[dict[str, Any]] | None:
    """Every rank's state at `step`, if the agent gathered them for that step."""
    try:
        data = json.loads((base / _protocol.DATA_STATES_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:
        raise errors.InputError(
            f"resume_from: cannot read {_protocol.DATA_STATES_NAME} in {str(base)!r}: {exc}"
        ) from exc
    if not isinstance(data, dict) or data.get("version") != _protocol.PROTOCOL_VERSION:
        raise errors.InputError(
            f"resume_from: {_protocol.DATA_STATES_NAME} in {str(base)!r} is not version "
            f"{_protocol.PROTOCOL_VERSION}: found {str(data)[:200]!r}"
        )
    found = data.get("states")
    if data.get("step") != step or not isinstance(found, list):
        return None
    return [dict(s) for s in found if isinstance(s, dict)]
