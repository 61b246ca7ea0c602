"""A process's place in the job: its DP/TP/PP/CP ranks from its global rank and the world size.

Rank order is Megatron-Core's default ("tp-cp-dp-pp"): tensor-parallel ranks vary fastest, then
context-parallel, then data-parallel, then pipeline stages:

    global_rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so the TP group of a replica sits on consecutive ranks (one node), and dp = world / (tp * cp * pp).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from plait.errors import PlaitError


@dataclass(frozen=True)
class ParallelRanks:
    dp: int
    tp: int
    pp: int
    cp: int


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dimensions."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def ranks_of(self, global_rank: int) -> ParallelRanks:
        if not 0 <= global_rank < self.world_size:
            raise PlaitError(f"rank {global_rank} is outside a world of {self.world_size} processes")
        tp_rank, rest = global_rank % self.tp, global_rank // self.tp
        cp_rank, rest = rest % self.cp, rest // self.cp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        return ParallelRanks(dp=dp_rank, tp=tp_rank, pp=pp_rank, cp=cp_rank)

    def global_rank(self, ranks: ParallelRanks) -> int:
        return ranks.tp + self.tp * (ranks.cp + self.cp * (ranks.dp + self.dp * ranks.pp))


def layout_for_world(world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1) -> Layout:
    """The layout of `world_size` processes with the given model-parallel sizes; dp is what is left."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if value < 1:
            raise PlaitError(f"{name} must be at least 1, not {value}")
    model = tp * pp * cp
    if world_size < 1 or world_size % model:
        raise PlaitError(
            f"WORLD_SIZE={world_size} is not a multiple of tp*pp*cp = {tp}*{pp}*{cp} = {model}: "
            "no data-parallel layout fits"
        )
    return Layout(dp=world_size // model, tp=tp, pp=pp, cp=cp)


def env_int(name: str) -> int:
    """An integer from the environment (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK)."""
    text = os.environ.get(name)
    if text is None:
        raise PlaitError(f"{name} is not set: run under torchrun (or set RANK and WORLD_SIZE yourself)")
    try:
        return int(text)
    except ValueError:
        raise PlaitError(f"{name}={text!r} is not an integer") from None
