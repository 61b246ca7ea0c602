"""`plait bench balance`: step-time balance of plait's planner against per-rank loaders.

For each length distribution, DP size and context length it draws one global step of documents (as many
as fill dp x microbatches x seq_len tokens; documents longer than seq_len are cut into chunks as the
Planner does) and places the same documents with each strategy:

  naive      each DP rank packs its own contiguous share of the stream, in order, first-fit into its
             micro-batches (what per-rank loaders do)
  sorted     sort by length, deal round-robin to ranks, first-fit into micro-batches
  plait      balance.assign, balance mode `equal` (every rank runs `microbatches` micro-batches)
  plait-var  balance.assign, balance mode `variable` (per-rank micro-batch counts may differ)

Per strategy it reports max/mean and max/LB of the per-rank cost (LB = max(sum c / R, max c) over the
documents that strategy placed), max/capLB against the bound that also respects each rank's token capacity
(plait.balance.certificate.capacity_lower_bound; >= LB, so max/capLB <= max/LB), tokens max/mean, the fraction of the step's token slots filled, the
simulated step time (slowest rank's cost, plus (pp-1) x its heaviest micro-batch with --pp) and the
speedup over naive in time per unit of work (documents a strategy could not place are carried, so
speedup compares step time / work placed). plan_ms is plait's planning time for the step: the CPU
time of the planning thread (one core; numba kernels compiled beforehand, compile/cache-load time
reported separately), best of --repeats; plan_wall_ms is the same run's wall-clock time.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELP = "compute balance of plait's planner vs per-rank loaders (naive, sorted) over DP sizes and contexts"
DESCRIPTION = (
    "Draw one global step of documents per (distribution, DP size, context) - enough to fill dp x "
    "microbatches x seq_len tokens, long documents chunked as the Planner does - and place the same "
    "documents four ways: naive (each rank packs its contiguous share of the stream, first-fit: per-rank "
    "loaders), sorted (sort by length, deal round-robin), plait (balance.assign, equal mode) and plait-var "
    "(variable mode). Reports max/mean and max/LB of per-rank cost (LB = max(sum c / R, max c)), tokens "
    "max/mean, token fill, the simulated step time (slowest rank, plus (pp-1) x its heaviest micro-batch) "
    "and plait's speedup over naive per unit of work, and plait's planning time (CPU ms, one core)."
)

DISTS = ("web", "longctx", "sft", "mix")
DPS = (8, 64, 512, 4096)
SEQ_LENS = (8192, 32768, 131072)
STRATEGIES = ("naive", "sorted", "plait", "plait-var")


def add_arguments(p) -> None:
    p.add_argument("--dists", default=None, help=f"length distributions (default {','.join(DISTS)})")
    p.add_argument("--lengths", metavar="FILE", help="also a distribution from your data: document lengths (.npy or text)")
    p.add_argument("--dp", default=None, help=f"DP sizes (default {','.join(map(str, DPS))})")
    p.add_argument("--seq-len", default=None, help=f"contexts, micro-batch token capacity (default {','.join(map(str, SEQ_LENS))})")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per rank per step")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: adds (pp-1) x heaviest micro-batch to a rank's time")
    p.add_argument("--steps", type=int, default=1, help="steps per configuration (metrics averaged)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="plan_ms is the best of this many plannings of the step")
    p.add_argument("--quick", action="store_true", help="a small sweep by default (dp 8,64; seq_len 8k,32k; web, mix)")
    p.add_argument("--json", metavar="PATH", help="write one row per (dist, dp, seq_len, strategy)")
    p.add_argument("--plot", metavar="PATH", help="per-rank cost bars of one step of each strategy (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")


# ----- documents -------------------------------------------------------------------------------
def sample_lengths(dist: str, n: int, rng: np.random.Generator, user: np.ndarray | None = None) -> np.ndarray:
    """n document lengths in stream order."""

    def lognormal(median, sigma, lo, hi, size):
        return np.clip(rng.lognormal(np.log(median), sigma, size=size), lo, hi).astype(np.int64)

    if dist == "web":  # median ~350, mean ~1.1k, tail past 100k
        return lognormal(350, 1.5, 16, 1_000_000, n)
    if dist == "longctx":  # median ~2k, tail to 128k and beyond
        return lognormal(2000, 1.3, 64, 1_000_000, n)
    if dist == "sft":  # prompt + response pairs
        return lognormal(600, 0.8, 32, 32_768, n)
    if dist == "mix":  # 1% of documents >= 128k, holding ~40% of the tokens
        out = lognormal(1500, 1.2, 16, 131_071, n)
        long = rng.random(n) < 0.01
        out[long] = np.minimum(131_072 + rng.exponential(72_000, size=int(long.sum())), 1_000_000).astype(np.int64)
        return out
    if dist.startswith("file:") and user is not None:  # consecutive documents from a random start
        start = int(rng.integers(0, len(user)))
        return user[(start + np.arange(n)) % len(user)]
    raise ValueError(f"unknown distribution {dist!r}")


def load_lengths(path: str) -> np.ndarray:
    from plait.errors import PlaitError

    p = Path(path)
    if not p.exists():
        raise PlaitError(f"no such file: {path}")
    a = np.load(p) if p.suffix == ".npy" else np.loadtxt(p, dtype=np.float64, ndmin=1)
    a = np.asarray(a).reshape(-1).astype(np.int64)
    a = a[a > 0]
    if not len(a):
        raise PlaitError(f"{path}: no positive document lengths")
    return a


def step_items(dist: str, budget: int, seq_len: int, rng: np.random.Generator, user=None) -> tuple[np.ndarray, int]:
    """Chunk lengths of one step (documents that start before `budget` tokens), and the document count."""
    parts, total = [], 0
    while total < budget:
        guess = max(1024, int((budget - total) / 500))
        L = sample_lengths(dist, guess, rng, user)
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


# ----- baselines -------------------------------------------------------------------------------
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


def place_naive(lengths, R, M, C) -> Placement:
    share = M * C
    starts = np.cumsum(lengths) - lengths
    rank = np.minimum(starts // share, R - 1)
    micro = first_fit(rank, lengths, M, C)
    return Placement(np.where(micro >= 0, rank, -1), micro, M)


def place_sorted(lengths, R, M, C) -> Placement:
    order = np.argsort(-lengths, kind="stable")
    rank_sorted = np.arange(len(lengths)) % R
    micro_sorted = first_fit(rank_sorted, lengths[order], M, C)
    rank = np.empty(len(lengths), dtype=np.int64)
    micro = np.empty(len(lengths), dtype=np.int64)
    rank[order] = np.where(micro_sorted >= 0, rank_sorted, -1)
    micro[order] = micro_sorted
    return Placement(rank, micro, M)


def place_plait(lengths, cost_model, R, M, C, mode, repeats: int = 1) -> Placement:
    """balance.assign. plan_ms (cost evaluation + assignment) is the CPU time of this thread, best of
    `repeats` runs: one core's work, unaffected by other processes sharing the machine; plan_wall_ms is
    the wall-clock time of the same run."""
    from plait import balance

    best, wall = float("inf"), float("inf")
    for _ in range(max(1, repeats)):
        t, w = time.thread_time(), time.perf_counter()
        costs = cost_model(lengths)
        a = balance.assign(lengths, costs, ranks=R, microbatches=M, capacity=C, mode=mode)
        cpu, w = (time.thread_time() - t) * 1e3, (time.perf_counter() - w) * 1e3
        if cpu < best:
            best, wall = cpu, w
    pl = Placement(a.rank.astype(np.int64), a.micro.astype(np.int64), a.micro_cost.shape[1], best)
    pl.wall_ms = wall
    return pl


def capacity_bound(p: Placement, lengths, costs, R, M, C, cache: dict | None = None) -> float:
    """The capacity-aware lower bound (plait.balance.certificate.capacity_lower_bound) of the items the
    placement placed, for the micro-batches it may run (equal mode: M; variable mode: its width). It takes
    ~0.1 s per 60k items, so a step's strategies that placed every item share one computation (`cache`)."""
    from plait.balance.certificate import capacity_lower_bound

    ok = p.rank >= 0
    key = (max(M, p.width), bool(ok.all()))
    if cache is not None and key[1] and key in cache:
        return cache[key]
    lb = capacity_lower_bound(lengths[ok], costs[ok], ranks=R, microbatches=key[0], capacity=C)
    if cache is not None and key[1]:
        cache[key] = lb
    return lb


