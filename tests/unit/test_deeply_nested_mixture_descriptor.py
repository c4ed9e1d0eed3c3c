"""A mixture descriptor nested past its 3 levels is bad input, never RecursionError.

`json.loads` recurses once per level: a `mixture.json` (or `$SHARDCACHE_MIXTURE`) of a
few thousand "[" raised RecursionError out of `shardcache.open_mixture()` and the
sidecar's settings, and `Mixture.from_json` given an object that contains itself
recursed in its repr. Each is an `InputError` that names the depth expected.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import shardcache
from shardcache import contract, errors
from shardcache.contract import mixture_sources, variables

pytestmark = pytest.mark.unit

DEEP = 100_000
GOOD = {
    "version": 1,
    "seed": 3,
    "sources": [
        {"name": "a", "weight": 1.0, "uri": "s3://b/a/"},
        {"name": "b", "weight": 2.0, "uri": "s3://b/b/"},
    ],
}


def _mount(tmp_path: Path, text: str) -> dict[str, str]:
    mount_dir = contract.mount_dir(tmp_path, "mix")
    mount_dir.mkdir(parents=True)
    (mount_dir / mixture_sources.DESCRIPTOR_NAME).write_text(text)
    return {contract.ENV_RUN_DIR: str(tmp_path), contract.ENV_MOUNT: "mix"}


@pytest.mark.parametrize(
    "text",
    ["[" * DEEP + "]" * DEEP, '{"version": 1, "sources": ' + "[" * DEEP + "]" * DEEP + "}"],
    ids=["bare", "inside"],
)
def test_open_mixture_refuses_a_deeply_nested_descriptor_file_naming_the_depth(
    tmp_path: Path, text: str
) -> None:
    with pytest.raises(errors.InputError, match="expected a mixture descriptor nested at most 3"):
        shardcache.open_mixture(environ=_mount(tmp_path, text))


def test_a_descriptor_file_nested_a_little_too_deep_says_how_deep(tmp_path: Path) -> None:
    deeper = dict(GOOD, seed=[[[1]]])
    with pytest.raises(errors.InputError, match="at most 3 deep, found one nested 4 deep"):
        shardcache.open_mixture(environ=_mount(tmp_path, json.dumps(deeper)))


def test_the_mixture_variable_refuses_a_deeply_nested_value_naming_the_depth() -> None:
    env = {variables.MIXTURE.env: "[" * DEEP + "]" * DEEP}
    with pytest.raises(errors.InputError, match=r"\$SHARDCACHE_MIXTURE: .*nested at most 3 deep"):
        variables.MIXTURE.get(env)
    with pytest.raises(errors.InputError, match="nested at most 3 deep"):
        mixture_sources.Mixture.parse("[" * DEEP)


def test_from_json_refuses_a_descriptor_that_contains_itself() -> None:
    looped: dict[str, Any] = dict(GOOD)
    looped["sources"] = [dict(s) for s in GOOD["sources"]]  # type: ignore[attr-defined]
    looped["sources"][0]["format"] = looped
    with pytest.raises(errors.InputError, match="nested deeper \\(or containing itself\\)"):
        mixture_sources.Mixture.from_json(looped)
    itself: list[Any] = []
    itself.append(itself)
    with pytest.raises(errors.InputError, match="nested at most 3 deep"):
        mixture_sources.Mixture.from_json({"version": 1, "sources": itself})


def test_from_json_refuses_a_deep_value_before_showing_it() -> None:
    value: Any = 1
    for _ in range(DEEP):
        value = [value]
    with pytest.raises(errors.InputError, match="nested at most 3 deep"):
        mixture_sources.Mixture.from_json({"version": value})


def test_a_descriptor_as_written_still_reads_back(tmp_path: Path) -> None:
    mixture = mixture_sources.Mixture.from_json(GOOD)
    assert mixture_sources.Mixture.parse(str(mixture)) == mixture
    assert mixture_sources.Mixture.from_json(json.loads(json.dumps(mixture.to_json()))) == mixture
