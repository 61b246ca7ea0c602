"""Runtimes decide where the roles run: `local` (one process) or `ray` (actors).

Every runtime offers the same methods, used by the Client (`iter_rank`) and by whole-job drivers such
as `plait run` and the benchmarks (`plan` / `build` / `release`):

  iter_rank(dp_rank, start_state, start_micro, max_steps) -> iterator of (state_before, MicroBatch)
  plan() -> StepPlan                       next global step (advances the Planner)
  build(plan, dp_rank, only=None) -> [MicroBatch]
  release(*in_flight_plans)                let loaders drop blocks no one needs any more
  state_dict() / load_state_dict(state)    the data state (the Planner's)
  error_report() -> {source: {"skipped": n, "messages": [...]}}
  close()
"""
