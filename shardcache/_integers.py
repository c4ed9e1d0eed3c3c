"""The one check of the reading API's integer arguments: `set_epoch(epoch)`,
`batches(batch_size)`, `batch_pieces(stride=)`, `skip_batches`, `Mixture.batches(steps=)`
and the plan's parameters (`plans.PlanParams`), so every entry point takes and refuses
the same values with the same words.

Taken: Python ints and numpy integers (an epoch from `np.arange`, a batch size computed
with numpy), made plain ints with `operator.index`: a state dict built from them must
stay JSON and load again, which a numpy integer in it breaks. Refused, naming the
argument: bool (`batches(True)` is a mistake, not a batch of one), floats even when
whole (`2.0` came from arithmetic whose rounding is the caller's to own; `1.5` would
plan an epoch that does not exist) and strings (a config value not parsed yet).
"""

from __future__ import annotations

import operator
from typing import SupportsIndex, cast

from shardcache import errors


def integer(value: object, name: str, *, minimum: int | None = None) -> int:
    """`value` as a plain int, or InputError naming `name`, what was expected and what
    was found."""
    number: int | None = None
    if type(value) is int:
        number = value
    elif not isinstance(value, bool):
        try:
            number = operator.index(cast(SupportsIndex, value))
        except TypeError:  # a float, a str, numpy.bool_ (which has the method, and refuses)
            number = None
    if number is None:
        raise errors.InputError(
            f"{name}: expected {_expected(minimum)}, found {type(value).__name__} {value!r}"
        )
    if minimum is not None and number < minimum:
        raise errors.InputError(f"{name}: expected {_expected(minimum)}, found {number}")
    return number


def _expected(minimum: int | None) -> str:
    return "an int" if minimum is None else f"an int >= {minimum}"
