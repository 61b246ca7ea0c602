"""`python -m benchmarks.balance`: plait's planner against per-rank loaders on synthetic length
distributions (and, with --lengths, a file's), four strategies, and a plot of one step.

The product's `plait bench balance --lengths FILE` (plait.cli.bench.balance) measures a user's lengths
with naive and plait; this sweep adds the distributions the project's figures use and two strategies:

  web / longctx / sft / mix   lognormal document lengths (medians ~350, ~2k, ~600; `mix` holds 1% of
                              documents >= 128k carrying ~40% of the tokens)
  sorted      sort by length, deal round-robin to ranks, first-fit into micro-batches
  plait-var   balance.assign, balance mode `variable` (per-rank micro-batch counts may differ)

Rows (--json) are those of the product's sweep, one per (dist, dp, seq_len, strategy).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks.common import main
from plait.cli.bench import balance as product

HELP = "compute balance of plait vs per-rank loaders over synthetic length distributions, DP sizes and contexts"
DESCRIPTION = __doc__
DISTS = ("web", "longctx", "sft", "mix")
DPS = (8, 64, 512, 4096)
SEQ_LENS = (8192, 32768, 131072)
STRATEGIES = ("naive", "sorted", "plait", "plait-var")


def add_arguments(p) -> None:
    product.add_arguments(p, lengths_required=False)
    p.set_defaults(dp=None, seq_len=None)
    p.add_argument("--dists", default=None, help=f"length distributions (default {','.join(DISTS)})")
    p.add_argument("--quick", action="store_true", help="a small sweep by default (dp 8,64; seq_len 8k,32k; web, mix)")
    p.add_argument("--plot", metavar="PATH", help="per-rank cost bars of one step of each strategy (PNG)")


def synthetic(dist: str):
    """The draw(n, rng) of a synthetic distribution: n document lengths in stream order."""
    def lognormal(rng, median, sigma, lo, hi, size):
        return np.clip(rng.lognormal(np.log(median), sigma, size=size), lo, hi).astype(np.int64)

    def draw(n: int, rng: np.random.Generator) -> np.ndarray:
        if dist == "web":  # median ~350, mean ~1.1k, tail past 100k
            return lognormal(rng, 350, 1.5, 16, 1_000_000, n)
        if dist == "longctx":  # median ~2k, tail to 128k and beyond
            return lognormal(rng, 2000, 1.3, 64, 1_000_000, n)
        if dist == "sft":  # prompt + response pairs
            return lognormal(rng, 600, 0.8, 32, 32_768, n)
        out = lognormal(rng, 1500, 1.2, 16, 131_071, n)  # mix
        long = rng.random(n) < 0.01
        out[long] = np.minimum(131_072 + rng.exponential(72_000, size=int(long.sum())), 1_000_000).astype(np.int64)
        return out
    return draw


def place_sorted(lengths, cost_model, R, M, C, repeats) -> product.Placement:
    order = np.argsort(-lengths, kind="stable")
    rank_sorted = np.arange(len(lengths)) % R
    micro_sorted = product.first_fit(rank_sorted, lengths[order], M, C)
    rank = np.empty(len(lengths), dtype=np.int64)
    micro = np.empty(len(lengths), dtype=np.int64)
    rank[order] = np.where(micro_sorted >= 0, rank_sorted, -1)
    micro[order] = micro_sorted
    return product.Placement(rank, micro, M)


def run(args) -> int:
    from plait.errors import PlaitError

    q = args.quick
    dists = [d.strip() for d in (args.dists or ("web,mix" if q else ",".join(DISTS))).split(",") if d.strip()]
    args.dp = args.dp or ([8, 64] if q else list(DPS))
    args.seq_len = args.seq_len or ([8192, 32768] if q else list(SEQ_LENS))
    unknown = [d for d in dists if d not in DISTS]
    if unknown:
        raise PlaitError(f"unknown distribution(s) {unknown}; choose from {', '.join(DISTS)} or give --lengths FILE")
    draws = {d: synthetic(d) for d in dists}
    if args.lengths:
        draws[f"file:{Path(args.lengths).name}"] = product.file_draw(product.load_lengths(args.lengths))
    strategies = {"naive": product.place_naive, "sorted": place_sorted, "plait": product.place_plait,
                  "plait-var": partial(product.place_plait, mode="variable")}
    keep: dict = {}
    if args.plot:
        d = "mix" if "mix" in draws else next(iter(draws))
        keep["config"] = (d, 64 if 64 in args.dp else min(args.dp), 32768 if 32768 in args.seq_len else args.seq_len[0])

    def on_step(config, step, figures):
        if step == 0 and config == keep.get("config"):
            keep["rank_cost"] = {n: m["_rank_cost"] for n, m in figures.items()}
            keep["lb"] = {n: m["_lb"] for n, m in figures.items()}

    rows, warm, elapsed = product.run_sweep(args, draws, strategies, on_step)
    if not args.quiet:
        table(rows, warm, elapsed, args)
    if "rank_cost" in keep:
        plot(keep, args.plot)
    return 0


def table(rows: list[dict], warm: float, elapsed: float, args) -> None:
    from rich.table import Table

    from plait.cli.common import table_console

    by = {(r["dist"], r["dp"], r["seq_len"], r["strategy"]): r for r in rows}
    t = Table(title=f"per-rank cost balance, {args.microbatches} micro-batches/rank, pp={args.pp}")
    for col in ("dist", "dp", "seq_len", "docs/rank", "naive\nmax/mean", "sorted\nmax/mean", "plait\nmax/mean",
                "plait\nmax/LB", "plait\nmax/capLB", "plait\nfill", "plait-var\nmax/LB", "plait plan\nms (CPU)",
                "speedup\nvs naive"):
        t.add_column(col, justify="left" if col == "dist" else "right")
    speedups = []
    for c in [(r["dist"], r["dp"], r["seq_len"]) for r in rows if r["strategy"] == "naive"]:
        n, s, p, v = (by[(*c, k)] for k in STRATEGIES)
        speedups.append(p["speedup_vs_naive"])
        flag = "" if p["max_over_lb"] <= 1.01 or p["docs_per_rank"] < 8 else "[yellow]"
        t.add_row(c[0], str(c[1]), f"{c[2] // 1024}k", f"{p['docs_per_rank']:,.0f}", f"{n['max_over_mean']:.3f}",
                  f"{s['max_over_mean']:.3f}", f"{p['max_over_mean']:.4f}", f"{flag}{p['max_over_lb']:.4f}",
                  f"{p['max_over_capacity_lb']:.4f}", f"{p['fill']:.3f}", f"{v['max_over_lb']:.4f}",
                  f"{p['plan_ms']:.1f}", f"{p['speedup_vs_naive']:.2f}x")
    out = table_console()
    out.print(t)
    geo = float(np.exp(np.mean(np.log(speedups))))
    out.print(f"plait over naive: {geo:.2f}x step time per unit of work (geometric mean), {min(speedups):.2f}x .. "
              f"{max(speedups):.2f}x; numba kernels ready in {warm:.2f} s; sweep {elapsed:.1f} s")
    big = [r for r in rows if r["strategy"] == "plait" and r["docs"] >= 250_000]
    if big:
        out.print(f"planning steps of >= 250k documents: {min(r['plan_ms'] for r in big):.0f} .. "
                  f"{max(r['plan_ms'] for r in big):.0f} ms (one core)")
    low = [r for r in rows if r["strategy"] == "plait" and r["docs_per_rank"] >= 8 and r["max_over_lb"] > 1.01]
    for r in low:  # every micro-batch full of tokens: max/LB ignores per-rank token capacity (max/capLB respects it)
        v = by[(r["dist"], r["dp"], r["seq_len"], "plait-var")]
        out.print(f"equal mode above max/LB 1.01: {r['dist']} dp={r['dp']} {r['seq_len'] // 1024}k: "
                  f"{r['max_over_lb']:.4f} (fill {r['fill']:.3f}, variable mode {v['max_over_lb']:.4f})")


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


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
