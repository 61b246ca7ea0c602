"""Stream a spec for every DP rank of its topology (what `plait demo` and `plait run` do)."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.markup import escape
from rich.table import Table

from plait.client import resume_start
from plait.errors import PlaitError
from plait.metrics import RECENT_STEPS, RunStats, ShareWindows
from plait.mixture import MixtureSchedule
from plait.state.schema import boundary_state
from plait.runtime import make_runtime
from plait.spec import Spec


def stream(
    spec: Spec,
    *,
    steps: int,
    runtime: str = "local",
    progress: bool = True,
    resume: dict | None = None,
    save_state: str | None = None,
    runtime_options: dict | None = None,
    allow_spec_change: bool = False,
    outputs: dict[str, str | None] | None = None,
) -> dict:
    """Streams `steps` global steps for every rank and returns the summary. `outputs` names files to
    write: `plot` (PNG), `report` (the mixing report) and `steps_log` (one JSON line per step)."""
    plot, report, steps_log = ((outputs or {}).get(k) for k in ("plot", "report", "steps_log"))
    rt = make_runtime(spec, runtime, **(runtime_options or {}))
    log = None
    try:
        changes = _resume(rt, resume, allow_spec_change) if resume is not None else []
        mixture = MixtureSchedule(spec)
        stats = RunStats(spec.source_names, spec.topology.dp)
        # Kept only when asked for, and bounded (a run may last weeks): --plot keeps the cumulative tokens
        # per source of the last RECENT_STEPS steps; --report one entry per 100-step window (ShareWindows).
        shares = CumulativeShares(len(spec.sources)) if plot else None
        windows = ShareWindows(len(spec.sources)) if report else None
        first_step = None
        log = open(steps_log, "w") if steps_log else None  # closed in the finally below
        with Progress(
            TextColumn("[bold]streaming[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), disable=not progress, console=Console(stderr=True),
        ) as bar:
            task = bar.add_task("steps", total=steps, rate="")
            for _ in range(steps):
                plan = rt.plan()
                w = plan.weights if plan.weights is not None else mixture.weights(plan.step)
                stats.add_plan(plan, w)
                first_step = plan.step if first_step is None else first_step
                if windows is not None:
                    windows.add(plan.drawn if plan.drawn is not None else np.zeros(len(w)), w)
                for rank in range(plan.ranks):
                    for mb in rt.build(plan, rank):
                        stats.add_batch(mb)
                rt.release()
                if shares is not None:
                    shares.add(plan)
                if log is not None:
                    log.write(step_record(plan, w, spec) + "\n")
                bar.update(task, advance=1, rate=f"{stats.tokens / max(stats.elapsed, 1e-9) / 1e6:.2f} M tok/s")
        summary = stats.summary()
        if any(s.video_field is not None for s in spec.sources):  # 0 too: a video source that delivered none
            summary.update(videos=stats.videos, videos_per_s=stats.videos / max(stats.elapsed, 1e-9))
        if any(s.audio_field is not None for s in spec.sources):
            summary.update(audio_clips=stats.audio_clips, audio_seconds=stats.audio_seconds,
                           audio_seconds_per_s=stats.audio_seconds / max(stats.elapsed, 1e-9))
        errors = rt.error_report()
        summary["errors"] = {k: v["skipped"] for k, v in errors.items()}  # samples lost, once per epoch each
        summary["bad_records"] = {k: v.get("bad_records", v["skipped"]) for k, v in errors.items()}  # distinct
        summary["placeholder_documents"] = {k: v["placeholder_documents"] for k, v in errors.items()
                                            if v.get("placeholder_documents")}  # media ids without media
        summary["error_messages"] = {k: v["messages"][:20] for k, v in errors.items() if v["messages"]}
        summary["runtime"] = runtime
        summary["scaling"] = rt.scaling_report()  # the loader layout's changes (ray; empty elsewhere)
        summary["dp"] = spec.topology.dp
        if changes:
            summary["spec_changes"] = changes
        if save_state:
            Path(save_state).write_text(json.dumps(boundary_state(rt.state_dict(), spec)))
        if plot:
            _plot(spec, stats, shares, mixture, plot)
            summary["plot"] = plot
        if report:
            summary["mixing_report"] = write_mixing_report(spec, windows, rt.state_dict(), changes, report,
                                                           first_step=int(first_step or 0))
        return summary
    finally:
        if log is not None:
            log.close()
        rt.close()


def step_record(plan, weights, spec: Spec) -> str:
    """One line of --steps-log: the step's balance, tokens and draws per source (JSON)."""
    tok = np.bincount(plan.items.source, weights=plan.items.length, minlength=len(spec.sources))
    return json.dumps({"step": int(plan.step), "efficiency": float(plan.efficiency),
                       "max_over_lb": float(plan.max_over_lb), "tokens": int(plan.tokens),
                       "tokens_per_source": dict(zip(spec.source_names, map(int, tok))),
                       "weights": dict(zip(spec.source_names, map(float, weights)))})


