"""Local runtime: every role in this process, called directly. Deterministic, no services.

`LocalRoles` is the job's driver in this process (one Planner, one SourceLoader over every source, the
Constructor: plan, build, release). `LocalRuntime` reads one rank's stream from them through the job
service every runtime shares (plait.job.service.JobService: plan -> build -> serve), so a trainer's own
process serves itself exactly as `plait serve --runtime local` serves many.

Under torchrun with several processes on a node, plait.Loader shares one job per node instead
(plait.runtime.node_share: LOCAL_RANK 0 hosts it, the node's processes read from it over Flight)."""

from __future__ import annotations

import threading
from typing import Iterator

from plait.batch import MicroBatch
from plait.job.cp_builds import GroupBuilds
from plait.job.plan_stream import kept_blocks
from plait.job.service import JobService
from plait.job.stream import asked, read_rank
from plait.plan import StepPlan
from plait.roles.constructor import Constructor, LoaderPayloads
from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader
from plait.spec import Spec
from plait.telemetry import Stopwatch, Telemetry

ALL_RANKS_AHEAD = 2  # steps built ahead of each rank's request when one process reads every rank


class LocalRoles:
    """The job's driver in this process (plait.runtime.JobDriver). Options: `dp` (override the
    topology's DP size); `metrics_port` (serve Prometheus metrics there; default: the spec's
    `metrics.port`, off when unset)."""

    def __init__(self, spec: Spec, *, dp: int | None = None, metrics_port: int | None = None):
        self.spec = spec
        self.loader = SourceLoader(spec)
        self.planner = Planner(spec, self.loader, dp=dp)
        # set_weights / report come from the trainer's thread while builds run on the job service's threads,
        # and a shared job builds several ranks at once: the loader's blocks are touched under this lock
        # only (a gather's media decode after it is released: LoaderPayloads)
        self._lock = threading.Lock()
        self.constructor = Constructor(LoaderPayloads(lambda source: self.loader, lock=self._lock))
        self.groups = GroupBuilds()  # dynamic CP: each group micro-batch built once for its members here
        self.telemetry = Telemetry(spec.source_names)
        self.telemetry.watch_loader(self.loader.telemetry)
        port = metrics_port if metrics_port is not None else spec.metrics.port
        try:
            self.metrics_port = None if port is None else self.telemetry.serve(port, spec.metrics.address)
        except BaseException:  # a port in use: release the loader's threads before saying so
            self.loader.close()
            raise

    def plan(self) -> StepPlan:
        with Stopwatch() as t, self._lock:
            plan = self.planner.plan_step()
        self.telemetry.observe_plan(plan, t.seconds)
        return plan

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        """The rank's micro-batches of the step (those of `only`); with dynamic CP `dp_rank` is a pool
        rank and each micro-batch its shard of a group built once here for all members (job.cp_builds)."""
        rank = plan.for_rank(dp_rank)
        with Stopwatch() as t:
            if rank.cp is None:
                batches = self.constructor.build(rank, only=only)
            else:
                batches = self.groups.rank_batches(self.groups.plan_scope(plan), rank,
                                                   lambda waves: self.constructor.build(rank, only=waves), only)
        self.telemetry.observe_build(batches, t.seconds)
        return batches

    def release(self, *in_flight: StepPlan) -> None:
        """Let the loader drop blocks that neither the Planner nor the given plans still need; the plans'
        blocks and the carried chunks' are what the next steps draw from (the shared buffer budget's)."""
        with self._lock:
            live, drawn = kept_blocks(self.planner, in_flight)
            self.loader.retain(live | drawn, drawn)

    def state_dict(self) -> dict:
        return self.planner.state_dict()

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        with self._lock:
            return self.planner.load_state_dict(state, allow_spec_change=allow_spec_change)

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
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