def measure(p: Placement, lengths, costs, R, M, C, pp, cache: dict | None = None) -> dict:
    from plait.balance import lower_bound

    ok = p.rank >= 0
    rank_cost = np.bincount(p.rank[ok], weights=costs[ok], minlength=R)
    rank_tok = np.bincount(p.rank[ok], weights=lengths[ok], minlength=R)
    micro_cost = np.bincount(p.rank[ok] * p.width + p.micro[ok], weights=costs[ok], minlength=R * p.width).reshape(R, p.width)
    lb = lower_bound(costs[ok], R)
    cap_lb = capacity_bound(p, lengths, costs, R, M, C, cache)
    work = float(rank_cost.sum())
    step_time = float((rank_cost + (pp - 1) * micro_cost.max(axis=1)).max())
    mean = work / R
    used = micro_cost > 0
    mm = micro_cost.max(axis=1) / np.maximum(micro_cost.sum(axis=1) / np.maximum(used.sum(axis=1), 1), 1e-300)
    return {
        "max_over_mean": float(rank_cost.max() / mean) if mean > 0 else 1.0,
        "max_over_lb": float(rank_cost.max() / lb) if lb > 0 else 1.0,
        # against the bound that respects each rank's token capacity (micro-batches x seq_len): what no
        # placement of these items can beat; max_over_lb ignores capacity and so overstates the distance
        "max_over_capacity_lb": float(rank_cost.max() / cap_lb) if cap_lb > 0 else 1.0,
        "tokens_max_over_mean": float(rank_tok.max() / rank_tok.mean()) if rank_tok.mean() > 0 else 1.0,
        "fill": float(lengths[ok].sum() / (R * M * C)),
        "placed": float(ok.mean()) if len(ok) else 1.0,
        "micro_max_over_mean": float(mm[used.any(axis=1)].mean()) if used.any() else 1.0,
        "step_time": step_time,
        "time_per_work": step_time / work if work > 0 else 0.0,
        "plan_ms": p.plan_ms,
        "plan_wall_ms": p.wall_ms,
        "_rank_cost": rank_cost,
        "_lb": lb,
    }


