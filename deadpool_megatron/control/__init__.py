"""Coordination: the job's store, spares."""
