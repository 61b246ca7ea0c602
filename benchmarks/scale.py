"""`python -m benchmarks.scale`: a 10k-GPU job on paper, with the real Planner and placement code.

It runs the real `plait.roles.planner.Planner` over synthetic block metadata (`synthetic.py`: S sources
of four kinds, lognormal document lengths, no files) for a job of DP x TP (x PP x CP) GPUs, and the
real placement (`plait.runtime.placement`: `demand_of`, `plan_layout`, `PartitionMap`) for the
resulting demand at a stated step time and per-token preprocessing cost. From them it reports the
design's scaling figures:

  plan time      the Planner's CPU time per step (one core; the synthetic metadata generation left out),
                 split into drawing (mixture quotas + chunking) and balancing (+ assembling the plan)
  bytes/step     loaders -> Planner (block metadata of the blocks newly read), Planner -> Constructors
                 (every rank's RankPlan, and the data state `state_at` each build fetches), Planner ->
                 loaders (`retain`: the live block set), loaders -> Constructors (payload tokens)
  actors         Planners, SourceLoaders (and partitions), Constructors, shadows
  memory/actor   measured where a process of this benchmark holds it (the Planner), computed from a
                 stated model for the others (loaders: live blocks they own x decoded block size)
  connections    per node: the Planner plus the loaders owning the blocks of the node's ranks' items,
                 from the real plans mapped through the real PartitionMap

Every figure says whether it was measured here or computed, and from what.
"""

from __future__ import annotations

import json
import pickle
import sys
import time

import numpy as np

from benchmarks.common import main, write_result
from benchmarks.synthetic import KINDS, SyntheticMetadata, SyntheticSources
from plait.state.log import diff_state, nbytes

HELP = "scaling figures of a 10k-GPU job on paper: real Planner + placement on synthetic metadata"
DESCRIPTION = __doc__
TOKEN_BYTES = 4  # int32 token ids
BATCH_BYTES_PER_TOKEN = 12  # MicroBatch: input_ids, labels, position_ids (int32 each)
BATCH_BYTES_PER_DOC = 48  # MicroBatch: cu_seqlens (int32), sample_ids (5 x int64), source_ids (int32)
BLOCK_INDEX_BYTES_PER_DOC = 32  # DocBlock: starts, lengths, rows, positions (int64 each)


def add_arguments(p) -> None:
    p.add_argument("--dp", type=int, default=1280, help="data-parallel ranks (default 1280)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--sources", type=int, default=1000, help="number of sources (default 1000)")
    p.add_argument("--steps", type=int, default=5, help="global steps to plan (default 5)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per DP rank per step")
    p.add_argument("--files", type=int, default=64, help="files per source on average (in proportion to weight)")
    p.add_argument("--blocks-per-file", type=int, default=8, help="blocks (row groups) per file")
    p.add_argument("--block-tokens", type=int, default=4 << 20, help="tokens per block (default 4M: 16 MB of int32)")
    p.add_argument("--step-time", type=float, default=1.0, help="training step time the loaders must keep up with (s)")
    p.add_argument("--cpus-per-node", type=int, default=64, help="CPUs per node (caps the loaders at the cluster's)")
    p.add_argument("--shadows", type=int, default=0, help="standby loaders per loader")
    p.add_argument("--prefetch", type=int, default=2, help="steps each Constructor builds ahead (the ray default)")
    p.add_argument("--max-cached-blocks", type=int, default=256, help="a loader's block cache (the ray default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON rows")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


# ----- the job -------------------------------------------------------------------------------------
def make_spec(args, cat: SyntheticSources):
    from plait.spec import load_spec

    sources = cat.spec_sources()
    for s in sources:
        s["shadows"] = args.shadows
    return load_spec({
        "sources": sources,
        "packing": {"seq_len": args.seq_len, "microbatches": args.microbatches},
        "topology": {"dp": args.dp, "tp": args.tp, "pp": args.pp, "cp": args.cp},
        "seed": args.seed,
    })


