"""`shardcache.jax.DevicePrefetcher` moved between two batches of an open pass
(`set_epoch`, `load_state_dict`): the next batch handed over is the new place's first,
not one of the `depth` batches placed ahead of the old place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from tests.support import datasets, torch_datasets

pytestmark = pytest.mark.integration

# In a process of its own: JAX starts threads (as in test_torch_adapter.py).
JAX_MOVES = """
import json, sys
import jax
import numpy as np
import shardcache.jax

uri, cache = sys.argv[1:3]
kw = {"cache_dir": cache, "block_size": 5, "batch_size": 4, "columns": ["uid"]}
def uids(batch):
    return np.asarray(batch["uid"]).tolist()
with shardcache.jax.Batches(uri, **kw) as plain:
    epoch0 = [b["uid"].tolist() for b in plain]
with shardcache.jax.Batches(uri, **kw) as plain:
    plain.set_epoch(1)
    epoch1 = [b["uid"].tolist() for b in plain]
assert epoch0 != epoch1
out = {}
with shardcache.jax.Batches(uri, **kw) as batches:
    prefetcher = shardcache.jax.DevicePrefetcher(batches, depth=3)
    it = iter(prefetcher)
    head = [uids(next(it)) for _ in range(2)]
    prefetcher.set_epoch(1)
    # Its state before the next batch: epoch 1's start, not the old epoch's batches.
    out["state_after_set_epoch"] = prefetcher.state_dict()["dataset"]
    got = [uids(next(it)) for _ in range(2)]
    state = json.loads(json.dumps(prefetcher.state_dict()))
    rest = [uids(b) for b in it]
out["head_ok"] = head == epoch0[:2]
out["moved"] = got + rest == epoch1
out["first_after_move"] = got[0]
out["epoch1_first"] = epoch1[0]
with shardcache.jax.Batches(uri, **kw) as again:
    resumed = shardcache.jax.DevicePrefetcher(again, depth=3)
    resumed.load_state_dict(state)
    out["resumed"] = [uids(b) for b in resumed] == rest
# Moved while the pass drains its last batches placed ahead (the reader under it has
# ended): the new epoch is read from its start all the same.
with shardcache.jax.Batches(uri, **kw) as batches:
    prefetcher = shardcache.jax.DevicePrefetcher(batches, depth=3)
    it = iter(prefetcher)
    head = [uids(next(it)) for _ in range(len(epoch0) - 2)]
    prefetcher.set_epoch(1)
    out["moved_at_the_end"] = [uids(b) for b in it] == epoch1
# load_state_dict between two batches: the state's next batch comes next.
with shardcache.jax.Batches(uri, **kw) as batches:
    prefetcher = shardcache.jax.DevicePrefetcher(batches, depth=3)
    it = iter(prefetcher)
    [next(it) for _ in range(3)]
    prefetcher.load_state_dict(state)
    out["loaded"] = [uids(b) for b in it] == rest
# The epoch being read already is no move: nothing is dropped.
with shardcache.jax.Batches(uri, **kw) as batches:
    prefetcher = shardcache.jax.DevicePrefetcher(batches, depth=3)
    it = iter(prefetcher)
    head = [uids(next(it)) for _ in range(2)]
    prefetcher.set_epoch(0)
    out["same_epoch"] = head + [uids(b) for b in it] == epoch0
print(json.dumps(out))
"""


def test_jax_prefetcher_set_epoch_mid_pass_hands_over_the_new_epochs_first_batch_next(
    tmp_path: Path,
) -> None:
    uri = str(tmp_path / "ds")
    datasets.write_dataset(pafs.LocalFileSystem(), uri, torch_datasets.SHARDS)
    out = subprocess.run(
        [sys.executable, "-c", JAX_MOVES, uri, str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["first_after_move"] == result["epoch1_first"]
    assert result["state_after_set_epoch"]["epoch"] == 1
    assert result["state_after_set_epoch"]["position"] == 0
    assert result == {
        **result,
        "head_ok": True,
        "moved": True,
        "resumed": True,
        "moved_at_the_end": True,
        "loaded": True,
        "same_epoch": True,
    }
