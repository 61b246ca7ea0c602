"""Runtimes decide where the roles run: `local` (one process) or `ray` (actors)."""
