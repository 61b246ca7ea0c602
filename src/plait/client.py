"""Client: the trainer-side iterator. One per trainer rank.

    loader = plait.Loader(spec, dp_rank=0)
    for batch in loader:          # one micro-batch at a time, in order
        ...
    state = loader.state_dict()   # small, JSON-serialisable; save it with the model checkpoint

The state names the step in progress (the Planner's state at its start) and how many of its
micro-batches this rank has consumed. Resuming re-plans that step (metadata only) and continues after
the last consumed micro-batch, so the stream continues bit for bit.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

from plait.errors import PlaitError
from plait.roles.constructor import MicroBatch
from plait.spec import Spec, load_spec

Batch = MicroBatch
CLIENT_STATE_VERSION = 1


class Loader:
    def __init__(
        self,
        spec: Spec | dict | str,
        dp_rank: int = 0,
        *,
        runtime: str = "local",
        tp_rank: int = 0,
        pp_rank: int = 0,
        cp_rank: int = 0,
        job: str | None = None,
        prefetch: int = 2,
        steps: int | None = None,
        **runtime_options,
    ):
        self.spec = load_spec(spec)
        topo = self.spec.topology
        for name, value, size in (("dp_rank", dp_rank, topo.dp), ("tp_rank", tp_rank, topo.tp),
                                  ("pp_rank", pp_rank, topo.pp), ("cp_rank", cp_rank, topo.cp)):
            if not 0 <= value < size:
                raise PlaitError(f"{name}={value} is outside the topology (size {size})")
        self.dp_rank, self.tp_rank, self.pp_rank, self.cp_rank = dp_rank, tp_rank, pp_rank, cp_rank
        self.prefetch = max(0, prefetch)
        self.max_steps = steps if steps is not None else self.spec.steps
        self._runtime = self._make_runtime(runtime, job, runtime_options)
        self._resume_state = self._runtime.state_dict()
        self._resume_micro = 0
        self._iterating = False

    def _make_runtime(self, runtime: str, job: str | None, options: dict):
        if runtime == "local":
            from plait.runtime.local import LocalRuntime

            return LocalRuntime(self.spec)
        if runtime == "ray":
            try:
                from plait.runtime.ray import RayRuntime
            except ImportError as e:
                raise PlaitError(f"the ray runtime needs `pip install plait[ray]` ({e})") from None
            return RayRuntime(self.spec, job=job, cp_rank=self.cp_rank, **options)
        raise PlaitError(f"unknown runtime {runtime!r} (choose local or ray)")

    # ----- iteration ---------------------------------------------------------------------------
    def _produce(self) -> Iterator[tuple[dict, MicroBatch]]:
        """(state at the start of the batch's step, batch) in order, from the resume point."""
        return self._runtime.iter_rank(self.dp_rank, self._resume_state, self._resume_micro, self.max_steps)

    def _for_this_rank(self, mb: MicroBatch) -> MicroBatch:
        if self.spec.topology.cp > 1:
            from plait.context_parallel import shard_for_cp

            return shard_for_cp(mb, self.spec.topology.cp, self.cp_rank)
        return mb

    def __iter__(self) -> Iterator[MicroBatch]:
        if self._iterating:
            raise PlaitError("this Loader is already being iterated")
        self._iterating = True
        try:
            source = self._produce() if self.prefetch == 0 else _prefetched(self._produce(), self.prefetch)
            for state, mb in source:
                self._resume_state = state
                self._resume_micro = mb.microbatch + 1
                yield self._for_this_rank(mb)
        finally:
            self._iterating = False

    # ----- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": CLIENT_STATE_VERSION,
            "data": self._resume_state,
            "next_microbatch": self._resume_micro,
            "layout": self._layout(self.spec),
        }

    @staticmethod
    def _layout(spec: Spec) -> dict:
        """What shapes a step (not which samples come): the step at `data` was planned on this."""
        return {"dp": spec.topology.dp, "microbatches": spec.packing.num_microbatches, "seq_len": spec.packing.seq_len}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != CLIENT_STATE_VERSION:
            raise PlaitError(f"loader state version {state.get('version')!r} is not supported")
        data, micro = self._elastic(state)
        self._runtime.load_state_dict(data)  # validates the fingerprint now, not at iteration
        self._resume_state = data
        self._resume_micro = micro

    def _elastic(self, state: dict) -> tuple[dict, int]:
        """Resume on another layout (DP size, micro-batches): only from a step boundary.

        The data state is layout-free at a step's start. A state saved after a step's last micro-batch
        names that step's start; the step is re-planned on the saved layout (metadata only) to get
        the state after it, which then continues on the new layout: no sample lost or repeated.
        """
        data, micro = state["data"], int(state["next_microbatch"])
        saved = state.get("layout")
        if saved is None or saved == self._layout(self.spec):
            return data, micro
        if micro == 0:
            return data, 0
        if micro < saved["microbatches"]:
            raise PlaitError(
                f"this checkpoint was taken in the middle of a step (after micro-batch {micro - 1} of "
                f"{saved['microbatches']}) on {saved['dp']} DP ranks; resuming on a different layout "
                f"({self._layout(self.spec)}) needs a checkpoint taken at a step boundary"
            )
        from plait.checkpoint import advance

        old = self.spec.with_overrides(
            topology={"dp": saved["dp"]}, packing={"seq_len": saved["seq_len"], "microbatches": saved["microbatches"],
                                                   "tokens_per_rank": None},
        )
        return advance(old, data, dp=saved["dp"]), 0

    def error_report(self) -> dict:
        return self._runtime.error_report()

    def close(self) -> None:
        self._runtime.close()


class _Done:
    pass


def _prefetched(gen: Iterator, depth: int) -> Iterator:
    """Run a generator in a background thread, `depth` items ahead. Exceptions re-raise here.

    When the consumer stops early, the worker stops at its next hand-over (it never blocks on a full
    queue once told to stop) and closes the generator in its own thread; the consumer waits for that,
    so no half-finished step can still be touching the runtime when iteration resumes.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in gen:
                if not put(item):
                    return
            put(_Done())
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put(e)
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    t = threading.Thread(target=work, daemon=True, name="plait-prefetch")
    t.start()
    try:
        while True:
            item = q.get()
            if isinstance(item, _Done):
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join()
