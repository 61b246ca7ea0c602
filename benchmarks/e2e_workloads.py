"""`python -m benchmarks.e2e_workloads`: the project's end-to-end workloads beyond `plait bench e2e`'s two
(the same simulated synchronous DP job, per-rank loaders vs plait; plait.cli.bench.e2e explains the job):

  long-context  benchmarks.e2e_long: per-rank, plait, plait-fixed-cp and plait-dcp on two length mixes,
                on a simulated clock (docs/long-context.md); its options are the --long-* ones.
  cpu-pool      the image mixture with the GPU fast enough that delivery sets the pace, where the trainers'
                side is limited to one core (CPU affinity): per-rank DataLoaders must run there. plait's data
                plane may also use the CPU pool (the other cores), which per-rank loaders cannot: this is
                disaggregation. Two plait rows (`--cpu-pool-runtimes`): `serve`, plait's local data plane in
                one `plait serve --runtime local` process pinned to the pool, the trainers reading over
                Arrow Flight (no Ray); `ray`, SourceLoaders on the trainers' Ray node and on a second Ray node
                pinned to the pool, the head node (Ray's control plane, the Planner, the Constructor) on
                the pool as well.
  node-images   the local runtime as torchrun starts it: DP processes with LOCAL_RANK / LOCAL_WORLD_SIZE,
                LOCAL_RANK 0 hosting the node's data plane (plait.runtime.node_share), images/s against
                per-rank DataLoaders with as many worker processes as plait's SourceLoader has threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import e2e as compare
from benchmarks import e2e_long
from benchmarks.common import main
from plait.cli.bench import e2e

HELP = "end to end beyond `plait bench e2e`: long-context (fixed and dynamic CP), cpu-pool, node-images"
DESCRIPTION = __doc__
WORKLOADS = ("long-context", "cpu-pool", "node-images")
TARGETS = {"cpu-pool": 1.8, "node-images": 0.9}  # plait / per-rank (long-context: e2e_long.TARGETS)
QUICK = {**compare.QUICK, "node_dp": 2, "node_workers": 2, "node_steps": 3, **e2e_long.QUICK}
ROOT = Path(__file__).resolve().parents[1]  # node-images trainers run `python -m benchmarks.e2e_workloads`


def add_arguments(p) -> None:
    compare.add_comparison_arguments(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--cpu-pool-runtimes", default="serve,ray",
                   help="cpu-pool: plait's runtimes, one plait row each (serve: `plait serve --runtime local` on the "
                        "pool's cores, trainers over Flight; ray: loaders on two Ray nodes, the trainers' and the pool's)")
    p.add_argument("--node-dp", type=int, default=8, help="node-images: trainer processes on this node")
    p.add_argument("--node-workers", type=int, default=8,
                   help="node-images: plait's loading.workers, and per-rank worker processes in all")
    p.add_argument("--node-steps", type=int, default=5, help="node-images: steps per process (the first is warm-up)")
    e2e_long.add_arguments(p)


def parse(args) -> list[int]:
    from plait.errors import PlaitError

    dps = compare.parse_comparison(args, add_arguments, QUICK)
    args.workload_list = e2e.names("workloads", args.workloads, WORKLOADS)
    args.pool_runtime_list = e2e.names("cpu-pool-runtimes", args.cpu_pool_runtimes, ("serve", "ray"))
    if min(args.node_dp, args.node_workers) < 1 or args.node_steps < 2:
        raise PlaitError("--node-dp and --node-workers must be >= 1, --node-steps >= 2 (the first is warm-up)")
    e2e_long.parse(args)
    return dps


def run(args) -> int:
    from rich.console import Console

    from benchmarks.e2e_per_rank import require_torch
    from benchmarks.e2e_ray import autoscale_available
    from plait.cli.bench.e2e_run import GpuClock

    dps = parse(args)
    require_torch()
    err = Console(stderr=True)
    load_before = os.getloadavg()
    demo, image_dir = e2e.prepare_data(Path(args.cache) if args.cache else None, args.images)
    specs = {dp: e2e.e2e_spec(demo, image_dir, dp, args) for dp in {dps[0], args.node_dp}}
    autoscale = autoscale_available() and not args.no_autoscale
    rows: list[dict] = []
    failures: list[dict] = []  # a workload that failed (Ray not starting on a loaded machine): the others still run

    def attempt(workload: str, fn) -> list[dict]:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported in the result and on stderr, never silently
            failures.append({"workload": workload, "error": f"{type(e).__name__}: {e}"})
            err.print(f"[red]e2e: {workload} failed: {type(e).__name__}: {e}[/]")
            return list(getattr(e, "rows", None) or [])  # the rows it had run (cpu-pool: per-rank's)

    if "long-context" in args.workload_list:
        rows += attempt("long-context", lambda: e2e_long.run_long_context(args, err))
    if "cpu-pool" in args.workload_list:
        clock = GpuClock.of_spec(specs[dps[0]], args.data_bound_tflops)
        rows += attempt("cpu-pool", lambda: run_cpu_pool(args, specs[dps[0]], clock, autoscale, err))
    if "node-images" in args.workload_list:
        rows += attempt("node-images", lambda: run_node_images(args, lambda dp: specs[dp], err))
    code = compare.report(args, rows, failures, load_before, err, e2e_long.long_ratios(rows), TARGETS)
    if not args.quiet and any(r["workload"].startswith("long-context") for r in rows):
        e2e_long.table(rows, e2e_long.long_ratios(rows))
    return code


# ----- cpu-pool: the trainers' core for per-rank loaders, plus a second Ray node's core for plait's ----
CLUSTER_NODES = 3  # the head (the driver's node: the Constructor, the Planner), the trainers', the pool's
STORE_SHARE = 0.3  # ray.init's default object store: this share of the available memory, for one machine
MIN_NODE_STORE = 1 << 30
MAX_NODE_STORE = 4 << 30


def node_object_store() -> int:
    """Bytes of object store for each node of the cpu-pool cluster: what ray.init gives one machine (the
    data-bound Ray row's instance) shared by the cluster's nodes, 1 to 4 GiB each. ray.cluster_utils'
    default, 150 MiB a node, held a fraction of a step's image batches: the head's store (the Constructor
    runs there, beside the driver: its builds and the gathers it pulls from the loaders, ~9 MiB each)
    filled, spilled to disk, and each new object waited Ray's 2 s grace before falling back to a file
    ("Shared memory store full, falling back to allocating from filesystem", restores at 1-10 MiB/s): the
    row measured 0.08x per-rank with every process mostly idle."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(MAX_NODE_STORE, max(MIN_NODE_STORE, STORE_SHARE * available / CLUSTER_NODES)))


def start_cluster(err, object_store_memory: int, tries: int = 3):
    """ray.cluster_utils.Cluster with a head of no CPUs yet and `object_store_memory` bytes of object store,
    tried again when a node does not register within Ray's fixed 30 s (on a loaded machine). Set up as plait
    sets up a Ray instance it starts (plait.runtime.ray.common.long_run_settings): no dashboard, no metrics
    export, bounded task events (the helper's default started the dashboard's seven processes)."""
    from ray.cluster_utils import Cluster

    from benchmarks.e2e_ray import patient_agents
    from plait.runtime.ray.common import long_run_settings

    patient_agents()
    settings, env = long_run_settings()
    for name, value in env.items():
        os.environ.setdefault(name, value)
    head = {"num_cpus": 0, "object_store_memory": object_store_memory, "include_dashboard": False,
            "_system_config": settings["_system_config"]}
    for attempt in range(tries):
        try:
            return Cluster(initialize_head=True, head_node_args=head)
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a slow start
            if "timed out during startup" not in str(e) or attempt == tries - 1:
                raise
            err.print("[yellow]a Ray node did not start in time (loaded machine): trying again[/]")


def run_cpu_pool(args, spec, clock, autoscale: bool, err) -> list[dict]:
    """The trainers' side pinned to the first core this process may use: per-rank DataLoaders run there.
    plait gets the same budget (`--cpus` decode threads or loaders) with the other cores as its CPU pool,
    once per runtime of `args.pool_runtime_list` (serve: plait_served_from_pool; ray: plait_on_two_nodes).
    Per-rank loaders cannot use the pool."""
    from benchmarks.e2e_per_rank import run_per_rank

    saved = os.sched_getaffinity(0)
    cores = sorted(saved)
    if len(cores) < 2:
        err.print("[yellow]cpu-pool needs 2 cores: skipped[/]")
        return []
    trainer, pool = {cores[0]}, set(cores[1:])
    wanted = getattr(args, "strategy_list", ["per-rank", "plait"])
    base = {"workload": "cpu-pool", "dp": spec.topology.dp, "seq_len": spec.packing.seq_len,
            "trainer_cores": sorted(trainer), "pool_cores": sorted(pool)}
    rows = []
    try:
        os.sched_setaffinity(0, trainer)  # the rank threads and the DataLoader workers forked now
        if "per-rank" in wanted:
            err.print(f"[bold]e2e[/] cpu-pool per-rank on core {cores[0]} ...")
            rows.append({**base, "strategy": "per-rank", **run_per_rank(spec, args, clock)})
        if "plait" not in wanted:
            return rows
        for runtime in getattr(args, "pool_runtime_list", ["serve", "ray"]):
            try:
                row = (plait_served_from_pool(args, spec, clock, err, pool) if runtime == "serve"
                       else {"runtime": "ray", **plait_on_two_nodes(args, spec, clock, autoscale, err, trainer, pool)})
            except Exception as e:  # Ray did not start (a loaded machine): the rows so far are still reported
                e.rows = rows
                raise
            rows.append({**base, "strategy": "plait", **row})
    finally:
        os.sched_setaffinity(0, saved)
    return rows


def plait_served_from_pool(args, spec, clock, err, pool: set[int]) -> dict:
    """plait's cpu-pool row on its local data plane served over Flight: one `plait serve --runtime local`
    process on the pool's cores and the trainers' (it plans, reads and decodes on loading.workers = --cpus
    threads, the budget per-rank spends on worker processes, and builds every rank's micro-batches) and the
    trainers (rank threads here, on the trainers' core) reading their micro-batches over Arrow Flight. The
    server may use the trainers' core as the Ray row's SourceLoaders do (half of them run on a node there):
    what the row measures is the pool that per-rank loaders cannot use. Until 2026-12-03 the server was
    pinned to the pool alone, which bounded the row near per-rank's one core (1.0-1.5x). No Ray."""
    import tempfile

    import plait
    from plait.cli.bench.e2e_run import load_average, plait_shape, run_synchronous, summarize
    from benchmarks.processes import start_serve, stop_serve

    served = spec.with_overrides(loading={"workers": args.cpus}).model_dump(mode="json")
    job = f"bench-e2e-pool-{os.getpid()}-{time.time_ns()}"
    trainer = os.sched_getaffinity(0)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="plait-e2e-pool-") as tmp:
        path = Path(tmp) / "spec.yaml"
        path.write_text(json.dumps(served))  # JSON is YAML
        err.print(f"[bold]e2e[/] cpu-pool plait: `plait serve --runtime local` on cores {sorted(pool)}, "
                  f"trainers over Flight on core {min(trainer)} ...")
        t0 = time.perf_counter()
        os.sched_setaffinity(0, pool | trainer)  # the server inherits them: the pool's and the trainers' cores
        try:
            proc, address, token = start_serve(path, job, None, None, dict(os.environ))
        finally:
            os.sched_setaffinity(0, trainer)
        server_cores = sorted(os.sched_getaffinity(proc.pid))
        loaders = []
        try:
            loaders = [plait.Loader(served, dp_rank=r, runtime="flight", job=job, job_address=address, token=token)
                       for r in range(spec.topology.dp)]
            trace = run_synchronous(loaders, args.steps, args.microbatches, clock, plait_shape)
            trace.start = t0
        finally:
            for loader in loaders:
                loader.close()
            stop_serve(proc)
    row = summarize(trace, args.warmup)
    row.update(runtime="serve", workers=args.cpus, server_cores=server_cores, images_delivered=int(trace.images.sum()),
               load_average=[load_before, load_average()])
    return row


