"""The balancer's tuning constants, in one place.

Every stage reads these through this module when it runs (`tuning.ROUND_ITEM`, never a copy taken at
import), and the compiled kernels receive the ones they need as arguments, so a benchmark or test that
sets `plait.balance.tuning.X` changes the next `assign()` call. The defaults trade plan quality against
planning time; none of them affects the validity of an assignment (capacity is always respected).
"""

from __future__ import annotations

# Stage 3, the cost cap (lpt.LptRun, driven by driver.assign).
CAP_SLACK = 0.002  # the capped pass allows rank costs this far above the lower bound
RECAP_ABOVE = 0.005  # a second capped pass (and stage 5, equal mode) runs above a certificate of 1 + this
RECAP_TOKENS = 0.02  # the second capped pass is kept if it carries at most this fraction of the tokens more
ENCODER_RECAP_ABOVE = 0.01  # where an encoder capacity left items out, a step above 1 + this after stage 5 ...
ENCODER_RECAP_TOKENS = 0.05  # ... tries a pass capped at the placed items' bound, carrying up to this more

# Snapshots of the first LPT pass, from which the other cost-cap passes resume (lpt.LptRun).
SNAPSHOTS = 16  # the first LPT pass keeps this many snapshots of its state for later passes to resume
SNAPSHOT_MIN = 8192  # steps with fewer items run every LPT pass from the start

# Stage 2, LPT in rounds (lpt.round_start, lpt._lpt_rounds).
ROUND_ITEM = 32  # items costing at most LB / ROUND_ITEM are placed in rounds ...
ROUND_MIN = 4  # ... when at least ROUND_MIN x ranks of them remain ...
ROUND_RANKS = 64  # ... and there are at least this many ranks (with few, a heap operation is cheap)
ROUND_SHORT = 8  # a round of fewer ranks hands the rest of the items back to the heaps

# Stage 5, the equal-mode rebalance (exchange.rebalance).
SWAP_SCAN = 256  # micro-batch swaps: the costliest rank tries this many of the lightest ranks
CARRY_PATIENCE = 32  # carrying stops after this many carried items (beyond the top ranks) without progress
REBALANCE_TOKENS = 0.01  # carrying holds back at most this fraction of the step's tokens

NAMES = ("CAP_SLACK", "RECAP_ABOVE", "RECAP_TOKENS", "ENCODER_RECAP_ABOVE", "ENCODER_RECAP_TOKENS",
         "SNAPSHOTS", "SNAPSHOT_MIN", "ROUND_ITEM", "ROUND_MIN",
         "ROUND_RANKS", "ROUND_SHORT", "SWAP_SCAN", "CARRY_PATIENCE", "REBALANCE_TOKENS")
