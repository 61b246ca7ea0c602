"""Local runtime: every role in this process, called directly. Deterministic, no services."""

from __future__ import annotations

from plait.plan import StepPlan
from plait.roles.constructor import Constructor, MicroBatch
from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader
from plait.spec import Spec


class LocalRuntime:
    def __init__(self, spec: Spec, *, dp: int | None = None):
        self.spec = spec
        self.loader = SourceLoader(spec)
        self.planner = Planner(spec, self.loader, dp=dp)
        self.constructor = Constructor(lambda source: self.loader)

    def plan(self) -> StepPlan:
        return self.planner.plan_step()

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        return self.constructor.build(plan.for_rank(dp_rank), only=only)

    def release(self, *in_flight: StepPlan) -> None:
        """Let the loader drop blocks that neither the Planner nor the given plans still need."""
        live = self.planner.live_blocks()
        for plan in in_flight:
            live.update(plan.items.block_keys()[0])
        self.loader.retain(live)

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)

    def error_report(self) -> dict:
        return self.loader.error_report()

    def close(self) -> None:
        self.loader.close()

    def planner_step(self) -> int:
        return self.planner.step
