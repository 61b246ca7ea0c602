"""`plait bench e2e`: a simulated training job fed from a text + image mixture, per-rank loaders vs plait.

The job: DP ranks (threads of this process) in synchronous data parallelism. For each step every rank
takes its micro-batches one by one from its loader (the time the call blocks is the rank's wait for
data) and "computes" each for the cost model's time of that micro-batch: the spec's `cost` (a 7B
Llama-like LLM over each document's tokens, attention included, plus a ViT-L-like encoder over each
image's patches: plait.cost.CostModel + EncoderCost, in training FLOPs) divided by a stated GPU speed
(`--gpu-tflops`, effective FLOP/s). The step ends when every rank has finished it (a barrier: the
gradient all-reduce), so a straggler, or a rank waiting for data, slows the whole step.

The data: three sources of the same mixture for both strategies: `web` (Parquet text, tokenized on
read), `long` (pre-tokenized 4k-64k token documents: cut at seq_len, long attention) and `image`
(LLaVA-style JSONL captions + JPEG/PNG images in 16 shards: header, decode, resize, patchify).

Workloads (`--workloads`, both by default; one row per (workload, DP, seq_len, strategy)):

  gpu-bound     the text + image mixture below at `--seq-len` with a GPU of `--gpu-tflops`;
  data-bound    the same with a GPU of `--data-bound-tflops` (default 100000): delivery sets the pace;
                plait runs there as one machine runs it by default (the local runtime, no services) and,
                in a second row (`runtime: ray`), on the ray runtime (`--data-bound-runtimes`).

The project's other workloads (long-context, cpu-pool, node-images) are `python -m benchmarks.e2e_workloads`.

Strategies, the same steps and the same CPU budget B (`--cpus`, default 8 logical CPUs):

  per-rank  each rank has a torch DataLoader with W = B / DP workers over its share of the sources,
            packing greedily in arrival order (plait.cli.bench.e2e_per_rank): B worker processes.
  plait     gpu-bound, and data-bound's `ray` row: the ray runtime (plait.Loader, runtime="ray",
            loaders="auto", and autoscale=True where the runtime has it) in a Ray instance of B CPUs: at
            most B SourceLoader actors, plus the Planner and a Constructor, balancing each step's compute
            across ranks. data-bound's `local` row: the local runtime in this process reading every rank
            (LocalRuntime all_ranks: each step planned once, every rank's micro-batches built ahead on
            build threads), one SourceLoader decoding on loading.workers = B threads: B preprocessing
            threads where per-rank has B worker processes, on the same cores.

On a machine with fewer cores than B (this one has 2) both are CPU-bound on the same cores; the budget
then caps processes, not cores. Per (strategy, DP): steps/s after warm-up, wait_fraction (rank-time
spent waiting for data), balance_loss (mean over steps of 1 - mean/max of the ranks' compute times),
tokens/s, and the compute-bound steps/s (what the GPUs alone would allow with that balance). The ratio
of steps/s plait / per-rank is the figure to put beside MegaScale-Data's reported 4.5x.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from plait.cli.bench.e2e_run import (
    GpuClock,
    autoscale_available,
    run_per_rank,
    run_plait,
    run_plait_local,
    start_ray,
)

HELP = "end to end: a simulated synchronous DP job fed by per-rank torch DataLoaders vs plait (steps/s)"
DESCRIPTION = __doc__
IMAGE_SHARDS = 16
DPS = (8,)
WORKLOADS = ("gpu-bound", "data-bound")


def add_arguments(p) -> None:
    add_job_arguments(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)} (default: both)")
    p.add_argument("--data-bound-runtimes", default="local,ray",
                   help="data-bound: plait's runtimes, one plait row each (local: in this process, no services, "
                        "loading.workers = --cpus threads; ray: the ray runtime in a Ray instance of --cpus CPUs)")
    p.add_argument("--local-workers", type=int, default=None,
                   help="data-bound, local runtime: loading.workers (default: --cpus, per-rank's worker processes)")
    p.add_argument("--local-build-threads", type=int, default=None,
                   help="data-bound, local runtime: build threads (default: plait's, plait.job.builds.default_threads)")


def add_job_arguments(p) -> None:
    """The simulated job's options (benchmarks.e2e_workloads shares them)."""
    p.add_argument("--dp", default=",".join(map(str, DPS)), help=f"DP sizes (default {','.join(map(str, DPS))})")
    p.add_argument("--steps", type=int, default=14, help="steps per (strategy, DP), warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates (start-up)")
    p.add_argument("--cpus", type=int, default=8,
                   help="CPU budget of both strategies: per-rank workers (W = cpus / DP per rank) and Ray's CPUs")
    p.add_argument("--gpu-tflops", type=float, default=400.0,
                   help="simulated GPU speed, effective training TFLOP/s per rank (default 400: an H100 at ~40%% MFU)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--images", type=int, default=480, help="distinct images of the image source")
    p.add_argument("--image-weight", type=float, default=0.3, help="token share of the image source")
    p.add_argument("--strategies", default="per-rank,plait", help="per-rank, plait or both (default)")
    p.add_argument("--no-autoscale", action="store_true", help="plait without the run-time autoscaler")
    p.add_argument("--quick", action="store_true", help="small sizes of every workload unless given: a smoke run")
    p.add_argument("--cache", default=None, help="folder of the bench's image source (default: plait's cache)")
    p.add_argument("--data-bound-tflops", type=float, default=100000.0, help="data-bound and cpu-pool: the GPU speed")
    p.add_argument("--json", metavar="PATH", help='write {"rows": [...], "ratios": [...], "load_average": ...}')
    p.add_argument("--quiet", action="store_true", help="no table")


