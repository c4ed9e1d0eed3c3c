"""A stand-in trainer for docs/debugging.md: reads batches, "trains", commits a
checkpoint with its data state every --every steps, and resumes from the newest one.

    python examples/debugging/train.py file:///tmp/sc/source --steps 300 --every 50

Run it beside a checkpoint agent (`python -m shardcache_sidecar.checkpoint`, or the
sidecar in a pod) with $SHARDCACHE_CHECKPOINT_DIR set.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import shardcache
from shardcache import checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="the dataset URI")
    p.add_argument("--steps", type=int, required=True, help="train until this step")
    p.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--cache-dir", default=None, help="the embedded cache (default ~/.cache)")
    args = p.parse_args()
    root = Path(os.environ["SHARDCACHE_CHECKPOINT_DIR"])
    # The restored checkpoint (if any) gives the model, the step, and the data state.
    restored = checkpoint.restore()
    step = int((restored / "step.txt").read_text()) if restored is not None else 0
    ds = shardcache.open(args.data, cache_dir=args.cache_dir, seed=0, resume_from="latest")
    print(f"starting at step {step}: epoch {ds.epoch}, position {ds.position}, skips {ds.skips}")
    while step < args.steps:
        for _batch in ds.batches(args.batch_size):
            step += 1  # forward, backward, optimizer step
            if step % args.every == 0:
                path = root / f"step-{step}"
                path.mkdir()
                (path / "step.txt").write_text(str(step))  # and the model's state
                checkpoint.commit(path, step=step, data_state=ds.state_dict())
                checkpoint.wait(step, timeout=60)
            if step >= args.steps:
                break
        else:
            ds.set_epoch(ds.epoch + 1)
    print(f"stopped at step {step}: epoch {ds.epoch}, position {ds.position}")
    ds.close()


if __name__ == "__main__":
    main()
