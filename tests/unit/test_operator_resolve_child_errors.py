"""A resolve child's error answer read back in the operator (`resolve_child.error_answer`
→ `resolve_children.raised`): the kinds the reconcile tells apart keep their class."""

from __future__ import annotations

import signal
from pathlib import Path

import pyarrow as pa
import pytest
from shardcache_operator import reconcile, resolve_child, resolve_children, sources

from shardcache import errors, manifests
from shardcache.node import handed_manifests
from tests.support import datasets


def over_memory(found: str) -> Exception:
    return reconcile.ResolveOverMemory(found)


def round_trip(exc: BaseException) -> Exception:
    return resolve_children.raised(
        resolve_child.error_answer(exc)["error"], over_memory=over_memory
    )


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        (reconcile.SourceRefused("no file://"), reconcile.SourceRefused),
        (errors.AccessDeniedError("403"), errors.AccessDeniedError),
        (errors.ManifestMismatchError("moved"), errors.ManifestMismatchError),
        (errors.InputError("empty dataset"), errors.InputError),
        (errors.SourceError("503"), errors.SourceError),
    ],
)
def test_each_kind_the_reconcile_tells_apart_keeps_its_class_and_message(
    sent: Exception, expected: type[Exception]
) -> None:
    back = round_trip(sent)
    assert type(back) is expected
    assert str(back) == str(sent)


def test_a_memory_error_in_the_child_is_resolve_over_memory() -> None:
    back = round_trip(MemoryError("malloc of 64 MiB failed"))
    assert isinstance(back, reconcile.ResolveOverMemory)
    assert "malloc of 64 MiB failed" in str(back)


@pytest.mark.parametrize(
    "sent",
    [KeyError("size"), pa.ArrowInvalid("bad footer"), OSError(5, "I/O error")],
)
def test_any_other_error_is_a_runtime_error_naming_its_class_and_message(
    sent: Exception,
) -> None:
    back = round_trip(sent)
    assert type(back) is RuntimeError
    cls = type(sent)
    assert str(back) == f"{cls.__module__}.{cls.__qualname__}: {sent}"


#: What CPython writes when the limit is hit while it handles a MemoryError: the cause
#: first, then each of the resolve's threads' stacks (the dump is well over 4 KiB).
FATAL = (
    b"Fatal Python error: _PyErr_NormalizeException: Cannot recover from MemoryErrors "
    b"while normalizing exceptions.\nPython runtime state: initialized\n\n"
    + b"".join(
        b"Thread 0x%016x (most recent call first):\n" % t
        + b'  File "/usr/lib/python3.11/threading.py", line 272 in __enter__\n' * 6
        + b"\n"
        for t in range(40)
    )
    + b"Extension modules: numpy._core._multiarray_umath, pyarrow.lib (total: 2)\n"
)


def read_in_chunks(stderr: bytes, size: int = 512) -> bytes:
    """`stderr` as `Resolver._exchange` keeps it, read a pipe's chunk at a time."""
    kept = bytearray()
    for at in range(0, len(stderr), size):
        kept.extend(stderr[at : at + size])
        resolve_children.kept(kept)
    return bytes(kept)


@pytest.mark.parametrize(
    ("cause", "said"),
    [
        (b"", b"_PyErr_NormalizeException: Cannot recover from MemoryErrors"),
        (b"Exception ignored in sys.unraisablehook: ", b"Cannot recover from stack overflow."),
    ],
)
def test_a_child_aborted_by_pythons_fatal_memory_error_is_over_memory_however_long_the_dump(
    cause: bytes, said: bytes
) -> None:
    stderr = cause + FATAL.replace(
        b"_PyErr_NormalizeException: Cannot recover from MemoryErrors", said
    )
    assert len(stderr) > 4 * resolve_children.STDERR_KEPT_BYTES
    resolver = resolve_children.Resolver(memory=192 << 20, timeout=1.0, access=sources.Access())
    died = resolver._died(-signal.SIGABRT, read_in_chunks(stderr))
    assert isinstance(died, reconcile.ResolveOverMemory)
    assert f"memory limit of 192 MiB ({cause.decode()}Fatal Python error: " in str(died)
    assert said.decode() in str(died)


