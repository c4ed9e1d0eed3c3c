"""The shardcache sidecar: control server, prefetcher, node cache, checkpoint agent."""