# ----- data and spec -----------------------------------------------------------------------------
def prepare_data(cache: Path | None, images: int) -> tuple[Path, Path]:
    """(the demo dataset's folder: its web and long sources and tokenizer; the image source's folder).
    The image source is written once per size: `images` pictures, captions in IMAGE_SHARDS JSONL shards."""
    from plait.cli.demo_data import default_cache_dir, generate, write_image_source

    demo = generate(images=False).parent
    folder = (Path(cache) if cache else default_cache_dir().parent / "e2e-v1") / f"image-{images}"
    last = folder / f"captions-{IMAGE_SHARDS - 1:03d}.jsonl"
    if not last.exists():
        lines = write_image_source(folder, images, seed=20261212).read_text().splitlines()
        for k in range(IMAGE_SHARDS):  # the last shard last: its presence means "written"
            (folder / f"captions-{k:03d}.jsonl").write_text("\n".join(lines[k::IMAGE_SHARDS]) + "\n")
    return demo, folder


def e2e_spec(demo: Path, image_dir: Path, dp: int, args):
    from plait.spec import load_spec

    text_weight = 1.0 - args.image_weight
    tokenizer = str(demo / "tokenizer.json")
    return load_spec({
        "seed": 12,
        "sources": [
            {"name": "web", "path": str(demo / "web" / "*.parquet"), "text_field": "text", "tokenizer": tokenizer,
             "eos": 1, "weight": 0.65 * text_weight},
            {"name": "long", "path": str(demo / "long" / "*.parquet"), "tokens_field": "input_ids", "bos": 0,
             "eos": 1, "weight": 0.35 * text_weight},
            {"name": "image", "path": str(image_dir / "captions-*.jsonl"), "format": "jsonl", "text_field": "caption",
             "image_field": "image", "image_root": str(image_dir), "tokenizer": tokenizer, "bos": 0, "eos": 1,
             "weight": args.image_weight},
        ],
        "images": {"policy": "dynamic", "patch": 14, "merge": 2, "min_pixels": 28 * 28 * 4,
                   "max_pixels": 28 * 28 * 256, "image_token_id": 4096},
        "packing": {"seq_len": args.seq_len, "microbatches": args.microbatches, "max_patches": 4 * args.seq_len},
        "topology": {"dp": dp},
        "cost": {"hidden": 4096, "layers": 32, "ffn": 11008, "heads": 32,
                 "encoder": {"hidden": 1024, "layers": 24, "ffn": 4096}},
        "steps": args.steps,
    })


