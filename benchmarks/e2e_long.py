"""The long-context workload of `python -m benchmarks.e2e_workloads`: whole documents, fixed CP and dynamic CP against per-rank
loaders on a simulated clock (docs/long-context.md).

Data. Two length mixes, each two Parquet sources of document lengths (`length_field`: planning reads the
lengths only, no token is read or built, so a 512k x DP 32 step of 33M tokens plans on this machine):
  lognormal   today's web + long documents: lognormal(log 700, 0.9) tokens clipped to 32..16,384 and
              lognormal(log 24,000, 0.9) clipped to 4,096..131,000, half the tokens each;
  long-tail   a continued-pretraining mix (ProLong's shape): 40% of the tokens in documents log-uniform
              between 32k and the context, the rest lognormal(6.8, 1.2) tokens capped at 32k.

Strategies, on the same GPUs (DP ranks of `seq_len` tokens of memory each) and the same sources:
  per-rank        each rank reads its share of every source (blocks round-robin, as a DataLoader
                  would) and packs greedily to seq_len, cutting documents at the boundary;
  plait           the Planner, whole documents to DP ranks (today's default);
  plait-fixed-cp  the Planner over DP / cp replicas of `--long-fixed-cp` ranks, every document of a
                  replica's micro-batch sharded over its cp ranks (seq_len x cp tokens a micro-batch);
  plait-dcp       the Planner with `context_parallel.mode: dynamic` (pow2 groups) over the DP ranks.

The clock. A rank computes each document (piece) it holds for c(L) / k of the cost model (7B, in training
FLOPs over --gpu-tflops), plus the CP traffic of its groups (plait.cost.CommCost: keys and values around
the ring per layer, forward and backward, not overlapped) at the interconnect recorded in every row;
the step takes its slowest rank. Rows: steps/s, tokens/s, balance loss, max_over_lb (each strategy
against its own lower bound: whole documents for per-rank and plait, the splitting bound for the CP
strategies), plan_ms (the Planner's step: reading lengths and planning), comm_share, padding, waves.
Planning-time rows time the dynamic-CP planner alone (plait.balance.cp_plan) at 256 and 1,024 ranks
(DP 32 and 128 x CP 8, 128k): plan_ms p50 and p95.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

MIXES = ("lognormal", "long-tail")
STRATEGIES = ("per-rank", "plait", "plait-fixed-cp", "plait-dcp")
LONG_DATA = "longctx-lengths-v1"
INTERCONNECT = {"bandwidth_gbps": 450.0, "inter_node_bandwidth_gbps": 50.0, "latency_us": 10.0, "ranks_per_node": 8}
MODEL = {"hidden": 4096, "layers": 32, "ffn": 11008, "heads": 32}  # a 7B model: its FLOPs and K/V sizes
TARGETS = {("long-tail", 1, 131072, 32): 1.8, ("long-tail", 1, 131072, 8): 1.5, ("long-tail", 1, 524288, 8): 2.0}
DCP_OVER_PLAIT = {("long-tail", 1, 131072, 32): 1.3}


# ----- data ----------------------------------------------------------------------------------------
QUICK = {"long_seq": "4096", "long_dp": "4", "long_steps": 2, "long_microbatches": "1", "long_plan_ranks": ""}


def add_arguments(p) -> None:
    p.add_argument("--long-seq", default="131072,524288", help="long-context: seq_len values (the context)")
    p.add_argument("--long-dp", default="8,32", help="long-context: DP sizes")
    p.add_argument("--long-steps", type=int, default=6, help="long-context: steps per row")
    p.add_argument("--long-mixes", default="lognormal,long-tail", help="long-context: length mixes (lognormal, long-tail)")
    p.add_argument("--long-strategies", default=",".join(STRATEGIES),
                   help="long-context: strategies (per-rank, plait, plait-fixed-cp, plait-dcp)")
    p.add_argument("--long-microbatches", default="1,2", help="long-context: micro-batches per rank")
    p.add_argument("--long-fixed-cp", type=int, default=4, help="long-context: plait-fixed-cp's CP group (DP / it replicas)")
    p.add_argument("--long-plan-ranks", default="256,1024",
                   help="long-context: dynamic-CP planning-time rows at these ranks (DP x CP 8, 128k); '' for none")
    p.add_argument("--long-plan-steps", type=int, default=8, help="long-context: steps of each planning-time row")
    p.add_argument("--long-max-delay", type=int, default=0,
                   help="long-context: plait's balance.max_delay (hold outlier documents up to N steps so several "
                        "share a step; default 0: off, plait's default). Use --long-steps >= 3 x N: held outliers "
                        "are charged when delivered, so a run shorter than that flatters plait")


def parse(args) -> None:
    """The long-context options as lists (args.long_*_list), checked."""
    from plait.cli.bench.e2e import names
    from plait.errors import PlaitError

    def ints(name: str, text: str) -> list[int]:
        try:
            values = [int(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise PlaitError(f"--{name}: expected comma-separated integers, got {text!r}") from None
        if any(v < 1 for v in values):
            raise PlaitError(f"--{name}: every value must be >= 1, got {text!r}")
        return values

    args.long_seq_list = ints("long-seq", args.long_seq)
    args.long_dp_list = ints("long-dp", args.long_dp)
    args.long_microbatch_list = ints("long-microbatches", args.long_microbatches)
    args.long_plan_rank_list = ints("long-plan-ranks", args.long_plan_ranks)
    args.long_mix_list = names("long-mixes", args.long_mixes, MIXES)
    args.long_strategy_list = names("long-strategies", args.long_strategies, STRATEGIES)
    if min(args.long_fixed_cp, args.long_plan_steps, args.long_steps) < 1 or args.long_max_delay < 0:
        raise PlaitError("--long-fixed-cp, --long-plan-steps and --long-steps must be >= 1, --long-max-delay >= 0")


def _write_lengths(folder: Path, lengths: np.ndarray, files: int = 8) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(lengths, files)):
        empty = pa.ListArray.from_arrays(pa.array(np.zeros(len(part) + 1, np.int32)), pa.array([], pa.int32()))
        table = pa.table({"input_ids": empty, "length": pa.array(part.astype(np.int64))})
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=max(1, len(part) // 4))


def mix_sources(cache: Path | None, mix: str, context: int) -> list[dict]:
    """The mix's two sources (spec entries), their Parquet length files written once."""
    from plait.cli.demo_data import default_cache_dir

    root = (Path(cache) if cache else default_cache_dir().parent) / LONG_DATA
    rng = np.random.default_rng([20261205, MIXES.index(mix), context])
    scale = 1 if context >= 131072 else 10  # a smoke run's short context: a tenth of the documents
    if mix == "lognormal":
        parts = {"web": (0.5, lambda n: np.clip(rng.lognormal(np.log(700), 0.9, n), 32, 16384), 60000 // scale),
                 "long": (0.5, lambda n: np.clip(rng.lognormal(np.log(24000), 0.9, n), 4096, 131000), 2400 // scale)}
        folder = root / f"lognormal-{60000 // scale}"
    else:
        low = min(32768, context // 4)  # (a smoke run's short context: a quarter of it)
        tail = lambda n: np.exp(rng.uniform(np.log(low), np.log(context), n))  # noqa: E731
        parts = {"short": (0.6, lambda n: np.clip(rng.lognormal(6.8, 1.2, n), 1, 32768), 60000 // scale),
                 "tail": (0.4, tail, 1200 // scale)}
        folder = root / f"long-tail-{context}"
    out = []
    for name, (weight, draw, docs) in parts.items():
        if not (folder / name / "part-007.parquet").exists():
            _write_lengths(folder / name, np.maximum(draw(docs), 1).astype(np.int64))
        out.append({"name": name, "path": str(folder / name / "*.parquet"), "tokens_field": "input_ids",
                    "length_field": "length", "weight": weight})
    return out


def long_spec(sources: list[dict], strategy: str, dp: int, seq_len: int, microbatches: int, args):
    """The spec of a strategy on the same GPUs: dp ranks of seq_len tokens of memory each."""
    from plait.spec import load_spec

    cp = args.long_fixed_cp if strategy == "plait-fixed-cp" else 1
    spec = {"seed": 5, "sources": sources, "topology": {"dp": dp // cp, "cp": cp},
            "packing": {"seq_len": seq_len * cp, "microbatches": microbatches},
            "cost": {**MODEL, "interconnect": {**INTERCONNECT, "compute_tflops": args.gpu_tflops}}}
    if strategy == "plait-dcp":
        spec["context_parallel"] = {"mode": "dynamic", "groups": "pow2"}
    elif strategy != "per-rank":  # --long-max-delay: whole-document plait's outlier delay (off by default)
        spec["balance"] = {"max_delay": getattr(args, "long_max_delay", 0)}
    return load_spec(spec)


# ----- strategies: per step, each rank's seconds -----------------------------------------------------
class Clock:
    """Seconds of compute and of CP traffic on the simulated GPUs."""

    def __init__(self, spec, tflops: float):
        from plait.cost import CommCost, CostModel

        self.model, self.comm = CostModel.from_spec(spec.cost), CommCost.from_spec(spec.cost)
        self.flops = tflops * 1e12

    def seconds(self, cost_units: np.ndarray) -> np.ndarray:
        return np.asarray(cost_units, dtype=np.float64) / self.flops


def per_rank_steps(spec, steps: int, clock: Clock):
    """Per step: (rank seconds, tokens, whole-document lower bound seconds); greedy packing of each rank's
    share of the lengths (module docstring)."""
    from plait.sources import Source

    ranks, mbs, seq = spec.topology.dp, spec.packing.num_microbatches, spec.packing.seq_len
    weights = np.array([s.weight for s in spec.sources], dtype=np.float64)
    streams = [[_share_lengths(Source.of_job(spec, i), r, ranks) for i in range(len(spec.sources))]
               for r in range(ranks)]
    packers = [_pack(_interleave(streams[r], weights), seq * mbs) for r in range(ranks)]
    for _ in range(steps):
        pieces = [next(p) for p in packers]
        costs = [clock.model.text(p) for p in pieces]
        seconds = clock.seconds([c.sum() for c in costs])
        every = np.concatenate(costs)
        bound = clock.seconds(max(every.sum() / ranks, every.max(initial=0.0)))
        yield seconds, int(sum(p.sum() for p in pieces)), float(bound), {}


def _share_lengths(source, share: int, shares: int):
    """The lengths of share `share` of `shares` of a source, forever (blocks round-robin, or documents where
    an epoch has fewer blocks than shares: benchmarks.e2e_per_rank.source_documents)."""
    blocks = sum(source.num_blocks(f) for f in range(len(source.files)))
    key, k, count = source.first_key(0), 0, 0
    while True:
        if blocks >= shares and k % shares == share:
            yield from source.read_lengths(key).lengths.tolist()
        elif blocks < shares:
            lengths = source.read_lengths(key).lengths
            yield from lengths[(count + np.arange(len(lengths))) % shares == share].tolist()
            count += len(lengths)
        key, k = source.next_key(key), k + 1


def _interleave(streams, weights: np.ndarray):
    taken, share = np.zeros(len(streams)), weights / weights.sum()
    while True:
        i = int(np.argmax(share * max(taken.sum(), 1.0) - taken))
        length = next(streams[i])
        taken[i] += length
        yield length


def _pack(lengths, capacity: int):
    """A rank's step: pieces filling `capacity` tokens (micro-batches cut at seq_len: a piece per cut)."""
    carry = 0
    while True:
        out, room = [], capacity
        while room > 0:
            length = carry or next(lengths)
            carry = 0
            take = min(length, room)
            out.append(take)
            room -= take
            carry = length - take
        yield np.asarray(out, dtype=np.int64)


def plait_steps(spec, steps: int, clock: Clock):
    """Per step from the Planner (no builds): each GPU's seconds, tokens, the bound, and the plan's figures."""
    from plait.roles.planner import Planner
    from plait.roles.source_loader import SourceLoader

    loader = SourceLoader(spec)
    planner = Planner(spec, loader)
    cp = spec.topology.cp
    try:
        for _ in range(steps):
            t = time.perf_counter()
            plan = planner.plan_step()
            plan_s = time.perf_counter() - t
            s = plan.stats()
            if plan.cp_groups is not None:  # dynamic: per pool rank, compute / k and traffic, in cost units
                seconds, bound = clock.seconds(plan.rank_cost), clock.seconds(plan.lower_bound)
                extra = {"comm_share": s["comm_share"], "padding": s["cp_padding"], "waves": s["waves"]}
            else:  # whole documents per replica: cost / cp per GPU, and the ring's traffic of every micro-batch
                comm = clock.comm.per_member(plan.micro_tokens, np.full(plan.micro_tokens.shape, cp)).sum(axis=1)
                seconds = clock.seconds(plan.rank_cost + comm)
                bound = clock.seconds(plan.lower_bound)
                share = float(comm.sum() / max((plan.rank_cost + comm).sum(), 1e-300))
                extra = {"comm_share": share, "padding": 0.0, "waves": plan.microbatches}
            yield seconds, plan.tokens, float(bound), {**extra, "plan_ms": plan_s * 1e3}
    finally:
        loader.close()


def simulated_row(steps_iter) -> dict:
    """Rates on the simulated clock: a step takes its slowest GPU."""
    from plait.cli.bench.e2e_run import balance_loss

    tops, bounds, tokens, loss, figures = [], [], 0, [], {}
    for seconds, step_tokens, bound, extra in steps_iter:
        tops.append(float(np.max(seconds)))
        bounds.append(bound)
        tokens += step_tokens
        loss.append(balance_loss(np.asarray(seconds)[None, :]))
        for k, v in extra.items():
            figures.setdefault(k, []).append(v)
    wall = float(np.sum(tops))
    row = {"steps": len(tops), "steps_per_s": len(tops) / wall, "tokens_per_s": tokens / wall,
           "tokens_per_step": tokens / len(tops), "wait_fraction": 0.0, "balance_loss": float(np.mean(loss)),
           "clock": "simulated", "bound_steps_per_s": len(tops) / float(np.sum(bounds)),
           "max_over_lb": float(np.mean(np.asarray(tops) / np.asarray(bounds)))}
    for k, v in figures.items():
        row[k] = float(np.median(v)) if k == "plan_ms" else float(np.mean(v))
    return row


# ----- the workload ----------------------------------------------------------------------------------
def run_long_context(args, err) -> list[dict]:
    from plait.cli.bench.e2e_run import load_average

    rows = []
    for mix in args.long_mix_list:
        for seq_len in args.long_seq_list:
            sources = mix_sources(getattr(args, "cache", None), mix, seq_len)
            for dp in args.long_dp_list:
                for mbs in args.long_microbatch_list:
                    for strategy in args.long_strategy_list:
                        if strategy == "plait-fixed-cp" and dp % args.long_fixed_cp:
                            continue
                        err.print(f"[bold]e2e[/] long-context {mix} {strategy}, DP {dp}, seq_len {seq_len}, "
                                  f"{mbs} micro-batch(es) ...")
                        spec = long_spec(sources, strategy, dp, seq_len, mbs, args)
                        clock = Clock(spec, args.gpu_tflops)
                        make = per_rank_steps if strategy == "per-rank" else plait_steps
                        load_before = load_average()
                        row = simulated_row(make(spec, args.long_steps, clock))
                        row.update(workload="long-context", mix=mix, strategy=strategy, dp=dp, seq_len=seq_len,
                                   microbatches=mbs, interconnect={**INTERCONNECT, "model": "7B"},
                                   load_average=[load_before, load_average()])
                        if strategy == "plait-fixed-cp":
                            row["cp"] = args.long_fixed_cp
                        rows.append(row)
    for ranks in args.long_plan_rank_list:
        err.print(f"[bold]e2e[/] long-context planning time, {ranks} ranks ...")
        rows.append(planning_row(args, ranks))
    return rows


def planning_row(args, ranks: int, cp: int = 8, seq_len: int = 131072) -> dict:
    """plan_ms p50/p95 of the dynamic-CP planner alone (degrees, waves, bound) on the Planner's steps of
    the long-tail mix over DP x CP 8 = `ranks` ranks at 128k (the Planner's other work apart)."""
    from plait.planning import dynamic_cp
    from plait.roles.planner import Planner
    from plait.roles.source_loader import SourceLoader
    from plait.spec import load_spec

    sources = mix_sources(getattr(args, "cache", None), "long-tail", seq_len)
    spec = load_spec({"seed": 5, "sources": sources, "topology": {"dp": ranks // cp, "cp": cp},
                      "packing": {"seq_len": seq_len, "microbatches": 1},
                      "cost": {**MODEL, "interconnect": {**INTERCONNECT, "compute_tflops": args.gpu_tflops}},
                      "context_parallel": {"mode": "dynamic", "groups": "pow2"}})
    timings, cpu, original = [], [], dynamic_cp.plan_dynamic_cp

    def timed(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        out = original(*a, **k)
        timings.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.thread_time() - c) * 1e3)
        return out

    loader = SourceLoader(spec)
    dynamic_cp.plan_dynamic_cp = timed
    try:
        planner = Planner(spec, loader)
        plans = [planner.plan_step() for _ in range(args.long_plan_steps)]
    finally:
        dynamic_cp.plan_dynamic_cp = original
        loader.close()
    ms = np.asarray(timings[1:] or timings)  # the first step loads the compiled kernels
    cpu_ms = np.asarray(cpu[1:] or cpu)
    return {"workload": "long-context-planning", "strategy": "plait-dcp", "mix": "long-tail", "dp": ranks // cp,
            "cp": cp, "ranks": ranks, "seq_len": seq_len, "microbatches": 1, "steps": len(plans),
            "plan_ms_p50": float(np.percentile(ms, 50)), "plan_ms_p95": float(np.percentile(ms, 95)),
            # the planner's own CPU time: what a quiet core would take (wall time counts a loaded machine's waits)
            "plan_cpu_ms_p50": float(np.percentile(cpu_ms, 50)), "plan_cpu_ms_p95": float(np.percentile(cpu_ms, 95)),
            "documents_per_step": float(np.mean([len(p.items) for p in plans])),
            "max_over_lb": float(np.mean([p.max_over_lb for p in plans])),
            "steps_per_s": None, "tokens_per_s": None, "wait_fraction": None, "balance_loss": None}


# ----- ratios and the table --------------------------------------------------------------------------
def long_ratios(rows: list[dict]) -> list[dict]:
    """Per (mix, seq_len, DP, micro-batches): each plait strategy's steps/s over per-rank's (and plait-dcp's
    over plait's), one run."""
    key = lambda r: (r["mix"], r["seq_len"], r["dp"], r["microbatches"])  # noqa: E731
    base = {key(r): r for r in rows if r.get("workload") == "long-context" and r["strategy"] == "per-rank"}
    whole = {key(r): r for r in rows if r.get("workload") == "long-context" and r["strategy"] == "plait"}
    out = []
    for r in rows:
        if r.get("workload") != "long-context" or r["strategy"] == "per-rank" or key(r) not in base:
            continue
        b = base[key(r)]
        q = {"workload": "long-context", "strategy": r["strategy"], "mix": r["mix"], "seq_len": r["seq_len"],
             "dp": r["dp"], "microbatches": r["microbatches"], "steps_per_s_ratio": r["steps_per_s"] / b["steps_per_s"],
             "tokens_per_s_ratio": r["tokens_per_s"] / b["tokens_per_s"],
             "bound_ratio": r["bound_steps_per_s"] / b["steps_per_s"]}
        if r["strategy"] == "plait-dcp" and key(r) in whole:
            q["over_plait"] = r["steps_per_s"] / whole[key(r)]["steps_per_s"]
        out.append(q)
    return out


def target(q: dict) -> tuple[float | None, float | None]:
    """The issue's targets for a ratio: (over per-rank, over plait), None where it sets none."""
    if q["strategy"] != "plait-dcp":
        return None, None
    k = (q["mix"], q["microbatches"], q["seq_len"], q["dp"])
    return TARGETS.get(k), DCP_OVER_PLAIT.get(k)


def table(rows: list[dict], ratios: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=max(Console().width, 160))
    t = Table(title="long context on the simulated clock (7B, 450 GB/s in a node of 8, 50 GB/s between, 10 us)")
    for col in ("mix", "seq_len", "dp", "mbs", "strategy", "steps/s", "tokens/s", "x per-rank", "max/LB", "comm",
                "padding", "waves", "plan ms"):
        t.add_column(col, justify="left" if col in ("mix", "strategy") else "right")
    ratio_of = {(q["mix"], q["seq_len"], q["dp"], q["microbatches"], q["strategy"]): q for q in ratios}
    for r in rows:
        if r.get("workload") != "long-context":
            continue
        q = ratio_of.get((r["mix"], r["seq_len"], r["dp"], r["microbatches"], r["strategy"]))
        t.add_row(r["mix"], f"{r['seq_len']:,}", str(r["dp"]), str(r["microbatches"]), r["strategy"],
                  f"{r['steps_per_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{q['steps_per_s_ratio']:.2f}x" if q else "-",
                  f"{r['max_over_lb']:.3f}", f"{r.get('comm_share', 0.0):.1%}", f"{r.get('padding', 0.0):.2%}",
                  f"{r.get('waves', r['microbatches']):.2f}", f"{r['plan_ms']:.1f}" if "plan_ms" in r else "-")
    out.print(t)
    for q in ratios:
        goal, over = target(q)
        if goal is not None:
            verdict = "met" if q["steps_per_s_ratio"] >= goal else "[red]missed[/]"
            out.print(f"{q['mix']} {q['seq_len']:,} DP {q['dp']} mbs {q['microbatches']}: plait-dcp / per-rank = "
                      f"[bold]{q['steps_per_s_ratio']:.2f}x[/] (target >= {goal}x: {verdict})")
        if over is not None:
            verdict = "met" if q.get("over_plait", 0.0) >= over else "[red]missed[/]"
            out.print(f"  plait-dcp / plait = [bold]{q.get('over_plait', 0.0):.2f}x[/] (target >= {over}x: {verdict})")
    for r in rows:
        if r.get("workload") == "long-context-planning":
            out.print(f"dynamic-CP planning at {r['ranks']:,} ranks ({r['documents_per_step']:,.0f} documents a step): "
                      f"p50 {r['plan_ms_p50']:.1f} ms, p95 {r['plan_ms_p95']:.1f} ms (CPU time p50 "
                      f"{r['plan_cpu_ms_p50']:.1f} ms, p95 {r['plan_cpu_ms_p95']:.1f} ms)")
