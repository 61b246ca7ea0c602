"""Elastic resume: move a data state forward by re-planning steps on the layout that produced them.

The data state is layout-free at a step's start. A trainer checkpoint taken at the end of a step on
layout A names that step's start; to continue on layout B the step is re-planned on A (metadata only)
and the state after it, which no longer depends on A, continues on B. This runs on the job's side (the
runtime's `replan_after`: the local roles, a served job's JobService), never in a thin trainer.
"""

from __future__ import annotations

from plait.errors import PlaitError
from plait.spec import Spec
from plait.state.spec_change import split_fingerprint


def advance(spec, state: dict, *, dp: int, steps: int = 1, provider=None) -> dict:
    """The data state `steps` global steps after `state`, planned on `dp` ranks (metadata only)."""
    from plait.roles.planner import Planner  # the Planner (and numba) only where a step is re-planned
    from plait.roles.source_loader import SourceLoader

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


def spec_on_layout(spec: Spec, layout: dict) -> Spec:
    """`spec` on a saved layout ({dp, microbatches, seq_len}: what a client state's `layout` holds)."""
    return spec.with_overrides(
        topology={"dp": layout["dp"]},
        packing={"seq_len": layout["seq_len"], "microbatches": layout["microbatches"], "tokens_per_rank": None},
    )


def replan_after(spec: Spec, state: dict, layout: dict) -> dict:
    """The data state after the step that starts at `state`, re-planned on the `layout` it ran on."""
    old = spec_on_layout(spec, layout)
    saved_fp = split_fingerprint(str(state.get("fingerprint", "")))  # (data, None): before run-time mixing
    if saved_fp[1] is not None and saved_fp != (old.data_fingerprint(), old.mixture_fingerprint()):
        raise PlaitError(
            "this step-boundary checkpoint holds no data state after its step (an older plait wrote it), so "
            "it cannot move to another layout and a changed spec at once: resume it on its own layout or "
            "with its own spec for one step, save, and make the other change then"
        )
    return advance(old, state, dp=int(layout["dp"]))