def _resume(rt, resume: dict, allow_spec_change: bool = False) -> list[str]:
    """Start from a saved state: a data state (--save-state) or a trainer's Loader.state_dict().

    A Loader state names the step in progress and how many of its micro-batches were consumed. This
    driver streams whole steps, so it continues after that step when it was fully consumed, and
    refuses a mid-step state rather than deliver the consumed micro-batches again. The state is read as
    `Loader.load_state_dict` reads it (plait.client.resume_start): both refuse the same states.
    """
    if "next_microbatch" not in resume and "data" not in resume:  # a bare data state
        resume = {"version": 1, "data": resume, "next_microbatch": 0}
    data, consumed, _ = resume_start(resume, rt.spec, rt, allow_spec_change)
    if allow_spec_change:
        changes = rt.load_state_dict(data, allow_spec_change=True) or []
        if changes and consumed:
            raise PlaitError("a spec change applies from a step's start: this state names a step in progress "
                             "and not the state after it")
        for c in changes:
            print(f"spec change: {c}")
        if not consumed:
            return changes
    else:
        rt.load_state_dict(data)
        changes = []
    if consumed:
        plan = rt.plan()  # metadata only: moves the data state past the consumed step
        if consumed < plan.microbatches:
            raise PlaitError(
                f"the state was saved in the middle of step {plan.step} (after micro-batch {consumed - 1} of "
                f"{plan.microbatches}); `plait run` resumes from step boundaries"
            )
        rt.release()
    return changes


def print_summary(spec: Spec, s: dict, console: Console) -> None:
    head = Table(title="run summary", show_header=False)
    head.add_column("metric")
    head.add_column("value", justify="right")
    head.add_row("global steps", str(s["steps"]))
    head.add_row("DP ranks", str(s["dp"]))
    head.add_row("tokens delivered", f"{s['tokens']:,}")
    head.add_row("tokens/s", f"{s['tokens_per_s']:,.0f}")
    head.add_row("balance efficiency (mean/max rank cost), mean", f"{s['efficiency_mean']:.4f}")
    head.add_row("balance efficiency, worst step", f"{s['efficiency_min']:.4f}")
    head.add_row("max rank cost / lower bound, mean", f"{s['max_over_lb_mean']:.4f}")
    head.add_row("fill (tokens / seq_len slots of the micro-batches run)", f"{s['fill']:.4f}")
    head.add_row("padding (unfilled seq_len slots = 1 - fill)", f"{s['padding_fraction']:.4f}")
    head.add_row("padding, worst micro-batch", f"{s['padding_fraction_worst_microbatch']:.4f}")
    if "images" in s:
        head.add_row("images delivered", f"{s['images']:,}")
        head.add_row("images/s", f"{s['images_per_s']:,.1f}")
        head.add_row("encoder share of the cost", f"{s['encoder_share']:.4f}")
    if "videos_per_s" in s:
        head.add_row("videos delivered", f"{s['videos']:,}")
        head.add_row("videos/s", f"{s['videos_per_s']:,.1f}")
    if "audio_seconds_per_s" in s:
        head.add_row("audio clips delivered (seconds of audio)", f"{s['audio_clips']:,} ({s['audio_seconds']:,.1f} s)")
        head.add_row("seconds of audio per second", f"{s['audio_seconds_per_s']:,.1f}")
    skipped = sum(s.get("errors", {}).values())
    bad = sum(s.get("bad_records", s.get("errors", {})).values())
    head.add_row("bad records skipped (distinct; samples lost, once per epoch)", f"{bad} ({skipped})")
    head.add_row("empty documents (0 tokens) drawn", str(s.get("empty_documents", 0)))
    console.print(head)
    mix = Table(title="mixture: token share per source")
    for col in ("source", "target", "achieved", "error"):
        mix.add_column(col, justify="right" if col != "source" else "left")
    for name, m in s["mixture"].items():
        mix.add_row(name, f"{m['target']:.4f}", f"{m['achieved']:.4f}", f"{m['achieved'] - m['target']:+.4f}")
    console.print(mix)
    for name, n in s.get("placeholder_documents", {}).items():
        console.print(f"[bold yellow]source {name!r}: {n} document(s) without media hold a media placeholder id[/] "
                      "(a vision-language model's forward takes it for media; set the source's placeholder_ids: "
                      "refuse or replace)", highlight=False)
    if skipped:  # skipped records are reported, never silent: say which
        console.print(f"[bold yellow]{bad} bad record(s) skipped[/] ({skipped} sample(s) lost, once per epoch each; "
                      "on_error: skip); first ones:", highlight=False)
        for name, messages in s.get("error_messages", {}).items():
            for m in messages[:5]:
                console.print(f"  {escape(m)}", highlight=False, soft_wrap=True)


