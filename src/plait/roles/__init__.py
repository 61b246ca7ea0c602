"""The roles: Planner, SourceLoader, Constructor, Shadow, and the state each keeps for recovery."""
