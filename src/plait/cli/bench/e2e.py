"""`plait bench e2e`: a simulated synchronous data-parallel training job fed by plait on this machine.

DP ranks (threads) take micro-batches one by one (a blocked call is the rank's wait for data) and "compute"
each for the cost model's time (a 7B Llama-like LLM plus a ViT-L-like encoder) over a stated GPU speed; a
step ends when every rank has finished it (the all-reduce). The data: the demo's text sources and LLaVA-style
captioned images. Workloads: gpu-bound (--gpu-tflops) and data-bound (--data-bound-tflops: delivery sets the
pace), on the local runtime (loading.workers = --cpus threads). Per row: steps/s; gpu_busy = steps/s over
what the GPUs alone allow with that balance (1.0: they never wait); wait_fraction, balance_loss, tokens/s.
Against per-rank torch DataLoaders and plait on Ray: `python -m benchmarks.e2e`.
"""

from __future__ import annotations

import os
from pathlib import Path

from plait.cli.bench.e2e_run import GpuClock, run_plait_local
from plait.cli.common import fmt, positive_int, positive_ints, print_table, write_json
from plait.errors import PlaitError

HELP = "end to end: a simulated synchronous DP job fed by plait (steps/s, and the share the GPUs alone allow)"
DESCRIPTION = __doc__
IMAGE_SHARDS = 16
WORKLOADS = ("gpu-bound", "data-bound")


def add_arguments(p) -> None:
    add_job_arguments(p)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)} (default: both)")


