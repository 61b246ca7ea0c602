"""`python -m benchmarks.autoscale`: loaders that follow demand (fixed vs start-time probe vs the run-time controller).

The job: a cheap text source (pre-tokenized Parquet) and an image source (LLaVA-style JSONL shards of
`plait demo`'s pictures: decode, resize and patchify per image) whose preprocessing per token costs far
more (measured in the run from the loaders' own production counters, reported as `cost_ratio`). A
`mixture.schedule` doubles the image source's token share at step `--change-at`.

A simulated trainer consumes the steps at a fixed rate: for each step it asks the runtime for the step's
batches (every DP rank's, `plan` + `build`), then "computes" for the rest of one step period. A step on
which some rank's batch was not built yet when asked for (the Constructors count such requests) is a
step the ranks waited on. Fetches slower than `--wait-tol-ms` (a late batch or a long transfer of pixels)
are reported beside it. Three configurations of the ray runtime, one after the other on one Ray instance:

  fixed   loaders=N: as many loaders as `auto` had at its peak (or --fixed-loaders), dealt by mixture
          weight (split evenly), no measurement
  probe   loaders="auto" with step_time = the trainer's period: today's start-time layout from a probe
  auto    loaders="auto" plus autoscale (plait.runtime.autoscale; a short control interval)

Per configuration: wait_fraction (steps waited on) after warm-up and before the change, in the first
three control intervals after the change, and after them; tokens_per_s; loader_cpu_s (CPU seconds of the
loader processes, from their pids: psutil); loader_reserved_cpu_s (loaders x seconds alive, one CPU
each); rescale events; the stream digest (same_digest: the layout never changes the data).
Targets (issue 12): auto waits on < 5% of steps after warm-up and after the first three intervals past
the change, uses no more loader CPU-seconds than fixed, and all digests are equal.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import main, write_result

HELP = "loaders that follow demand: fixed vs start-time probe vs run-time autoscale (waits, loader CPU, digest)"
DESCRIPTION = __doc__
CONFIGS = ("fixed", "probe", "auto")
WAIT_TARGET = 0.05


def add_arguments(p) -> None:
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="a reduced run (fewer steps, fewer images): under a minute")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"default {','.join(CONFIGS)}")
    p.add_argument("--rate", type=float, default=None, help="trainer steps per second (default: calibrated so "
                   "that the image source needs --image-cores after the change)")
    p.add_argument("--image-cores", type=float, default=1.1, help="cores the image source's preprocessing needs "
                   "after the change at the calibrated rate (more than one loader can give)")
    p.add_argument("--steps", type=int, default=None, help="steps per configuration (default 110; quick 26)")
    p.add_argument("--change-at", type=int, default=None, help="step at which the image share doubles "
                   "(default: 40%% of --steps)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out as warm-up (default: 10%% of --steps, "
                   "at least 4)")
    p.add_argument("--images", type=int, default=None, help="distinct pictures (default 240; quick 80)")
    p.add_argument("--image-share", type=float, default=0.35, help="image token share before the change (doubled after)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=12288)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--interval", type=float, default=1.0, help="autoscale control interval (s)")
    p.add_argument("--cooldown", type=float, default=3.0, help="autoscale cooldown (s)")
    p.add_argument("--fixed-loaders", type=int, default=None, help="loaders of `fixed` (default: auto's peak, else 2)")
    p.add_argument("--cpus", type=int, default=None, help="CPUs Ray offers (default: this machine's, at least 2)")
    p.add_argument("--wait-tol-ms", type=float, default=None, help="a fetch longer than this is slow (reported "
                   "beside the waits; default: 10%% of the step period, at least 15 ms)")
    p.add_argument("--quiet", action="store_true", help="no table")


def resolve(args) -> dict:
    """The run's sizes from the arguments (quick or full)."""
    steps = args.steps or (26 if args.quick else 110)
    change = args.change_at if args.change_at is not None else int(steps * 0.4)
    warmup = args.warmup if args.warmup is not None else max(4, steps // 10)
    if not 0 < warmup < change < steps:
        from plait.errors import PlaitError

        raise PlaitError(f"need 0 < warmup ({warmup}) < change_at ({change}) < steps ({steps})")
    if not 0 < args.image_share < 0.5:
        from plait.errors import PlaitError

        raise PlaitError(f"--image-share must be in (0, 0.5) (it doubles at the change), not {args.image_share}")
    for name, value in (("rate", args.rate), ("image-cores", args.image_cores)):
        if value is not None and not value > 0:
            from plait.errors import PlaitError

            raise PlaitError(f"--{name} must be > 0, not {value}")
    sizes = {"steps": steps, "change_at": change, "warmup": warmup, "image_cores": args.image_cores,
            "images": args.images or (80 if args.quick else 240), "dp": args.dp, "seq_len": args.seq_len,
            "microbatches": args.microbatches,
            "image_share": args.image_share, "interval_s": args.interval, "cooldown_s": args.cooldown,
            "cpus": args.cpus or max(2, os.cpu_count() or 2), "wait_tol_ms": args.wait_tol_ms}
    return with_rate(sizes, args.rate) if args.rate is not None else sizes


def with_rate(sizes: dict, rate: float) -> dict:
    """The sizes with the trainer's rate (and what follows from it: the slow-fetch tolerance)."""
    tol = sizes["wait_tol_ms"] / 1000 if sizes.get("wait_tol_ms") is not None else max(0.015, 0.1 / rate)
    return {**sizes, "rate": rate, "wait_tol_s": tol}


def calibrate(spec, sizes: dict, steps: int = 2) -> dict:
    """Seconds of preprocessing per image token on this machine (the local runtime builds `steps` steps:
    CPU seconds of the builds / image tokens delivered; text and packing are counted in, so it reads a
    little high), and the rate at which the image source needs `image_cores` cores after the change."""
    from plait.runtime import make_runtime

    image = spec.source_names.index("image")
    rt = make_runtime(spec, "local")
    cpu, tokens = 0.0, 0
    try:
        for _ in range(steps):
            plan = rt.plan()
            t0 = time.process_time()
            for r in range(plan.ranks):
                for mb in rt.build(plan, r):
                    lengths = mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]
                    tokens += int(lengths[mb.source_ids == image].sum())
            cpu += time.process_time() - t0
            rt.release()
    finally:
        rt.close()
    per_token = cpu / max(tokens, 1)
    step_tokens = sizes["dp"] * sizes["microbatches"] * sizes["seq_len"]
    rate = sizes["image_cores"] / max(per_token * step_tokens * 2 * sizes["image_share"], 1e-9)
    return {"image_s_per_token": per_token, "rate": float(min(8.0, max(0.5, round(rate, 2))))}


