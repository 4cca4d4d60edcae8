"""In-memory checkpointing: host snapshots and optimizer-shard replicas on the DP ring."""
