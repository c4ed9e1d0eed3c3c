"""The shardcache operator: DatasetMount reconcile and the pod-injection webhook."""
