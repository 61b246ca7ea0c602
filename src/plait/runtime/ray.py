"""Ray runtime: the Planner, the SourceLoaders and the Constructors are Ray actors.

Wiring (one job; actor names are `<job>/planner`, `<job>/loader-<i>`, `<job>/constructor-<node|rank>`
in the `plait` namespace, so trainer processes started by torchrun attach by job name):

  * Planner actor (one per job) — creates the loader actors and plans every global step exactly once.
    It keeps a window of planned steps; Constructors and clients ask for step t, nobody "advances" it.
    Metadata (block ids, lengths) comes to it from the loaders by `block_meta`; it never sees a token.
  * SourceLoader actors — each owns partitions of one or several sources. A partition is a group of a
    source's files (`partition_of`: file index mod the number of partitions), so the block at key
    (epoch, file_pos, block_pos) belongs to the partition owning file `file_order(epoch)[file_pos]`.
    How many loaders, and which partitions each owns, follows each source's measured cost and mixture
    share (`loaders="auto"`, plait.runtime.scaling): 64 cheap sources share one loader, an expensive
    source is split into partitions spread over several.
  * Constructor actors — one per node (serving the DP replicas of that node; default) or one per DP
    replica (`constructors="replica"`). For (step, dp_rank) it fetches the rank's plan from the Planner,
    pulls the payloads straight from the owning loaders (Ray's object store, never through the Planner),
    packs the micro-batches and keeps `prefetch` steps built ahead. Every TP/PP/CP rank of a replica
    gets the same build.

The stream is the local runtime's, bit for bit: the Planner is the same class fed the same metadata
(`block_meta` is a pure function of the data), and payload gathers are pure functions of block keys.

Ray is imported lazily (plait[ray] is optional); the local runtime never imports this module.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import numpy as np

from plait.errors import PlaitError
from plait.plan import RankPlan, StepPlan
from plait.roles.constructor import Constructor, MicroBatch
from plait.runtime.scaling import (
    Layout,
    deal,
    demand_of,
    describe,
    format_layout,
    plan_layout,
    probe_costs,
)
from plait.spec import Spec, load_spec

# The Planner and SourceLoader (format readers, tokenizers, pyarrow) are imported inside the actors
# that run them: a trainer process holding a client never loads them.

NAMESPACE = "plait"
log = logging.getLogger("plait.recovery")
scale_log = logging.getLogger("plait.scaling")
PLAN_WINDOW = 64  # planned steps the Planner keeps (ranks of one job are at most `prefetch` apart)


def _ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise PlaitError(f"the ray runtime needs `pip install plait[ray]` ({e})") from None
    return ray


def _serialization_without_arrow() -> None:
    """Create this process's Ray serialization context without importing pyarrow, if nothing has yet.

    Ray imports pyarrow (about 25-40 MiB resident, mostly libarrow) when it creates a process's
    serialization context, only to register reducers for Arrow tables and JSON options. A trainer
    process that Ray was started in by plait exchanges numpy arrays and plain objects with plait's
    actors, never Arrow data, so the context is created while pyarrow reads as absent (Ray then skips
    those reducers; Arrow objects still serialize, by pickle). Where pyarrow is already imported, or
    PLAIT_RAY_ARROW=1, nothing changes.
    """
    import sys

    if "pyarrow" in sys.modules or os.environ.get("PLAIT_RAY_ARROW") == "1":
        return
    try:
        from ray._private.worker import global_worker
    except ImportError:  # pragma: no cover - another Ray layout: keep Ray's default
        return
    sys.modules["pyarrow"] = None  # `import pyarrow` raises ModuleNotFoundError meanwhile
    try:
        global_worker.get_serialization_context()
    except Exception:  # noqa: BLE001 - created normally on first use instead
        pass
    finally:
        if "pyarrow" in sys.modules and sys.modules["pyarrow"] is None:
            del sys.modules["pyarrow"]


def _get(refs, timeout: float | None = None):
    """ray.get that re-raises plait's own errors as themselves (a bad spec or shard, not a Ray trace)."""
    ray = _ray()
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, PlaitError):
            raise cause from None
        raise


def _dead_errors() -> tuple[type, ...]:
    """Exceptions meaning "the actor you called is dead" (killed, crashed, its node lost)."""
    ray = _ray()
    return (ray.exceptions.RayActorError,)


def _actor_id(handle) -> str:
    return handle._actor_id.hex()


def _wait_name_free(name: str, timeout: float = 10.0) -> None:
    """A dead actor's name is released asynchronously; reusing it too early would find the corpse."""
    ray = _ray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.05)


# ----- partitions ------------------------------------------------------------------------------
def file_order(seed: int, source: int, epoch: int, num_files: int) -> np.ndarray:
    """A source's file order in an epoch; must equal Source.file_order (tested)."""
    from plait.sources.base import _rng

    return _rng(seed, source, epoch).permutation(num_files)


class PartitionMap:
    """Which loader actor owns which block: source -> partitions -> loader index.

    Small: per source its file count and partition count, plus a cache of recent file orders.
    """

    def __init__(self, seed: int, num_files: dict[int, int], num_partitions: dict[int, int],
                 owner: dict[tuple[int, int], int]):
        self.seed = seed
        self.num_files = dict(num_files)
        self.num_partitions = dict(num_partitions)
        self.owner = dict(owner)  # (source, partition) -> loader index
        from plait.roles.source_loader import partition_of

        self._partition_of = partition_of
        self._orders: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def loader_of(self, source: int, epoch: int, fpos: int) -> int:
        order = self._orders.get((source, epoch))
        if order is None:
            order = file_order(self.seed, source, epoch, self.num_files[source])
            self._orders[(source, epoch)] = order
            while len(self._orders) > 4 * max(1, len(self.num_files)):
                self._orders.popitem(last=False)
        part = self._partition_of(int(order[fpos]), self.num_partitions[source])
        return self.owner[(source, part)]