def add_job_arguments(p) -> None:
    """The simulated job's options (benchmarks.e2e and benchmarks.e2e_workloads share them)."""
    p.add_argument("--dp", type=positive_ints, default="8", help="DP sizes, comma-separated (default 8)")
    p.add_argument("--steps", type=positive_int, default=14, help="steps per row, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates (start-up)")
    p.add_argument("--cpus", type=positive_int, default=8, help="CPU budget: the local runtime's loading threads, Ray's CPUs")
    p.add_argument("--gpu-tflops", type=float, default=400.0,
                   help="simulated GPU speed, effective training TFLOP/s per rank (default 400: an H100 at ~40%% MFU)")
    p.add_argument("--data-bound-tflops", type=float, default=100000.0, help="data-bound: the GPU speed")
    p.add_argument("--seq-len", type=positive_int, default=8192)
    p.add_argument("--microbatches", type=positive_int, default=2)
    p.add_argument("--images", type=positive_int, default=480, help="distinct images of the image source")
    p.add_argument("--image-weight", type=float, default=0.3, help="token share of the image source")
    p.add_argument("--cache", default=None, help="folder of the bench's image source (default: plait's cache)")
    p.add_argument("--json", metavar="PATH", help='write {"rows": [...], "load_average": ...}')
    p.add_argument("--quiet", action="store_true", help="no table")


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

    text, tokenizer = 1.0 - args.image_weight, str(demo / "tokenizer.json")
    return load_spec({
        "seed": 12,
        "sources": [
            {"name": "web", "path": str(demo / "web" / "*.parquet"), "text_field": "text", "tokenizer": tokenizer,
             "eos": 1, "weight": 0.65 * text},
            {"name": "long", "path": str(demo / "long" / "*.parquet"), "tokens_field": "input_ids", "bos": 0,
             "eos": 1, "weight": 0.35 * text},
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


def names(option: str, text: str, known) -> list[str]:
    values = [x.strip() for x in str(text).split(",") if x.strip()]
    if not values or set(values) - set(known):
        raise PlaitError(f"--{option}: choose from {', '.join(known)}; got {text!r}")
    return values


def parse_job(args) -> list[int]:
    """The job's options checked; the DP sizes."""
    if args.warmup < 0 or args.warmup >= args.steps:
        raise PlaitError(f"--warmup must be in 0..steps-1 ({args.steps - 1}), got {args.warmup}")
    if not (args.gpu_tflops > 0 and args.data_bound_tflops > 0):
        raise PlaitError(f"--gpu-tflops and --data-bound-tflops must be > 0, got {args.gpu_tflops}, {args.data_bound_tflops}")
    if not 0 < args.image_weight < 1:
        raise PlaitError(f"--image-weight must be between 0 and 1 (exclusive), got {args.image_weight}")
    return args.dp


def plait_rows(args, specs: dict, workloads: list[str], err, failures: list[dict], runners=None) -> list[dict]:
    """plait's rows of every (workload, runtime, DP size), each run by runners[runtime](spec, args, clock)
    (default: the local runtime); a row that fails is reported in `failures`, the others still run."""
    tflops = {"gpu-bound": args.gpu_tflops, "data-bound": args.data_bound_tflops}
    rows: list[dict] = []
    for runtime, runner in (runners or {"local": run_plait_local}).items():
        for workload in workloads:
            for dp, spec in specs.items():
                err.print(f"[bold]e2e[/] {workload} plait ({runtime} runtime), DP {dp} ...")
                try:
                    row = runner(spec, args, GpuClock.of_spec(spec, tflops[workload]))
                except Exception as e:  # noqa: BLE001 - reported; the other rows still run
                    failures.append({"workload": workload, "dp": dp, "strategy": "plait", "runtime": runtime,
                                     "error": f"{type(e).__name__}: {e}"})
                    err.print(f"[red]e2e: {workload} plait ({runtime}), DP {dp} failed: {e}[/]")
                    continue
                rows.append({"workload": workload, "dp": dp, "seq_len": args.seq_len, "strategy": "plait", **row,
                             "runtime": runtime, "gpu_busy": row["steps_per_s"] / row["compute_bound_steps_per_s"]})
    return rows


def run(args) -> int:
    from plait.cli.common import console as err

    dps, load_before = parse_job(args), os.getloadavg()
    workloads = names("workloads", args.workloads, WORKLOADS)
    demo, image_dir = prepare_data(Path(args.cache) if args.cache else None, args.images)
    specs = {dp: e2e_spec(demo, image_dir, dp, args) for dp in dps}
    failures: list[dict] = []
    rows = plait_rows(args, specs, workloads, err, failures)
    result = {"cpus": args.cpus, "machine_cores": os.cpu_count(), "gpu_tflops": args.gpu_tflops,
              "data_bound_tflops": args.data_bound_tflops, "rows": rows, "failures": failures,
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())}}
    if not args.quiet:
        table(result)
    write_json(args.json, result)
    return 1 if failures else 0


def table(result: dict) -> None:
    rows = []
    for r in result["rows"]:
        who = (f"{r['processes']} proc" if "processes" in r else f"{r['loaders_at_start']}->{r['loaders_at_end']} "
               "actors" if "loaders_at_start" in r else f"{r.get('workers', '-')} threads")
        gpu_only = r.get("compute_bound_steps_per_s")
        busy = r["steps_per_s"] / gpu_only if gpu_only else None
        rows.append((r["workload"], r["strategy"] + (f" ({r['runtime']})" if r.get("runtime") else ""), str(r["dp"]),
                     fmt(r["steps_per_s"], ".3f"), fmt(gpu_only, ".3f"), fmt(busy, ".0%"),
                     fmt(r.get("images_per_s"), ".1f"), fmt(r["wait_fraction"], ".1%"), fmt(r["balance_loss"], ".3f"),
                     fmt(r["tokens_per_s"], ",.0f"), who))
    load = result["load_average"]
    out = print_table(f"end to end, {result['cpus']} CPUs budget on {result['machine_cores']} cores, load average "
                      f"{load['before'][0]:.1f} -> {load['after'][0]:.1f}", rows, columns=(
                          "workload", "strategy", "dp", "steps/s", "GPU-only steps/s", "GPU busy", "images/s", "wait",
                          "balance loss", "tokens/s", "loaders"), left=("workload", "strategy", "loaders"))
    for f in result.get("failures") or []:
        out.print(f"[red]{f['workload']}: no rows ({f['error']})[/]")
