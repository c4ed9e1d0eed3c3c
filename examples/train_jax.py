"""A JAX trainer fed by shardcache: batches as numpy arrays, put on the devices ahead
of the step by `jax.device_put` (rank = jax.process_index())."""

import jax
import jax.numpy as jnp

import shardcache.jax

batches = shardcache.jax.Batches(
    "s3://bucket/tokens/", batch_size=16, columns=["tokens"], pack=2048, cache_dir="/tmp/shardcache"
)
feed = shardcache.jax.DevicePrefetcher(batches, sharding=jax.devices()[0], depth=2)
step = jax.jit(lambda tokens: jnp.mean(tokens.astype(jnp.float32)))
# Resume: feed.load_state_dict(state) here; the loop starts at the state's epoch.
for epoch in range(feed.epoch, 2):
    feed.set_epoch(epoch)
    for batch in feed:
        step(batch["tokens"])  # int32 [16, 2048], already on the device
        state = feed.state_dict()  # save with the model; feed.load_state_dict(state) resumes
