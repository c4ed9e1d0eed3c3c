"""What a resolve's child answers for the ways its memory limit shows (`resolve_child`)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from shardcache_operator import resolve_child

pytestmark = pytest.mark.unit


def test_pyarrow_refused_a_worker_thread_is_an_answer_of_over_memory() -> None:
    # What pyarrow raises when RLIMIT_DATA refuses the stack of an I/O thread it starts
    # on a read's first need: the limit, not a bug of the source or the operator.
    exc = pa.lib.ArrowException(
        "Unknown error: Failed to launch worker thread: Resource temporarily unavailable"
    )
    answer = resolve_child.error_answer(exc)
    assert answer["error"]["kind"] == resolve_child.MEMORY
    assert "Failed to launch worker thread" in answer["error"]["message"]


def test_another_pyarrow_error_is_answered_as_unexpected_naming_its_class() -> None:
    answer = resolve_child.error_answer(pa.lib.ArrowException("Unknown error: something else"))
    assert answer["error"] == {
        "kind": resolve_child.UNEXPECTED,
        "module": "pyarrow.lib",
        "name": "ArrowException",
        "message": "Unknown error: something else",
    }


def test_a_memory_error_is_an_answer_of_over_memory() -> None:
    answer = resolve_child.error_answer(MemoryError("malloc of size 1048576 failed"))
    assert answer["error"] == {"kind": "MemoryError", "message": "malloc of size 1048576 failed"}
