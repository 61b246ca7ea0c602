"""`plait plan SPEC`: run the Planner on a spec and its data without building batches, and show balance.

Per step: documents, tokens, capacity filled, balance efficiency (mean/max rank cost), the certificate
max/LB (LB = max(sum of costs / ranks, largest cost)), tokens max/mean, carried and delayed chunks, and
planning time. With `context_parallel.mode: dynamic`, per step the CP degrees chosen (documents per group
size), the waves, the communication's share of the cost and the padding. For the worst step: every rank's cost, and the slowest ranks with the documents that made
them slow (source, shard file, row, chunk, length, cost).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

HELP = "plan a spec's steps (no batches) and show per-step balance, per-rank cost and the slowest ranks"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("spec", help="the spec (YAML)")
    p.add_argument("--steps", type=int, default=10, help="global steps to plan (default 10)")
    p.add_argument("--dp", type=int, default=None, help="override topology.dp")
    p.add_argument("--mode", choices=["equal", "variable"], default=None, help="override balance.mode")
    p.add_argument("--step", type=int, default=None, help="explain this step (default: the least balanced)")
    p.add_argument("--top", type=int, default=3, help="slowest ranks to explain (default 3)")
    p.add_argument("--docs", type=int, default=5, help="documents to list per slow rank (default 5)")
    p.add_argument("--json", metavar="PATH", help="write per-step stats and the explained step as JSON")
    p.add_argument("--plot", metavar="PATH", help="per-step efficiency and per-rank cost of the explained step (PNG)")


def collect(spec, steps: int) -> tuple[list, list[float], list[list[str]]]:
    """Plan `steps` steps; returns the plans, planning seconds per step and each source's shard files."""
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    try:
        plans, seconds = [], []
        for _ in range(steps):
            t = time.perf_counter()
            plans.append(rt.plan())
            seconds.append(time.perf_counter() - t)
            rt.release(plans[-1])
        sources = getattr(rt.loader, "sources", {})
        if isinstance(sources, dict):
            sources = [sources.get(i) for i in range(len(spec.sources))]
        files = [[str(f) for f in getattr(s, "files", [])] for s in sources]
        return plans, seconds, files
    finally:
        rt.close()


def step_row(plan, seconds: float, microbatches: int) -> dict:
    """One step's numbers; fill is tokens over the nominal ranks x microbatches x seq_len slots (in
    variable mode ranks may use more micro-batches than nominal, or fewer)."""
    s = plan.stats()
    return {
        "step": plan.step, "docs": int(len(plan.items)), "tokens": int(plan.tokens),
        "fill": plan.tokens / max(1, plan.ranks * microbatches * plan.capacity),
        "microbatches": int(plan.ranks * plan.microbatches if plan.rank_microbatches is None else plan.rank_microbatches.sum()),
        "efficiency": s["efficiency"], "max_over_lb": s["max_over_lb"], "tokens_max_over_mean": s["tokens_max_over_mean"],
        "carried": s["carried"], "delayed_outliers": s["delayed_outliers"], "plan_ms": seconds * 1e3,
        "seq_len": int(plan.capacity), "documents_cut": int(plan.documents_cut),
        "max_over_capacity_lb": s.get("max_over_capacity_lb"),  # against the bound respecting the capacities
        **({k: s[k] for k in ("waves", "cp_degrees", "comm_share", "cp_padding")} if "waves" in s else {}),
    }


def split_tradeoff(rows: list[dict]) -> str:
    """packing.split's trade-off over the planned steps: the capacity filled against the documents cut."""
    tokens, slots = sum(r["tokens"] for r in rows), sum(r["tokens"] / r["fill"] for r in rows if r["fill"])
    docs, cut = sum(r["docs"] for r in rows), sum(r["documents_cut"] for r in rows)
    return (f"split: boundary: fill {tokens / max(slots, 1):.2%} of capacity; {cut:,} chunks cut at a micro-batch's "
            f"end ({cut / max(docs, 1):.2%} of the {docs:,} sequences delivered: each cut starts a new sequence, "
            "whose first tokens lose their preceding context)")