# ----- the sweep -------------------------------------------------------------------------------
@dataclass
class Sweep:
    """What one `bench balance` run covers: every (distribution, dp, seq_len) over `steps` random steps."""

    dists: list[str]
    dps: list[int]
    seq_lens: list[int]
    microbatches: int
    pp: int
    steps: int
    seed: int
    user: np.ndarray | None = None  # document lengths for `--lengths`
    repeats: int = 1


def sweep(cfg: Sweep, *, progress=None, keep=None) -> list[dict]:
    from plait.cost import CostModel

    dists, dps, seq_lens, microbatches, pp = cfg.dists, cfg.dps, cfg.seq_lens, cfg.microbatches, cfg.pp
    steps, seed, user, repeats = cfg.steps, cfg.seed, cfg.user, cfg.repeats

    cost_model = CostModel.from_dims(4096, 32, 11008, 32)  # a 7B Llama-like model
    rows = []
    for dist in dists:
        for dp in dps:
            for S in seq_lens:
                acc: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
                docs_total = items_total = 0
                for step in range(steps):
                    key = zlib.crc32(f"{dist}/{dp}/{S}/{step}/{seed}".encode())
                    rng = np.random.default_rng(key)
                    lengths, ndocs = step_items(dist, dp * microbatches * S, S, rng, user)
                    costs = cost_model(lengths)
                    docs_total += ndocs
                    items_total += len(lengths)
                    placements = {
                        "naive": place_naive(lengths, dp, microbatches, S),
                        "sorted": place_sorted(lengths, dp, microbatches, S),
                        "plait": place_plait(lengths, cost_model, dp, microbatches, S, "equal", repeats),
                        "plait-var": place_plait(lengths, cost_model, dp, microbatches, S, "variable", repeats),
                    }
                    bounds: dict = {}  # the capacity bound, shared by strategies that placed every item
                    for name, pl in placements.items():
                        acc[name].append(measure(pl, lengths, costs, dp, microbatches, S, pp, bounds))
                    if keep is not None and step == 0 and (dist, dp, S) == keep["config"]:
                        keep["rank_cost"] = {n: m[-1]["_rank_cost"] for n, m in acc.items()}
                        keep["lb"] = {n: m[-1]["_lb"] for n, m in acc.items()}
                    if progress:
                        progress()
                base = float(np.mean([m["time_per_work"] for m in acc["naive"]]))
                for name in STRATEGIES:
                    ms = acc[name]
                    row = {"dist": dist, "dp": dp, "seq_len": S, "microbatches": microbatches, "pp": pp,
                           "strategy": name, "steps": steps, "docs": docs_total // steps, "items": items_total // steps,
                           "docs_per_rank": docs_total / steps / dp}
                    for k in ms[0]:
                        if k.startswith("_"):
                            continue
                        row[k] = float(np.median([m[k] for m in ms])) if k.startswith("plan_") else float(np.mean([m[k] for m in ms]))
                    row["speedup_vs_naive"] = base / row["time_per_work"] if row["time_per_work"] > 0 else 1.0
                    rows.append(row)
    return rows


