"""The Planner's dynamic context-parallel path (`context_parallel.mode: dynamic`, docs/long-context.md).

The step's documents are drawn as in fixed mode (the same budget: dp x microbatches x seq_len tokens =
pool x waves x slot); then, instead of whole documents onto DP replicas, plait.balance.cp_plan gives each
a CP degree by cost and places group micro-batches in waves over the pool of dp x cp ranks. The StepPlan
follows the contract of plait.plan (ranks = the pool, microbatches = the waves, capacity = a rank's slot
seq_len / cp, cp_groups and item_group). What does not fit waits in the carry, first in the next step.

Chunks. A document is cut into chunks of at most max_degree x slot tokens (the largest group's micro-batch;
at least seq_len, so chunk numbers stay unique: packing_phases.py) instead of seq_len, unless its source
sets max_chunk. Documents with media stay on one rank (chunks of at most a slot, degree 1, never filled
into a group): a shard would cut a placeholder run, or every member would run the encoder over the
group's media while the plan charged it 1/k.

The plan is a pure function of the data state and the layout: exact resume replays it, and a resume on
another dp plans the carried and new documents over the new pool (every document once).
"""

from __future__ import annotations

import numpy as np

from plait.balance.cp_degrees import CommTable, CPLayout
from plait.balance.cp_plan import plan_dynamic_cp
from plait.cost import CommCost, CostModel
from plait.plan import CPGroups, Items, StepPlan
from plait.planning.step_costs import Encoders
from plait.spec import Spec


class DynamicCP:
    """Per job: the pool, the vocabulary, the cost and traffic models; per step: the plan."""

    def __init__(self, spec: Spec, dp: int):
        self.spec = spec
        self.cp = spec.topology.cp
        self.pool = dp * self.cp
        section = spec.context_parallel
        self.cap = section.degree_cap(self.pool)
        self.theta, self.pow2 = section.theta, section.groups == "pow2"
        self.model = CostModel.from_spec(spec.cost)
        self.encoders = Encoders(spec)
        self.comm = comm_table(CommCost.from_spec(spec.cost), self.cap)

    def layout(self, seq_len: int, microbatches: int) -> CPLayout:
        return CPLayout(self.pool, seq_len // self.cp, microbatches, self.cap, self.theta, self.pow2)

    def chunk_limits(self, seq_len: int) -> np.ndarray:
        """Longest chunk per source: max_chunk where set, else the largest group's micro-batch; a media
        source's chunks fit one rank's slot (its documents are never sharded over a group: a shard would cut
        a placeholder run, or every member would run the encoder over the group's media)."""
        longest, slot = self.cap * (seq_len // self.cp), seq_len // self.cp
        limits = [min(s.max_chunk or slot, slot) if s.multimodal else min(s.max_chunk or longest, longest)
                  for s in self.spec.sources]
        return np.array(limits, dtype=np.int64)

    def costs(self, items: Items) -> np.ndarray:
        """Each item's whole cost (a group of k members carries it / k): LLM plus its media's encoders."""
        return self.model(items.length) + self.encoders.of(items)

    def plan(self, step: int, items: Items, priority: np.ndarray, seq_len: int, microbatches: int):
        """(the StepPlan's fields for the placed items, the items left for the carry)."""
        layout = self.layout(seq_len, microbatches)
        costs = self.costs(items)
        result = plan_dynamic_cp(items.length, costs, layout, self.comm, priority=priority,
                                 minimal=items.media)
        a = result.assignment
        placed = np.flatnonzero(a.item_group >= 0)
        placed = placed[np.argsort(a.item_group[placed], kind="stable")]  # group by group, drawn order inside
        group = a.item_group[placed]
        fields = dict(
            step=step, ranks=self.pool, microbatches=a.waves, capacity=layout.slot, items=items.take(placed),
            cost=costs[placed], rank=a.first[group].astype(np.int32), micro=a.wave[group].astype(np.int32),
            rank_cost=a.rank_cost, micro_cost=a.micro_cost, micro_tokens=a.micro_tokens,
            lower_bound=result.lower_bound,
            cp_groups=CPGroups(wave=a.wave.astype(np.int32), first=a.first.astype(np.int32),
                               size=a.size.astype(np.int32), comm=a.comm),
            item_group=group,
        )
        return fields, items.take(np.flatnonzero(a.item_group < 0))

    def image_stats(self, plan: StepPlan, masked_labels: int) -> dict:
        """The image figures of a dynamic step: patches per (pool rank, wave) where a group's first rank
        stands for it, the encoder's share of the cost."""
        micro_patches = np.zeros(plan.micro_cost.shape, dtype=np.int64)
        np.add.at(micro_patches, (plan.rank, plan.micro), plan.items.patches)
        encoder = float(self.encoders.of(plan.items).sum())
        return {"micro_patches": micro_patches, "encoder_cost": encoder, "cost": float(plan.cost.sum()),
                "masked_labels": masked_labels}


def comm_table(comm: CommCost, cap: int) -> CommTable:
    """CommCost's coefficients per group size 0..cap (the balancer's form: plait.balance imports no cost)."""
    k = np.maximum(np.arange(cap + 1), 1)
    return CommTable(comm.slope(k, False), comm.slope(k, True), comm.intercept(k), comm.ranks_per_node)


def finish_step(planner, items: Items, priority: np.ndarray, outliers: Items, context: dict) -> StepPlan:
    """The Planner's step in dynamic mode, from its drawn items on: plan, carry, count (roles/planner.py
    calls it where fixed mode balances). `context`: state_before, drawn_before, weights."""
    dcp: DynamicCP = planner.dcp
    fields, rest = dcp.plan(planner.step, items, priority, planner.seq_len, planner.microbatches)
    planner.carry = Items.concat([outliers, rest])
    planner.carry.delayed = planner.carry.delayed + 1
    plan = StepPlan(
        **fields, carried=len(planner.carry), delayed_outliers=len(outliers), empty_documents=planner.draws.empty_docs,
        state_before=context["state_before"], vocab_size=planner.spec.vocab_size,
        label_horizon=planner.spec.packing.label_horizon, weights=context["weights"],
        drawn=planner.drawn - context["drawn_before"],
    )
    if planner.images or planner.spec.audio is not None:  # as fixed CP: media's masked placeholder labels
        plan.images = dcp.image_stats(plan, planner.costs.masked_labels(plan.items))
    planner.delivered_tokens += plan.tokens
    planner.delivered_samples += len(plan.items)
    planner.step += 1
    return plan
