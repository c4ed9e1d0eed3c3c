"""A trainer reading a multi-source DatasetMount (examples/datasetmount-mixture.yaml).

Run in a pod labelled `shardcache.io/mount: pretrain-mix`; the webhook injects the
sidecar, which serves every source. Resumes data and model together from the latest
checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import shardcache
from shardcache import checkpoint

rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
steps = 1_000
ckpt_root = Path(os.environ.get("SHARDCACHE_CHECKPOINT_DIR", "/checkpoints"))

mixed = shardcache.open_mixture(rank=rank, world_size=world, resume_from="latest")
for batch in mixed.batches(1024, columns=["tokens"], steps=steps - mixed.step):
    tokens = batch.column("tokens")  # the training step consumes them
    if mixed.step % 100 == 0:
        path = ckpt_root / f"step-{mixed.step}"
        path.mkdir(parents=True, exist_ok=True)  # write the model there, then:
        checkpoint.commit(path, step=mixed.step, data_state=mixed.state_dict())
print(mixed.snapshot())  # batches and rows per source
mixed.close()
