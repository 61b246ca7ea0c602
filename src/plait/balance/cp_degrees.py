"""Dynamic CP, stage 1: a context-parallel degree per document, by cost (docs/long-context.md).

A document of L tokens and cost c gets k = max(ceil(L / B), ceil(c / (theta * m))) ranks, where B is a
rank's token slot and m the step's mean rank cost: memory needs ceil(L / B) ranks, and a document costing
more than a mean rank would bound the step unless it is shared. Short cheap documents get k = 1 (whole, as
today). With the `pow2` vocabulary k is rounded up to a power of two (the aligned blocks a trainer
pre-creates, as Megatron-Core's hybrid CP); with `contiguous` it is kept. k never exceeds `cap` (the
largest group: max_degree, at most the pool). With traffic (`CommTable`: a group beyond a node's ranks
pays the inter-node bandwidth) a larger group lowers what each member carries but adds work (k members
each pass the traffic), so the documents costing more than theta * m choose jointly: each the size that
minimises max(c / k + its traffic, theta x the mean rank work with every document at its size) -- without
traffic, the smallest k with c / k <= theta * m, the rule above. Documents with media keep the smallest
degree their tokens allow (`minimal`): a chunk boundary then never has to move around a placeholder run
when k = 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEGREE_ROUNDS = 4  # rounds of the joint choice of the costly documents' degrees

@dataclass(frozen=True)
class CPLayout:
    """What a dynamic-CP step is planned for: the pool, a rank's slot, the waves asked for, the largest group,
    theta and the vocabulary (pow2 or contiguous)."""

    pool: int
    slot: int
    waves: int
    cap: int
    theta: float = 1.0
    pow2: bool = True


@dataclass(frozen=True)
class CommTable:
    """Per degree k (index 0..cap): the CP traffic each member of a group carries, slope x the group's
    tokens + intercept, inside a node and across nodes (plait.cost.CommCost gives them)."""

    slope_intra: np.ndarray
    slope_inter: np.ndarray
    intercept: np.ndarray
    ranks_per_node: int

    @classmethod
    def free(cls, cap: int) -> "CommTable":
        """No traffic cost (tests, and cost models without an interconnect)."""
        z = np.zeros(cap + 1)
        return cls(z, z, z, 1 << 30)

    def per_member(self, tokens: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Traffic of a group of k ranks holding `tokens`, placed inside a node where k allows."""
        k = np.asarray(k, dtype=np.int64)
        slope = np.where(k > self.ranks_per_node, self.slope_inter[k], self.slope_intra[k])
        return np.where(k > 1, slope * tokens + self.intercept[k], 0.0)


def pow2_ceil(k: np.ndarray) -> np.ndarray:
    """The least power of two >= k (k >= 1)."""
    k = np.maximum(np.asarray(k, dtype=np.int64), 1)
    return np.left_shift(1, np.ceil(np.log2(k - 0.5)).clip(min=0).astype(np.int64))


def cp_degrees(lengths: np.ndarray, costs: np.ndarray, layout: CPLayout, comm: CommTable | None = None,
               minimal: np.ndarray | None = None) -> np.ndarray:
    """[n] int64 degree of each document (module docstring); `minimal` marks documents that keep
    ceil(L / slot)."""
    slot, pool, cap, theta, pow2 = layout.slot, layout.pool, layout.cap, layout.theta, layout.pow2
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    by_memory = np.minimum(np.maximum(-(-lengths // slot), 1), cap)
    if pow2:
        by_memory = np.minimum(pow2_ceil(by_memory), cap)
    mean = float(costs.sum()) / pool if len(costs) else 0.0
    k = by_memory.copy()
    wide = np.flatnonzero((costs > theta * mean) if mean > 0 else np.zeros(len(costs), bool))
    if minimal is not None:
        wide = wide[~np.asarray(minimal)[wide]]
    if len(wide):
        rest = float(costs.sum() - costs[wide].sum())
        k[wide] = _by_cost(lengths[wide], costs[wide], by_memory[wide], rest, layout, comm or CommTable.free(cap))
    return k


def _by_cost(lengths, costs, least, rest_work: float, layout: CPLayout, comm: CommTable) -> np.ndarray:
    """Degrees of the costly documents, jointly (module docstring): each the size of the vocabulary (>= its
    least) that minimises max(what its members carry, theta x the mean rank work with every document at
    its degree), ties to the smaller; a few rounds, each against the others' degrees of the round before."""
    sizes = np.unique(vocabulary(layout.cap, layout.pow2))
    value = member_cost(lengths[:, None], costs[:, None], sizes[None, :], comm)
    value = np.where(sizes[None, :] >= least[:, None], value, np.inf)
    work = np.where(np.isfinite(value), value * sizes[None, :], np.inf)
    pick = np.argmax(np.isfinite(value), axis=1)  # start from the least sizes
    rows = np.arange(len(costs))
    for _ in range(DEGREE_ROUNDS):
        chosen = work[rows, pick]
        total = rest_work + float(chosen.sum())
        mean = (total - chosen[:, None] + work) / layout.pool
        new = np.argmin(np.maximum(value, layout.theta * mean), axis=1)
        if np.array_equal(new, pick):
            break
        pick = new
    return sizes[pick]


def vocabulary(cap: int, pow2: bool) -> np.ndarray:
    """The group sizes 1..cap the trainer can run."""
    return pow2_ceil(np.arange(1, cap + 1)) if pow2 and cap > 1 else np.arange(1, cap + 1)


def member_cost(lengths: np.ndarray, costs: np.ndarray, k: np.ndarray, comm: CommTable) -> np.ndarray:
    """What each member carries for a document alone in a group of k: c / k plus its traffic."""
    return costs / k + comm.per_member(padded_lengths(lengths, k), k)


def padded_lengths(lengths: np.ndarray, degrees: np.ndarray) -> np.ndarray:
    """Tokens a document occupies in its group: a multiple of 2k for k > 1 (per-document zigzag)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    k2 = 2 * np.asarray(degrees, dtype=np.int64)
    return np.where(k2 > 2, -(-lengths // k2) * k2, lengths)