class CumulativeShares:
    """Tokens per source since the run started, as of each of the last RECENT_STEPS steps (the mixture plot)."""

    def __init__(self, sources: int):
        self.total = np.zeros(sources)
        self.steps = 0
        self.cumulative: deque = deque(maxlen=RECENT_STEPS)

    def add(self, plan) -> None:
        self.total += np.bincount(plan.items.source, weights=plan.items.length, minlength=len(self.total))
        self.cumulative.append(self.total.copy())
        self.steps += 1


def _plot(spec: Spec, stats: RunStats, shares: CumulativeShares, mixture: MixtureSchedule, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    totals = np.array(shares.cumulative).reshape(-1, len(spec.source_names))
    steps = np.arange(shares.steps - len(totals), shares.steps)
    cum = totals / np.maximum(1, totals.sum(axis=1, keepdims=True))
    for i, name in enumerate(spec.source_names):
        line = a.plot(steps, cum[:, i], label=f"{name} (cumulative)")
        a.plot(steps, [mixture.weights(t)[i] for t in steps], "--", color=line[0].get_color(), alpha=0.6)
    a.set(title="mixture over steps (dashed: target)", xlabel="step", ylabel="token share")
    a.legend(fontsize=8)
    recent = np.arange(stats.steps - len(stats.efficiency), stats.steps)
    b.plot(recent, list(stats.efficiency), label="mean/max rank cost")
    b.plot(recent, 1 / np.array(stats.max_over_lb), label="lower bound / max rank cost")
    b.set(title=f"balance per step (the last {RECENT_STEPS:,} at most)", xlabel="step", ylim=(0.8, 1.01))
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_mixing_report(spec: Spec, shares: ShareWindows, state: dict, changes: list[str], path: str, *,
                        first_step: int = 0) -> dict:
    """Achieved share per source over windows of steps against its target, and the weight changes in
    force (run-time overrides, spec changes): JSON at `path` (.json) and a PNG beside it (its per-step
    curve covers the last RECENT_STEPS steps)."""
    names = spec.source_names
    window = shares.window
    windows = [dict(w, start=w["start"] + first_step, end=w["end"] + first_step) for w in shares.finish()]
    drawn = np.array(shares.drawn).reshape(-1, len(names))
    weights = np.array(shares.weights).reshape(-1, len(names))
    report = {
        "sources": names, "window": window, "first_step": first_step, "windows": windows,
        "worst_error": max((w["worst_error"] for w in windows), default=0.0),
        "weight_changes": state.get("overrides") or [], "spec_changes": changes,
    }
    base = Path(path)
    json_path = base if base.suffix == ".json" else base.with_suffix(".json")
    json_path.write_text(json.dumps(report, indent=2))
    report["json"], report["png"] = str(json_path), str(json_path.with_suffix(".png"))
    _plot_shares(names, drawn, weights, first_step + shares.steps - len(drawn), window, report)
    return report


def _plot_shares(names, drawn, weights, first_step, window, report) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    steps = first_step + np.arange(len(drawn))
    k = max(1, min(window, len(drawn)) // 4)  # a moving window for the per-step share
    kernel = np.ones(k)
    for i, name in enumerate(names):
        got = np.convolve(drawn[:, i], kernel, "same") / np.maximum(1, np.convolve(drawn.sum(axis=1), kernel, "same"))
        line = ax.plot(steps, got, label=f"{name} (achieved, {k}-step mean)")
        ax.plot(steps, weights[:, i], "--", color=line[0].get_color(), alpha=0.7)
    for o in report["weight_changes"]:
        ax.axvline(o["at_step"], color="grey", lw=0.6, ls=":")
    ax.set(title="token share per source (dashed: target; dotted: weight changes)", xlabel="step", ylabel="share")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(report["png"], dpi=100)
    plt.close(fig)
