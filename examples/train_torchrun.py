"""A torchrun trainer fed by shardcache: `torchrun --nproc-per-node 8 examples/train_torchrun.py`.

Rank and world size come from torchrun's environment; each rank's batches land on its
GPU (LOCAL_RANK) without a CPU copy; the data state is saved with the model's.
In a pod with an injected sidecar, drop the URI: `IterableDataset(batch_size=...)`.
"""

import torch

import shardcache.torch

ds = shardcache.torch.IterableDataset(
    "s3://bucket/tokens/", batch_size=16, columns=["tokens"], pack=2048, cache_dir="/tmp/shardcache"
)
batches = shardcache.torch.DevicePrefetcher(
    ds, depth=2
)  # or a (Stateful)DataLoader(ds, batch_size=None)
model = torch.nn.Embedding(50_000, 64).to(batches.device)
# Resume: batches.load_state_dict(torch.load("/tmp/ckpt.pt")["data"]) here; the loop then
# starts at the state's epoch (an earlier one would read its samples again, and is refused).
for epoch in range(batches.epoch, 2):
    batches.set_epoch(epoch)
    for step, batch in enumerate(batches):
        loss = model(batch["tokens"].long()).float().pow(2).mean()  # [16, 2048] on this rank's GPU
        loss.backward()
        if step % 1000 == 0:
            torch.save({"model": model.state_dict(), "data": batches.state_dict()}, "/tmp/ckpt.pt")