def assign_partitions(spec: Spec, loaders: int, partitions: int | dict[str, int] | None) -> tuple[dict[int, int], list[list[tuple[int, int]]]]:
    """How many partitions each source gets, and which (source, partition) pairs each loader owns.

    Without `partitions`, a source has one partition, except that when there are more loaders than
    sources the heaviest sources (by mixture weight per partition) are split until every loader has
    work. Pairs are dealt to loaders in order, balancing the summed weight per loader.
    """
    weight = np.array([max(s.weight, 1e-9) for s in spec.sources], dtype=np.float64)
    fixed = fixed_partitions(spec, partitions)
    num = {i: fixed.get(i, 1) for i in range(len(spec.sources))}
    free = [i for i in num if i not in fixed]
    while free and sum(num.values()) < loaders:
        i = max(free, key=lambda j: weight[j] / num[j])
        num[i] += 1
    return num, deal(num, weight, loaders)


def fixed_partitions(spec: Spec, partitions: int | dict[str, int] | None) -> dict[int, int]:
    """The `partitions` option as {source index: partitions (>= 1)}: an int fixes every source."""
    if isinstance(partitions, int):
        return {i: max(1, partitions) for i in range(len(spec.sources))}
    unknown = sorted(set(partitions or {}) - set(spec.source_names))
    if unknown:
        raise PlaitError(f"partitions names unknown sources {unknown}")
    return {spec.source_names.index(name): max(1, int(n)) for name, n in (partitions or {}).items()}


def decide_layout(spec: Spec, options: dict) -> Layout:
    """The job's loader layout: a layout decided before (a recreated Planner keeps it), the measured
    auto layout (`loaders="auto"`: probe each source's cost, then `plan_layout`), or an explicit number of
    loaders dealt by mixture weight (`assign_partitions`; no probe)."""
    if options.get("layout"):
        return Layout.from_dict(options["layout"])
    loaders, partitions = options["loaders"], options.get("partitions")
    if loaders != "auto":
        return Layout(*assign_partitions(spec, int(loaders), partitions))
    fixed = fixed_partitions(spec, partitions)
    t0 = time.perf_counter()
    cost, files = _probe_elsewhere(spec)
    demand = demand_of(spec, cost, float(options.get("step_time") or 1.0), options.get("dp"))
    layout = plan_layout(demand, files, int(options.get("cpus") or 1), partitions=fixed)
    layout.cost = cost
    scale_log.info("auto layout: %d loader(s) for %d source(s), probed in %.2f s", layout.loaders,
                   len(spec.sources), time.perf_counter() - t0)
    for line in format_layout(layout, spec.source_names):
        scale_log.info("  %s", line)
    return layout


