"""Hot-swap recovery: plan (pure), then rebuild and restore (the hot-swap issue)."""
