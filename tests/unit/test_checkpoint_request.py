"""Restore requests: the file a trainer writes for a published step not on the node,
and the answer the agent writes over it. No agent here: its answers are written the way
the agent writes them (_protocol.answer_json)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from shardcache import checkpoint, errors
from shardcache.checkpoint import _protocol
from tests.support import waiting

pytestmark = pytest.mark.unit


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoints"
    path.mkdir()
    _protocol.write_json_atomic(
        path / _protocol.LATEST_NAME, {"version": 1, "step": 8, "steps": [4, 8], "uri": "s3://b"}
    )
    return path


def requests_in(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if _protocol.request_id_of(p.name) is not None]


def answer_when_asked(root: Path, answer: dict[str, object] | None = None) -> threading.Thread:
    """An agent stand-in: waits for one request and writes `answer` (restored) over it."""

    def run() -> None:
        (path,) = waiting.wait_until("the trainer's restore request", lambda: requests_in(root))
        request = _protocol.parse_request(
            path.read_text(), request_id=_protocol.request_id_of(path.name) or "", where="t"
        )
        assert isinstance(request, _protocol.RestoreRequest)
        (root / "step-4").mkdir()
        _protocol.write_marker(root / "step-4", _protocol.Marker(4, {"position": 7}))
        data = answer or _protocol.answer_json(
            request.id, request.step, name="step-4", path=Path("/elsewhere/step-4")
        )
        _protocol.write_json_atomic(path, data)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_request_round_trips_and_its_file_name_carries_the_id(tmp_path: Path) -> None:
    request = _protocol.RestoreRequest(id="ab12", step=40, requested_at=5.0)
    path = _protocol.request_path(tmp_path, request.id)
    assert path.name == ".shardcache-request-ab12.json"
    assert _protocol.request_id_of(path.name) == "ab12"
    assert _protocol.request_id_of(_protocol.LATEST_NAME) is None
    assert _protocol.request_id_of(".shardcache-restore-step-4") is None
    text = json.dumps(request.to_json())
    assert json.loads(text) == {
        "version": 1,
        "kind": "restore",
        "id": "ab12",
        "step": 40,
        "requested_at": 5.0,
    }
    assert _protocol.parse_request(text, request_id="ab12", where="t") == request


def test_answers_are_read_as_answers() -> None:
    ok = json.dumps(_protocol.answer_json("ab", 3, name="step-3", path=Path("/c/step-3")))
    parsed = _protocol.parse_request(ok, request_id="ab", where="t")
    assert isinstance(parsed, _protocol.RestoreAnswer)
    assert (parsed.phase, parsed.step, parsed.name, parsed.error) == ("restored", 3, "step-3", None)
    failed = json.dumps(_protocol.answer_json("ab", 3, error="damaged"))
    parsed = _protocol.parse_request(failed, request_id="ab", where="t")
    assert isinstance(parsed, _protocol.RestoreAnswer)
    assert (parsed.phase, parsed.error) == ("failed", "damaged")
    # The agent's answer to a badly named request is still read back as answered.
    bad_name = json.dumps(_protocol.answer_json("BAD NAME", None, error="bad"))
    assert isinstance(
        _protocol.parse_request(bad_name, request_id="BAD NAME", where="t"),
        _protocol.RestoreAnswer,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("not json", "expected a JSON restore request"),
        ("[1]", "expected a JSON object, found list"),
        ('{"version": 2, "kind": "restore", "id": "ab", "step": 1}', "version 2"),
        ('{"version": 1, "kind": "upload", "id": "ab", "step": 1}', "kind 'restore'"),
        ('{"version": 1, "kind": "restore", "id": "cd", "step": 1}', "expected the id 'ab'"),
        ('{"version": 1, "kind": "restore", "id": "ab", "step": "two"}', "integer >= 0"),
        ('{"version": 1, "kind": "restore", "id": "ab", "step": -1}', "integer >= 0"),
        ('{"version": 1, "kind": "restore", "id": "ab", "step": 1, "phase": "x"}', "phase"),
        (
            '{"version": 1, "kind": "restore", "id": "ab", "step": 1, "phase": "restored"}',
            "needs the directory name",
        ),
    ],
)
def test_malformed_request_is_an_input_error_naming_what_was_expected(
    text: str, expected: str
) -> None:
    with pytest.raises(errors.InputError, match=expected):
        _protocol.parse_request(text, request_id="ab", where="t")


def test_step_neither_local_nor_published_names_the_published_steps(root: Path) -> None:
    with pytest.raises(errors.InputError, match=r"step 5 .*published steps: \[4, 8\]"):
        checkpoint.restore(5, timeout=1, root=root)
    assert requests_in(root) == []


def test_published_step_is_requested_and_the_answer_gives_the_local_directory(
    root: Path,
) -> None:
    agent = answer_when_asked(root)
    path = checkpoint.restore(4, timeout=10, root=root)
    agent.join()
    # The trainer's own root, not the agent's mount path.
    assert path == root / "step-4"
    assert requests_in(root) == []  # collected
    assert checkpoint.data_state(4, root=root) == {"position": 7}


def test_agent_failure_is_an_input_error_with_its_reason(root: Path) -> None:
    agent = answer_when_asked(root, _protocol.answer_json("x", 4, error="model.bin: damaged"))
    with pytest.raises(errors.InputError, match=r"step 4 was not restored: model\.bin: damaged"):
        checkpoint.restore(4, timeout=10, root=root)
    agent.join()
    assert requests_in(root) == []


def test_no_answer_is_a_timeout_and_the_request_is_withdrawn(root: Path) -> None:
    with pytest.raises(TimeoutError, match=r"within 0\.2s .*checkpoint agent running"):
        checkpoint.restore(8, timeout=0.2, root=root)
    assert requests_in(root) == []


def test_local_step_and_no_step_write_no_request(root: Path) -> None:
    (root / "step-8").mkdir()
    _protocol.write_marker(root / "step-8", _protocol.Marker(8))
    assert checkpoint.restore(8, timeout=0.01, root=root) == root / "step-8"
    assert checkpoint.restore(root=root) == root / "step-8"
    assert requests_in(root) == []


def test_data_state_of_a_step_not_on_the_node_does_not_ask_the_agent(root: Path) -> None:
    with pytest.raises(errors.InputError, match=r"checkpoint\.restore\(4\) first"):
        checkpoint.data_state(4, root=root)
    assert requests_in(root) == []