# ----- data and spec ---------------------------------------------------------------------------
def make_data(root: Path, images: int, *, image_shards: int = 8, text_files: int = 4, seed: int = 5) -> dict:
    """The text source (pre-tokenized Parquet, lognormal lengths) and the image source (`plait demo`'s
    picture generator, its captions JSONL dealt into `image_shards` files so it can be partitioned)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plait.cli.demo_data import write_image_source

    jsonl = write_image_source(root / "image", images)
    lines = jsonl.read_text().splitlines()
    for k in range(image_shards):
        (root / "image" / f"captions-{k:02d}.jsonl").write_text("\n".join(lines[k::image_shards]) + "\n")
    jsonl.unlink()
    rng = np.random.default_rng(seed)
    (root / "text").mkdir(parents=True, exist_ok=True)
    for f in range(text_files):
        lengths = np.clip(rng.lognormal(np.log(400), 0.8, 500), 16, 4000).astype(np.int64)
        flat = rng.integers(2, 4000, int(lengths.sum())).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        pq.write_table(pa.table({"input_ids": tokens}), root / "text" / f"text-{f:02d}.parquet", row_group_size=250)
    return {"text": str(root / "text" / "*.parquet"), "image": str(root / "image" / "captions-*.jsonl"),
            "image_root": str(root / "image")}


def bench_spec(paths: dict, sizes: dict):
    from plait.spec import load_spec

    share = sizes["image_share"]
    return load_spec({
        "seed": 11,
        "sources": [{"name": "text", "path": paths["text"], "tokens_field": "input_ids", "eos": 1},
                    {"name": "image", "path": paths["image"], "format": "jsonl", "text_field": "caption",
                     "image_field": "image", "image_root": paths["image_root"], "eos": 257}],
        "mixture": {"interpolation": "step", "schedule": [
            {"step": 0, "weights": {"text": 1 - share, "image": share}},
            {"step": sizes["change_at"], "weights": {"text": 1 - 2 * share, "image": 2 * share}}]},
        "images": {"policy": "dynamic", "patch": 14, "merge": 2, "min_pixels": 28 * 28 * 4,
                   "max_pixels": 28 * 28 * 64, "image_token_id": 300},
        "packing": {"seq_len": sizes["seq_len"], "microbatches": sizes["microbatches"], "max_patches": 4 * sizes["seq_len"]},
        "topology": {"dp": sizes["dp"]},
        "cost": {"linear": 1.0, "quadratic": 0.0001, "encoder": {"linear": 2.0, "quadratic": 0.001}},
    })


# ----- measuring one configuration -------------------------------------------------------------
class LoaderWatch(threading.Thread):
    """Polls the job's current loaders (pids from their stats) every `period` s: CPU seconds of each
    loader process (user + system, psutil; a retired loader keeps its last reading) and how long each was
    seen alive. A loader's process start-up is part of its CPU time."""

    def __init__(self, planner, period: float = 0.25):
        super().__init__(name="plait-bench-loader-watch", daemon=True)
        self.planner, self.period = planner, period
        self.cpu: dict[int, float] = {}
        self.seen: dict[int, list[float]] = {}  # pid -> [first, last] monotonic seconds
        self.stopped = threading.Event()

    def poll(self) -> None:
        import psutil

        from plait.runtime.ray.common import get

        now = time.monotonic()
        for st in get(self.planner.loader_stats.remote()):
            pid = int(st["pid"])
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            self.cpu[pid] = float(t.user + t.system)
            self.seen.setdefault(pid, [now, now])[1] = now

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the job is closing; the last readings stand
                return

    def finish(self) -> dict:
        self.stopped.set()
        self.join(timeout=5)
        # each reading stands for one polling period (a loader lives up to a period beyond its first and last)
        return {"loader_cpu_s": sum(self.cpu.values()), "loader_processes": len(self.cpu),
                "loader_reserved_cpu_s": sum(last - first + self.period for first, last in self.seen.values())}