def plait_on_two_nodes(args, spec, clock, autoscale: bool, err, trainer: set[int], pool: set[int]) -> dict:
    """plait's cpu-pool row: --cpus loaders at most, half on a Ray node pinned to the trainers' core, half on
    a node pinned to the pool's (a raylet and its workers inherit the affinity they start with).

    The head node (no CPUs) is pinned to the pool too. It is the driver's node, so it holds what needs no
    CPU resource: Ray's control plane (GCS, dashboard, the head raylet), the Planner and its standby
    (num_cpus=0) and the Constructor (hard affinity to the driver's node), as `plait serve` in the serve row
    plans and builds on the pool. Started with the trainers' affinity they took 40-45% of the trainers' core
    (measured: docs/e2e.md, "Fifth session")."""
    import ray

    from benchmarks.e2e_ray import run_plait, start_ray

    here = max(1, args.cpus // 2)
    store = node_object_store()  # not ray.cluster_utils' 150 MiB a node: see node_object_store
    os.sched_setaffinity(0, pool)  # the head on the pool: see this function's docstring
    try:
        cluster = start_cluster(err, store)
    finally:
        os.sched_setaffinity(0, trainer)
    try:
        cluster.add_node(num_cpus=here, object_store_memory=store)  # the trainers' node: loaders beside the trainers
        os.sched_setaffinity(0, pool)
        cluster.add_node(num_cpus=max(1, args.cpus - here), object_store_memory=store)  # the CPU pool
        os.sched_setaffinity(0, trainer)
        start_ray(address=cluster.address)
        err.print(f"[bold]e2e[/] cpu-pool plait: trainers on core {min(trainer)}, SourceLoaders on "
                  f"{min(trainer)} and {sorted(pool)} ...")
        return {"loader_cpus_per_node": [here, max(1, args.cpus - here)], "object_store_mib_per_node": store >> 20,
                "head_cores": sorted(pool),
                **run_plait(spec, args, clock, autoscale, loader_cpus=1)}
    finally:
        ray.shutdown()
        cluster.shutdown()


# ----- node-images: the local runtime under torchrun-style processes --------------------------------
def node_trainer(cfg: dict) -> None:
    """One trainer process: take `steps` steps of its rank, print images delivered and when (JSON)."""
    os.environ.update(cfg["env"])
    rank, steps, mbs = cfg["rank"], cfg["steps"], cfg["microbatches"]
    loader = None
    if cfg["strategy"] == "plait":
        import plait

        loader = plait.Loader(cfg["spec"], dp_rank=rank)
        stream = iter(loader)
        count = lambda mb: int(mb.num_images)  # noqa: E731
    else:
        from benchmarks.e2e_per_rank import rank_loaders_for
        from plait.spec import load_spec

        stream = rank_loaders_for(load_spec(cfg["spec"]), rank, cfg["workers"])
        count = lambda mb: int(len(mb["image_grid"]))  # noqa: E731
    images, start = 0, None
    for s in range(steps):
        if s == cfg["warmup"]:
            start = time.time()
        for _ in range(mbs):
            n = count(next(stream))
            images += n if start is not None else 0
    print(json.dumps({"rank": rank, "images": images, "start": start, "end": time.time()}), flush=True)
    if loader is not None:
        loader.close()  # the node's host serves the others until they have left (plait.runtime.node_share)


def run_node_images(args, spec_of, err) -> list[dict]:
    """DP processes, torchrun's environment each: plait (one SourceLoader, loading.workers = W threads) vs
    per-rank (a DataLoader per process, W / DP worker processes each, at least one)."""
    from plait.cli.bench.e2e_run import load_average
    from plait.cli.bench.memory import torchrun_env

    dp, workers = args.node_dp, args.node_workers
    spec = spec_of(dp)
    rows = []
    for strategy in ("per-rank", "plait"):
        err.print(f"[bold]e2e[/] node-images {strategy}, DP {dp} processes, {workers} workers ...")
        spec_dict = spec.model_dump(mode="json")
        spec_dict["loading"] = {**spec_dict.get("loading", {}), "workers": workers}
        spec_dict["steps"] = args.node_steps
        run_id = f"e2e-{os.getpid()}-{time.time_ns()}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        load_before = load_average()
        procs = []
        for r in range(dp):
            cfg = {"strategy": strategy, "spec": spec_dict, "rank": r, "steps": args.node_steps, "warmup": 1,
                   "microbatches": spec.packing.num_microbatches, "workers": max(1, workers // dp),
                   "env": torchrun_env(r, dp, run_id)}
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.e2e_workloads", "--node-trainer",
                                           json.dumps(cfg)], stdout=subprocess.PIPE, text=True, env=env))
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=900)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"a node-images {strategy} trainer failed (exit {p.returncode})")
            reports.append(json.loads(lines[-1]))
        wall = max(r["end"] for r in reports) - min(r["start"] for r in reports)
        images = sum(r["images"] for r in reports)
        rows.append({"workload": "node-images", "dp": dp, "seq_len": spec.packing.seq_len, "strategy": strategy,
                     "images_per_s": images / wall, "steps_per_s": (args.node_steps - 1) / wall,
                     "tokens_per_s": None, "wait_fraction": None, "balance_loss": None, "workers": workers,
                     "processes": dp + (workers if strategy == "per-rank" else 0),
                     "load_average": [load_before, load_average()]})
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--node-trainer":
        node_trainer(json.loads(sys.argv[2]))
    else:
        sys.exit(main(sys.modules[__name__]))
