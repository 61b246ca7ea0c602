"""Client: the trainer-side iterator. One per trainer rank.

    loader = plait.Loader(spec, dp_rank=0)
    for batch in loader:          # one micro-batch at a time, in order
        ...
    state = loader.state_dict()   # small, JSON-serialisable; save it with the model checkpoint

The state names the step in progress (the Planner's state at its start) and how many of its
micro-batches this rank has consumed. Resuming re-plans that step (metadata only) and continues after
the last consumed micro-batch, so the stream continues bit for bit.

The Loader is the trainer's face only: planning, building and the re-planning of an elastic resume run on
the job's side, behind the runtime (plait.runtime.RankStream).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import warnings
from typing import Iterator

from plait.batch import MicroBatch
from plait.errors import PlaitError
from plait.runtime import make_runtime
from plait.runtime.options import build_ahead_option, renamed
from plait.spec import Spec, load_spec
from plait.state.log import diff_state, resolved
from plait.state.overrides import merge_pending, report_effect_step
from plait.state.schema import CLIENT_STATE_VERSION, ClientState, after_consumed_step, check_client_state, seal
from plait.state.spec_change import warn_changes
from plait.topology import Layout, ParallelRanks, env_int, layout_for_world

log = logging.getLogger("plait.loader")
READ_AHEAD = 2  # micro-batches the Loader's reader thread holds ahead of the trainer


class Loader:
    """The trainer-side iterator of one rank: yields its micro-batches (`plait.Batch`) in order.

    `Loader(spec, dp_rank, tp_rank=, pp_rank=, cp_rank=, runtime="local"|"node"|"ray"|"flight", steps=,
    read_ahead=, **options)`; under torchrun prefer `Loader.from_torchrun(spec, tp=, pp=, cp=)`, which
    reads the ranks from the environment. `steps` (default: the spec's `steps`; None: no end) counts
    global steps from 0, not from a resume: the stream ends before global step `steps` wherever it
    started (a Loader resumed at step 40 with steps=100 reads steps 40 to 99). `read_ahead`: micro-batches
    a reader thread fetches ahead of the trainer (0: none; `prefetch` is its deprecated name); `build_ahead`:
    how many *steps* the job builds ahead of this rank's requests (local, node and ray alike; default 2 where
    several ranks share a job, 0 for a process reading alone). Options a runtime does not take are an error
    naming them. Use it as a context manager (or call `close()`) so that what it started is released.

    runtime="local" under torchrun with several processes on a node: the processes share one data plane,
    hosted by LOCAL_RANK 0 (the node-shared layout, plait.runtime.node_share; the same stream, memory flat
    in ranks and sources); `share="process"` (or PLAIT_LOCAL_SHARE=process) makes every process load
    alone. docs/operations/runtimes.md names the five layouts and how each is selected.
    """

    def __init__(self, spec: Spec | dict | str, dp_rank: int = 0, *, runtime: str = "local", tp_rank: int = 0,
                 pp_rank: int = 0, cp_rank: int = 0, job: str | None = None, read_ahead: int | None = None,
                 steps: int | None = None, prefetch: int | None = None, **runtime_options):
        self.spec = load_spec(spec)
        topo = self.spec.topology
        for name, value, size in (("dp_rank", dp_rank, topo.dp), ("tp_rank", tp_rank, topo.tp),
                                  ("pp_rank", pp_rank, topo.pp), ("cp_rank", cp_rank, topo.cp)):
            if not 0 <= value < size:
                raise PlaitError(f"{name}={value} is outside the topology (size {size})")
        self.ranks = ParallelRanks(dp=dp_rank, tp=tp_rank, pp=pp_rank, cp=cp_rank)
        self.dp_rank, self.tp_rank, self.pp_rank, self.cp_rank = dp_rank, tp_rank, pp_rank, cp_rank
        read_ahead = renamed("prefetch", prefetch, "read_ahead", read_ahead)
        self.read_ahead = max(0, READ_AHEAD if read_ahead is None else read_ahead)
        self.max_steps = steps if steps is not None else self.spec.steps
        self._runtime = self._make_runtime(runtime, job, runtime_options)
        self._at = Position(self._runtime.state_dict())
        self._iterating = self._closed = False
        self._pending = PendingMixing(self.spec)  # run-time mixing calls since the step in progress was planned
        self.resume_report: list[str] = []  # what a resume with allow_spec_change found changed

    @property
    def prefetch(self) -> int:
        """Deprecated name of `read_ahead`."""
        return self.read_ahead

    @classmethod
    def from_torchrun(cls, spec: Spec | dict | str, *, tp: int | None = None, pp: int | None = None,
                      cp: int | None = None, **options) -> "Loader":
        """The Loader of this torchrun process: ranks from RANK and WORLD_SIZE (plait.topology's order).

        `topology` in the spec is filled in from the world size: the launch decides the DP size, so a spec
        that pins another one (the demo's `dp: 8` on 2 processes) runs with the launch's (logged at info);
        a tp/pp/cp passed here that contradicts the spec's is refused.

        runtime="ray": every rank uses one job (`job=`, default: named after torchrun's run), which rank 0
        creates and the other ranks attach to by themselves, waiting for it to appear; without `address`
        the ranks on rank 0's machine join the Ray instance it started (plait.runtime.ray.jobs).
        """
        rank = env_int("RANK")
        if options.get("runtime") == "ray":  # one job for all ranks: rank 0 creates it, the others attach
            from plait.runtime.ray.jobs import torchrun_options

            options = torchrun_options(rank, options)
        return cls.for_process(spec, rank=rank, world_size=env_int("WORLD_SIZE"), tp=tp, pp=pp, cp=cp, **options)

    @classmethod
    def from_ray_train(cls, spec: Spec | dict | str, *, tp: int | None = None, pp: int | None = None,
                       cp: int | None = None, **options) -> "Loader":
        """The Loader of this Ray Train worker: ranks from `ray.train.get_context()`; runtime ray by default."""
        from ray import train

        ctx = train.get_context()
        options.setdefault("runtime", "ray")
        return cls.for_process(spec, rank=ctx.get_world_rank(), world_size=ctx.get_world_size(), tp=tp, pp=pp,
                               cp=cp, **options)

    @classmethod
    def for_process(cls, spec: Spec | dict | str, *, rank: int, world_size: int, tp: int | None = None,
                    pp: int | None = None, cp: int | None = None, **options) -> "Loader":
        """The Loader of global `rank` in a job of `world_size` processes (see `from_torchrun`)."""
        spec, r = spec_for_process(load_spec(spec), rank, world_size, {"tp": tp, "pp": pp, "cp": cp})
        return cls(spec, r.dp, tp_rank=r.tp, pp_rank=r.pp, cp_rank=r.cp, **options)

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def runtime(self):
        """The runtime serving this Loader (plait.runtime), read-only: for introspection (stats, recovery)."""
        return self._runtime

    def _make_runtime(self, runtime: str, job: str | None, options: dict):
        options = dict(options)
        if job is not None:
            options["job"] = job
        if runtime == "local":  # several torchrun processes on this node share one data plane (node_share)
            from plait.runtime.node_share import node_launch

            share = options.pop("share", "auto")
            if node_launch(share) is not None:
                runtime, options["share"] = "node", share
        port = self.spec.metrics.port
        if runtime in ("local", "node") and port:  # one endpoint per trainer process: the port plus its global rank
            topo = self.spec.topology
            options.setdefault("metrics_port", port + Layout(dp=topo.dp, tp=topo.tp, pp=topo.pp,
                                                             cp=topo.cp).global_rank(self.ranks))
        self._runtime_kind = runtime  # which runtime serves it decides where error_report() gathers from
        return make_runtime(self.spec, runtime, **build_ahead_option(runtime, options))

    # ----- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[MicroBatch]:
        if self._closed:
            raise PlaitError("this Loader is closed (close() or its `with` block ended): create a new one, and "
                             "load_state_dict() a saved state to continue")
        if self._iterating:
            raise PlaitError("this Loader is already being iterated")
        self._iterating = True
        try:
            stream = self._runtime.iter_rank(self.dp_rank, self._data_state(), self._at.micro, self.max_steps,
                                             cp_rank=self.cp_rank)  # the runtime serves this CP rank its shard
            items = iter(stream if self.read_ahead == 0 else _read_ahead(stream, self.read_ahead))
            watch = getattr(self._runtime, "telemetry", None)
            while True:
                waited = time.perf_counter()
                try:
                    state, mb = next(items)
                except StopIteration:
                    break
                if watch is not None:  # time this rank waited for data (0 when read-ahead keeps ahead)
                    watch.observe_wait(self.dp_rank, time.perf_counter() - waited)
                self._at.consumed(state, mb)
                yield mb
        finally:
            self._iterating = False

    # ----- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's place in the stream: small, JSON-serialisable; save it with the model checkpoint.

        At a step boundary (`at_step_boundary`: every micro-batch of the step consumed) the state is the
        same on every rank of the job, so saving one rank's state is enough; mid-step it names the step
        and how many of this rank's micro-batches were consumed. `tokens_seen` / `samples_seen` count
        the whole job's tokens and samples (document chunks) of the completed steps, for schedules that
        key on tokens rather than steps (after an elastic resume a step holds a different number).
        """
        tokens, samples, micro, boundary = self._at.seen()
        return seal({"version": CLIENT_STATE_VERSION, "data": self._data_state(), "next_microbatch": micro,
                     "layout": layout_of(self.spec), "at_step_boundary": boundary, "tokens_seen": tokens,
                     "samples_seen": samples, **self._next_state(boundary and micro > 0)})

    def _data_state(self) -> dict:
        """The data state of the step in progress, with the run-time mixing calls made since it was
        planned (set_weights, report): a resume replays them exactly."""
        return self._pending.merged(self._at.resolved())

    def _next_state(self, done: bool) -> dict:
        """At a step's end, the data state after that step as a diff (`next`), where the runtime knows it:
        a resume under a changed spec starts there (the consumed step is not re-planned under the new
        spec, whose draws would differ)."""
        state = self._runtime.state_after(int(self._at.state["step"])) if done else None
        return {} if state is None else {"next": diff_state(self._at.state, state)}

    # ----- run-time mixing ---------------------------------------------------------------------
    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        """Change the token shares from global step `at_step` on: `{source: share}` for the sources to pin
        (the others share what is left, in their current proportions). Recorded in the data state, so a
        resume reproduces it. A step already planned is refused: the job plans a few steps ahead of the
        trainer, so choose at_step >= the current step + read_ahead + 2. Local runtime: call it identically
        on every rank (each plans the whole step itself); ray runtime: call it on one rank (the job's one
        Planner applies it)."""
        self._runtime.set_weights(weights, at_step)
        self._pending.set_weights(weights, at_step)

    def report(self, step: int, losses: dict[str, float]) -> None:
        """Per-source training losses of global step `step` (e.g. all-reduced over ranks) for the online
        mixing policy (`mixture.online`): its update of the window [wK, (w+1)K) takes effect at step
        (w+1)K - 1 + delay. Local runtime: call it identically on every rank."""
        self._runtime.report(step, losses)
        self._pending.report(step, losses)

    def load_state_dict(self, state: dict, *, allow_spec_change: bool = False) -> None:
        """Continue from a state saved by `state_dict()` (call before iterating, not during).

        `allow_spec_change=True`: the state may come from a spec with other weights or schedule, more or
        fewer sources; unchanged sources continue exactly, an added one starts at its beginning, a
        removed one's cursor stays in the state. What changed is warned (SpecChangeWarning) and listed
        in `resume_report`. A source whose files or seed changed is still refused."""
        if self._iterating:
            raise PlaitError(
                "load_state_dict() was called while this Loader is being iterated; the running stream would "
                "ignore it. Load the state before the loop (or after the loop has ended)"
            )
        data, micro, parsed = resume_start(state, self.spec, self._runtime, allow_spec_change)
        self.resume_report = []
        if allow_spec_change:
            data = self._load_changed(data, micro)
        else:
            self._runtime.load_state_dict(data)  # validates the data state now, not at iteration
        self._pending = PendingMixing(self.spec)
        self._at = Position(data, micro, micro > 0 and bool(parsed.at_step_boundary),
                            (parsed.tokens_seen or 0, parsed.samples_seen or 0))

    def _load_changed(self, data: dict, micro: int) -> dict:
        changes = self._runtime.load_state_dict(data, allow_spec_change=True) or []
        if changes and micro:
            raise PlaitError(
                "this checkpoint was taken in the middle of a step (or, written by an older plait, holds no "
                "state after its step); a spec change applies from a step's start: resume it with its own "
                "spec first, or use a checkpoint taken at a step boundary"
            )
        if changes:
            data = self._runtime.state_dict()
            warn_changes(changes)
        self.resume_report = changes
        return data

    def error_report(self, gather: bool = False) -> dict:
        """The bad records skipped so far under `on_error: skip`, per source: `{source: {"skipped": n,
        "messages": [...]}}`, each message naming the source, file, record and epoch (the first 100 per
        source). One rule, wherever a record failed (while planning, or decoding its media for a batch):
        each bad sample counts once per epoch, over the whole job, on every runtime. Where the job's
        batches are built by processes that never talk (torchrun with `share="process"`, or node-shared
        on several nodes) a report is this process's own; `gather=True` gathers the whole job's over the
        process group: a collective, to call on every rank (plait.runtime.error_reports)."""
        from plait.runtime.error_reports import job_error_report  # loads the sources: not in a thin trainer

        return job_error_report(self._runtime.error_report(), self._runtime_kind, gather)

    def scaling_report(self) -> dict:
        """How the job's SourceLoaders were re-partitioned while it ran (the ray runtime with `autoscale`,
        or `rescale`): {"events", "timeline", "options"}; empty on the local and flight runtimes."""
        return self._runtime.scaling_report()

    def close(self) -> None:
        """Release what this Loader holds; safe to call twice. On the ray runtime every trainer process
        closes (also done by `with`, and at interpreter exit): the last one of a job ends the job's actors."""
        self._closed = True
        self._runtime.close()


class Position:
    """Where a rank is in its stream: the data state at the start of the step in progress (`state`), the
    micro-batches of it consumed (`micro`), whether that was the step's last (`step_done`) and that
    step's totals; `loaded_seen`: the token and sample counts of a state loaded at a step boundary."""

    def __init__(self, state: dict, micro: int = 0, step_done: bool = False, loaded_seen: tuple = (0, 0)):
        self.state, self.micro, self.step_done, self.loaded_seen = state, micro, step_done, loaded_seen
        self.step_totals: tuple[int, int, int] | None = None  # the step's tokens, samples, micro-batches

    def consumed(self, state, mb: MicroBatch) -> None:
        self.state, self.micro = state, mb.microbatch + 1
        self.step_done = self.micro >= mb.num_microbatches
        self.step_totals = (int(mb.stats.get("tokens", 0)), int(mb.stats.get("samples", 0)),
                            int(mb.stats.get("microbatches", mb.num_microbatches)))

    def resolved(self) -> dict:
        """The state, fetched where a thin client's step carried a reference only."""
        self.state = resolved(self.state)
        return self.state

    def seen(self) -> tuple[int, int, int, bool]:
        """(tokens and samples of the job's completed steps, the next micro-batch, at a step boundary)."""
        delivered = self.resolved().get("delivered") or {"tokens": 0, "samples": 0}
        tokens, samples, micro = int(delivered["tokens"]), int(delivered["samples"]), self.micro
        if self.step_done and self.step_totals is not None:
            step_tokens, step_samples, micro = self.step_totals
            tokens, samples = tokens + step_tokens, samples + step_samples
        elif self.step_done:  # loaded from a boundary state: its counts stand
            tokens, samples = self.loaded_seen
        return tokens, samples, micro, micro == 0 or self.step_done


class PendingMixing:
    """The run-time mixing calls (set_weights, report) made since the step in progress was planned: a
    state snapshot taken then does not hold them, so they are merged into the checkpointed state."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.overrides: list[dict] = []
        self.reports: dict[int, dict[str, float]] = {}

    def set_weights(self, weights: dict[str, float], at_step: int) -> None:
        entry = {"at_step": int(at_step), "weights": {n: float(v) for n, v in weights.items()}, "by": "user"}
        if entry not in self.overrides:  # the same call again is one entry, as in the Planner's state
            self.overrides.append(entry)

    def report(self, step: int, losses: dict[str, float]) -> None:
        self.reports.setdefault(int(step), {}).update({n: float(v) for n, v in losses.items()})

    def merged(self, state: dict) -> dict:
        step = int(state["step"])
        self.overrides = [o for o in self.overrides if o["at_step"] >= step]  # older ones are in the snapshot
        online = self.spec.mixture.online
        if online is not None:
            self.reports = {s: r for s, r in self.reports.items() if report_effect_step(online, s) >= step}
        if not self.overrides and not self.reports:
            return state
        return merge_pending(state, self.overrides, self.reports, self.spec)


def spec_for_process(spec: Spec, rank: int, world_size: int, given: dict) -> tuple[Spec, ParallelRanks]:
    """The spec of a launch of `world_size` processes (its DP size from the world, `given` tp/pp/cp where
    passed) and global `rank`'s parallel ranks in it."""
    topo = spec.topology
    stated = topo.model_fields_set
    sizes = {}
    for name, value in given.items():
        in_spec = getattr(topo, name)
        if value is not None and name in stated and value != in_spec:
            raise PlaitError(f"{name}={value} was passed but the spec's topology says {name}: {in_spec}")
        sizes[name] = in_spec if value is None else value
    layout = layout_for_world(world_size, **sizes)
    if "dp" in stated and topo.dp != layout.dp:
        log.info("the spec's topology says dp: %d; this launch of %d processes with tp=%d, pp=%d, cp=%d makes "
                 "dp=%d, which is used", topo.dp, world_size, sizes["tp"], sizes["pp"], sizes["cp"], layout.dp)
    return spec.with_overrides(topology={"dp": layout.dp, **sizes}), layout.ranks_of(rank)


def layout_of(spec: Spec) -> dict:
    """What shapes a step (not which samples come): a checkpoint's step was planned on this."""
    return {"dp": spec.topology.dp, "microbatches": spec.packing.num_microbatches, "seq_len": spec.packing.seq_len}


def resume_start(state: dict, spec: Spec, runtime, allow_spec_change: bool = False) -> tuple[dict, int, ClientState]:
    """(data state to load, next micro-batch, the parsed state): where a saved Loader state resumes on
    `spec`. The one reading of a state to resume, for `Loader.load_state_dict` and `plait run --resume`,
    so that both refuse the same states: its shape, ranges and checksum (check_client_state); the state
    after a finished step (`next`) only under a spec or layout change; on another layout the consumed step
    re-planned (elastic_start). The runtime's load_state_dict then checks the data state against the spec
    and the sources (cursors, carried chunks, sources)."""
    if isinstance(state, dict) and set(state) == {"data"}:  # a `plait run --save-state` file of plait <= 0.x
        state = {"version": 1, "data": state["data"], "next_microbatch": 0}
    per_rank = spec.packing.num_microbatches
    parsed = check_client_state(state, 2 * per_rank if spec.balance.mode == "variable" else per_rank, spec)
    if allow_spec_change or state.get("layout") not in (None, layout_of(spec)):
        state = after_consumed_step(state, parsed.at_step_boundary)
    data, micro = elastic_start(state, spec, runtime)
    return data, micro, parsed


def elastic_start(state: dict, spec: Spec, runtime) -> tuple[dict, int]:
    """(data state, next micro-batch) to resume a client state from on `spec`'s layout: on another layout
    (DP size, micro-batches) only from a step boundary, whose step the job re-plans on the saved layout
    (plait.job.elastic, through the runtime): the state after it is layout-free, no sample lost or repeated."""
    data, micro = state["data"], int(state["next_microbatch"])
    saved, now = state.get("layout"), layout_of(spec)
    if saved is None or saved == now:
        return data, micro
    changed = ", ".join(f"{k} {saved[k]} -> {v}" for k, v in now.items() if saved.get(k) != v)
    if 0 < micro < saved["microbatches"]:
        raise PlaitError(
            f"this checkpoint was taken in the middle of a step (after micro-batch {micro - 1} of "
            f"{saved['microbatches']}) on {saved['dp']} DP ranks; resuming on a different layout "
            f"({now}) needs a checkpoint taken at a step boundary"
        )
    if micro:
        data = runtime.replan_after(data, saved)  # plait.job.elastic, on the job's side
    warnings.warn(
        f"resuming on a different layout ({changed}): the data continues exactly, but a step now holds a "
        "different number of tokens, so step-keyed schedules (learning rate) drift; key them on "
        "state_dict()['tokens_seen'] instead",
        LayoutChangeWarning, stacklevel=3,
    )
    return data, 0


class LayoutChangeWarning(UserWarning):
    """A state saved on one layout (dp, micro-batches, seq_len) was resumed on another."""


class DistributedCheckpoint:
    """A Loader as a `torch.distributed.checkpoint` Stateful: `dcp.save({"data": DistributedCheckpoint(loader),
    "model": ...}, checkpoint_id=path)` and `dcp.load(...)` with a new one before iterating.

    The state travels as one JSON string: its lists (carried chunks) change length from step to step,
    which DCP's in-place loading of nested containers would not allow.
    """

    KEY = "plait_loader_state"

    def __init__(self, loader: "Loader"):
        self.loader = loader

    def state_dict(self) -> dict:
        return {self.KEY: json.dumps(self.loader.state_dict(), separators=(",", ":"))}

    def load_state_dict(self, state_dict: dict) -> None:
        try:
            state = json.loads(state_dict[self.KEY])
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise PlaitError(f"this checkpoint holds no plait Loader state ({type(e).__name__}: {e})") from None
        self.loader.load_state_dict(state)


class _Done:
    pass


def _read_ahead(gen: Iterator, depth: int) -> Iterator:
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