def nodes_of(args) -> tuple[int, np.ndarray]:
    """(nodes, node of each DP rank). A replica spanning several nodes is built by each of them (one
    Constructor per node); its first node stands for all in the per-node figures (they are equal)."""
    mp = args.tp * args.pp * args.cp
    world = args.dp * mp
    nodes = max(1, -(-world // args.gpus_per_node))
    per_node = max(1, args.gpus_per_node // mp)
    rank_node = np.arange(args.dp) // per_node * max(1, mp // args.gpus_per_node)
    return nodes, rank_node


def make_layout(args, spec, cat: SyntheticSources, nodes: int):
    from plait.runtime.placement import PartitionMap, demand_of, plan_layout

    cost = cat.seconds_per_token()
    demand = demand_of(spec, cost, args.step_time, args.dp)
    layout = plan_layout(demand, cat.num_files.tolist(), nodes * args.cpus_per_node)
    layout.cost = cost
    pmap = PartitionMap(args.seed, {i: int(n) for i, n in enumerate(cat.num_files)}, layout.num_partitions,
                        layout.owner())
    return layout, pmap


# ----- measuring ------------------------------------------------------------------------------------
def timed_planner_class():
    """The real Planner, with its `draw` timed (thread CPU), so a step splits into drawing and the rest."""
    from plait.roles.planner import Planner

    class TimedPlanner(Planner):
        draw_cpu = 0.0

        def draw(self, source: int):
            c0 = time.thread_time()
            try:
                return super().draw(source)
            finally:
                self.draw_cpu += time.thread_time() - c0

    return TimedPlanner


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def plan_nbytes(plan) -> int:
    arrays = [getattr(plan.items, c) for c in ("source", "epoch", "fpos", "bpos", "position", "shard", "row",
                                                "chunk", "offset", "length", "delayed")]
    arrays += [plan.cost, plan.rank, plan.micro, plan.rank_cost, plan.micro_cost, plan.micro_tokens]
    return int(sum(a.nbytes for a in arrays)) + len(json.dumps(plan.state_before))


def connections(plan, pmap, rank_node: np.ndarray, loaders: int) -> dict:
    """Loaders each node's Constructor pulls from this step (the owners of its ranks' items' blocks), and
    nodes each loader serves."""
    keys, block_index = plan.items.block_keys()
    owner_of_block = np.array([pmap.loader_of(k[0], k[1], k[2]) for k in keys], dtype=np.int64)
    owner = owner_of_block[block_index]
    node = rank_node[plan.rank]
    pairs = np.unique(node.astype(np.int64) * loaders + owner)
    per_node = np.bincount(pairs // loaders, minlength=int(rank_node.max()) + 1)[np.unique(rank_node)]
    per_loader = np.bincount(pairs % loaders, minlength=loaders)
    return {"per_node": per_node, "per_loader": per_loader}


def rank_plan_bytes(plan) -> np.ndarray:
    """Pickled RankPlan of every DP rank: what the Planner actor returns to `rank_plan` calls."""
    return np.array([len(pickle.dumps(plan.for_rank(r), protocol=5)) for r in range(plan.ranks)], dtype=np.int64)


def live_per_loader(live: set, pmap, loaders: int) -> np.ndarray:
    count = np.zeros(loaders, dtype=np.int64)
    for s, e, f, _ in live:
        count[pmap.loader_of(s, e, f)] += 1
    return count


def plan_steps(planner, provider: SyntheticMetadata, ctx: dict, progress=None) -> dict:
    """Plan the steps, measuring each one."""
    args, pmap, rank_node, loaders = ctx["args"], ctx["pmap"], ctx["rank_node"], ctx["loaders"]
    per: dict[str, list] = {k: [] for k in ("plan_cpu_ms", "plan_wall_ms", "draw_cpu_ms", "meta_bytes", "meta_blocks",
                                           "state_bytes", "cursor_state_bytes", "rank_plan_bytes", "retain_bytes", "items", "tokens",
                                           "max_over_lb", "conn_mean", "conn_max", "loader_nodes_max",
                                           "live_blocks_max", "plan_bytes", "rss", "standby_bytes")}
    window: list = []
    previous = None
    for _ in range(args.steps):
        provider.reset_counters()
        planner.draw_cpu = 0.0
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = planner.plan_step()
        cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
        per["plan_cpu_ms"].append((cpu - provider.cpu_seconds) * 1e3)
        per["plan_wall_ms"].append((wall - provider.seconds) * 1e3)
        per["draw_cpu_ms"].append((planner.draw_cpu - provider.cpu_seconds) * 1e3)
        per["meta_bytes"].append(provider.bytes)
        per["meta_blocks"].append(provider.blocks)
        state = planner.state_dict()
        # what the standby Planner receives per step (plait.runtime.ray.standby_planner): the state's diff
        per["standby_bytes"].append(nbytes(diff_state(previous, state)) if previous is not None else nbytes(state))
        previous = state
        per["state_bytes"].append(len(json.dumps(state)))
        per["cursor_state_bytes"].append(len(json.dumps({**state, "carry": []})))
        per["rank_plan_bytes"].append(int(rank_plan_bytes(plan).sum()))
        window = (window + [plan])[-(args.prefetch + 1):]
        live = set(planner.live_blocks())
        for p in window:  # plans not yet built by every rank keep their blocks live (PlannerActor._release)
            live.update(p.items.block_keys()[0])
        per["retain_bytes"].append(len(pickle.dumps(live, protocol=5)))
        per["live_blocks_max"].append(int(live_per_loader(live, pmap, loaders).max()))
        per["items"].append(len(plan.items))
        per["tokens"].append(plan.tokens)
        per["max_over_lb"].append(plan.max_over_lb)
        conn = connections(plan, pmap, rank_node, loaders)
        per["conn_mean"].append(float(conn["per_node"].mean()))
        per["conn_max"].append(int(conn["per_node"].max()))
        per["loader_nodes_max"].append(int(conn["per_loader"].max()))
        per["plan_bytes"].append(plan_nbytes(plan))
        per["rss"].append(rss())
        if progress:
            progress()
    return per


# ----- the figures ----------------------------------------------------------------------------------
def figure(rows: list, group: str, name: str, value, unit: str, how: str, note: str) -> None:
    rows.append({"group": group, "figure": name, "value": value, "unit": unit, "how": how, "note": note})


def figures(args, m: dict) -> list[dict]:
    """The scaling table: one row per figure, with its unit and how it was obtained."""
    per, cat, layout = m["per"], m["cat"], m["layout"]
    med = {k: float(np.median(v)) for k, v in per.items()}
    nodes, dp, loaders = m["nodes"], args.dp, layout.loaders
    rows: list[dict] = []
    step_tokens = dp * args.microbatches * args.seq_len
    figure(rows, "job", "GPUs", dp * args.tp * args.pp * args.cp, "GPUs", "given",
           f"dp {dp} x tp {args.tp} x pp {args.pp} x cp {args.cp}, {args.gpus_per_node} per node, {nodes} nodes")
    figure(rows, "job", "sources", len(cat), "sources", "given",
           ", ".join(f"{n} {k}" for k, n in cat.kind_counts().items()) + f"; {cat.total_tokens() / 1e12:.2f}T tokens")
    figure(rows, "job", "tokens per step", step_tokens, "tokens", "given",
           f"dp x {args.microbatches} micro-batches x seq_len {args.seq_len}; {med['items']:,.0f} chunks planned (median)")
    # plan time
    figure(rows, "plan", "plan time per step", round(med["plan_cpu_ms"], 1), "ms CPU", "measured",
           f"median of {args.steps} steps (max {max(per['plan_cpu_ms']):.1f}); one core, metadata generation left out; "
           f"wall {med['plan_wall_ms']:.1f} ms on a shared machine")
    figure(rows, "plan", "  drawing (mixture, chunks)", round(med["draw_cpu_ms"], 1), "ms CPU", "measured",
           f"Planner.draw over {len(cat)} sources")
    figure(rows, "plan", "  balancing + plan assembly", round(med["plan_cpu_ms"] - med["draw_cpu_ms"], 1), "ms CPU",
           "measured", f"balance.assign etc.; max/LB {med['max_over_lb']:.4f} (median)")
    later = per["meta_bytes"][1:]
    figure(rows, "bytes/step", "loaders -> Planner: block metadata", int(m["meta_rate"]), "B/step", "computed",
           "steady state: measured pickled BlockMeta bytes per token of each source's block x its tokens per step"
           + (f"; measured over steps 2-{args.steps}: {np.mean(later) / 1e3:.1f} kB/step "
              f"({np.mean(per['meta_blocks'][1:]):.2f} blocks/step)" if later else ""))
    figure(rows, "bytes/step", "  first step (first block of every source)", int(per["meta_bytes"][0]), "B", "measured",
           f"{int(per['meta_blocks'][0])} blocks, once per job start or resume")
    rp = med["rank_plan_bytes"]
    figure(rows, "bytes/step", "Planner -> Constructors: rank plans", int(rp), "B/step", "measured",
           f"pickled RankPlan of all {dp} ranks ({rp / dp / 1e3:.1f} kB per rank)")
    state = med["state_bytes"]
    gpus = dp * args.tp * args.pp * args.cp
    figure(rows, "bytes/step", "Planner -> trainers: data state", int(state * gpus), "B/checkpoint", "computed",
           f"thin (Flight) clients: a step carries none; state_dict() fetches it, {state / 1e3:.1f} kB (measured, "
           f"JSON) x {gpus} processes per checkpoint")
    figure(rows, "bytes/step", "  Ray-attached trainers instead", int(state * dp), "B/step", "computed",
           f"state_at once per (step, rank): {state / 1e3:.1f} kB x {dp} ranks (each logs it to rebuild a "
           "private job's Planner)")
    figure(rows, "bytes/step", "Planner -> loaders: retain (live blocks)", int(med["retain_bytes"] * loaders), "B/step",
           "computed", f"live set {med['retain_bytes'] / 1e3:.1f} kB (measured, pickled) x {loaders} loaders, >= once per step")
    figure(rows, "bytes/step", "loaders -> Constructors: payloads", step_tokens * TOKEN_BYTES, "B/step", "computed",
           f"tokens x 4 B; {step_tokens * TOKEN_BYTES / nodes / 1e6:.2f} MB per node")
    figure(rows, "state", "data state (JSON)", int(med["state_bytes"]), "B", "measured",
           f"median over steps (range {min(per['state_bytes']) / 1e3:.1f}-{max(per['state_bytes']) / 1e3:.1f} kB): "
           "cursors + carried chunks; larger after step 1 (cold-start carry)")
    figure(rows, "state", "  cursors only (no carry)", int(per["cursor_state_bytes"][-1]), "B", "measured",
           f"after step {args.steps} ({per['cursor_state_bytes'][-1] / len(cat):.0f} B per source); after step 1: "
           f"{int(per['cursor_state_bytes'][0])} B: flat in steps and ranks")
    # actors
    split = sum(1 for n in layout.num_partitions.values() if n > 1)
    total_demand = float(sum(layout.demand))
    figure(rows, "actors", "Planner", 2, "actors", "given",
           "one active per job and its standby, which follows the per-step state and starts a successor if it dies")
    follow = per["standby_bytes"][1:] or per["standby_bytes"]
    figure(rows, "bytes/step", "Planner -> standby: state diff", int(np.median(follow)), "B/step", "measured",
           f"median over steps 2..{args.steps} (the first sends the whole state, {per['standby_bytes'][0] / 1e3:.1f} kB)")
    figure(rows, "actors", "SourceLoaders", loaders, "actors", "computed",
           f"plan_layout: demand {total_demand:.1f} cores at step time {args.step_time:g} s / {layout_util()} utilisation; "
           f"{sum(layout.num_partitions.values())} partitions, {split} sources split; "
           f"{len(cat) / loaders:.1f} sources per loader")
    figure(rows, "actors", "Constructors", nodes, "actors", "computed", "one per node")
    figure(rows, "actors", "shadows", loaders * args.shadows, "actors", "computed", f"{args.shadows} per loader (--shadows)")
    # memory per actor
    block_bytes = m["block_bytes"]
    figure(rows, "memory", "Planner: RSS growth", m["planner_rss"], "B", "measured",
           f"psutil RSS after {args.steps} steps - before the Planner (state, one block of metadata per source, last plan)")
    figure(rows, "memory", "  of which block metadata held", int(m["held_meta"]), "B", "measured",
           "one BlockMeta per source (the cursor's block), pickled size")
    figure(rows, "memory", "  + plan window (ray: 64 plans)", int(med["plan_bytes"] * m["plan_window"]), "B", "computed",
           f"{med['plan_bytes'] / 1e6:.2f} MB per StepPlan (measured arrays) x {m['plan_window']}")
    figure(rows, "memory", "SourceLoader: live blocks (busiest)", int(max(per["live_blocks_max"]) * block_bytes), "B",
           "computed", f"{max(per['live_blocks_max'])} live blocks it owns (from the plans) x {block_bytes / 1e6:.1f} MB "
           f"decoded block; LRU cap {args.max_cached_blocks} blocks = {args.max_cached_blocks * block_bytes / 1e9:.1f} GB")
    per_rank = args.microbatches * args.seq_len
    ranks_per_node = max(1, dp // nodes)
    docs = med["items"] / dp
    builds = (args.prefetch + 2) * ranks_per_node
    cons = builds * (per_rank * BATCH_BYTES_PER_TOKEN + docs * BATCH_BYTES_PER_DOC) + per_rank * TOKEN_BYTES
    figure(rows, "memory", "Constructor (per node)", int(cons), "B", "computed",
           f"(prefetch {args.prefetch} + 2) builds x {ranks_per_node} rank(s) x {per_rank} tokens x 12 B + payload buffer")
    # connections
    figure(rows, "connections", "per node (Constructor -> loaders + Planner)", round(med["conn_mean"] + 1, 1),
           "peers", "computed", f"from the real plans via PartitionMap: mean; max {max(per['conn_max']) + 1} "
           f"(of {loaders} loaders + 1 Planner)")
    figure(rows, "connections", "per loader (nodes it serves)", int(max(per["loader_nodes_max"])), "peers", "computed",
           f"max over loaders and steps, of {nodes} nodes; + 1 Planner")
    return rows


def layout_util() -> float:
    from plait.runtime.placement import UTILISATION

    return UTILISATION


def measure(args, progress=None) -> dict:
    from plait import balance

    balance.warmup()
    cat = SyntheticSources(args.sources, seed=args.seed, files=args.files, blocks_per_file=args.blocks_per_file,
                           block_tokens=args.block_tokens)
    spec = make_spec(args, cat)
    nodes, rank_node = nodes_of(args)
    layout, pmap = make_layout(args, spec, cat, nodes)
    provider = SyntheticMetadata(cat)
    rss0 = rss()
    planner = timed_planner_class()(spec, provider)
    if progress:
        progress()
    ctx = {"args": args, "pmap": pmap, "rank_node": rank_node, "loaders": layout.loaders}
    per = plan_steps(planner, provider, ctx, progress)
    from plait.runtime.ray.planner_actor import PLAN_WINDOW

    mean_doc = float(np.mean([KINDS[k].mean_length() for k in cat.kind]))
    block_bytes = args.block_tokens * TOKEN_BYTES + args.block_tokens / mean_doc * BLOCK_INDEX_BYTES_PER_DOC
    share = cat.weight / cat.weight.sum()
    per_token = provider.current_bytes / np.maximum(provider.current_tokens, 1)
    meta_rate = float((share * per_token).sum()) * args.dp * args.microbatches * args.seq_len
    return {"per": per, "cat": cat, "layout": layout, "nodes": nodes, "meta_rate": meta_rate,
            "planner_rss": max(per["rss"]) - rss0,
            "held_meta": int(provider.current_bytes.sum()), "plan_window": PLAN_WINDOW, "block_bytes": block_bytes}


def human(value, unit: str) -> str:
    if unit == "B" or unit.startswith("B/"):
        per = unit[1:]  # "", "/step", "/checkpoint"
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= scale:
                return f"{value / scale:,.2f} {name}{per}"
        return f"{value:,.0f} {unit}"
    if isinstance(value, float):
        return f"{value:,.1f} {unit}" if unit != "ms CPU" else f"{value:,.1f} ms"
    return f"{value:,} {unit}"


def print_table(rows: list[dict], elapsed: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="plait at scale: real Planner + placement on synthetic metadata")
    for col, just in (("figure", "left"), ("value", "right"), ("how", "left"), ("note", "left")):
        table.add_column(col, justify=just, overflow="fold")
    group = None
    for r in rows:
        if r["group"] != group and group is not None:
            table.add_section()
        group = r["group"]
        table.add_row(r["figure"], human(r["value"], r["unit"]), r["how"], r["note"])
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)
    console.print(f"[dim]measured on this machine in {elapsed:.1f} s (shared with other work: times vary)[/]")


def run(args) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from plait.errors import PlaitError

    if min(args.dp, args.tp, args.pp, args.cp, args.gpus_per_node, args.sources, args.steps, args.seq_len,
           args.microbatches, args.files, args.blocks_per_file, args.block_tokens, args.cpus_per_node) < 1:
        raise PlaitError("sizes, counts and steps must be >= 1")
    if not args.step_time > 0 or args.shadows < 0 or args.prefetch < 0:
        raise PlaitError("--step-time must be > 0, --shadows and --prefetch >= 0")
    err = Console(stderr=True)
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]scale[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=err, disable=args.quiet) as bar:
        task = bar.add_task("plan", total=args.steps + 1)
        m = measure(args, progress=lambda: bar.advance(task))
    elapsed = time.perf_counter() - t0
    rows = figures(args, m)
    if not args.quiet:
        print_table(rows, elapsed)
    if args.json:
        out = {"rows": rows, "config": {k: v for k, v in vars(args).items() if k != "func"},
               "per_step": {k: [float(x) for x in v] for k, v in m["per"].items()}, "elapsed_s": elapsed,
               "sources_per_loader": len(m["cat"]) / m["layout"].loaders}
        write_result(args.json, out)
        err.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