# ----- the command -------------------------------------------------------------------------------
QUICK = {"dp": "2", "steps": 5, "warmup": 2, "cpus": 4, "images": 160}


def apply_quick(args, add, quick: dict) -> None:
    """--quick: `quick`'s smaller defaults, where the option was left at the default `add` gives it."""
    if not args.quick:
        return
    import argparse

    defaults = argparse.ArgumentParser()
    add(defaults)
    defaults = vars(defaults.parse_args([]))
    for name, value in quick.items():
        if getattr(args, name) == defaults[name]:
            setattr(args, name, value)


def names(option: str, text: str, known) -> list[str]:
    from plait.errors import PlaitError

    values = [x.strip() for x in str(text).split(",") if x.strip()]
    if not values or set(values) - set(known):
        raise PlaitError(f"--{option}: choose from {', '.join(known)}; got {text!r}")
    return values


def parse_job(args) -> list[int]:
    """The job's options checked; the DP sizes."""
    from plait.errors import PlaitError

    try:
        dps = [int(x) for x in str(args.dp).split(",") if x.strip()]
    except ValueError:
        raise PlaitError(f"--dp: expected comma-separated integers, got {args.dp!r}") from None
    for name, value in (("dp", min(dps, default=0)), ("steps", args.steps), ("cpus", args.cpus),
                        ("seq_len", args.seq_len), ("microbatches", args.microbatches), ("images", args.images)):
        if value < 1:
            raise PlaitError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0 or args.warmup >= args.steps:
        raise PlaitError(f"--warmup must be in 0..steps-1 ({args.steps - 1}), got {args.warmup}")
    if not (args.gpu_tflops > 0 and args.data_bound_tflops > 0):
        raise PlaitError(f"--gpu-tflops and --data-bound-tflops must be > 0, got {args.gpu_tflops}, {args.data_bound_tflops}")
    if not 0 < args.image_weight < 1:
        raise PlaitError(f"--image-weight must be between 0 and 1 (exclusive), got {args.image_weight}")
    args.strategy_list = names("strategies", args.strategies, ("per-rank", "plait"))
    return dps


def parse(args) -> list[int]:
    apply_quick(args, add_arguments, QUICK)
    dps = parse_job(args)
    args.runtime_list = names("data-bound-runtimes", args.data_bound_runtimes, ("local", "ray"))
    args.workload_list = names("workloads", args.workloads, WORKLOADS)
    return dps