def build_waits(rt) -> tuple[int, float]:
    """(requests that found their build unfinished, seconds they waited) summed over the Constructors."""
    from plait.runtime.ray.common import get

    stats = get([c.stats.remote() for c in rt.builders().values()])
    return (sum(int(st.get("waits", 0)) for st in stats),
            sum(float(w) for st in stats for w in st.get("wait_s", {}).values()))


def drive(rt, sizes: dict) -> dict:
    """The simulated trainer: per step ask for every rank's batches, then compute for one period. A step
    waited when some rank's build was not finished when asked for (the Constructors count such requests)."""
    from plait.metrics import batch_digest_update, combined_digest

    period = 1.0 / sizes["rate"]
    digests = {r: hashlib.sha256() for r in range(sizes["dp"])}
    fetch_s, waited, tokens = [], [], 0
    waits, wait_s = build_waits(rt)
    start = time.perf_counter()
    for _ in range(sizes["steps"]):
        t0 = time.perf_counter()
        plan = rt.plan()
        for r in range(plan.ranks):
            for mb in rt.build(plan, r):
                batch_digest_update(digests[r], mb)
                tokens += len(mb.input_ids)
        rt.release()
        fetch = time.perf_counter() - t0
        fetch_s.append(fetch)
        now_waits, wait_s_now = build_waits(rt)
        waited.append(now_waits > waits)
        waits = now_waits
        # "compute": one period from the step's start; a step that waited starts its period when its batch came
        time.sleep(max(0.0, t0 + period + (fetch if waited[-1] else 0.0) - time.perf_counter()))
    elapsed = time.perf_counter() - start
    return {"fetch_s": fetch_s, "waited": waited, "tokens": tokens, "elapsed_s": elapsed,
            "build_wait_s": wait_s_now - wait_s,
            "digest": combined_digest({str(r): h.hexdigest() for r, h in digests.items()})}


