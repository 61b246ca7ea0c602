"""The data state: what fully defines the rest of a job's stream, apart from the roles that act on it.

  schema.py       the state's typed schema, validation and checksum (what a resume accepts)
  log.py          per-step diffs and the log that rebuilds a lost Planner from them
  deltas.py       a SourceLoader's differential checkpoints, for its Shadow
  spec_change.py  what a resume under a changed spec carries over, parks or refuses
  overrides.py    the mixture weights while a job runs: schedule, run-time overrides, online policy
"""