def mixture_rows(args, dps, specs, err, failures: list[dict]) -> list[dict]:
    """gpu-bound and data-bound: per-rank DataLoaders, then plait on Ray (same CPUs, same steps)."""
    autoscale = autoscale_available() and not args.no_autoscale
    runs = [(w, args.gpu_tflops if w == "gpu-bound" else args.data_bound_tflops)
            for w in ("gpu-bound", "data-bound") if w in args.workload_list]
    rows: list[dict] = []
    # per-rank first: its workers fork from this process, which must not hold Ray's threads yet
    for workload, tflops in runs:
        for dp in (dps if "per-rank" in args.strategy_list else []):
            err.print(f"[bold]e2e[/] {workload} per-rank, DP {dp} ...")
            row = run_per_rank(specs[dp], args, GpuClock.of_spec(specs[dp], tflops))
            rows.append({"workload": workload, "dp": dp, "seq_len": args.seq_len, "strategy": "per-rank", **row})
    if "plait" in args.strategy_list and "data-bound" in args.workload_list and "local" in args.runtime_list:
        tflops = args.data_bound_tflops
        for dp in dps:  # the one-machine default: the local runtime in this process, no services
            err.print(f"[bold]e2e[/] data-bound plait, local runtime, DP {dp} ...")
            try:
                row = run_plait_local(specs[dp], args, GpuClock.of_spec(specs[dp], tflops))
            except Exception as e:  # noqa: BLE001 - reported; the other rows still run
                failures.append({"workload": "data-bound", "dp": dp, "strategy": "plait", "runtime": "local",
                                 "error": f"{type(e).__name__}: {e}"})
                err.print(f"[red]e2e: data-bound plait (local), DP {dp} failed: {e}[/]")
                continue
            rows.append({"workload": "data-bound", "dp": dp, "seq_len": args.seq_len, "strategy": "plait", **row})
    runs = [(w, t) for w, t in runs if w == "gpu-bound" or "ray" in args.runtime_list]
    if "plait" in args.strategy_list and runs:
        import ray

        started = not ray.is_initialized()  # (a caller's instance is used as it is, and left running)
        if started:
            try:
                from plait.runtime.ray.common import long_run_settings

                settings, env = long_run_settings()  # as plait starts its own instance: the data plane's settings
                for name, value in env.items():
                    os.environ.setdefault(name, value)
                start_ray(num_cpus=args.cpus, include_dashboard=False, _system_config=settings["_system_config"])
            except Exception as e:  # noqa: BLE001 - the per-rank rows above are still reported
                failures.append({"workload": ",".join(w for w, _ in runs), "strategy": "plait", "error": str(e)})
                err.print(f"[red]e2e: Ray did not start ({e}); plait's rows of {failures[-1]['workload']} are missing[/]")
                return rows
        try:
            for workload, tflops in runs:
                for dp in dps:
                    err.print(f"[bold]e2e[/] {workload} plait on ray, DP {dp} ...")
                    try:
                        row = run_plait(specs[dp], args, GpuClock.of_spec(specs[dp], tflops), autoscale)
                    except Exception as e:  # noqa: BLE001 - reported; the other rows still run
                        failures.append({"workload": workload, "dp": dp, "strategy": "plait",
                                         "error": f"{type(e).__name__}: {e}"})
                        err.print(f"[red]e2e: {workload} plait, DP {dp} failed: {e}[/]")
                        continue
                    rows.append({"workload": workload, "dp": dp, "seq_len": args.seq_len, "strategy": "plait",
                                 "runtime": "ray", **row})
        finally:
            if started:
                ray.shutdown()
    return rows


def run(args) -> int:
    from rich.console import Console

    from plait.cli.bench.e2e_per_rank import require_torch

    dps = parse(args)
    require_torch()
    err = Console(stderr=True)
    load_before = os.getloadavg()
    demo, image_dir = prepare_data(Path(args.cache) if args.cache else None, args.images)
    specs = {dp: e2e_spec(demo, image_dir, dp, args) for dp in dps}
    failures: list[dict] = []  # a row that failed (Ray not starting on a loaded machine): the others still run
    rows = mixture_rows(args, dps, specs, err, failures)
    return report(args, rows, failures, load_before, err)


def report(args, rows: list[dict], failures: list[dict], load_before, err, extra_ratios=(), targets=None) -> int:
    """The result (table, --json) of rows measured since `load_before`; 1 when some failed."""
    rows = [r for r in rows if r["workload"].startswith("long-context") or r["strategy"] in args.strategy_list]
    result = {"gpu_tflops": args.gpu_tflops, "data_bound_tflops": args.data_bound_tflops, "cpus": args.cpus,
              "machine_cores": os.cpu_count(), "microbatches": args.microbatches, "image_weight": args.image_weight,
              "autoscale": autoscale_available() and not args.no_autoscale, "rows": rows,
              "ratios": ratios(rows) + list(extra_ratios), "failures": failures,
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}
    if not args.quiet:
        table(result, targets or TARGETS)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        err.print(f"rows written to {args.json}")
    return 1 if failures else 0


