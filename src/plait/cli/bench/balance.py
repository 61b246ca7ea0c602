"""`plait bench balance --lengths FILE`: step-time balance of plait's planner on your document lengths,
against per-rank loaders. Per DP size and context: one global step of consecutive documents of FILE (enough
to fill dp x microbatches x seq_len tokens, from a random start; long documents cut as the Planner cuts them)
placed by `naive` (each rank packs its contiguous share first-fit: per-rank loaders) and by `plait`
(balance.assign). Reported: max/mean, max/LB and max/capLB of the per-rank cost, token fill, the simulated
step time's speedup over naive per unit of work, and plait's planning CPU time (one core, best of
--repeats). Synthetic distributions, more strategies and the plot: `python -m benchmarks.balance`.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELP = "compute balance of plait's planner vs per-rank loaders on your document lengths (--lengths FILE)"
DESCRIPTION = __doc__
DPS = (8, 64, 512)
SEQ_LENS = (8192, 32768)


def add_arguments(p, lengths_required: bool = True) -> None:
    from plait.cli.common import positive_int, positive_ints

    p.add_argument("--lengths", metavar="FILE", required=lengths_required,
                   help="your document lengths in tokens (.npy, or text: one number per line)")
    p.add_argument("--dp", type=positive_ints, default=",".join(map(str, DPS)), help="DP sizes (comma-separated)")
    p.add_argument("--seq-len", type=positive_ints, default=",".join(map(str, SEQ_LENS)),
                   help="contexts: micro-batch token capacity")
    p.add_argument("--microbatches", type=positive_int, default=4, help="micro-batches per rank per step")
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline stages: adds (pp-1) x heaviest micro-batch to a rank's time")
    p.add_argument("--steps", type=positive_int, default=1, help="steps per configuration (metrics averaged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="plan_ms is the best of this many plannings of the step")
    p.add_argument("--json", metavar="PATH", help="write one row per (dist, dp, seq_len, strategy)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


def load_lengths(path: str) -> np.ndarray:
    from plait.errors import PlaitError

    p = Path(path)
    if not p.exists():
        raise PlaitError(f"--lengths {path}: no such file")
    try:
        a = np.load(p) if p.suffix == ".npy" else np.loadtxt(p, dtype=np.float64, ndmin=1)
    except ValueError as e:
        raise PlaitError(f"--lengths {path}: not a list of numbers ({e})") from None
    a = np.asarray(a).reshape(-1).astype(np.int64)
    a = a[a > 0]
    if not len(a):
        raise PlaitError(f"--lengths {path}: no positive document lengths")
    return a


def file_draw(user: np.ndarray):
    """`n` consecutive documents of `user` from a random start: a `draw` of `sweep`."""
    def draw(n: int, rng: np.random.Generator) -> np.ndarray:
        start = int(rng.integers(0, len(user)))
        return user[(start + np.arange(n)) % len(user)]
    return draw


def step_items(draw, budget: int, seq_len: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Chunk lengths of one step (documents that start before `budget` tokens), and the document count."""
    parts, total = [], 0
    while total < budget:
        L = draw(max(1024, int((budget - total) / 500)), rng)
        starts = total + np.cumsum(L) - L
        k = int(np.searchsorted(starts, budget, side="left"))
        parts.append(L[:k])
        total += int(L[:k].sum())
        if k < len(L):
            break
    docs = np.concatenate(parts)
    nchunks = -(-docs // seq_len)
    doc = np.repeat(np.arange(len(docs)), nchunks)
    chunk = np.arange(len(doc)) - np.repeat(np.cumsum(nchunks) - nchunks, nchunks)
    return np.minimum(seq_len, docs[doc] - chunk * seq_len).astype(np.int64), len(docs)


# ----- placements --------------------------------------------------------------------------------
def first_fit(rank: np.ndarray, lengths: np.ndarray, M: int, capacity: int) -> np.ndarray:
    """Each item, in the given order, into its rank's first micro-batch with room (-1: none)."""
    from plait.balance import first_fit as kernel

    micro = np.empty(len(lengths), dtype=np.int64)
    kernel(np.ascontiguousarray(rank, dtype=np.int64), np.ascontiguousarray(lengths, dtype=np.int64), M, capacity, micro)
    return micro


@dataclass
class Placement:
    rank: np.ndarray  # -1: not placed
    micro: np.ndarray
    width: int
    plan_ms: float = 0.0
    wall_ms: float = 0.0


def place_naive(lengths, cost_model, R, M, C, repeats) -> Placement:
    starts = np.cumsum(lengths) - lengths
    rank = np.minimum(starts // (M * C), R - 1)
    micro = first_fit(rank, lengths, M, C)
    return Placement(np.where(micro >= 0, rank, -1), micro, M)


def place_plait(lengths, cost_model, R, M, C, repeats: int = 1, mode: str = "equal") -> Placement:
    """balance.assign; plan_ms is the planning thread's CPU time (one core's work, whatever else runs on
    the machine), best of `repeats`; wall_ms the wall-clock time of the same run."""
    from plait import balance

    best, wall = float("inf"), float("inf")
    for _ in range(max(1, repeats)):
        t, w = time.thread_time(), time.perf_counter()
        a = balance.assign(lengths, cost_model(lengths), ranks=R, microbatches=M, capacity=C, mode=mode)
        cpu, w = (time.thread_time() - t) * 1e3, (time.perf_counter() - w) * 1e3
        if cpu < best:
            best, wall = cpu, w
    return Placement(a.rank.astype(np.int64), a.micro.astype(np.int64), a.micro_cost.shape[1], best, wall)


def measure(p: Placement, lengths, costs, R, M, C, pp, bounds: dict) -> dict:
    """A placement's figures; `bounds` shares the capacity bound (~0.1 s per 60k items) between a step's
    strategies that placed every item."""
    from plait.balance import lower_bound
    from plait.balance.certificate import capacity_lower_bound

    ok = p.rank >= 0
    rank_cost = np.bincount(p.rank[ok], weights=costs[ok], minlength=R)
    rank_tok = np.bincount(p.rank[ok], weights=lengths[ok], minlength=R)
    micro_cost = np.bincount(p.rank[ok] * p.width + p.micro[ok], weights=costs[ok], minlength=R * p.width).reshape(R, p.width)
    lb = lower_bound(costs[ok], R)
    key = (max(M, p.width), bool(ok.all()))
    if key not in bounds or not key[1]:
        bounds[key] = capacity_lower_bound(lengths[ok], costs[ok], ranks=R, microbatches=key[0], capacity=C)
    cap_lb, work = bounds[key], float(rank_cost.sum())
    step_time = float((rank_cost + (pp - 1) * micro_cost.max(axis=1)).max())
    mean = work / R
    used = micro_cost > 0
    mm = micro_cost.max(axis=1) / np.maximum(micro_cost.sum(axis=1) / np.maximum(used.sum(axis=1), 1), 1e-300)
    return {
        "max_over_mean": float(rank_cost.max() / mean) if mean > 0 else 1.0,
        "max_over_lb": float(rank_cost.max() / lb) if lb > 0 else 1.0,
        # max_over_lb ignores each rank's token capacity and so overstates the distance from optimal
        "max_over_capacity_lb": float(rank_cost.max() / cap_lb) if cap_lb > 0 else 1.0,
        "tokens_max_over_mean": float(rank_tok.max() / rank_tok.mean()) if rank_tok.mean() > 0 else 1.0,
        "fill": float(lengths[ok].sum() / (R * M * C)),
        "placed": float(ok.mean()) if len(ok) else 1.0,
        "micro_max_over_mean": float(mm[used.any(axis=1)].mean()) if used.any() else 1.0,
        "step_time": step_time, "time_per_work": step_time / work if work > 0 else 0.0,
        "plan_ms": p.plan_ms, "plan_wall_ms": p.wall_ms, "_rank_cost": rank_cost, "_lb": lb,
    }


# ----- the sweep ---------------------------------------------------------------------------------
STRATEGIES = {"naive": place_naive, "plait": place_plait}


def sweep(args, draws: dict, strategies: dict, progress=None, on_step=None) -> list[dict]:
    """One row per (dist, --dp, --seq-len, strategy) over --steps random steps, each
    distribution a name -> draw(n, rng), each strategy a name -> place(lengths, cost_model, R, M, C, repeats);
    `on_step(config, step, figures by strategy)`."""
    from plait.cost import CostModel

    cost_model = CostModel.from_dims(4096, 32, 11008, 32)  # a 7B Llama-like model
    M, rows = args.microbatches, []
    for dist, draw in draws.items():
        for dp in args.dp:
            for S in args.seq_len:
                acc: dict[str, list[dict]] = {s: [] for s in strategies}
                docs_total = items_total = 0
                for step in range(args.steps):
                    rng = np.random.default_rng(zlib.crc32(f"{dist}/{dp}/{S}/{step}/{args.seed}".encode()))
                    lengths, ndocs = step_items(draw, dp * M * S, S, rng)
                    costs = cost_model(lengths)
                    docs_total, items_total = docs_total + ndocs, items_total + len(lengths)
                    bounds: dict = {}
                    for name, place in strategies.items():
                        pl = place(lengths, cost_model, dp, M, S, args.repeats)
                        acc[name].append(measure(pl, lengths, costs, dp, M, S, args.pp, bounds))
                    if on_step:
                        on_step((dist, dp, S), step, {n: m[-1] for n, m in acc.items()})
                    if progress:
                        progress()
                base = float(np.mean([m["time_per_work"] for m in acc["naive"]]))
                for name, ms in acc.items():
                    row = {"dist": dist, "dp": dp, "seq_len": S, "microbatches": M, "pp": args.pp, "strategy": name,
                           "steps": args.steps, "docs": docs_total // args.steps, "items": items_total // args.steps,
                           "docs_per_rank": docs_total / args.steps / dp}
                    for k in (k for k in ms[0] if not k.startswith("_")):
                        row[k] = float((np.median if k.startswith("plan_") else np.mean)([m[k] for m in ms]))
                    row["speedup_vs_naive"] = base / row["time_per_work"] if row["time_per_work"] > 0 else 1.0
                    rows.append(row)
    return rows


def run_sweep(args, draws: dict, strategies: dict = STRATEGIES, on_step=None) -> tuple[list[dict], float, float]:
    """(rows, seconds the numba kernels took to be ready, seconds of the sweep), with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from plait import balance
    from plait.cli.common import console, write_json

    warm = balance.warmup()
    first_fit(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), 1, 1)
    total, t0 = len(draws) * len(args.dp) * len(args.seq_len) * args.steps, time.perf_counter()
    with Progress(TextColumn("[bold]balance[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=console, disable=args.quiet) as bar:
        task = bar.add_task("sweep", total=total)
        rows = sweep(args, draws, strategies, progress=lambda: bar.advance(task), on_step=on_step)
    write_json(args.json, rows)
    return rows, warm, time.perf_counter() - t0


def run(args) -> int:
    rows, warm, elapsed = run_sweep(args, {f"file:{Path(args.lengths).name}": file_draw(load_lengths(args.lengths))})
    if not args.quiet:
        print_table(rows, warm, elapsed, args)
    return 0


def print_table(rows: list[dict], warm: float, elapsed: float, args) -> None:
    from plait.cli.common import print_table as table

    by = {(r["dist"], r["dp"], r["seq_len"], r["strategy"]): r for r in rows}
    lines, speedups = [], []
    for r in (r for r in rows if r["strategy"] == "naive"):
        p = by[(r["dist"], r["dp"], r["seq_len"], "plait")]
        speedups.append(p["speedup_vs_naive"])
        lines.append((r["dist"], str(r["dp"]), f"{r['seq_len'] // 1024}k", f"{p['docs_per_rank']:,.0f}",
                      f"{r['max_over_mean']:.3f}", f"{p['max_over_mean']:.4f}", f"{p['max_over_lb']:.4f}",
                      f"{p['max_over_capacity_lb']:.4f}", f"{p['fill']:.3f}", f"{p['plan_ms']:.1f}",
                      f"{p['speedup_vs_naive']:.2f}x"))
    out = table(f"per-rank cost balance, {args.microbatches} micro-batches/rank, pp={args.pp} (max/mean: 1.0 is "
                "perfect; max/LB: certified distance from optimal)", lines, left=("dist",), columns=(
                    "dist", "dp", "seq_len", "docs/rank", "naive\nmax/mean", "plait\nmax/mean", "plait\nmax/LB",
                    "plait\nmax/capLB", "plait\nfill", "plait plan\nms (CPU)", "speedup\nvs naive"))
    geo = float(np.exp(np.mean(np.log(speedups)))) if speedups else 1.0
    out.print(f"plait over naive: step-time speedup per unit of work {geo:.2f}x (geometric mean), "
              f"{min(speedups):.2f}x .. {max(speedups):.2f}x; numba kernels ready in {warm:.2f} s; sweep {elapsed:.1f} s")