def test_a_child_that_crashed_otherwise_says_its_exit_status_and_last_lines() -> None:
    crash = FATAL.replace(b"Cannot recover from MemoryErrors", b"Segmentation fault")
    resolver = resolve_children.Resolver(memory=192 << 20, timeout=1.0, access=sources.Access())
    died = resolver._died(-signal.SIGSEGV, read_in_chunks(crash))
    assert type(died) is RuntimeError
    assert str(died).startswith("the resolve's process ended with exit status -11: ")
    assert str(died).endswith(
        "Extension modules: numpy._core._multiarray_umath, pyarrow.lib (total: 2)"
    )


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


GOOD_SUMMARY = {
    "digest": "sha256:" + "ab" * 32,
    "format": "jsonl",
    "shard_count": 3,
    "total_rows": 30,
    "total_bytes": 900,
    "largest_shard": {"path": "part-1.jsonl", "size": 400},
}


def test_a_summary_answer_is_what_the_operator_pins() -> None:
    summary = resolve_child.Summary.from_json(GOOD_SUMMARY)
    assert summary == resolve_child.Summary(
        "sha256:" + "ab" * 32, "jsonl", 3, 30, 900, resolve_child.Shard("part-1.jsonl", 400)
    )
    assert resolve_child.Summary.from_json(summary.to_json()) == summary
    empty = resolve_child.Summary.from_json({**GOOD_SUMMARY, "largest_shard": None})
    assert empty.largest_shard is None


def test_a_summary_carries_the_handed_parts_in_base64_and_back() -> None:
    summary = resolve_child.Summary.from_json({**GOOD_SUMMARY, "handed": ["AAEC", "AwQ="]})
    assert summary.handed == (b"\x00\x01\x02", b"\x03\x04")
    assert resolve_child.Summary.from_json(summary.to_json()) == summary
    assert resolve_child.Summary.from_json(GOOD_SUMMARY).handed == ()  # an older child's


def test_a_summary_of_a_manifest_too_large_to_hand_carries_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, _ = datasets.write_local(tmp_path / "ds", [30, 20])
    manifest = manifests.resolve(uri)
    assert resolve_child.Summary.of(manifest, hand=True).handed == tuple(
        handed_manifests.encode(manifest) or ()
    )
    monkeypatch.setattr(handed_manifests, "PART_BYTES", 64)
    assert resolve_child.Summary.of(manifest, hand=True).handed == ()


@pytest.mark.parametrize(
    ("changed", "expected"),
    [
        ({"digest": "sha256:xyz"}, "expected a digest sha256:<64 hex digits>, found 'sha256:xyz'"),
        ({"handed": "AAEC"}, "expected handed a list of at most 4 parts, found 'AAEC'"),
        ({"handed": ["AA"] * 5}, "expected handed a list of at most 4 parts"),
        ({"handed": ["not base64!"]}, "expected each handed part base64 of 1 to 786432 bytes"),
        ({"handed": [""]}, "expected each handed part base64 of 1 to 786432 bytes, found ''"),
        ({"handed": [3]}, "expected each handed part base64 of 1 to 786432 bytes, found 3"),
        ({"format": ""}, "expected a format name, found ''"),
        ({"shard_count": -1}, "expected shard_count an integer >= 0, found -1"),
        ({"total_rows": True}, "expected total_rows an integer >= 0, found True"),
        ({"total_bytes": "900"}, "expected total_bytes an integer >= 0, found '900'"),
        ({"largest_shard": {"path": 3, "size": 1}}, "expected largest_shard a path and a size"),
        ({"largest_shard": [1]}, "expected largest_shard a path and a size, found [1]"),
    ],
)
def test_a_summary_that_is_not_one_is_refused_saying_what_was_expected(
    changed: dict[str, object], expected: str
) -> None:
    with pytest.raises(ValueError) as refused:
        resolve_child.Summary.from_json({**GOOD_SUMMARY, **changed})
    assert str(refused.value).startswith(expected)
