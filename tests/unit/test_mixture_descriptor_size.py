"""A `mixture.json` larger than any descriptor a sidecar writes is refused before it
is read: an InputError naming the limit and the size found, never a read of the whole
file into the trainer's memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardcache import _open_mixture, contract, errors
from shardcache.contract import mixture_sources

pytestmark = pytest.mark.unit

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


def test_a_descriptor_larger_than_the_cap_is_refused_naming_the_limit_and_the_size(
    tmp_path: Path,
) -> None:
    cap = mixture_sources.MAX_DESCRIPTOR_BYTES
    # Valid JSON, shallow: only its size is wrong.
    text = json.dumps(GOOD) + " " * (2 * cap)
    env = _mount(tmp_path, text)
    with pytest.raises(errors.InputError) as caught:
        _open_mixture.descriptor(environ=env)
    message = str(caught.value)
    assert f"at most {cap} bytes" in message
    assert f"found {len(text.encode())} bytes" in message
    assert mixture_sources.DESCRIPTOR_NAME in message


def test_a_descriptor_padded_up_to_the_cap_is_read(tmp_path: Path) -> None:
    text = json.dumps(GOOD)
    text += " " * (mixture_sources.MAX_DESCRIPTOR_BYTES - len(text))
    mixture, _ = _open_mixture.descriptor(environ=_mount(tmp_path, text))
    assert [s.name for s in mixture.sources] == ["a", "b"]


def test_the_cap_holds_the_largest_legitimate_descriptor() -> None:
    # spec.source and the 15 sources spec.mixture.sources allows, with URIs of the longest allowed (2048 characters).
    sources = tuple(
        mixture_sources.Source(
            name=f"s{i}",
            weight=1.0,
            uri="s3://bucket/" + "p" * 2000 + "/",
            digest="sha256:" + "0" * 64,
        )
        for i in range(16)
    )
    largest = str(mixture_sources.Mixture(sources=sources, seed=2**63))
    assert len(largest.encode()) * 10 < mixture_sources.MAX_DESCRIPTOR_BYTES
