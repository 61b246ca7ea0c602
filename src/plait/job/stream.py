"""The one loop that reads one rank's stream, step by step, for every runtime (local, flight, ray).

A runtime says how a step is asked for (`request(step)`: a handle, e.g. a Ray object ref already on
its way, or just the step) and how its answer is received (`receive(handle, step)`: the data state at the
step's start and the rank's micro-batches of that step). The loop asks for the next step before it hands
out the current one's micro-batches, so a runtime whose requests run remotely builds the next step while
the trainer consumes this one; the first step skips the micro-batches a resumed trainer already had.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from plait.batch import MicroBatch
from plait.errors import PlaitError

Request = Callable[[int], Any]
Receive = Callable[[Any, int], tuple[Any, list[MicroBatch]]]


def read_rank(request: Request, receive: Receive, first_step: int, skip: int,
              max_steps: int | None) -> Iterator[tuple[Any, MicroBatch]]:
    """(state at the step's start, micro-batch) from `first_step` on, up to `max_steps` (None: forever);
    micro-batches of `first_step` below `skip` are left out (a resume in the middle of a step)."""

    def wanted(step: int) -> bool:
        return max_steps is None or step < max_steps

    step = first_step
    pending = request(step) if wanted(step) else None
    while pending is not None:
        state, batches = receive(pending, step)
        pending = request(step + 1) if wanted(step + 1) else None
        for mb in batches:
            if mb.microbatch >= skip:
                yield state, mb
        skip = 0
        step += 1


def asked(step: int) -> int:
    """`request` of a runtime whose `receive` does the asking (nothing is sent ahead)."""
    return step


def state_after(state_at: Callable[[int, int], dict], gen: int, step: int) -> dict | None:
    """The data state after `step` of generation `gen`: the start of the next one, asked of the job's plan
    window with `state_at(gen, step)`; None where it no longer knows it (the stream was reset, or the step
    left the window): a Loader then writes no `next` into its checkpoint."""
    try:
        return state_at(gen, step + 1)
    except PlaitError:
        return None
