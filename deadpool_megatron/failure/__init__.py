"""Failure layer: evidence of a failure, its classification, heartbeats and fault injection.

Everything here except `heartbeat.HeartbeatSender` is pure bookkeeping (no I/O, no threads,
no clocks of its own), so the rules that decide between a local reset and a hot-swap to a
spare are tested alone, table by table.
"""
