"""A resolve child's error answer read back in the operator (`resolve_child.error_answer`
→ `resolve_children.raised`): the kinds the reconcile tells apart keep their class."""

from __future__ import annotations

import pyarrow as pa
import pytest
from shardcache_operator import reconcile, resolve_child, resolve_children

from shardcache import errors


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
