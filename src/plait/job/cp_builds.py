"""Dynamic context parallelism on the build side: a pool rank's wave micro-batches, each its shard of a
group micro-batch built once per group in this process.

In `context_parallel.mode: dynamic` the Planner plans a step over the pool of dp x cp ranks in waves
(plait.plan.CPGroups): in each wave a pool rank belongs to exactly one group of k ranks, and the group's
micro-batch (whole documents, or pieces of one) is cut per member (plait.context_parallel.shard_for_group).
A trainer (dp_rank, cp_rank) reads pool rank p = cp_rank + cp * dp_rank: what it receives is already cut, so
the build cache keys dynamic builds by pool rank and serves them uncut (`served_rank`).

Where one process builds for several pool ranks (a node's shared job, `plait serve`, all ranks in one
process, a Ray Constructor serving a node) the members of a group share one build: the first member to
need a group claims it and builds every group it claimed in one Constructor call (one gather), the others
wait for it and cut their own shard. Each group is built once per process that serves one of its members.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from typing import Callable, Hashable

from plait.batch import MicroBatch
from plait.context_parallel import shard_for_group
from plait.plan import RankPlan

BuildWaves = Callable[[set[int]], list[MicroBatch]]  # the rank's micro-batches of these waves, in wave order


def is_dynamic(spec) -> bool:
    """Whether the spec plans context parallelism per document (`context_parallel.mode: dynamic`)."""
    section = getattr(spec, "context_parallel", None)
    return section is not None and getattr(section, "mode", "fixed") == "dynamic"


def build_ranks(spec, dp: int) -> int:
    """Builds of a step (one per rank that reads a build): the DP ranks, or in dynamic mode the pool's ranks."""
    return dp * spec.topology.cp if is_dynamic(spec) else dp


def served_rank(dynamic: bool, dp_rank: int, cp: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """The build a trainer (dp_rank, CP rank cp[1] of cp[0]) reads and the cut it still needs: its DP rank's
    build cut to its CP shard, or in dynamic mode its pool rank's build, cut already."""
    if not dynamic:
        return dp_rank, cp
    return cp[1] + cp[0] * dp_rank, (1, 0)


class GroupBuilds:
    """Group micro-batches of dynamic-CP steps, shared by the pool ranks this process builds for. A group is
    dropped once all its members cut it, or with its step's plan (`plan_scope`, `drop`): where only one
    pool rank reads, the plan window bounds what is kept. `builds`: groups built here."""

    def __init__(self):
        self.lock = threading.RLock()  # reentrant: a plan's finalizer (`plan_scope`) may run in a thread holding it
        self.groups: dict[tuple[Hashable, int], Future] = {}  # (scope, group id) -> the group micro-batch
        self.cuts: dict[tuple[Hashable, int], int] = {}  # members that cut it so far
        self.scopes: set[int] = set()
        self.builds = 0

    def plan_scope(self, plan: object) -> int:
        """The scope of a live plan object's groups: they are forgotten with it (before its id can name
        another plan)."""
        scope = id(plan)
        with self.lock:
            if scope not in self.scopes:
                self.scopes.add(scope)
                weakref.finalize(plan, self._forget_scope, scope)
        return scope

    def _forget_scope(self, scope: int) -> None:
        self.drop(lambda s: s != scope)
        with self.lock:
            self.scopes.discard(scope)

    def rank_batches(self, scope: Hashable, plan: RankPlan, build: BuildWaves,
                     waves: set[int] | None = None) -> list[MicroBatch]:
        """Pool rank `plan.dp_rank`'s shards of the step's waves (or of `waves`), in wave order. `scope`
        names the step's plan (a group id is only unique within it); `build(waves)` builds the rank's
        micro-batches of those waves (plait.roles.constructor.Constructor.build with `only`)."""
        wanted = [w for w in range(plan.microbatches) if waves is None or w in waves]
        futures, claimed = {}, []
        with self.lock:
            for w in wanted:
                key = (scope, int(plan.cp[w]["group_id"]))
                fut = self.groups.get(key)
                if fut is None:
                    fut = self.groups[key] = Future()
                    claimed.append(w)
                    self.builds += 1
                futures[w] = fut
        if claimed:
            self._build_claimed(scope, plan, build, claimed, futures)
        out = []
        for w in wanted:  # a member's groups claimed by another build: that build is running, never waiting
            info = plan.cp[w]
            shard = shard_for_group(futures[w].result(), info["size"], info["rank"], group=info["group"],
                                    group_id=info["group_id"])
            shard.dp_rank = plan.dp_rank  # whoever built the group, the shard names the rank it is for
            out.append(shard)
            self._cut((scope, int(info["group_id"])), info["size"])
        return out

    def _build_claimed(self, scope: Hashable, plan: RankPlan, build: BuildWaves, claimed: list[int],
                       futures: dict[int, Future]) -> None:
        try:
            built = build(set(claimed))
        except BaseException as e:  # the members waiting get the error; asked again, the group is built again
            with self.lock:
                for w in claimed:
                    self.groups.pop((scope, int(plan.cp[w]["group_id"])), None)
            for w in claimed:
                futures[w].set_exception(e)
            raise
        for w, mb in zip(claimed, built):
            futures[w].set_result(mb)

    def _cut(self, key: tuple[Hashable, int], size: int) -> None:
        with self.lock:
            done = self.cuts.get(key, 0) + 1
            if done >= size:
                self.groups.pop(key, None)
                self.cuts.pop(key, None)
            else:
                self.cuts[key] = done

    def drop(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget the groups of every scope `keep` refuses (steps no longer planned, an old generation)."""
        with self.lock:
            for key in [key for key in self.groups if not keep(key[0])]:
                self.groups.pop(key, None)
                self.cuts.pop(key, None)