def _ints(text: str) -> list[int]:
    from plait.errors import PlaitError

    try:
        return [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlaitError(f"expected comma-separated integers, got {text!r}") from None


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from plait import balance
    from plait.errors import PlaitError

    err = Console(stderr=True)
    q = args.quick
    dists = [d.strip() for d in (args.dists or ("web,mix" if q else ",".join(DISTS))).split(",") if d.strip()]
    dps = _ints(args.dp or ("8,64" if q else ",".join(map(str, DPS))))
    seq_lens = _ints(args.seq_len or ("8192,32768" if q else ",".join(map(str, SEQ_LENS))))
    unknown = [d for d in dists if d not in DISTS]
    if unknown:
        raise PlaitError(f"unknown distribution(s) {unknown}; choose from {', '.join(DISTS)} or give --lengths FILE")
    user = None
    if args.lengths:
        user = load_lengths(args.lengths)
        dists.append(f"file:{Path(args.lengths).name}")
    if min(dps + seq_lens + [args.microbatches, args.pp, args.steps, args.repeats]) < 1:
        raise PlaitError("dp, seq_len, microbatches, pp, steps and repeats must be >= 1")

    warm = balance.warmup()
    first_fit(np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), 1, 1)
    keep = None
    if args.plot:
        d = "mix" if "mix" in dists else dists[0]
        keep = {"config": (d, 64 if 64 in dps else min(dps), 32768 if 32768 in seq_lens else seq_lens[0])}
    total = len(dists) * len(dps) * len(seq_lens) * args.steps
    t0 = time.perf_counter()
    with Progress(TextColumn("[bold]balance[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=err, disable=args.quiet) as bar:
        task = bar.add_task("sweep", total=total)
        cfg = Sweep(dists, dps, seq_lens, microbatches=args.microbatches, pp=args.pp, steps=args.steps, seed=args.seed,
                    user=user, repeats=args.repeats)
        rows = sweep(cfg, progress=lambda: bar.advance(task), keep=keep)
    elapsed = time.perf_counter() - t0
    if not args.quiet:
        print_table(rows, warm, elapsed, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
        err.print(f"rows written to {args.json}")
    if args.plot and keep and "rank_cost" in keep:
        plot(keep, args.plot)
        err.print(f"plot written to {args.plot}")
    return 0


def print_table(rows: list[dict], warm: float, elapsed: float, args) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console()
    if not out.is_terminal:
        out = Console(width=140)
    by = {(r["dist"], r["dp"], r["seq_len"], r["strategy"]): r for r in rows}
    configs = sorted({(r["dist"], r["dp"], r["seq_len"]) for r in rows}, key=lambda c: (rows.index(by[(*c, "naive")])))
    t = Table(title=f"per-rank cost balance, {args.microbatches} micro-batches/rank, pp={args.pp} "
                    "(max/mean: 1.0 is perfect; max/LB: certified distance from optimal)")
    for col in ("dist", "dp", "seq_len", "docs/rank", "naive\nmax/mean", "sorted\nmax/mean", "plait\nmax/mean",
                "plait\nmax/LB", "plait\nmax/capLB", "plait\nfill", "plait-var\nmax/LB", "plait plan\nms (CPU)", "speedup\nvs naive"):
        t.add_column(col, justify="left" if col == "dist" else "right")
    speedups = []
    for c in configs:
        n, s, p, v = (by[(*c, k)] for k in STRATEGIES)
        speedups.append(p["speedup_vs_naive"])
        flag = "" if p["max_over_lb"] <= 1.01 or p["docs_per_rank"] < 8 else "[yellow]"
        t.add_row(c[0], str(c[1]), f"{c[2] // 1024}k", f"{p['docs_per_rank']:,.0f}", f"{n['max_over_mean']:.3f}",
                  f"{s['max_over_mean']:.3f}", f"{p['max_over_mean']:.4f}", f"{flag}{p['max_over_lb']:.4f}",
                  f"{p['max_over_capacity_lb']:.4f}", f"{p['fill']:.3f}", f"{v['max_over_lb']:.4f}", f"{p['plan_ms']:.1f}", f"{p['speedup_vs_naive']:.2f}x")
    out.print(t)
    geo = float(np.exp(np.mean(np.log(speedups)))) if speedups else 1.0
    out.print(f"plait over naive: step-time speedup per unit of work {geo:.2f}x (geometric mean), "
              f"{min(speedups):.2f}x .. {max(speedups):.2f}x; numba kernels ready in {warm:.2f} s "
              f"(compile, or load from its cache); sweep {elapsed:.1f} s")
    big = [r for r in rows if r["strategy"] == "plait" and r["docs"] >= 250_000]
    if big:
        worst = max(big, key=lambda r: r["plan_ms"] / r["docs"])
        out.print(f"planning steps of >= 250k documents: {min(r['plan_ms'] for r in big):.0f} .. "
                  f"{max(r['plan_ms'] for r in big):.0f} ms (one core); slowest per document: {worst['dist']} dp={worst['dp']} "
                  f"seq_len={worst['seq_len']}, {worst['docs']:,} documents in {worst['plan_ms']:.0f} ms")
    low = [r for r in rows if r["strategy"] == "plait" and r["docs_per_rank"] >= 8 and r["max_over_lb"] > 1.01]
    if low:
        var = {(r["dist"], r["dp"], r["seq_len"]): r for r in rows if r["strategy"] == "plait-var"}
        out.print(f"equal mode above max/LB 1.01 with >= 8 documents per rank ({len(low)}): " + "; ".join(
            f"{r['dist']} dp={r['dp']} {r['seq_len'] // 1024}k: {r['max_over_lb']:.4f} (fill {r['fill']:.3f}, "
            f"variable mode {var[(r['dist'], r['dp'], r['seq_len'])]['max_over_lb']:.4f})" for r in low))
        out.print("  there every micro-batch is full of tokens while ranks holding long chunks cost more: "
                  "max/LB ignores per-rank token capacity (max/capLB respects it), and carrying more would cost fill")


def plot(keep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    costs = keep["rank_cost"]
    dist, dp, S = keep["config"]
    fig, axes = plt.subplots(1, len(costs), figsize=(4 * len(costs), 3.4), sharey=True)
    for ax, (name, rc) in zip(axes, costs.items()):
        lb = keep["lb"][name]
        ax.bar(np.arange(len(rc)), rc / lb, width=1.0, color="tab:red" if name == "naive" else "tab:blue")
        ax.axhline(1.0, color="k", lw=1, ls="--", label="lower bound")
        ax.axhline(rc.mean() / lb, color="tab:green", lw=1, label="mean")
        ax.set(title=f"{name}: max/LB {rc.max() / lb:.3f}", xlabel="DP rank", ylim=(0.5, None))
    axes[0].set_ylabel("rank cost / lower bound")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"one step, {dist}, dp={dp}, seq_len={S}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