class LocalRuntime:
    """One rank's stream (plait.runtime.RankStream) from the roles in this process, and their driver
    (plan / build / release: `plait run`, the benchmarks). Options: LocalRoles's `dp`, `metrics_port`;
    `all_ranks`, `build_ahead`, `build_threads` below.

    Every process plans the whole global step itself (cheap: metadata only) and builds only its own
    rank's micro-batches; all ranks compute the same plan, so they agree without talking. Nothing is
    built ahead here: the Loader's reader thread already reads ahead of the trainer.

    `all_ranks=True`: this one process reads every DP rank's stream (`iter_rank` of each rank, e.g. from a
    thread per rank: one process driving all of a machine's GPUs, a simulator). The job is then served as
    the node-shared data plane serves it (plait.runtime.node_share), without the sockets: each step planned
    once, a step's blocks kept until every rank has built it (each image decoded once per delivery), and
    each rank's micro-batches built `build_ahead` steps ahead (default 2) on `build_threads` threads
    (default plait.job.builds.default_threads), several ranks at once; the images of a build are decoded
    on the SourceLoader's `loading.workers` threads."""

    def __init__(self, spec: Spec, *, dp: int | None = None, metrics_port: int | None = None,
                 all_ranks: bool = False, build_ahead: int | None = None, build_threads: int | None = None):
        self.roles = LocalRoles(spec, dp=dp, metrics_port=metrics_port)
        self.spec, self.planner, self.loader = spec, self.roles.planner, self.roles.loader
        self.constructor, self.telemetry, self.metrics_port = (self.roles.constructor, self.roles.telemetry,
                                                               self.roles.metrics_port)
        self.driven: tuple[int, int] | None = None  # (generation, next step) of `plan`, the job's driver
        ahead = build_ahead if build_ahead is not None else (ALL_RANKS_AHEAD if all_ranks else 0)
        threads = build_threads if build_threads is not None else (None if all_ranks else 1)
        try:
            self.service = JobService(self.roles, build_ahead=ahead, threads=threads, every_rank_reads=all_ranks)
        except BaseException:
            self.roles.close()
            raise

    # ----- the job's driver (`plait run`): the job service's stream, as every runtime's -----------------------
    def plan(self) -> StepPlan:
        """The next step of the job's plan stream (from where the last `load_state_dict` put it)."""
        self.service.every_rank_reads = True  # the driver builds every rank of each step
        gen, base = self.service.base()
        if self.driven is None or self.driven[0] != gen:
            self.driven = (gen, int(base["step"]))
        gen, step = self.driven
        plan = self.service.stream.plan(gen, step)
        self.driven = (gen, step + 1)
        return plan

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        """Rank `dp_rank`'s micro-batches of a step `plan` returned (with dynamic CP a pool rank's), built
        once by the job service (`only`: those micro-batch indices)."""
        _, batches = self.service.get(self.service.gen, plan.step, dp_rank, with_state=False)  # uncut
        return [mb for mb in batches if only is None or mb.microbatch in only]

    def release(self, *in_flight: StepPlan) -> None:
        """Nothing to do: the job service releases a step's blocks once every rank built it."""

    # ----- the trainer's stream: through the job service --------------------------------------------------
    def iter_rank(self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None,
                  cp_rank: int = 0) -> Iterator[tuple[dict, MicroBatch]]:
        """One rank's micro-batches from a data state on: (state at the step's start, batch), each cut
        to CP rank `cp_rank`'s shard when the topology has context parallelism."""
        service, cp = self.service, (self.spec.topology.cp, cp_rank)
        gen = service.seek(start_state)

        def receive(step: int, _: int) -> tuple[dict, list[MicroBatch]]:
            return service.get(gen, step, dp_rank, max_steps, cp)

        return read_rank(asked, receive, int(start_state["step"]), start_micro, max_steps)

    def state_dict(self) -> dict:
        return self.roles.state_dict()

    def state_after(self, step: int) -> dict | None:
        """The data state after a recently iterated step (None when no longer known)."""
        return self.service.state_after(self.service.gen, step)

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> list[str]:
        if allow_spec_change:
            return self.service.seek_with_changes(state)[1]
        self.service.seek(state)
        return []

    def replan_after(self, state: dict, layout: dict) -> dict:
        return self.service.replan_after(state, layout)

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """This process's Planner. With DP > 1 every rank plans the whole step itself, so call it
        identically (same weights, same at_step) on every rank, as for `report`."""
        self.roles.set_weights(weights, at_step)

    def report(self, step: int, losses: dict[str, float]) -> None:
        self.roles.report(step, losses)

    def error_report(self) -> dict:
        return self.roles.error_report()

    def scaling_report(self) -> dict:
        return self.roles.scaling_report()

    def close(self) -> None:
        self.service.close()
