"""deadpool-launch's agent: the process on each node that starts the job's workers and spares,
hosts the job's store, watches its processes, and acts on failures (hot-swap, checkpoint-
restart, or a clean end)."""
