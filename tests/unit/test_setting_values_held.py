"""Values every setting is held to, whichever process reads them: a mixture source's
URI is a URI like every other, seconds are finite, and an integer out of range is told
the whole range. Each refusal names the setting, what was expected and what was found."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardcache import errors
from shardcache.contract import mixture_sources, parsers, variables

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _mixture(second_uri: str) -> str:
    return json.dumps(
        {
            "version": mixture_sources.FORMAT_VERSION,
            "seed": 0,
            "sources": [
                {"name": "web", "weight": 1, "uri": "s3://b/web/"},
                {"name": "code", "weight": 1, "uri": second_uri},
            ],
        }
    )


@pytest.mark.parametrize(
    ("uri", "found"),
    [
        ("bucket/code", "found 'bucket/code'"),
        ("/data/code", "found '/data/code', a local path: write it file:///data/code"),
        ("s3//b/code", "the scheme is not followed by '://'"),
        ("", "found ''"),
    ],
)
def test_a_mixture_source_uri_without_a_scheme_is_refused_naming_the_source(
    uri: str, found: str
) -> None:
    with pytest.raises(errors.InputError) as info:
        variables.MIXTURE.parse(_mixture(uri))
    message = str(info.value)
    assert message.startswith("$SHARDCACHE_MIXTURE: "), message
    assert "mixture source 'code': uri: expected a URI" in message, message
    assert found in message, message


def test_a_mixture_of_proper_uris_is_taken() -> None:
    mixture = variables.MIXTURE.parse(_mixture("file:///data/code"))
    assert mixture is not None
    assert [s.uri for s in mixture.sources] == ["s3://b/web/", "file:///data/code"]


@pytest.mark.parametrize("text", ["inf", "-inf", "Infinity", "nan", "1e999"])
def test_non_finite_seconds_are_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(errors.InputError) as info:
        variables.RECONNECT_TIMEOUT.parse(text)
    assert str(info.value) == (
        f"${variables.RECONNECT_TIMEOUT.env}: expected finite seconds > 0, found {text}"
    )


def test_finite_seconds_are_taken() -> None:
    assert parsers.SECONDS("$X", "0.25") == 0.25
    assert parsers.SECONDS("$X", "1e6") == 1e6


@pytest.mark.parametrize("text", ["-1", "65536"])
def test_an_integer_out_of_range_is_told_the_whole_range(text: str) -> None:
    port = parsers.integer(minimum=0, maximum=65535)
    with pytest.raises(errors.InputError) as info:
        port("--port", text)
    assert str(info.value) == f"--port: expected an integer 0-65535, found {text}"


def test_an_integer_with_one_bound_is_told_that_bound() -> None:
    with pytest.raises(errors.InputError, match=r"^\$N: expected an integer >= 1, found 0$"):
        parsers.integer(minimum=1)("$N", "0")


def test_the_wire_format_states_the_uri_form_it_carries() -> None:
    text = (ROOT / "docs" / "wire-format.md").read_text(encoding="utf-8")
    conventions = text[text.index("## Environment") : text.index("## Routes")]
    assert f"`{parsers.URI_PATTERN}`" in conventions
    assert re.search(r"`file:///absolute/path`", conventions)
    assert str(parsers.MAX_URI_LENGTH) in conventions
