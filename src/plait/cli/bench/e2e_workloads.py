"""The workloads of `plait bench e2e` besides the image mixture on Ray (plait.cli.bench.e2e):

  long-context  pre-tokenized short web documents + long documents (4k..128k tokens), seq_len 32k and
                128k, DP 8 and 32. Ranks are threads of one simulated clock: each step every rank's
                micro-batches are taken (both strategies read the same sources: plait's local runtime,
                per-rank greedy packing of each rank's share) and charged the 7B cost model's time, whose
                attention term dominates at these lengths; the step takes its slowest rank. The data is
                pre-tokenized and read ahead, so this row measures what balance buys (the seconds each
                strategy spent producing a step on this machine are reported beside, not charged).
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

import numpy as np

LONG_SEQ = (32768, 131072)
LONG_DPS = (8, 32)
LONG_DATA = "longctx-v1"


# ----- long-context --------------------------------------------------------------------------------
def long_data(cache: Path | None) -> Path:
    """Pre-tokenized `web` (median 700 tokens) and `long` (median 24k, 4k..128k) Parquet, written once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.cli.demo_data import default_cache_dir

    root = (Path(cache) if cache else default_cache_dir().parent) / LONG_DATA
    done = root / "long" / "long-007.parquet"
    if done.exists():
        return root
    rng = np.random.default_rng(20261202)
    for name, files, docs, median, lo, hi in (("web", 8, 600, 700, 32, 16384), ("long", 8, 16, 24000, 4096, 131000)):
        (root / name).mkdir(parents=True, exist_ok=True)
        for f in range(files):
            lengths = np.clip(rng.lognormal(np.log(median), 0.9, docs), lo, hi).astype(np.int64)
            flat = rng.integers(2, 32000, int(lengths.sum()), dtype=np.int32)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            table = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))})
            pq.write_table(table, root / name / f"{name}-{f:03d}.parquet", row_group_size=max(1, docs // 4))
    return root


def step_buffer_mb(dp: int, seq_len: int, microbatches: int) -> float:
    """A source's buffer_mb that holds one global step of tokens (int32) with room to spare. Both
    strategies' ranks run in this one process, so plait's one SourceLoader serves all of them: with the
    default 16 MiB a 128k x DP 32 step (8.4M tokens, 17 MiB a source) did not fit, and each rank's build
    read its blocks again (1,675 row-group reads for 2 steps instead of 124: 28 s of the step's time on a
    loaded machine). Row groups here decode to < 2 MiB, under a quarter of either budget, so the budget
    changes no block and no order: the data is the same."""
    return max(16.0, 2 * dp * seq_len * microbatches * 4 / 2**20)


def long_spec(root: Path, dp: int, seq_len: int, microbatches: int, max_delay: int = 0):
    """`max_delay`: plait's balance.max_delay (outlier documents held until several fill one step; 0: off,
    plait's default). Per-rank packing has no such option and ignores it."""
    from plait.spec import load_spec

    buffer_mb = step_buffer_mb(dp, seq_len, microbatches)
    return load_spec({
        "balance": {"max_delay": max_delay},
        "seed": 5,
        "sources": [{"name": n, "path": str(root / n / "*.parquet"), "tokens_field": "input_ids", "bos": 0, "eos": 1,
                     "weight": 0.5, "buffer_mb": buffer_mb} for n in ("web", "long")],
        "packing": {"seq_len": seq_len, "microbatches": microbatches},
        "topology": {"dp": dp},
        "cost": {"hidden": 4096, "layers": 32, "ffn": 11008, "heads": 32},
    })


def plait_steps(spec, steps: int):
    """Per step, per rank: the document lengths of its micro-batches (plait, local runtime)."""
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    try:
        for _ in range(steps):
            plan = rt.plan()
            yield [[np.diff(mb.cu_seqlens) for mb in rt.build(plan, r)] for r in range(plan.ranks)]
            rt.release()
    finally:
        rt.close()


def per_rank_steps(spec, steps: int):
    """The same from per-rank greedy packing of each rank's share (plait.cli.bench.e2e_per_rank)."""
    from plait.cli.bench.e2e_per_rank import interleave, pack_greedy, source_documents
    from plait.sources import Source

    ranks, mbs = spec.topology.dp, spec.packing.num_microbatches
    weights = np.array([s.weight for s in spec.sources], dtype=np.float64)
    sources = [[Source.of_job(spec, i) for i in range(len(spec.sources))] for _ in range(ranks)]
    packers = [pack_greedy(interleave([source_documents(s, r, ranks) for s in sources[r]], weights),
                           spec.packing.seq_len, None) for r in range(ranks)]
    for _ in range(steps):
        yield [[np.diff(next(packers[r])["cu_seqlens"]) for _ in range(mbs)] for r in range(ranks)]
    for group in sources:
        for s in group:
            s.close()


def step_lower_bound(per_rank, clock) -> float:
    """Seconds no placement of this step's documents over its ranks can beat: max(mean rank, the costliest
    document): a document is never split across ranks (plait.balance.certificate.lower_bound)."""
    docs = np.concatenate([lengths for mbs in per_rank for lengths in mbs])
    costs = clock.llm.text(docs) / clock.flops_per_s
    return max(float(costs.sum()) / len(per_rank), float(costs.max(initial=0.0)))


def simulated_row(steps_iter, clock) -> dict:
    """Rates on the simulated clock: a step takes its slowest rank's compute (data read ahead). Beside
    them, `bound_steps_per_s`: the rate if every step ran at its lower bound (step_lower_bound), and
    the seconds this process spent producing a step (the first one apart: it loads compiled kernels)."""
    from plait.cli.bench.e2e_run import balance_loss

    computes, bounds, tokens, data_s = [], [], 0, []
    t = time.perf_counter()
    for per_rank in steps_iter:
        data_s.append(time.perf_counter() - t)
        computes.append([sum(clock.seconds(lengths, np.zeros(0, np.int64)) for lengths in mbs) for mbs in per_rank])
        bounds.append(step_lower_bound(per_rank, clock))
        tokens += sum(int(lengths.sum()) for mbs in per_rank for lengths in mbs)
        t = time.perf_counter()
    c = np.asarray(computes)
    wall = float(c.max(axis=1).sum())
    return {"steps": len(c), "steps_per_s": len(c) / wall, "tokens_per_s": tokens / wall, "wait_fraction": 0.0,
            "balance_loss": balance_loss(c), "clock": "simulated",
            "bound_steps_per_s": len(c) / float(np.sum(bounds)),
            "max_over_lb": float(np.mean(c.max(axis=1) / np.asarray(bounds))),
            "lb_over_mean": float(np.mean(np.asarray(bounds) / c.mean(axis=1))),
            "first_data_s": float(data_s[0]),
            "data_s_per_step": float(np.mean(data_s[1:])) if len(data_s) > 1 else float(data_s[0])}


def run_long_context(args, err) -> list[dict]:
    from plait.cli.bench.e2e_run import GpuClock, load_average

    root = long_data(Path(args.cache) if args.cache else None)
    seqs = [int(x) for x in str(args.long_seq).split(",")]
    dps = [int(x) for x in str(args.long_dp).split(",")]
    rows = []
    for seq_len in seqs:
        for dp in dps:
            spec = long_spec(root, dp, seq_len, args.microbatches, getattr(args, "long_max_delay", 0))
            clock = GpuClock.of_spec(spec, args.gpu_tflops)
            for strategy, make in (("per-rank", per_rank_steps), ("plait", plait_steps)):
                err.print(f"[bold]e2e[/] long-context {strategy}, DP {dp}, seq_len {seq_len} ...")
                load_before = load_average()
                row = simulated_row(make(spec, args.long_steps), clock)
                row["load_average"] = [load_before, load_average()]
                if strategy == "plait":
                    row["max_delay"] = spec.balance.max_delay
                rows.append({"workload": "long-context", "dp": dp, "seq_len": seq_len, "strategy": strategy, **row})
    return rows


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

    from plait.cli.bench.e2e_run import patient_agents
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
    from plait.cli.bench.e2e_run import run_per_rank

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
    from plait.cli.bench.memory_realistic import start_serve, stop_serve

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

    from plait.cli.bench.e2e_run import run_plait, start_ray

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
        from plait.cli.bench.e2e_per_rank import rank_loaders_for
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
    from plait.cli.bench.memory_realistic import torchrun_env

    dp, workers = args.node_dp, args.node_workers
    spec = spec_of(dp)
    rows = []
    for strategy in ("per-rank", "plait"):
        err.print(f"[bold]e2e[/] node-images {strategy}, DP {dp} processes, {workers} workers ...")
        spec_dict = spec.model_dump(mode="json")
        spec_dict["loading"] = {**spec_dict.get("loading", {}), "workers": workers}
        spec_dict["steps"] = args.node_steps
        run_id = f"e2e-{os.getpid()}-{time.time_ns()}"
        load_before = load_average()
        procs = []
        for r in range(dp):
            cfg = {"strategy": strategy, "spec": spec_dict, "rank": r, "steps": args.node_steps, "warmup": 1,
                   "microbatches": spec.packing.num_microbatches, "workers": max(1, workers // dp),
                   "env": torchrun_env(r, dp, run_id)}
            procs.append(subprocess.Popen([sys.executable, "-m", __name__, "--node-trainer", json.dumps(cfg)],
                                          stdout=subprocess.PIPE, text=True))
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