def _probe_elsewhere(spec: Spec) -> tuple[list[float], list[int]]:
    """probe_costs in a one-off Ray worker process that exits afterwards: what reading and decoding the
    probe's blocks leaves behind (allocator pages, file-system and footer caches: ~60 MiB for 64
    sources) goes with it instead of staying in the Planner for the whole job."""
    ray = _ray()
    task = ray.remote(num_cpus=0, max_calls=1)(_probe_task)
    try:
        return _get(task.remote(spec.model_dump(mode="json")), timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise PlaitError(f"the cost probe (each source's first blocks) took over {PROBE_TIMEOUT_S:.0f} s: is the "
                         "storage reachable? Pass loaders=N to skip the probe") from None


PROBE_TIMEOUT_S = 600.0


def _probe_task(spec_dict: dict) -> tuple[list[float], list[int]]:
    return probe_costs(load_spec(spec_dict))


def check_reachable(address: str | None, timeout: float = 3.0) -> None:
    """Fail fast on an explicit cluster address nobody listens on (Ray itself retries for a long time).

    Only `host:port` and `ray://host:port` are checked (one TCP connect); `auto`, `local` and None are
    left to Ray.
    """
    if not address or address in ("auto", "local"):
        return
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise PlaitError(f"cannot reach the Ray cluster at {address!r}: {e.strerror or e} (is `ray start --head` "
                         "running there? leave --address unset to start a local instance)") from None


# ----- actors (plain classes; wrapped with ray.remote when first used) -------------------------------
def _numpy_kernels() -> None:
    """Loader and Constructor actors copy a few spans per request: the numpy kernels (same values) do it
    without importing numba and llvmlite (60-80 MiB per process). The Planner keeps compiled balancing."""
    from plait import kernels

    kernels.use_compiled(False)


class LoaderActor:
    """A SourceLoader owning some partitions of some sources."""

    def __init__(self, spec_dict: dict, owned: list[tuple[int, int]], num_partitions: dict[int, int],
                 max_cached_blocks: int):
        _numpy_kernels()
        from plait.roles.source_loader import SourceLoader

        spec = load_spec(spec_dict)
        parts: dict[int, tuple[int, set[int]]] = {}
        for s, p in owned:
            parts.setdefault(s, (num_partitions[s], set()))[1].add(p)
        self.loader = SourceLoader(spec, max_cached_blocks=max_cached_blocks, partitions=parts)
        self._lock = threading.Lock()  # SourceLoader and its readers are not thread-safe

    def num_files(self) -> dict[int, int]:
        return self.loader.num_files()

    def first_keys(self, sources: list[int]) -> dict[int, tuple[int, int, int]]:
        with self._lock:
            return {s: self.loader.first_key(s) for s in sources}

    def block_meta(self, source: int, key):
        with self._lock:
            return self.loader.block_meta(source, tuple(key))

    def gather(self, source, keys, block_index, position, offset, length) -> np.ndarray:
        with self._lock:
            return self.loader.gather(source, keys, block_index, position, offset, length)

    def retain(self, live) -> None:
        with self._lock:
            mine = {k for k in live if k[0] in self.loader.sources}
            self.loader.retain(mine)

    def stats(self) -> dict:
        with self._lock:
            return {"blocks_read": self.loader.blocks_read, "cached_bytes": self.loader.cached_bytes,
                    "sources": sorted(self.loader.sources), "pid": os.getpid()}

    def error_report(self) -> dict:
        with self._lock:
            return self.loader.error_report()

    def close(self) -> None:
        with self._lock:
            self.loader.close()

    # differential checkpoints, for this loader's shadows (plait.checkpoint)
    def checkpoint_delta(self, step: int | None = None) -> dict:
        with self._lock:
            return self.loader.checkpoint_delta(step)

    def checkpoint_snapshot(self, step: int | None = None) -> dict:
        with self._lock:
            return self.loader.checkpoint_snapshot(step)


class ShadowActor(LoaderActor):
    """A standby loader for the same partitions as its primary (plait.roles.shadow).

    It follows the primary's deltas (decoding the blocks the primary buffers) and serves nothing until
    the Planner `promote`s it, after which it is the partitions' owner, a LoaderActor like any other.
    """

    def __init__(self, spec_dict: dict, owned: list[tuple[int, int]], num_partitions: dict[int, int],
                 max_cached_blocks: int, primary: str):
        _numpy_kernels()
        from plait.roles.shadow import ShadowLoader

        spec = load_spec(spec_dict)
        parts: dict[int, tuple[int, set[int]]] = {}
        for s, p in owned:
            parts.setdefault(s, (num_partitions[s], set()))[1].add(p)
        self.loader = ShadowLoader(spec, max_cached_blocks=max_cached_blocks, partitions=parts, primary=primary)
        self._lock = threading.Lock()

    def follow(self, delta: dict) -> int:
        with self._lock:
            return self.loader.follow(delta) if self.loader.standby else 0

    def sync(self, snapshot: dict) -> int:
        with self._lock:
            return self.loader.sync(snapshot) if self.loader.standby else 0

    def promote(self) -> dict:
        with self._lock:
            return self.loader.promote()

    def shadow_stats(self) -> dict:
        with self._lock:
            ld = self.loader
            return {"deltas": ld.deltas_applied, "delta_bytes": ld.delta_bytes, "prefetched": ld.blocks_prefetched,
                    "standby": ld.standby, "buffered": len(ld.buffered_keys())}


class _Metadata:
    """The Planner's MetadataProvider: asks the loader that owns each block."""

    def __init__(self, loaders, pmap: PartitionMap, first_keys: dict[int, tuple], on_dead=None):
        self.loaders = loaders
        self.pmap = pmap
        self._first = first_keys
        self.on_dead = on_dead  # (loader index, dead handle) -> None: replaces it in `loaders`

    def first_key(self, source: int):
        return self._first[source]

    def block_meta(self, source: int, key):
        owner = self.pmap.loader_of(source, key[0], key[1])
        while True:
            handle = self.loaders[owner]
            try:
                return _get(handle.block_meta.remote(source, tuple(key)))
            except _dead_errors():
                if self.on_dead is None:
                    raise
                self.on_dead(owner, handle)  # metadata is a pure function of the key: ask the new owner


class StaleGeneration(PlaitError):
    """The plan stream was reset (a client resumed from another data state) under this request."""


class PlannerActor:
    """The job's one Planner, plus the bookkeeping of a shared, windowed plan stream."""

    def __init__(self, spec_dict: dict, job: str, options: dict):
        ray = _ray()
        self.spec = load_spec(spec_dict)
        self.job = job
        self.options = options
        self.layout = decide_layout(self.spec, options)
        num_parts, owned, loaders = self.layout.num_partitions, self.layout.owned, self.layout.loaders
        remote = ray.remote(LoaderActor)
        lifetime = options.get("lifetime")
        self.loaders = []
        for k in range(loaders):
            opts: dict[str, Any] = dict(name=f"{job}/loader-{k}", namespace=NAMESPACE, get_if_exists=True,
                                        num_cpus=options.get("loader_cpus", 0), max_concurrency=4,
                                        scheduling_strategy="SPREAD")
            if lifetime:
                opts["lifetime"] = lifetime
            self.loaders.append(remote.options(**opts).remote(
                spec_dict, owned[k], num_parts, int(options.get("max_cached_blocks", 256))))
        num_files: dict[int, int] = {}
        for counts in _get([ld.num_files.remote() for ld in self.loaders]):
            num_files.update({int(s): n for s, n in counts.items()})
        owner = {pair: k for k, pairs in enumerate(owned) for pair in pairs}
        self.pmap = PartitionMap(self.spec.seed, num_files, num_parts, owner)
        by_loader: dict[int, list[int]] = {}
        for s in range(len(self.spec.sources)):
            by_loader.setdefault(owner[(s, 0)], []).append(s)
        first: dict[int, tuple] = {}
        for part in _get([self.loaders[k].first_keys.remote(srcs) for k, srcs in by_loader.items()]):
            first.update({int(s): tuple(v) for s, v in part.items()})
        from plait.roles.planner import Planner

        self.planner = Planner(self.spec, _Metadata(self.loaders, self.pmap, first, on_dead=self._loader_died),
                               dp=options.get("dp"))
        self._init_recovery(spec_dict, owned, num_parts, options)
        self.gen = 0
        self.window: OrderedDict[int, StepPlan] = OrderedDict()
        self.base_state = self.planner.state_dict()
        self.built: dict[int, set[int]] = {}
        self.planned = 0  # steps planned in total (each exactly once per generation)
        self.clients = 0
        self.constructors: set[str] = set()

    # ----- shared plan stream --------------------------------------------------------------------
    def info(self) -> dict:
        return {"gen": self.gen, "fingerprint": self.spec.data_fingerprint(), "ranks": self.planner.ranks,
                "loaders": len(self.loaders), "num_files": self.pmap.num_files,
                "num_partitions": self.pmap.num_partitions, "owner": self.pmap.owner, "seed": self.spec.seed,
                "layout": self.layout.to_dict()}

    def get_loaders(self) -> list:
        return self.loaders

    def seek(self, state: dict) -> int:
        """Make step state['step'] start from `state`; a no-op when the stream already does."""
        step = int(state["step"])
        plan = self.window.get(step)
        if plan is not None and plan.state_before == state:
            return self.gen
        if plan is None and self.planner.step == step and self.planner.state_dict() == state:
            return self.gen
        self.planner.load_state_dict(state)  # validates version and fingerprint
        self.window.clear()
        self.built.clear()
        self.base_state = self.planner.state_dict()
        self.gen += 1
        return self.gen

    def _plan(self, gen: int, step: int) -> StepPlan:
        if gen != self.gen:
            raise StaleGeneration(f"the plan stream was reset (generation {self.gen}, asked {gen})")
        if step in self.window:
            return self.window[step]
        if step < self.planner.step:
            raise PlaitError(f"step {step} left the Planner's window; resume from a saved state")
        while self.planner.step <= step:
            plan = self.planner.plan_step()
            self.planned += 1
            self.window[plan.step] = plan
            while len(self.window) > PLAN_WINDOW:
                old, _ = self.window.popitem(last=False)
                self.built.pop(old, None)
        self._release()
        self._checkpoint()
        return self.window[step]

    def step_plan(self, gen: int, step: int) -> StepPlan:
        return self._plan(gen, step)

    def rank_plan(self, gen: int, step: int, dp_rank: int) -> RankPlan:
        return self._plan(gen, step).for_rank(dp_rank)

    def state_at(self, gen: int, step: int) -> dict:
        if gen == self.gen and step == self.base_state["step"]:
            return self.base_state
        if gen == self.gen and step == self.planner.step:
            return self.planner.state_dict()
        return self._plan(gen, step).state_before

    def mark_built(self, gen: int, step: int, dp_rank: int) -> None:
        if gen != self.gen or step not in self.window:
            return
        done = self.built.setdefault(step, set())
        done.add(dp_rank)
        if len(done) == self.planner.ranks:
            self._release()

    def _release(self) -> None:
        """Tell loaders which blocks are still live: the Planner's own, and those of unbuilt steps."""
        live = self.planner.live_blocks()
        for step, plan in self.window.items():
            if len(self.built.get(step, ())) < self.planner.ranks:
                live.update(plan.items.block_keys()[0])
        for ld in self.loaders:
            ld.retain.remote(live)

    def stats(self) -> dict:
        return {"planned": self.planned, "step": self.planner.step, "gen": self.gen, "clients": self.clients,
                "constructors": sorted(self.constructors)}

    # ----- lifetime -----------------------------------------------------------------------------
    def attach(self, fingerprint: str) -> int:
        if fingerprint != self.spec.data_fingerprint():
            raise PlaitError(f"job {self.job!r} runs a different spec (data fingerprint differs)")
        self.clients += 1
        return self.clients

    def register_constructor(self, name: str) -> None:
        self.constructors.add(name)

    def base(self) -> tuple[int, dict]:
        """The current generation and the data state it started from."""
        return self.gen, self.base_state

    def detach(self) -> int:
        self.clients -= 1
        return self.clients

    def error_report(self) -> dict:
        out: dict[str, dict] = {}
        for rep in self._each_loader("error_report"):
            for name, r in rep.items():
                agg = out.setdefault(name, {"skipped": 0, "messages": []})
                agg["skipped"] += r["skipped"]
                agg["messages"].extend(m for m in r["messages"] if m not in agg["messages"])
        return out

    def loader_stats(self) -> list[dict]:
        return self._each_loader("stats")

    # ----- fault tolerance: shadows, deltas, loader replacement ---------------------------------------
    def _init_recovery(self, spec_dict: dict, owned: list, num_parts: dict, options: dict) -> None:
        self._loader_args = (spec_dict, owned, num_parts, int(options.get("max_cached_blocks", 256)))
        self.checkpoint_interval = max(1, int(options.get("checkpoint_interval") or 1))
        self.loader_gen = [0] * len(self.loaders)
        self.loader_names = [f"{self.job}/loader-{k}" for k in range(len(self.loaders))]
        self.recovery_log: list[dict] = []
        self._last_delta_step = -1
        self.respawn_delay = int(options.get("respawn_delay", 4))
        self._respawn: list[tuple[int, int]] = []  # (loader index, step at which a new shadow starts)
        self._follows: dict[int, list] = {}  # loader index -> [(shadow, ref of its last follow calls)]
        self.shadows = [[self._new_shadow(k) for _ in range(self._shadow_count(k))] for k in range(len(self.loaders))]

    def _shadow_count(self, k: int) -> int:
        return max((self.spec.sources[s].shadows for s, _ in self._loader_args[1][k]), default=0)

    def _new_shadow(self, k: int):
        ray = _ray()
        spec_dict, owned, num_parts, cached = self._loader_args
        return ray.remote(ShadowActor).options(
            num_cpus=self.options.get("loader_cpus", 0), max_concurrency=4, scheduling_strategy="SPREAD",
        ).remote(spec_dict, owned[k], num_parts, cached, self.loader_names[k])

    def _checkpoint(self) -> None:
        """Every `checkpoint_interval` steps, each loader's delta goes to its shadows (object store,
        loader to shadow; the Planner only passes the reference). Right after planning: the shadows
        then decode the blocks the new steps need while the Constructors fetch them."""
        step = self.planner.step
        self._check_shadows()
        due = [(k, at) for k, at in self._respawn if step >= at]
        self._respawn = [r for r in self._respawn if r not in due]
        for k, _ in due:
            sh = self._new_shadow(k)
            sh.sync.remote(self.loaders[k].checkpoint_snapshot.remote(step))
            self.shadows[k].append(sh)
            log.info("standby: a new shadow of %s starts at step %d", self.loader_names[k], step)
            self.recovery_log.append({"role": "shadow-start", "actor": self.loader_names[k], "step": step,
                                      "at": time.time()})
        if step - self._last_delta_step < self.checkpoint_interval:
            return
        self._last_delta_step = step
        for k, ld in enumerate(self.loaders):
            if self.shadows[k]:
                ref = ld.checkpoint_delta.remote(step)
                follows = self._follows.setdefault(k, [])
                for sh in self.shadows[k]:
                    follows.append((sh, sh.follow.remote(ref)))
                del follows[: max(0, len(follows) - 16 * len(self.shadows[k]))]

    def _check_shadows(self) -> None:
        """Find dead shadows from their finished follow calls (no extra traffic), replace them later."""
        ray = _ray()
        for k, follows in self._follows.items():
            done = [(sh, ref) for sh, ref in follows if ray.wait([ref], timeout=0)[0]]
            for pair in done:
                follows.remove(pair)
            failed = []
            for sh, ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead shadow, or a delta from a dead primary
                    failed.append(sh)
            for sh in {_actor_id(h): h for h in failed}.values():
                if not any(_actor_id(sh) == _actor_id(x) for x in self.shadows[k]):
                    continue
                try:
                    _get(sh.shadow_stats.remote(), timeout=30)
                    continue  # alive: the delta's primary died (handled where it is detected)
                except _dead_errors():
                    pass
                self.shadows[k] = [x for x in self.shadows[k] if _actor_id(x) != _actor_id(sh)]
                log.warning("failure: a shadow of SourceLoader %s is dead; detected at step %d; a new one starts "
                            "in %d steps", self.loader_names[k], self.planner.step, self.respawn_delay)
                self.recovery_log.append({"role": "shadow", "actor": self.loader_names[k], "step": self.planner.step,
                                          "at": time.time(), "recovery_s": 0.0})
                self._respawn.append((k, self.planner.step + self.respawn_delay))

    def _loader_died(self, k: int, handle) -> None:
        if _actor_id(self.loaders[k]) == _actor_id(handle):
            self._replace_loader(k)

    def replace_loader(self, k: int, dead_id: str) -> list:
        """Called by a Constructor whose gather found loader k dead; returns the current handles."""
        if _actor_id(self.loaders[k]) == dead_id:
            self._replace_loader(k)
        return self.loaders

    def _replace_loader(self, k: int) -> None:
        """Promote a shadow of loader k (or start a fresh loader) and give it loader k's partitions.

        Exact either way: the new owner answers block_meta and gather for the same keys with the same
        bytes. A promoted shadow already holds what the primary buffered at its last delta and re-reads
        only what it lacks; a fresh loader re-reads every block still needed, on demand."""
        ray = _ray()
        t0 = time.perf_counter()
        dead = self.loader_names[k]
        sources = sorted({self.spec.sources[s].name for s, _ in self._loader_args[1][k]})
        log.warning("failure: SourceLoader %s (sources %s) is dead; detected at step %d",
                    dead, ",".join(sources), self.planner.step)
        self.loader_gen[k] += 1
        new, info = None, {}
        while self.shadows[k] and new is None:
            sh = self.shadows[k].pop(0)
            try:
                info = _get(sh.promote.remote())
                new = sh
            except _dead_errors():
                continue
        if new is not None:
            how = f"shadow promoted, re-read {info['reread_blocks']} of {info['held_blocks']} buffered blocks"
        else:
            spec_dict, owned, num_parts, cached = self._loader_args
            opts: dict[str, Any] = dict(name=f"{dead.split('~')[0]}~{self.loader_gen[k]}", namespace=NAMESPACE,
                                        num_cpus=self.options.get("loader_cpus", 0), max_concurrency=4,
                                        scheduling_strategy="SPREAD")
            if self.options.get("lifetime"):
                opts["lifetime"] = self.options["lifetime"]
            new = ray.remote(LoaderActor).options(**opts).remote(spec_dict, owned[k], num_parts, cached)
            how = "restarted cold (no shadow left): blocks are re-read on demand"
        self.loaders[k] = new  # in place: the metadata provider shares this list
        self.loader_names[k] = f"{dead.split('~')[0]}~{self.loader_gen[k]}"
        self._release()
        if self._shadow_count(k):
            # Keep the standby count, but not now: starting a worker process costs a second of CPU
            # that the failure step should not pay. It starts a few steps later, from a snapshot.
            self._respawn.append((k, self.planner.step + self.respawn_delay))
        took = time.perf_counter() - t0
        log.warning("recovery: SourceLoader %s replaced by %s (%s) in %.3f s", dead, self.loader_names[k], how, took)
        self.recovery_log.append({"role": "loader", "actor": dead, "replacement": self.loader_names[k],
                                  "step": self.planner.step, "at": time.time(), "recovery_s": took, "how": how,
                                  "reread_blocks": info.get("reread_blocks")})

    def _each_loader(self, method: str, *args) -> list:
        out = []
        for k in range(len(self.loaders)):
            while True:
                handle = self.loaders[k]
                try:
                    out.append(_get(getattr(handle, method).remote(*args)))
                    break
                except _dead_errors():
                    self._loader_died(k, handle)
        return out

    def recovery_events(self) -> list[dict]:
        return list(self.recovery_log)

    def get_shadows(self) -> list[list]:
        return self.shadows

    def shadow_stats(self) -> list[list[dict]]:
        return [_get([sh.shadow_stats.remote() for sh in group]) for group in self.shadows]

    def shutdown(self) -> None:
        ray = _ray()
        try:
            _get([ld.close.remote() for ld in self.loaders], timeout=30)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        for name in self.constructors:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            except Exception:  # noqa: BLE001
                pass
        for ld in self.loaders + [sh for group in getattr(self, "shadows", []) for sh in group]:
            ray.kill(ld)


class _RayConstructor(Constructor):
    """The Constructor with payloads pulled from the owning loader actors, in parallel."""

    def __init__(self, loaders, pmap: PartitionMap, planner=None):
        super().__init__(lambda source: None)
        self.loaders = loaders
        self.pmap = pmap
        self.planner = planner  # asked to replace a loader found dead (None: errors propagate)

    def _fetch(self, items) -> np.ndarray:
        from plait.packing import ragged_arange

        if not len(items):
            return np.zeros(0, dtype=np.int32)
        keys, block_index = items.block_keys()
        owner_of_block = np.array([self.pmap.loader_of(k[0], k[1], k[2]) for k in keys], dtype=np.int64)
        owner = owner_of_block[block_index]
        refs, sels, owners = [], [], []
        for k in np.unique(owner):
            sel = np.flatnonzero(owner == k)
            sels.append(sel)
            owners.append((int(k), self.loaders[int(k)]))
            refs.append(self.loaders[int(k)].gather.remote(
                items.source[sel], keys, block_index[sel], items.position[sel], items.offset[sel], items.length[sel]))
        parts = self._collect(refs, sels, owners, items, keys, block_index)
        if len(parts) == 1:
            return parts[0]
        out = np.empty(int(items.length.sum()), dtype=np.int32)
        starts = np.cumsum(items.length) - items.length
        for sel, part in zip(sels, parts):
            out[ragged_arange(starts[sel], items.length[sel])] = part
        return out

    def _collect(self, refs, sels, owners, items, keys, block_index) -> list:
        """Each loader's part; a part whose loader died is asked again of the loader's replacement."""
        try:
            return _get(refs)
        except _dead_errors():
            if self.planner is None:
                raise
        parts = []
        for ref, sel, (k, handle) in zip(refs, sels, owners):
            while True:
                try:
                    parts.append(_get(ref))
                    break
                except _dead_errors():
                    self.loaders[:] = _get(self.planner.replace_loader.remote(k, _actor_id(handle)))
                    handle = self.loaders[k]
                    ref = handle.gather.remote(items.source[sel], keys, block_index[sel], items.position[sel],
                                               items.offset[sel], items.length[sel])
        return parts


class ConstructorActor:
    """Builds (step, dp_rank) once for all ranks of the replica, `prefetch` steps ahead."""

    def __init__(self, job: str, prefetch: int, threads: int = 2):
        _numpy_kernels()
        ray = _ray()
        self.planner = ray.get_actor(f"{job}/planner", namespace=NAMESPACE)
        info = _get(self.planner.info.remote())
        loaders = _get(self.planner.get_loaders.remote())
        pmap = PartitionMap(info["seed"], info["num_files"], info["num_partitions"], info["owner"])
        self.constructor = _RayConstructor(loaders, pmap, planner=self.planner)
        self.prefetch = max(0, int(prefetch))
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="plait-build")
        self.lock = threading.Lock()
        self.builds: dict[tuple[int, int, int], Future] = {}
        self.waits = 0  # requests that found their build not finished yet
        self.requests = 0

    def _build(self, gen: int, step: int, dp_rank: int) -> tuple[dict, list[MicroBatch]]:
        plan, state = _get([self.planner.rank_plan.remote(gen, step, dp_rank),
                            self.planner.state_at.remote(gen, step)])
        batches = self.constructor.build(plan)
        self.planner.mark_built.remote(gen, step, dp_rank)
        return state, batches

    def _ensure(self, gen: int, step: int, dp_rank: int) -> Future:
        key = (gen, step, dp_rank)
        fut = self.builds.get(key)
        if fut is None:
            fut = self.pool.submit(self._build, gen, step, dp_rank)
            self.builds[key] = fut
        return fut

    def get(self, gen: int, step: int, dp_rank: int, limit: int | None = None,
            cp: tuple[int, int] | None = None) -> tuple[dict, list[MicroBatch]]:
        """(state at the start of `step`, the rank's micro-batches of `step`); with cp=(size, rank), that
        CP rank's shard of each (the build is shared; only the shard travels to the trainer)."""
        if cp is not None and cp[0] > 1:
            from plait.context_parallel import shard_for_cp

            state, batches = self.get(gen, step, dp_rank, limit)
            return state, [shard_for_cp(mb, cp[0], cp[1]) for mb in batches]
        with self.lock:
            fut = self._ensure(gen, step, dp_rank)
            for k in range(1, self.prefetch + 1):
                if limit is None or step + k < limit:
                    self._ensure(gen, step + k, dp_rank)
            # Keep a little history: other TP/PP/CP ranks of the replica may still ask for it.
            for key in [k for k in self.builds if k[2] == dp_rank and (k[0] != gen or k[1] < step - self.prefetch - 1)]:
                self.builds.pop(key).cancel()
            self.requests += 1
            if not fut.done():
                self.waits += 1
        try:
            return fut.result()
        except BaseException:
            with self.lock:
                self.builds.pop((gen, step, dp_rank), None)
            raise

    def stats(self) -> dict:
        return {"requests": self.requests, "waits": self.waits, "pid": os.getpid(), "cached": len(self.builds)}