def explain(plan, spec, files: list[list[str]], top: int, docs: int) -> list[dict]:
    """The `top` slowest ranks of a step and their heaviest documents."""
    mean = float(plan.rank_cost.mean()) or 1.0
    out = []
    for r in np.argsort(-plan.rank_cost, kind="stable")[:top]:
        sel = np.flatnonzero(plan.rank == r)
        heavy = sel[np.argsort(-plan.cost[sel], kind="stable")[:docs]]
        total = float(plan.rank_cost[r]) or 1.0
        items = []
        for i in heavy:
            src = int(plan.items.source[i])
            shard = int(plan.items.shard[i])
            shard_name = files[src][shard] if src < len(files) and shard < len(files[src]) else str(shard)
            items.append({
                "source": spec.sources[src].name, "shard": shard_name, "row": int(plan.items.row[i]),
                "chunk": int(plan.items.chunk[i]), "length": int(plan.items.length[i]),
                "cost": float(plan.cost[i]), "share": float(plan.cost[i]) / total,
            })
        tokens = int(plan.micro_tokens[r].sum())
        out.append({
            "rank": int(r), "cost": float(plan.rank_cost[r]), "cost_over_mean": float(plan.rank_cost[r]) / mean,
            "cost_over_lb": float(plan.rank_cost[r]) / plan.lower_bound if plan.lower_bound else 1.0,
            "tokens": tokens, "docs": int(len(sel)), "documents": items,
            "why": _why(plan, r, items, tokens),
        })
    return out


def variable_mode_check(plan, spec, above: float = 1.01) -> dict | None:
    """For an equal-mode step certifying worse than `above`: the same documents placed in variable mode.

    When tokens bind (every micro-batch full, ranks differing by whole long chunks) no equal-mode
    assignment of the step can be balanced; variable mode lets ranks of long chunks run fewer
    micro-batches. None when the spec already uses variable mode or the step is within `above`.
    """
    from plait import balance

    if spec.balance.mode != "equal" or not len(plan.items) or plan.stats()["max_over_lb"] <= above \
            or plan.cp_groups is not None:
        return None
    # Carried items are urgent, as when the Planner placed them (never held back again).
    delayed = plan.items.delayed
    priority = np.where(delayed > 0, delayed + 1, 0)
    a = balance.assign(plan.items.length, plan.cost, ranks=plan.ranks, microbatches=plan.microbatches,
                       capacity=plan.capacity, mode="variable", priority=priority)
    lb = balance.lower_bound(plan.cost[a.placed], plan.ranks)
    return {"max_over_lb": float(a.rank_cost.max()) / lb if lb > 0 else 1.0, "placed": float(a.placed.mean()),
            "microbatches_min": int(a.microbatches.min()), "microbatches_max": int(a.microbatches.max())}


