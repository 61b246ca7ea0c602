"""Local runtime: every role in this process, called directly. Deterministic, no services."""

from __future__ import annotations

from typing import Iterator

from plait.plan import StepPlan
from plait.batch import MicroBatch
from plait.context_parallel import shard_for_rank
from plait.roles.constructor import Constructor, LoaderPayloads
from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader
from plait.spec import Spec


class LocalRuntime:
    def __init__(self, spec: Spec, *, dp: int | None = None):
        self.spec = spec
        self.loader = SourceLoader(spec)
        self.planner = Planner(spec, self.loader, dp=dp)
        self.constructor = Constructor(LoaderPayloads(lambda source: self.loader))

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

    def iter_rank(
        self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None, cp_rank: int = 0
    ) -> Iterator[tuple[dict, MicroBatch]]:
        """One rank's micro-batches from a data state on: (state at the step's start, batch), each cut
        to CP rank `cp_rank`'s shard when the topology has context parallelism.

        Locally every rank plans the whole global step itself (cheap: metadata only) and builds only
        its own micro-batches; all ranks compute the same plan, so they agree without talking.
        """
        cp = self.spec.topology.cp
        self.load_state_dict(start_state)
        skip = start_micro
        while max_steps is None or self.planner.step < max_steps:
            plan = self.plan()
            wanted = None if skip == 0 else set(range(skip, plan.microbatches))
            skip = 0
            for mb in shard_for_rank(self.build(plan, dp_rank, only=wanted), cp, cp_rank):
                yield plan.state_before, mb
            self.release()

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.planner.load_state_dict(state)

    def error_report(self) -> dict:
        return self.loader.error_report()

    def close(self) -> None:
        self.loader.close()