def ratios(rows: list[dict]) -> list[dict]:
    """Per (workload, DP, seq_len) and plait row: steps/s of plait over per-rank (node-images: images/s),
    one run. A workload with plait on several runtimes (data-bound: local and ray) has one ratio per
    runtime, which names it (`runtime`)."""
    rows = [r for r in rows if not r["workload"].startswith("long-context")]  # e2e_long.long_ratios: per mix, strategy
    per_rank = {(r["workload"], r["dp"], r["seq_len"]): r for r in rows if r["strategy"] == "per-rank"}
    plaits = [r for r in rows if r["strategy"] == "plait"]
    several = {k for k in per_rank if sum(1 for a in plaits if (a["workload"], a["dp"], a["seq_len"]) == k) > 1}
    out = []
    seen = list(dict.fromkeys(r["workload"] for r in rows))
    order = lambda a: (seen.index(a["workload"]), a["dp"], a["seq_len"], a.get("runtime") or "")  # noqa: E731
    for a in sorted(plaits, key=order):
        key = (a["workload"], a["dp"], a["seq_len"])
        b = per_rank.get(key)
        if b is None:
            continue
        rate = "images_per_s" if key[0] == "node-images" else "steps_per_s"
        q = {"workload": key[0], "dp": key[1], "seq_len": key[2], "steps_per_s_ratio": a[rate] / max(b[rate], 1e-12)}
        if key in several or (key[0] in ("data-bound", "cpu-pool") and a.get("runtime")):
            q["runtime"] = a.get("runtime")
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            q["tokens_per_s_ratio"] = a["tokens_per_s"] / max(b["tokens_per_s"], 1e-12)
        out.append(q)
    return out


TARGETS = {"gpu-bound": 1.05, "data-bound": 1.0}  # plait / per-rank, the project's goals per workload


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(result: dict, targets: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=max(Console().width, 140))
    t = Table(title=f"end to end: plait vs per-rank loaders, {result['cpus']} CPUs budget on "
                    f"{result['machine_cores']} cores, load average {result['load_average']['before'][0]:.1f} -> "
                    f"{result['load_average']['after'][0]:.1f}")
    for col in ("workload", "strategy", "dp", "seq_len", "steps/s", "images/s", "wait", "balance loss", "tokens/s", "loaders",
                "load"):
        t.add_column(col, justify="left" if col in ("workload", "strategy", "loaders") else "right")
    for r in result["rows"]:
        if r["workload"].startswith("long-context"):
            continue  # their own table (e2e_long.table)
        procs = (f"{r['processes']} proc" if r["strategy"] == "per-rank" and "processes" in r
                 else f"{r['loaders_at_start']}->{r['loaders_at_end']} actors" if "loaders_at_start" in r
                 else f"{r.get('workers', '-')} threads" if "workers" in r else "local")
        t.add_row(r["workload"],
                  r["strategy"] + (f" ({r['runtime']})" if r.get("runtime") and r["workload"] in ("data-bound", "cpu-pool")
                                   else ""),
                  str(r["dp"]), str(r["seq_len"]), fmt(r["steps_per_s"], ".3f"), fmt(r.get("images_per_s"), ".1f"),
                  fmt(r["wait_fraction"], ".1%"), fmt(r["balance_loss"], ".3f"), fmt(r["tokens_per_s"], ",.0f"), procs,
                  "->".join(f"{x:.1f}" for x in r.get("load_average") or []) or "-")
    out.print(t)
    for q in result["ratios"]:
        if q["workload"] == "long-context":
            continue
        goal = targets.get(q["workload"])
        verdict = "-" if goal is None else "met" if q["steps_per_s_ratio"] >= goal else "[red]missed[/]"
        rate = "images/s" if q["workload"] == "node-images" else "steps/s"
        on = f" ({q['runtime']} runtime)" if q.get("runtime") else ""
        out.print(f"{q['workload']}{on} DP {q['dp']} seq_len {q['seq_len']}: plait / per-rank {rate} = "
                  f"[bold]{q['steps_per_s_ratio']:.2f}x[/] (target >= {goal}x: {verdict})")
    for f in result.get("failures") or []:
        out.print(f"[red]{f['workload']}: no rows ({f['error']})[/]")
    out.print("MegaScale-Data reports 4.5x end to end.")