# ----- the runtime (driver / client side) ------------------------------------------------------------
def _loaders_option(loaders) -> int | str:
    if loaders is None or loaders == "auto":
        return "auto"
    try:
        n = int(loaders)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(loaders, float) and loaders != n):
        raise PlaitError(f"loaders must be 'auto' or a positive integer, not {loaders!r}")
    return n


class RayRuntime:
    """The runtime interface (see plait.runtime) over Ray actors.

    Options:
      job           name shared by all trainer processes of one job (they attach); default: private
      address       Ray address (`auto`, `ray://host:10001`); default: the running one, else a local one
      loaders       "auto" (default) or a number of SourceLoader actors. auto: each source's cost per token
                    is measured (plait.runtime.scaling.probe_costs); loaders follow the total demand (cost x
                    mixture share x tokens per step / step_time), at most one per CPU of the cluster and
                    one per partition; an expensive source is split over several loaders, cheap ones share
                    one; pairs are dealt by measured demand. A number: dealt by mixture weight, no probe.
      partitions    int (every source) or {source: n}: partitions per source (default: from the measured
                    demand with auto; else 1, more when there are more loaders than sources)
      step_time     seconds per training step the loaders must keep up with (auto only; default 1.0):
                    each loader is sized to be busy at most half of it
      on_layout     called with the layout, one row per loader (plait.runtime.scaling.describe), once
      prefetch      steps each Constructor builds ahead (default 2)
      constructors  "node" (one per node, default) or "replica" (one per DP replica)
      dp            override the topology's DP size
      loader_cpus   CPUs each loader actor reserves (default 0: placement by spreading only)
      max_cached_blocks  decoded blocks a loader keeps (LRU; plus what plans still need)
      cp_rank       the client's CP rank: iter_rank then yields CP shards, cut by the Constructor
      checkpoint_interval  steps between loader deltas to their shadows (`shadows` per source in the spec)
      respawn_delay  steps after a takeover before a new shadow starts (a worker process start-up costs
                    about a second of CPU; it should not land on the failure step)
    """

    def __init__(
        self, spec: Spec, *, job: str | None = None, address: str | None = None, loaders: int | str | None = "auto",
        partitions: int | dict[str, int] | None = None, prefetch: int = 2, constructors: str = "node",
        dp: int | None = None, loader_cpus: float = 0, max_cached_blocks: int = 256, init_options: dict | None = None,
        checkpoint_interval: int = 1, respawn_delay: int = 4, cp_rank: int | None = None, step_time: float = 1.0,
        on_layout: Callable[[list[dict]], None] | None = None,
    ):
        ray = _ray()
        self.spec = load_spec(spec)
        self._started_ray = False
        loaders = _loaders_option(loaders)
        if not (isinstance(step_time, (int, float)) and step_time > 0 and math.isfinite(step_time)):
            raise PlaitError(f"step_time must be a positive number of seconds, not {step_time!r}")
        if not ray.is_initialized():
            check_reachable(address)
            kwargs = dict(init_options or {})
            if address is None:
                kwargs.setdefault("include_dashboard", False)
                self._started_ray = True
            try:
                ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **kwargs)
            except ConnectionError as e:
                raise PlaitError(f"cannot join the Ray cluster at {address!r}: {e} (start one with `ray start "
                                 "--head`, or leave --address unset to start a local instance)") from None
            _serialization_without_arrow()
        if constructors not in ("node", "replica"):
            raise PlaitError(f"constructors must be 'node' or 'replica', not {constructors!r}")
        self.shared = job is not None
        self.cp_rank = cp_rank  # set by a client: its Constructor then sends only this CP rank's shard
        self.job = job or f"job-{uuid.uuid4().hex[:12]}"
        self.prefetch = prefetch
        self.constructor_mode = constructors
        self.dp = dp or self.spec.topology.dp
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        options = {"loaders": loaders, "partitions": partitions, "dp": self.dp, "loader_cpus": loader_cpus,
                   "max_cached_blocks": max_cached_blocks, "lifetime": "detached" if self.shared else None,
                   "checkpoint_interval": checkpoint_interval, "respawn_delay": respawn_delay, "cpus": cpus,
                   "step_time": step_time}
        spec_dict = self.spec.model_dump(mode="json")
        self.planner = ray.remote(PlannerActor).options(
            name=f"{self.job}/planner", namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
            **({"lifetime": "detached"} if self.shared else {}),
        ).remote(spec_dict, self.job, options)
        self.info = _get(self.planner.info.remote())
        if self.info["ranks"] != self.dp:
            raise PlaitError(f"job {self.job!r} plans for {self.info['ranks']} DP ranks, this client's topology has "
                             f"{self.dp}: every trainer process of a job must use the same spec and layout")
        # A recreated Planner keeps this layout (no second probe, same loaders).
        options["layout"] = self.info["layout"]
        self.layout = Layout.from_dict(self.info["layout"])
        if on_layout is not None:
            on_layout(describe(self.layout, self.spec.source_names))
        self._constructors: dict[str, Any] = {}
        self._closed = False
        _get(self.planner.attach.remote(self.spec.data_fingerprint()))
        self._gen, base = _get(self.planner.base.remote())
        self._next_step = int(base["step"])
        self._plan_refs: dict[int, Any] = {}
        self._build_refs: dict[int, Any] = {}
        self._build_step: int | None = None
        self.recovery_log: list[dict] = []  # this process's recoveries (Constructors); loaders: the Planner's
        # To rebuild a dead Planner: how it was made, and the data state of the steps this process is at.
        from plait.checkpoint import PlannerLog

        self._planner_args = (spec_dict, self.job, options)
        self._planner_log = PlannerLog(base)

    # ----- placement -----------------------------------------------------------------------------
    def _constructor_for(self, dp_rank: int):
        ray = _ray()
        if self.constructor_mode == "replica":
            key = f"replica-{dp_rank}"
        else:
            key = f"node-{ray.get_runtime_context().get_node_id()[:16]}"
        handle = self._constructors.get(key)
        if handle is None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            name = f"{self.job}/constructor-{key}"
            opts: dict[str, Any] = dict(
                name=name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_concurrency=64,
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True),
            )
            if self.shared:
                opts["lifetime"] = "detached"
            handle = ray.remote(ConstructorActor).options(**opts).remote(self.job, self.prefetch)
            self.planner.register_constructor.remote(name)
            self._constructors[key] = handle
        return handle

    # ----- driver interface ------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        step = self._next_step
        for k in range(self.prefetch + 1):
            if step + k not in self._plan_refs:
                self._plan_refs[step + k] = self.planner.step_plan.remote(self._gen, step + k)
        while True:
            try:
                plan = _get(self._plan_refs.pop(step))
                break
            except _dead_errors():
                self._planner_died(step)
                self._plan_refs[step] = self.planner.step_plan.remote(self._gen, step)
        self._planner_log.record(plan.state_before)
        self._next_step = step + 1
        # Ask for every rank's build now (the Constructors also start the next `prefetch` steps):
        # build() then only waits.
        self._build_refs = {r: self._constructor_for(r).get.remote(self._gen, step, r) for r in range(plan.ranks)}
        self._build_step = step
        return plan

    def build(self, plan: StepPlan, dp_rank: int, only: set[int] | None = None) -> list[MicroBatch]:
        ref = self._build_refs.pop(dp_rank, None) if self._build_step == plan.step else None
        if ref is None:
            ref = self._constructor_for(dp_rank).get.remote(self._gen, plan.step, dp_rank)
        _, batches = self._get_build(ref, plan.step, dp_rank)
        return [mb for mb in batches if only is None or mb.microbatch in only]

    def _get_build(self, ref, step: int, dp_rank: int, limit: int | None = None):
        """A build's result; if the Constructor died, a new one rebuilds the step (the Planner keeps a
        window of plans and the loaders re-read whatever was released: same bytes)."""
        while True:
            try:
                return _get(ref)
            except _dead_errors():
                if self._planner_alive():
                    self._constructor_died(dp_rank, step)
                else:  # the Constructor failed because the Planner (and its loaders) are gone
                    self._planner_died(step)
                ref = self._constructor_for(dp_rank).get.remote(self._gen, step, dp_rank, limit)

    def _planner_alive(self) -> bool:
        try:
            _get(self.planner.stats.remote(), timeout=60)
            return True
        except _dead_errors():
            return False

    def _planner_died(self, step: int) -> None:
        """Recreate the Planner from the data state this process last saw, plus re-planning.

        The Planner's loaders and shadows die with it (Ray fate-shares actors with their creator;
        detached ones, in a shared job, survive and are found again by name), so the new Planner
        starts loaders that re-read what is needed. The Constructors held the dead Planner's handle
        and are recreated too. Planning is a pure function of the data state: the new Planner plans
        the same steps again, exactly."""
        ray = _ray()
        t0 = time.perf_counter()
        name = f"{self.job}/planner"
        log.warning("failure: Planner %s is dead; detected at step %d", name, step)
        for c in self._constructors.values():
            try:
                ray.kill(c)
            except Exception:  # noqa: BLE001 - may be gone already
                pass
        names = [name] + [f"{self.job}/constructor-{k}" for k in self._constructors]
        if not self.shared:
            names += [f"{self.job}/loader-{k}" for k in range(len(self._planner_args[2]["layout"]["owned"]))]
        for n in names:
            _wait_name_free(n)
        self._constructors.clear()
        state = self._planner_log.latest()
        self.planner = ray.remote(PlannerActor).options(
            name=name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
            **({"lifetime": "detached"} if self.shared else {}),
        ).remote(*self._planner_args)
        self.info = _get(self.planner.info.remote())
        _get(self.planner.attach.remote(self.spec.data_fingerprint()))
        self._gen = _get(self.planner.seek.remote(state))
        for ref in list(self._plan_refs.values()) + list(self._build_refs.values()):
            try:  # collect the errors of requests to the dead actors (else Ray reports them as unhandled)
                _get(ref, timeout=0.5)
            except Exception:  # noqa: BLE001
                pass
        self._plan_refs.clear()
        self._build_refs = {}
        took = time.perf_counter() - t0
        log.warning("recovery: Planner recreated from the data state of step %d (re-plans to step %d; loaders "
                    "restarted) in %.3f s", state["step"], step, took)
        self.recovery_log.append({"role": "planner", "step": step, "from_step": int(state["step"]), "at": time.time(),
                                  "recovery_s": took})

    def _constructor_died(self, dp_rank: int, step: int) -> None:
        ray = _ray()
        t0 = time.perf_counter()
        found = False
        for key, handle in list(self._constructors.items()):
            try:
                _get(handle.stats.remote(), timeout=30)
                continue
            except _dead_errors():
                found = True
            log.warning("failure: Constructor %s/constructor-%s is dead; detected at step %d (rank %d)",
                        self.job, key, step, dp_rank)
            del self._constructors[key]
            for _ in range(50):  # the dead actor's name is released asynchronously
                try:
                    ray.get_actor(f"{self.job}/constructor-{key}", namespace=NAMESPACE)
                except ValueError:
                    break
                time.sleep(0.05)
        if not found:
            return  # already replaced (another rank's request found it first): just ask again
        ranks = [r for r in range(self.dp) if self._constructor_key(r) not in self._constructors]
        for r in ranks:
            self._constructor_for(r)
        took = time.perf_counter() - t0
        log.warning("recovery: Constructor recreated in %.3f s; it rebuilds from step %d for ranks %s",
                    took, step, ranks)
        self.recovery_log.append({"role": "constructor", "step": step, "at": time.time(), "recovery_s": took,
                                  "ranks": ranks})

    def _constructor_key(self, dp_rank: int) -> str:
        if self.constructor_mode == "replica":
            return f"replica-{dp_rank}"
        return f"node-{_ray().get_runtime_context().get_node_id()[:16]}"

    def release(self, *in_flight: StepPlan) -> None:
        """Nothing to do: the Planner tells loaders what is live as Constructors finish steps."""

    def iter_rank(self, dp_rank: int, start_state: dict, start_micro: int, max_steps: int | None
                  ) -> Iterator[tuple[dict, MicroBatch]]:
        """One rank's micro-batches from a data state on. Every rank of the job reads the same,
        once-planned stream; the DP replica's Constructor builds each step once for all its ranks."""
        self._seek(start_state)
        step, skip = int(start_state["step"]), start_micro

        cp = (self.spec.topology.cp, self.cp_rank) if self.cp_rank is not None else None

        def request(t):
            return self._constructor_for(dp_rank).get.remote(self._gen, t, dp_rank, max_steps, cp)

        ahead = request(step) if max_steps is None or step < max_steps else None
        while ahead is not None:
            state, batches = self._get_build(ahead, step, dp_rank, max_steps)
            self._planner_log.record(state)
            nxt = step + 1
            ahead = request(nxt) if max_steps is None or nxt < max_steps else None
            for mb in batches:
                if mb.microbatch >= skip:
                    yield state, mb
            skip = 0
            step = nxt

    def _seek(self, state: dict) -> None:
        gen = _get(self.planner.seek.remote(state))
        if gen != self._gen:
            self._plan_refs.clear()
        self._gen = gen
        self._next_step = int(state["step"])

    def state_dict(self) -> dict:
        return _get(self.planner.state_at.remote(self._gen, self._next_step))

    def load_state_dict(self, state: dict) -> None:
        self._seek(state)

    def error_report(self) -> dict:
        return _get(self.planner.error_report.remote())

    # ----- introspection (tests, benchmarks) ----------------------------------------------------------
    def recovery_events(self) -> list[dict]:
        """Every failure survived so far: SourceLoaders (replaced by the Planner) and Constructors."""
        return _get(self.planner.recovery_events.remote()) + list(self.recovery_log)

    def stats(self) -> dict:
        out = _get(self.planner.stats.remote())
        out["loaders"] = _get(self.planner.loader_stats.remote())
        out["constructors"] = {k: _get(c.stats.remote()) for k, c in self._constructors.items()}
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = _ray()
        try:
            left = _get(self.planner.detach.remote(), timeout=30)
            if left <= 0:
                _get(self.planner.shutdown.remote(), timeout=60)
                for c in self._constructors.values():
                    ray.kill(c)
                ray.kill(self.planner)
        except Exception:  # noqa: BLE001 - closing is best effort; actors die with the driver anyway
            pass
        if self._started_ray:
            ray.shutdown()
