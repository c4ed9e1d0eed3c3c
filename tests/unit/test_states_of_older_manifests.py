"""A data state saved before manifest version 3 (per-shard sha256) carries the digest of
the dataset's version 2 manifest. The plan is seeded by the digest, so it cannot resume
exactly; it is refused as what it is, not as "another dataset or configuration"."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import shardcache
from shardcache import errors, manifests
from tests.support import datasets

pytestmark = pytest.mark.unit


def version_2_digest(root: Path, manifest: manifests.Manifest) -> str:
    """As shardcache computed it before manifest version 3 for local files, whose
    `version` was then "sha256:" and the sha256 of their bytes (hashed here, from disk)."""
    shards = [
        [
            s.path,
            s.size,
            "sha256:" + hashlib.sha256((root / s.path).read_bytes()).hexdigest(),
            s.rows,
            s.fingerprint,
        ]
        for s in manifest.shards
    ]
    canonical = json.dumps(
        {"version": 2, "format": manifest.format, "shards": shards},
        sort_keys=True,
        separators=(",", ":"),
    )
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def test_a_state_saved_before_manifest_version_3_is_refused_naming_the_manifest_version(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ds"
    uri, _ = datasets.write_local(root, [40, 40])
    with shardcache.open(uri, cache_dir=tmp_path / "cache", rank=0, world_size=2) as ds:
        next(ds.batches(8))
        state = ds.state_dict()
        old = {**state, "digest": version_2_digest(root, ds.manifest)}
        assert old["digest"] in manifests.version_2_digests(ds.manifest)
        before = (ds.epoch, ds.position)
        for given in (old, [old, {**old, "rank": 1, "position": 0}]):
            with pytest.raises(errors.StateMismatchError) as caught:
                ds.load_state_dict(given)
            message = str(caught.value)
            assert "this dataset's manifest of version 2" in message
            assert f"digest {old['digest']}" in message and ds.manifest.digest in message
            assert "another dataset" not in message
            assert "set_epoch(state['epoch'] + 1)" in message
        assert (ds.epoch, ds.position) == before
        # Another digest still reads as another dataset, naming the difference.
        with pytest.raises(errors.StateMismatchError, match="another dataset or configuration "
                           r"\(digest: state has 'sha256:0+'"):  # fmt: skip
            ds.load_state_dict({**state, "digest": "sha256:" + "0" * 64})
        ds.load_state_dict(state)
