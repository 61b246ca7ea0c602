"""Elastic resume: move a data state forward by re-planning steps on the layout that produced them.

The data state is layout-free at a step's start. A trainer checkpoint taken at the end of a step on
layout A names that step's start; to continue on layout B the step is re-planned on A (metadata only)
and the state after it, which no longer depends on A, continues on B.
"""

from __future__ import annotations

from plait.roles.planner import Planner
from plait.roles.source_loader import SourceLoader


def advance(spec, state: dict, *, dp: int, steps: int = 1, provider=None) -> dict:
    """The data state `steps` global steps after `state`, planned on `dp` ranks (metadata only).

    A trainer checkpoint taken at the end of a step on layout A holds the state at that step's *start*
    (the client resumes by re-planning it). To resume on layout B the step must be re-planned on A,
    whose budget and assignment produced what was delivered; the state after it is layout-free.
    """
    loader = provider
    if loader is None:
        loader = SourceLoader(spec, max_cached_blocks=8)
    try:
        planner = Planner(spec, loader, dp=dp)
        planner.load_state_dict(state)
        for _ in range(steps):
            planner.plan_step()
        return planner.state_dict()
    finally:
        if provider is None:
            loader.close()
