"""`shardcache.open_mixture()` before any sidecar is reached: options and the descriptor."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardcache
from shardcache import contract, errors
from shardcache.contract import mixture_sources

pytestmark = pytest.mark.unit


def test_a_wrong_option_is_refused_before_the_sidecar_is_looked_for() -> None:
    with pytest.raises(
        errors.InputError, match=r"open_mixture\(\): shuffle: expected True, False, \"block\" or"
    ):
        shardcache.open_mixture(shuffle="rows", environ={})
    with pytest.raises(errors.InputError, match="mix_seed: expected an int"):
        shardcache.open_mixture(mix_seed="7", environ={})  # type: ignore[arg-type]


def test_without_a_mount_it_says_what_it_expected() -> None:
    with pytest.raises(errors.InputError, match=r"expected a mount name or \$SHARDCACHE_MOUNT"):
        shardcache.open_mixture(environ={})


def test_a_malformed_descriptor_is_refused_naming_it(tmp_path: Path) -> None:
    mount_dir = contract.mount_dir(tmp_path, "mix")
    mount_dir.mkdir(parents=True)
    (mount_dir / mixture_sources.DESCRIPTOR_NAME).write_text('{"version": 1, "sources": []}')
    env = {contract.ENV_RUN_DIR: str(tmp_path), contract.ENV_MOUNT: "mix"}
    with pytest.raises(errors.InputError, match="a mixture needs at least two sources, found 0"):
        shardcache.open_mixture(environ=env)


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([("a", 1.0), ("a", 1.0)], "names must differ"),
        ([("a", 0.0), ("b", 0.0)], "some source with a weight > 0"),
        ([("a", 1.0), ("B_", 1.0)], "expected a DNS label"),
        ([("a", 1.0), ("b\n", 1.0)], "expected a DNS label"),
        ([("a", 1.0), ("b", -1.0)], "expected a weight >= 0"),
    ],
)
def test_the_sources_a_sidecar_is_given_are_checked(
    sources: list[tuple[str, float]], message: str
) -> None:
    with pytest.raises(errors.InputError, match=message):
        mixture_sources.Mixture(
            tuple(mixture_sources.Source(n, w, f"s3://b/{n}/") for n, w in sources)
        )


def test_the_sources_survive_the_environment_as_json() -> None:
    mixture = mixture_sources.Mixture(
        (
            mixture_sources.Source("web", 3.0, "s3://b/web/", "parquet", "sha256:" + "a" * 64),
            mixture_sources.Source("code", 1.0, "s3://b/code/"),
        ),
        seed=4,
    )
    assert mixture_sources.Mixture.parse(str(mixture)) == mixture
