"""Local runtime: every role in this process, called directly. Deterministic, no services.

Under torchrun with several processes on a node, plait.Loader shares one of these per node instead
(plait.runtime.node_share: LOCAL_RANK 0 hosts it, the node's processes read from it over Flight)."""

from __future__ import annotations

import threading
from typing import Iterator

from plait.plan import StepPlan
from plait.batch import MicroBatch
from plait.context_parallel import shard_for_rank
from plait.job.builds import GuardedPayloads
from plait.roles.constructor import Constructor, LoaderPayloads
from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader
from plait.spec import Spec
from plait.telemetry import Stopwatch, Telemetry


class LocalRuntime:
    """Options: `dp` (override the topology's DP size); `metrics_port` (serve Prometheus metrics there;
    default: the spec's `metrics.port`, off when unset)."""

    def __init__(self, spec: Spec, *, dp: int | None = None, metrics_port: int | None = None):
        self.spec = spec
        self.loader = SourceLoader(spec)
        self.planner = Planner(spec, self.loader, dp=dp)
        # set_weights / report come from the trainer's thread while prefetch plans in another, and a shared
        # job (plait.job.service) builds several ranks at once: the loader is touched under this lock only
        self._lock = threading.Lock()
        self.constructor = Constructor(GuardedPayloads(LoaderPayloads(lambda source: self.loader), self._lock))
        self.telemetry = Telemetry(spec.source_names)
        self.telemetry.watch_loader(self.loader.telemetry)
        port = metrics_port if metrics_port is not None else spec.metrics.port
        try:
            self.metrics_port = None if port is None else self.telemetry.serve(port, spec.metrics.address)
        except BaseException:  # a port in use: release the loader's threads before saying so
            self.loader.close()
            raise
        self._after: dict[int, dict] = {}  # step -> data state after it (the last few iterated)

    def plan(self) -> StepPlan:
        with Stopwatch() as t, self._lock:
            plan = self.planner.plan_step()
        self.telemetry.observe_plan(plan, t.seconds)
        return plan

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        with Stopwatch() as t:
            batches = self.constructor.build(plan.for_rank(dp_rank), only=only)
        self.telemetry.observe_build(batches, t.seconds)
        return batches

    def release(self, *in_flight: StepPlan) -> None:
        """Let the loader drop blocks that neither the Planner nor the given plans still need."""
        with self._lock:
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
            self._after[plan.step] = self.planner.state_dict()
            self._after.pop(plan.step - 8, None)
            wanted = None if skip == 0 else set(range(skip, plan.microbatches))
            skip = 0
            for mb in shard_for_rank(self.build(plan, dp_rank, only=wanted), cp, cp_rank):
                yield plan.state_before, mb
            self.release()

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def state_after(self, step: int) -> dict | None:
        """The data state after a recently iterated step (None when no longer known)."""
        return self._after.get(step)

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        with self._lock:
            return self.planner.load_state_dict(state, allow_spec_change=allow_spec_change)

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """Local: this process's Planner. With DP > 1 every rank plans the whole step itself, so call it
        identically (same weights, same at_step) on every rank, as for `report`."""
        with self._lock:
            self.planner.set_weights(weights, at_step)

    def report(self, step: int, losses: dict[str, float]) -> None:
        with self._lock:
            self.planner.report(step, losses)

    def error_report(self) -> dict:
        return self.loader.error_report()

    def scaling_report(self) -> dict:
        """One process, one loader: nothing is ever re-partitioned."""
        return {"events": [], "timeline": [], "options": None}

    def close(self) -> None:
        self.loader.close()
