"""Balancing: assign each document (chunk) of a global step to a (DP rank, micro-batch).

The objective is the step time: the largest total cost over DP ranks, subject to every micro-batch
holding at most `capacity` tokens. Pure: arrays in, arrays out, deterministic. The certificate reported
with every step is max(rank cost) / LB, where no assignment can beat LB = max(sum(cost) / ranks,
max(cost)) (certificate.py).

The algorithm runs in stages over arrays, one module each (compiled with numba when it is installed,
_jit.py; the very same Python functions run uncompiled otherwise, so results never depend on it):

1. **Placement order** (ordering.py): urgent items (carried before) first, so nothing starves, then by
   decreasing cost, ties by index; stable radix sorts.
2. **LPT with capacity** (lpt.py): each item to the least-loaded rank that still has a micro-batch with
   room for it, into the fullest micro-batch it fits (best fit keeps big holes for big items). Heaps,
   and rounds for the many small items at the end: exactly LPT's choices, faster. Items that fit
   nowhere stay unplaced (rank -1).
3. **Cost cap** (lpt.py, driven by driver.py): when tokens bind before cost, the pass is repeated with
   every rank's cost capped just above the lower bound, carrying the cheap leftovers that would push a
   rank past the cap to the next step; the pass that certifies best is kept. Carried items go first in
   the next step, uncapped, so nothing waits more than a step for this. A pass that carries but ends
   above the cap all the same is dropped for the plain pass when that places more tokens: carrying
   is for holding the cap. Later passes resume from snapshots of the first. When an encoder capacity
   leaves items out (the cap, set from all items, is then too loose for those that fit) and the step
   still certifies above 1 + ENCODER_RECAP_ABOVE after stage 5, a pass capped at the placed items'
   bound goes through stages 4 and 5 too, and the better one is kept (driver.py).
4. **Micro-batches** (microbatches.py): inside each rank the items are re-packed cost-first onto the
   least costly micro-batch with room (balanced micro-batch costs shorten pipeline bubbles).
5. **Rebalance** (exchange.py; equal mode, when the step still certifies worse than 1 + RECAP_ABOVE):
   whole micro-batches swap between ranks, items move between a micro-batch of the costliest rank and
   one of the lightest, and a few long items of the costliest rank are carried (at most
   REBALANCE_TOKENS of the step's tokens, never an urgent item).
6. **Micro-batch order** (microbatches.py): the heaviest micro-batches go to the middle of each rank's
   order, so pipeline warm-up and cool-down run the light ones.

Multimodal steps have a vector of encoder capacities beside tokens: `assign(..., loads=, load_capacity=)`
(loads int [n, K]: image patches, video patches, audio frames, whatever each encoder's memory limits;
load_capacity [K]) lets an item into a micro-batch only where its tokens and every load fit; every stage
checks all K in one code path (capacities.py; LPT's "least loaded rank that can take the item" stays
exact: lpt.py), and with K = 0 every stage runs its text-only path, bit for bit. `capacity_lower_bound`
(certificate.py) is a provable bound that respects the capacities (at least LB above);
`max_over_capacity_lb` the matching certificate.

driver.py holds `assign()`, which runs the stages, and `Assignment`; tuning.py the tuning constants
(set `plait.balance.tuning.X`: the stages read them there at each call); baselines.py the
baselines the balancer is measured against; warmup.py the compile warm-up. (The driver is not called
assign.py: the package's `assign` is the function, which would hide a submodule of that name.)

Modes: `equal` gives every rank exactly `microbatches` micro-batches (some may be empty when a step
holds too few items). `variable` lets a rank use up to `max_microbatches` (default 2x) micro-batches:
ranks of short documents take more tokens, ranks of long ones fewer, so costs can balance even when
tokens cannot. Per-rank token counts then differ: a trainer must normalise its loss by the step's
global label tokens (StepPlan.stats()["global_label_tokens"]), not per rank.
"""

from __future__ import annotations

from . import tuning
from .baselines import first_fit, greedy
from .certificate import capacity_lower_bound, lower_bound, max_over_capacity_lb
from .driver import Assignment, assign
from .microbatches import middle_heavy_order
from .warmup import warmup

__all__ = ["Assignment", "assign", "capacity_lower_bound", "first_fit", "greedy", "lower_bound", "max_over_capacity_lb",
           "middle_heavy_order", "tuning", "warmup"]