def _why(plan, r: int, items: list[dict], tokens: int) -> str:
    mean_tokens = float(plan.micro_tokens.sum(axis=1).mean()) or 1.0
    over = float(plan.rank_cost[r]) / plan.lower_bound if plan.lower_bound else 1.0
    if over <= 1.002:
        return f"within {over - 1:.2%} of the lower bound: as balanced as any assignment can be"
    if items and items[0]["cost"] >= 0.999 * plan.lower_bound and items[0]["share"] > 0.5:
        return f"one chunk of {items[0]['length']:,} tokens costs {items[0]['share']:.0%} of the rank: no split can beat it"
    if items and items[0]["share"] > 0.25:
        return (f"long chunk ({items[0]['length']:,} tokens, {items[0]['share']:.0%} of its cost) and "
                f"{tokens / mean_tokens:.2f}x the mean tokens; the lighter ranks' micro-batches are full, so its cheap "
                "documents had nowhere to go (balance mode `variable` lets light ranks take more tokens)")
    return f"many documents ({tokens / mean_tokens:.2f}x the mean tokens)"


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from plait.cost import CostModel
    from plait.errors import PlaitError
    from plait.spec import load_spec

    spec = load_spec(args.spec)
    if args.dp:
        spec = spec.with_overrides(topology={"dp": args.dp})
    if args.mode:
        spec = spec.with_overrides(balance={"mode": args.mode})
    if args.steps < 1:
        raise PlaitError("--steps must be >= 1")
    from plait import balance

    warm = balance.warmup()
    plans, seconds, files = collect(spec, args.steps)
    rows = [step_row(p, s, spec.packing.phase_at(p.step)[1]) for p, s in zip(plans, seconds)]
    if args.step is not None:
        if not 0 <= args.step < len(plans):
            raise PlaitError(f"--step {args.step} is outside the {len(plans)} planned steps")
        worst = args.step
    else:
        worst = int(np.argmin([r["efficiency"] for r in rows]))
    plan = plans[worst]
    slow = explain(plan, spec, files, args.top, args.docs)

    out = Console()
    if not out.is_terminal:
        out = Console(width=140)
    cm = CostModel.from_spec(spec.cost)
    topo = spec.topology
    ranks = f"pool dp x cp = {plan.ranks}" if plan.cp_groups is not None else f"dp={plan.ranks}"
    out.print(
        f"[bold]{args.spec}[/]: {ranks} (tp={topo.tp} pp={topo.pp} cp={topo.cp}), {_layout_text(spec)}, balance mode {spec.balance.mode}; cost c(L) = "
        f"{cm.linear:.3g} L + {cm.quadratic:.3g} L^2 (attention = the rest at L = {cm.crossover:,.0f})"
        + (f", per CP rank / {topo.cp}" if topo.cp > 1 and plan.cp_groups is None else ""), highlight=False,
    )
    t = Table(title=f"{len(rows)} planned steps (efficiency = mean/max rank cost; LB = max(sum c / R, max c))")
    extra = (["seq_len"] if spec.packing.schedule else []) + (["cut"] if spec.packing.split == "boundary" else [])
    for col in ("step", "docs", "tokens", "fill", "micro-batches", "efficiency", "max/LB", "max/cap-LB", "tokens max/mean", "carried",
                "delayed", *extra, "plan ms*"):
        t.add_column(col, justify="right")
    for r in rows:
        mark = "[bold yellow]" if r["step"] == plan.step else ""
        cap = r["max_over_capacity_lb"]
        more = ([f"{r['seq_len']:,}"] if spec.packing.schedule else []) + (
            [str(r["documents_cut"])] if spec.packing.split == "boundary" else [])
        t.add_row(f"{mark}{r['step']}", f"{r['docs']:,}", f"{r['tokens']:,}", f"{r['fill']:.3f}", f"{r['microbatches']:,}",
                  f"{r['efficiency']:.4f}",
                  f"{r['max_over_lb']:.4f}", "-" if cap is None else f"{cap:.4f}", f"{r['tokens_max_over_mean']:.3f}", str(r["carried"]),
                  str(r["delayed_outliers"]), *more, f"{r['plan_ms']:.1f}")
    out.print(t)
    if spec.packing.split == "boundary":
        out.print(split_tradeoff(rows), highlight=False)
    if "waves" in rows[0]:
        out.print(degrees_table(rows, spec))
    out.print("[dim]* the Planner's time for the step, including reading block metadata from the sources[/]")
    eff = np.array([r["efficiency"] for r in rows])
    out.print(f"efficiency mean {eff.mean():.4f}, worst {eff.min():.4f} (step {rows[int(eff.argmin())]['step']}); "
              f"max/LB mean {np.mean([r['max_over_lb'] for r in rows]):.4f}; planning {np.median(seconds) * 1e3:.1f} ms/step "
              f"(median; kernels ready in {warm:.2f} s)")

    rc = plan.rank_cost / (plan.lower_bound or 1.0)
    if plan.ranks <= 64:
        t = Table(title=f"step {plan.step}: cost per rank / lower bound")
        t.add_column("rank", justify="right")
        t.add_column("cost/LB", justify="right")
        t.add_column("tokens", justify="right")
        t.add_column("docs", justify="right")
        t.add_column("", justify="left")
        for r in range(plan.ranks):
            bar = "█" * int(round(30 * rc[r] / max(rc.max(), 1e-12)))
            t.add_row(str(r), f"{rc[r]:.4f}", f"{int(plan.micro_tokens[r].sum()):,}", str(int((plan.rank == r).sum())), bar)
        out.print(t)
    else:
        q = np.quantile(rc, [0, 0.5, 0.9, 0.99, 1])
        out.print(f"step {plan.step}: cost/LB over {plan.ranks} ranks: min {q[0]:.4f}, median {q[1]:.4f}, p90 {q[2]:.4f}, "
                  f"p99 {q[3]:.4f}, max {q[4]:.4f}")
    t = Table(title=f"step {plan.step}: the {len(slow)} slowest ranks and their heaviest documents")
    for col in ("rank", "cost/mean", "source", "shard", "row", "chunk", "length", "cost share"):
        t.add_column(col, justify="left" if col in ("source", "shard") else "right")
    for s in slow:
        for k, d in enumerate(s["documents"]):
            head = (str(s["rank"]), f"{s['cost_over_mean']:.4f}") if k == 0 else ("", "")
            t.add_row(*head, d["source"], Path(d["shard"]).name, str(d["row"]), str(d["chunk"]), f"{d['length']:,}",
                      f"{d['share']:.1%}")
        t.add_section()
    out.print(t)
    for s in slow:
        out.print(f"  rank {s['rank']}: {s['why']}", highlight=False)
    alt = variable_mode_check(plan, spec)
    if alt is not None:
        out.print(f"  the same documents in balance mode `variable`: max/LB {alt['max_over_lb']:.4f} (ranks run "
                  f"{alt['microbatches_min']}-{alt['microbatches_max']} micro-batches; the trainer then normalises "
                  "its loss by batch.stats['global_label_tokens'])", highlight=False)

    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows, "explained_step": plan.step, "slowest": slow,
                                               "rank_cost": plan.rank_cost.tolist(), "lower_bound": plan.lower_bound,
                                               "variable_mode": alt}, indent=2))
    if args.plot:
        _plot(rows, plan, args.plot)
        Console(stderr=True).print(f"plot written to {args.plot}")
    return 0


