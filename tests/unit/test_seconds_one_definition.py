"""Seconds have one definition, the contract's (`parsers.seconds`): the operator's
intervals and timeouts use it rather than a copy of their own, and no parser the
contract exports takes `inf` or `nan` for a number (`NUMBER` did, unused)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from shardcache_operator import configuration

from shardcache import errors
from shardcache.contract import parsers

pytestmark = pytest.mark.unit

SECONDS_FIELDS = [
    f.name for f in dataclasses.fields(configuration.Settings) if f.name.endswith("_seconds")
]


@pytest.mark.parametrize("name", SECONDS_FIELDS)
def test_the_operators_seconds_are_the_contracts(name: str) -> None:
    parser = configuration.parser(name)
    if name == "startup_timeout_seconds":  # whole seconds: a probe's field is an integer
        assert parser.kind == "integer >= 1"
        return
    expected = parsers.seconds(zero="off") if name == "stall_check_seconds" else parsers.SECONDS
    # The same convert function as the contract's, not an equal-looking copy.
    assert parser.convert.__code__ is expected.convert.__code__, name
    assert parser.kind == expected.kind


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "Infinity", "-1"])
def test_the_operators_seconds_refuse_what_the_contract_refuses(text: str) -> None:
    with pytest.raises(errors.InputError) as refused:
        configuration.from_env({"SHARDCACHE_OPERATOR_SOURCE_CHECK_SECONDS": text})
    assert str(refused.value) == (
        f"$SHARDCACHE_OPERATOR_SOURCE_CHECK_SECONDS: expected finite seconds > 0, found {text}"
    )
    with pytest.raises(errors.InputError, match=r"expected finite seconds >= 0 \(0: off\)"):
        configuration.from_env({"SHARDCACHE_OPERATOR_STALL_CHECK_SECONDS": text})


def test_a_word_for_seconds_is_refused_naming_the_setting() -> None:
    with pytest.raises(errors.InputError) as refused:
        configuration.from_env({"SHARDCACHE_OPERATOR_PODS_INTERVAL_SECONDS": "soon"})
    assert str(refused.value) == (
        "$SHARDCACHE_OPERATOR_PODS_INTERVAL_SECONDS: expected seconds as a number, found 'soon'"
    )


def _exported_parsers() -> list[tuple[str, parsers.Parser[object]]]:
    return [(k, v) for k, v in vars(parsers).items() if isinstance(v, parsers.Parser)]


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "1e400"])
def test_no_contract_parser_takes_a_number_that_is_not_finite(text: str) -> None:
    for name, parser in _exported_parsers():
        try:
            value = parser("$X", text)
        except errors.InputError:
            continue
        assert not (isinstance(value, float) and not math.isfinite(value)), (name, value)
