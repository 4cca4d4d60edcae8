"""Coordination: the job's store (TCPStore or etcd), its keys and typed records, the job
context that owns the generation, membership, the agent's monitor and chaos, the workers'
client for heartbeats and reports."""