def degrees_table(rows: list[dict], spec):
    """Dynamic CP: per step the documents per CP degree, the waves, the traffic's share, the padding."""
    from rich.table import Table

    cp = spec.context_parallel
    t = Table(title=f"dynamic CP over dp x cp = {spec.topology.dp * spec.topology.cp} ranks ({cp.groups} groups, "
                    f"theta {cp.theta:g}): documents per degree k")
    for col in ("step", "waves", "degrees (k: documents)", "comm share", "padding"):
        t.add_column(col, justify="left" if col.startswith("degrees") else "right")
    for r in rows:
        degrees = "  ".join(f"{k}: {n:,}" for k, n in sorted(r["cp_degrees"].items()))
        t.add_row(str(r["step"]), str(r["waves"]), degrees, f"{r['comm_share']:.2%}", f"{r['cp_padding']:.2%}")
    return t


def _layout_text(spec) -> str:
    p = spec.packing
    if not p.schedule:
        return f"seq_len={p.seq_len}, {p.num_microbatches} micro-batches/rank"
    return "seq_len schedule " + " -> ".join(f"{x.seq_len}x{x.microbatches} from step {x.step}" for x in p.schedule)


def _plot(rows: list[dict], plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["efficiency"] for r in rows], "o-", label="mean/max rank cost")
    a.plot(steps, [1 / r["max_over_lb"] for r in rows], "s--", label="lower bound/max rank cost")
    a.set(title="balance per step", xlabel="step", ylim=(min(0.8, min(r["efficiency"] for r in rows) - 0.02), 1.005))
    a.legend(fontsize=8)
    rc = plan.rank_cost / (plan.lower_bound or 1.0)
    b.bar(np.arange(plan.ranks), rc, width=1.0)
    b.axhline(1.0, color="k", ls="--", lw=1, label="lower bound")
    b.set(title=f"step {plan.step}: cost per rank", xlabel="DP rank", ylabel="cost / lower bound")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