def wait_windows(waited: list[bool], fetch_s: list[float], sizes: dict) -> dict:
    """wait_fraction after warm-up (before the change), in the first three control intervals after the
    change (the transition, in steps at the trainer's rate), and after that to the end; the same for
    slow fetches (longer than wait_tol_s: a late batch or a long transfer)."""
    change = sizes["change_at"]
    transition = change + max(1, round(3 * sizes["interval_s"] * sizes["rate"]))
    slow = [f > sizes["wait_tol_s"] for f in fetch_s]

    def frac(flags: list[bool], lo: int, hi: int):
        part = flags[lo:hi]
        return sum(part) / len(part) if part else None

    n, warm = len(waited), sizes["warmup"]
    return {"wait_fraction_warm": frac(waited, warm, change), "wait_fraction_transition": frac(waited, change, transition),
            "wait_fraction_after": frac(waited, transition, n), "wait_fraction_all": frac(waited, warm, n),
            "slow_fetch_fraction_warm": frac(slow, warm, change), "slow_fetch_fraction_after": frac(slow, transition, n),
            "fetch_ms_median": 1e3 * sorted(fetch_s)[len(fetch_s) // 2] if fetch_s else None,
            "transition_steps": [change, min(transition, n)]}


def production(rt) -> dict | None:
    """Per source (busy seconds, tokens, images) summed over the job's current loaders (their production
    counters), or None where the loaders do not count production."""
    from plait.runtime.ray.common import get

    handles = get(rt.planner.get_loaders.remote())
    rows = [t.get("produced") for t in get([h.telemetry.remote() for h in handles])]
    if not any(rows):
        return None
    total: dict[str, list[float]] = {}
    for row in rows:
        for s, (busy, tok, _samples, images) in (row or {}).items():
            acc = total.setdefault(rt.spec.source_names[int(s)], [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + busy, acc[1] + tok, acc[2] + images
    return {name: {"busy_s": b, "tokens": t, "images": i, "us_per_token": 1e6 * b / t if t else None}
            for name, (b, t, i) in total.items()}


def run_config(name: str, spec, sizes: dict, fixed_loaders: int) -> dict:
    from plait.runtime import make_runtime

    options: dict = {"build_ahead": 2}
    if name == "fixed":
        options["loaders"] = fixed_loaders
    else:
        options.update(loaders="auto", step_time=1.0 / sizes["rate"])
    if name == "auto":
        options["autoscale"] = {"interval_s": sizes["interval_s"], "cooldown_s": sizes["cooldown_s"]}
    t0 = time.perf_counter()
    rt = make_runtime(spec, "ray", **options)
    try:
        startup = time.perf_counter() - t0
        watch = LoaderWatch(rt.planner)
        watch.poll()
        watch.start()
        driven = drive(rt, sizes)
        produced = production(rt)
        report = rt.scaling_report() if hasattr(rt, "scaling_report") else {"events": [], "timeline": []}
        cpu = watch.finish()
        start_layout = rt.layout
    finally:
        rt.close()
    events = report.get("events", [])
    peak = max([start_layout.loaders] + [int(e["loaders"]) for e in events if e.get("kind") != "unmet"])
    row = {"config": name, "available": True, "startup_s": startup, "loaders_at_start": start_layout.loaders,
           "partitions_at_start": {spec.source_names[s]: n for s, n in start_layout.num_partitions.items()},
           "peak_loaders": peak, "tokens": driven["tokens"], "elapsed_s": driven["elapsed_s"],
           "tokens_per_s": driven["tokens"] / driven["elapsed_s"], "digest": driven["digest"],
           "rescale_events": sum(e.get("kind") != "unmet" for e in events),
           "unmet_events": sum(e.get("kind") == "unmet" for e in events),
           "events": [{k: e.get(k) for k in ("t", "step", "kind", "loaders", "partitions", "reason")} for e in events],
           "produced": produced, **cpu, "build_wait_s": driven["build_wait_s"],
           **wait_windows(driven["waited"], driven["fetch_s"], sizes)}
    row["timeline"] = [{k: r.get(k) for k in ("t", "step", "loaders", "loaders_per_source", "wait_s")}
                       for r in report.get("timeline", [])]
    return row


def autoscale_available() -> bool:
    from plait.runtime import accepted_options
    from plait.runtime.ray.runtime import RayRuntime

    return "autoscale" in accepted_options(RayRuntime)


# ----- the benchmark ---------------------------------------------------------------------------
def cost_ratio(rows: list[dict]) -> dict | None:
    """Image vs text preprocessing seconds per token, from the loaders' production counters of the run
    (all configurations pooled)."""
    busy = {"text": [0.0, 0.0], "image": [0.0, 0.0]}
    for row in rows:
        for name, p in (row.get("produced") or {}).items():
            busy[name][0] += p["busy_s"]
            busy[name][1] += p["tokens"]
    if not busy["text"][1] or not busy["image"][1] or not busy["text"][0]:
        return None
    text, image = busy["text"][0] / busy["text"][1], busy["image"][0] / busy["image"][1]
    return {"text_us_per_token": text * 1e6, "image_us_per_token": image * 1e6, "ratio": image / text}


def run(args) -> int:
    from plait.runtime.ray.common import NAMESPACE, ray_module

    sizes = resolve(args)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        from plait.errors import PlaitError

        raise PlaitError(f"--configs: unknown configuration(s) {unknown} (choose from {', '.join(CONFIGS)})")
    has_auto = autoscale_available()
    load_start = os.getloadavg()[0]
    # auto first: `fixed` gets as many loaders as auto's peak
    order = [c for c in ("auto", "probe", "fixed") if c in configs]
    rows: dict[str, dict] = {}
    ray = ray_module()
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="plait-bench-autoscale-") as tmp:
        spec = bench_spec(make_data(Path(tmp), sizes["images"]), sizes)
        calibration = None
        if "rate" not in sizes:
            calibration = calibrate(spec, sizes)
            sizes = with_rate(sizes, calibration["rate"])
        started = not ray.is_initialized()  # else: the caller's instance (a test's), left running
        if started:
            ray.init(num_cpus=sizes["cpus"], include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
                     configure_logging=False)
        try:
            for name in order:
                if name == "auto" and not has_auto:
                    rows[name] = {"config": "auto", "available": False,
                                  "note": "the ray runtime has no `autoscale` option yet (issue 12's mechanism): not run"}
                    continue
                fixed = args.fixed_loaders or rows.get("auto", {}).get("peak_loaders") or 2
                rows[name] = run_config(name, spec, sizes, fixed)
        finally:
            if started:
                ray.shutdown()
    ran = [rows[c] for c in configs if rows[c].get("available")]
    digests = {r["digest"] for r in ran}
    result = {"sizes": sizes, "calibration": calibration, "autoscale_available": has_auto, "configs": [rows[c] for c in configs],
              "cost_ratio": cost_ratio(ran), "same_digest": len(digests) == 1 if ran else None,
              "wall_s": time.perf_counter() - t_all,
              # loader busy time is wall time: on a machine busier than its cores, every cost reads higher
              "load_average": {"start": load_start, "end": os.getloadavg()[0], "cpus": os.cpu_count()}}
    result["targets"] = targets(rows)
    if not args.quiet:
        table(result)
    if args.json:
        write_result(args.json, result)
    return 0


def targets(rows: dict[str, dict]) -> dict | None:
    """Issue 12's targets for `auto` (None when auto did not run)."""
    auto, fixed = rows.get("auto"), rows.get("fixed")
    if not auto or not auto.get("available"):
        return None
    out = {"auto_waits_after_warmup_lt_5pct": (auto["wait_fraction_warm"] or 0.0) < WAIT_TARGET,
           "auto_back_under_5pct_within_3_intervals": (auto["wait_fraction_after"] or 0.0) < WAIT_TARGET}
    if fixed and fixed.get("available"):
        out["auto_cpu_le_fixed"] = auto["loader_cpu_s"] <= fixed["loader_cpu_s"]
        out["auto_reserved_le_fixed"] = auto["loader_reserved_cpu_s"] <= fixed["loader_reserved_cpu_s"]
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    s = result["sizes"]
    console = Console(width=max(110, Console().width))  # ten columns: never squeezed into 80
    t = Table(title=f"autoscale: {s['steps']} steps at {s['rate']:g} steps/s, DP {s['dp']}, image share "
                    f"{s['image_share']:.0%} -> {2 * s['image_share']:.0%} at step {s['change_at']}")
    cols = ("config", "loaders", "wait warm", "wait chg", "wait after", "tok/s", "CPU-s", "rsv CPU-s",
            "rescales", "digest")
    for c in cols:
        t.add_column(c, justify="left" if c == "config" else "right")
    for r in result["configs"]:
        if not r.get("available"):
            t.add_row(r["config"], r["note"], *[""] * (len(cols) - 2))
            continue
        t.add_row(r["config"], f"{r['loaders_at_start']}/{r['peak_loaders']}", _pct(r["wait_fraction_warm"]),
                  _pct(r["wait_fraction_transition"]), _pct(r["wait_fraction_after"]), f"{r['tokens_per_s']:,.0f}",
                  f"{r['loader_cpu_s']:.1f}", f"{r['loader_reserved_cpu_s']:.1f}",
                  f"{r['rescale_events']}" + (f"+{r['unmet_events']}u" if r["unmet_events"] else ""),
                  r["digest"][:8])
    console.print(t)
    console.print("loaders: at start/peak; wait: share of steps on which a rank's batch was not built when "
                  "asked for, after warm-up, in the 3 control intervals after the change, "
                  "after those; CPU-s: loader processes' CPU seconds; rsv: loaders x seconds alive; u: unmet")
    ratio = result["cost_ratio"]
    if ratio:
        console.print(f"preprocessing per token: image {ratio['image_us_per_token']:.2f} µs, text "
                      f"{ratio['text_us_per_token']:.3f} µs: ratio {ratio['ratio']:.0f}x (loaders' counters)")
    console.print(f"same digest across configurations: {result['same_digest']}; wall {result['wall_s']:.0f} s")
    load = result["load_average"]
    if max(load["start"], load["end"]) > (load["cpus"] or 1):
        console.print(f"[yellow]note: load average {load['start']:.1f} -> {load['end']:.1f} on {load['cpus']} CPUs: "
                      "other work competed with the job; costs and waits read higher than on an idle machine[/]")
    for r in result["configs"]:
        for e in r.get("events", []):
            console.print(f"  {r['config']} t={e['t']:.1f}s step {e['step']}: {e['kind']}: {escape(e['reason'])}")
    if result["targets"]:
        console.print("targets: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result["targets"].items()))


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
