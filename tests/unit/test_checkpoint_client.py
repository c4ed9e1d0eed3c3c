"""The trainer's side of checkpoints: the marker-file protocol of `shardcache.checkpoint`.

These run on a temporary directory and need no agent: the agent's side (status and
pointer files) is written here the way the agent writes it.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

import shardcache
from shardcache import checkpoint, contract, errors
from shardcache.checkpoint import _protocol
from tests.support import waiting

pytestmark = pytest.mark.unit


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    monkeypatch.setenv(contract.ENV_CHECKPOINT_DIR, str(path))
    return path


def finished(root: Path, name: str) -> Path:
    (root / name).mkdir()
    (root / name / "model.pt").write_bytes(b"weights")
    return root / name


def test_commit_writes_the_marker_with_step_and_data_state(root: Path) -> None:
    path = finished(root, "step-3")
    checkpoint.commit(path, step=3, data_state={"position": 12})
    marker = json.loads((path / _protocol.MARKER_NAME).read_text())
    assert (marker["version"], marker["step"], marker["data_state"]) == (1, 3, {"position": 12})
    assert [c.step for c in _protocol.local_checkpoints(root)] == [3]
    # No temp files are left next to the marker.
    assert sorted(p.name for p in path.iterdir()) == [_protocol.MARKER_NAME, "model.pt"]


def test_committing_the_same_checkpoint_twice_is_harmless(root: Path) -> None:
    path = finished(root, "a")
    checkpoint.commit(path, step=1, data_state={"position": 1})
    checkpoint.commit(path, step=1, data_state={"position": 1})
    with pytest.raises(errors.InputError, match="already committed as step 1"):
        checkpoint.commit(path, step=2)


def test_a_step_can_be_committed_only_once(root: Path) -> None:
    checkpoint.commit(finished(root, "a"), step=5)
    with pytest.raises(errors.InputError, match=r"step 5 is already committed as .*/a"):
        checkpoint.commit(finished(root, "b"), step=5)
    assert _protocol.read_marker(root / "b") is None


def test_only_direct_subdirectories_of_the_volume_are_committed(root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(errors.InputError, match="not a direct subdirectory"):
        checkpoint.commit(elsewhere, step=1)
    nested = finished(root, "a") / "inner"
    nested.mkdir()
    with pytest.raises(errors.InputError, match="not a direct subdirectory"):
        checkpoint.commit(nested, step=1)
    with pytest.raises(errors.InputError, match="hidden"):
        checkpoint.commit(finished(root, ".hidden"), step=1)


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_the_step_must_be_a_non_negative_integer(root: Path, step: object) -> None:
    with pytest.raises(errors.InputError, match="integer >= 0"):
        checkpoint.commit(finished(root, "a"), step=step)  # type: ignore[arg-type]


def test_a_file_is_not_a_checkpoint_directory(root: Path) -> None:
    (root / "file").write_text("x")
    with pytest.raises(errors.InputError, match="is not a directory"):
        checkpoint.commit(root / "file", step=1)


@pytest.mark.parametrize(
    ("text", "step"),
    [("12", 12), ("12\n", 12), ('{"step": 4}', 4), ("7 ", 7), ('{"version": 1, "step": 0}', 0)],
)
def test_marker_files_written_by_hand_are_understood(text: str, step: int) -> None:
    assert _protocol.parse_marker(text, where="m").step == step


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "expected JSON"),
        ("twelve", "expected JSON"),
        ('{"step": -2}', "integer >= 0"),
        ('{"version": 9, "step": 1}', "version 9"),
        ('{"step": 1, "data_state": [1]}', "data_state must be an object"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_bad_marker_files_are_clear_errors(text: str, match: str) -> None:
    with pytest.raises(errors.InputError, match=match):
        _protocol.parse_marker(text, where="m")


def test_wait_returns_once_the_agent_reports_the_upload(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = finished(root, "s")
    checkpoint.commit(path, step=8)
    looks = [0]
    find = checkpoint._find

    def counted(base: Path, step: int) -> _protocol.LocalCheckpoint | None:
        looks[0] += 1
        return find(base, step)

    monkeypatch.setattr(checkpoint, "_find", counted)
    reported = threading.Event()
    returned = threading.Event()

    def agent() -> None:
        # Reports only after wait() looked, found nothing uploaded, and looked again:
        # a wait() that returned at once, before any report, never gets a report.
        waiting.wait_until(
            "wait() to look at the checkpoint twice",
            lambda: looks[0] >= 2 or returned.is_set(),
        )
        if not returned.is_set():
            reported.set()
            _protocol.write_status(path, _protocol.Status("uploaded", 8))

    thread = threading.Thread(target=agent)
    thread.start()
    checkpoint.wait(8, timeout=30)
    returned.set()
    thread.join()
    assert reported.is_set(), "wait() returned before the agent reported the upload"


def test_wait_times_out_with_the_state_and_last_error(root: Path) -> None:
    path = finished(root, "s")
    checkpoint.commit(path, step=8)
    _protocol.write_status(
        path, _protocol.Status("failed", 8, error="store unreachable", retryable=True)
    )
    with pytest.raises(TimeoutError, match="store unreachable"):
        checkpoint.wait(8, timeout=0.2)


def test_wait_raises_what_the_agent_refused(root: Path) -> None:
    path = finished(root, "s")
    checkpoint.commit(path, step=8)
    _protocol.write_status(path, _protocol.Status("failed", 8, error="duplicate step"))
    with pytest.raises(errors.InputError, match="duplicate step"):
        checkpoint.wait(8)
    with pytest.raises(errors.InputError, match="no checkpoint with step 9"):
        checkpoint.wait(9)


def test_latest_and_restore_on_a_fresh_volume(root: Path) -> None:
    assert checkpoint.latest() is None
    assert checkpoint.restore() is None
    assert checkpoint.data_state("latest") is None


def test_restore_finds_the_newest_checkpoint_or_a_given_step(root: Path) -> None:
    for step in (2, 10, 4):
        checkpoint.commit(finished(root, f"s{step}"), step=step, data_state={"position": step})
    assert checkpoint.restore() == root / "s10"
    assert checkpoint.restore(4) == root / "s4"
    assert checkpoint.data_state("latest") == {"position": 10}
    assert checkpoint.data_state(2) == {"position": 2}
    assert checkpoint.data_state(root / "s4") == {"position": 4}
    with pytest.raises(
        errors.InputError, match=r"step 7 is not on this node \(have \[2, 4, 10\]\)"
    ):
        checkpoint.restore(7)


def test_latest_gives_every_old_ranks_state_only_at_another_world_size(root: Path) -> None:
    own = {"rank": 1, "world_size": 2, "position": 8}
    checkpoint.commit(finished(root, "s4"), step=4, data_state=own)
    gathered = [{"rank": 0, "world_size": 2, "position": 8}, own]
    (root / _protocol.DATA_STATES_NAME).write_text(
        json.dumps({"version": _protocol.PROTOCOL_VERSION, "step": 4, "states": gathered})
    )
    # The same world size, or none said: this rank's own state, as before elastic resume.
    assert checkpoint.data_state("latest") == own
    assert checkpoint.data_state("latest", world_size=2) == own
    # Another world size: every old rank's state, for Dataset.load_state_dict to resize.
    assert checkpoint.data_state("latest", world_size=3) == gathered
    # Gathered for another step than the one restored: not this checkpoint's ranks.
    (root / _protocol.DATA_STATES_NAME).write_text(
        json.dumps({"version": _protocol.PROTOCOL_VERSION, "step": 2, "states": gathered})
    )
    assert checkpoint.data_state("latest", world_size=3) == own


def test_resume_from_a_checkpoint_without_data_state_is_a_clear_error(root: Path) -> None:
    checkpoint.commit(finished(root, "s"), step=1)
    with pytest.raises(errors.InputError, match="has no data state"):
        checkpoint.data_state("latest")
    with pytest.raises(errors.InputError, match="has no data state"):
        shardcache.open("file:///nonexistent", resume_from="latest")


def test_no_checkpoint_directory_configured_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(contract.ENV_CHECKPOINT_DIR, raising=False)
    with pytest.raises(errors.InputError, match=contract.ENV_CHECKPOINT_DIR):
        checkpoint.latest()


def test_a_marker_that_is_a_directory_does_not_break_the_other_checkpoints(root: Path) -> None:
    (root / "scratch").mkdir()
    (root / "scratch" / _protocol.MARKER_NAME).mkdir()
    path = finished(root, "s")
    checkpoint.commit(path, step=1, data_state={"position": 1})
    _protocol.write_status(path, _protocol.Status("uploaded", 1))
    checkpoint.wait(1, timeout=5)
    assert checkpoint.restore() == path
    assert checkpoint.restore(1) == path
    assert checkpoint.data_state("latest") == {"position": 1}
    with pytest.raises(errors.InputError, match=r"step 42 is not on this node \(have \[1\]\)"):
        checkpoint.data_state(42)
    marker = re.escape(str(root / "scratch" / _protocol.MARKER_NAME))
    with pytest.raises(errors.InputError, match=f"{marker}: expected a regular file, found a dir"):
        checkpoint.data_state(root / "scratch")


def test_a_data_state_that_is_not_a_dict_is_a_clear_error(root: Path) -> None:
    with pytest.raises(errors.InputError, match=r"data_state must be a JSON object .* found list"):
        checkpoint.commit(finished(root, "s"), step=1, data_state=[1, 2])  # type: ignore[arg-type]
    assert _protocol.read_marker(root / "s") is None


def test_a_checkpoint_root_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.InputError, match="expected a directory, found a file"):
        checkpoint.restore(root=tmp_path / "file")
    with pytest.raises(errors.InputError, match="expected a directory, found a file"):
        checkpoint.wait(1, root=tmp_path / "file")


# --- markers in other scripts' digits -------------------------------------------------
@pytest.mark.parametrize("text", ["\u00b2", "\u0661\u0662", "\uff11\uff12"])
def test_a_marker_in_digits_other_than_ascii_is_a_clear_error(text: str) -> None:
    # str.isdigit() takes these, int() does not (or reads them as another number).
    with pytest.raises(errors.InputError, match="expected JSON"):
        _protocol.parse_marker(text, where="m")


def test_a_marker_in_other_digits_does_not_break_commits_and_restores_of_the_others(
    root: Path,
) -> None:
    (finished(root, "step-0") / _protocol.MARKER_NAME).write_text("²\n")
    checkpoint.commit(finished(root, "step-1"), step=1)
    assert checkpoint.restore() == root / "step-1"
    with pytest.raises(errors.InputError, match="not a committed checkpoint"):
        checkpoint.data_state("²")


# --- data_state is JSON ---------------------------------------------------------------
def test_data_state_is_stored_as_json_and_committing_it_again_is_harmless(root: Path) -> None:
    path = finished(root, "s")
    state = {"epoch": 1, "rng": (7, 9), "nested": {"pair": ("a", 2)}}
    checkpoint.commit(path, step=1, data_state=state)
    assert checkpoint.data_state(str(path)) == {
        "epoch": 1,
        "rng": [7, 9],
        "nested": {"pair": ["a", 2]},
    }
    checkpoint.commit(path, step=1, data_state=state)  # the same state: a no-op


@pytest.mark.parametrize(
    ("state", "named"),
    [
        ({"epoch": 1, 0: "rank0"}, "int key 0 in data_state"),
        ({"per_rank": {3: 10}}, "int key 3 in data_state['per_rank']"),
        ({"runs": [{None: 1}]}, "NoneType key None in data_state['runs'][0]"),
    ],
)
def test_data_state_keys_must_be_strings(
    root: Path, state: dict[object, object], named: str
) -> None:
    path = finished(root, "s")
    with pytest.raises(errors.InputError, match=re.escape(named)):
        checkpoint.commit(path, step=1, data_state=state)  # type: ignore[arg-type]
    assert _protocol.read_marker(path) is None


def test_data_state_that_is_not_finite_json_is_refused(root: Path) -> None:
    with pytest.raises(errors.InputError, match="JSON-serialisable"):
        checkpoint.commit(finished(root, "s"), step=1, data_state={"loss": float("nan")})


# --- size of the marker ---------------------------------------------------------------
def test_a_data_state_too_large_for_the_agent_is_refused_at_commit_with_size_and_limit(
    root: Path,
) -> None:
    path = finished(root, "s")
    big = {"seen": "x" * _protocol.MAX_PROTOCOL_FILE}
    with pytest.raises(
        errors.InputError, match=rf"\d+ bytes, over the {_protocol.MAX_PROTOCOL_FILE}"
    ):
        checkpoint.commit(path, step=1, data_state=big)
    assert _protocol.read_marker(path) is None


def test_wait_for_a_step_whose_marker_the_agent_cannot_read_gives_the_agents_reason(
    root: Path,
) -> None:
    # A trainer writing the marker itself is not held to commit()'s checks.
    path = finished(root, "step-1")
    (path / _protocol.MARKER_NAME).write_text('{"step": 1, "data_state": {"x": "')
    _protocol.write_status(
        path, _protocol.Status("failed", -1, error="the agent's own reason", retryable=False)
    )
    with pytest.raises(errors.InputError, match="'step-1': the agent's own reason"):
        checkpoint.wait(1, timeout=5)


# --- wait after retention -------------------------------------------------------------
def _latest(root: Path, steps: list[int], highest: int | None) -> None:
    data = {"version": 1, "step": steps[-1], "steps": steps, "highest_published": highest}
    _protocol.write_json_atomic(root / _protocol.LATEST_NAME, data)


def test_wait_returns_for_a_step_published_and_since_removed_by_retention(root: Path) -> None:
    # Step 1 was committed, published, then removed from the store and the node.
    _latest(root, [2], highest=2)
    checkpoint.wait(1, timeout=1)
    with pytest.raises(errors.InputError, match="no checkpoint with step 3"):
        checkpoint.wait(3, timeout=1)
