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

Strategies, the same steps and the same CPU budget B (`--cpus`, default 8 logical CPUs):

  per-rank  each rank has a torch DataLoader with W = B / DP workers over its share of the sources,
            packing greedily in arrival order (plait.cli.bench.e2e_per_rank): B worker processes.
  plait     the ray runtime (plait.Loader, runtime="ray", loaders="auto", and autoscale=True where the
            runtime has it) in a Ray instance of B CPUs: at most B SourceLoader actors, plus the Planner
            and a Constructor, balancing each step's compute across ranks.

On a machine with fewer cores than B (this one has 2) both are CPU-bound on the same cores; the budget
then caps processes, not cores. Per (strategy, DP): steps/s after warm-up, wait_fraction (rank-time
spent waiting for data), balance_loss (mean over steps of 1 - mean/max of the ranks' compute times),
tokens/s, and the compute-bound steps/s (what the GPUs alone would allow with that balance). The ratio
of steps/s plait / per-rank is the figure to put beside MegaScale-Data's reported 4.5x.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELP = "end to end: a simulated synchronous DP job fed by per-rank torch DataLoaders vs plait on ray (steps/s)"
DESCRIPTION = __doc__
IMAGE_SHARDS = 16
DPS = (4, 8)


def add_arguments(p) -> None:
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
    p.add_argument("--quick", action="store_true", help="DP 2, 6 steps, 4 CPUs, 160 images unless given: a smoke run (< 60 s)")
    p.add_argument("--cache", default=None, help="folder of the bench's image source (default: plait's cache)")
    p.add_argument("--json", metavar="PATH", help="write one row per (strategy, dp) and the ratios")
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


# ----- the simulated GPU -------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuClock:
    """Seconds a micro-batch computes: its cost-model FLOPs (LLM per document + encoder per image) over
    the GPU's effective FLOP/s."""

    llm: object  # plait.cost.CostModel
    encoder: object  # plait.cost.EncoderCost
    flops_per_s: float

    @classmethod
    def of_spec(cls, spec, tflops: float) -> GpuClock:
        from plait.cost import CostModel
        from plait.roles.planner import encoder_cost

        return cls(CostModel.from_spec(spec.cost), encoder_cost(spec), tflops * 1e12)

    def seconds(self, doc_lengths: np.ndarray, image_patches: np.ndarray) -> float:
        flops = float(self.llm.text(doc_lengths).sum())
        if len(image_patches):
            flops += float(self.encoder(image_patches).sum())
        return flops / self.flops_per_s


def plait_shape(mb) -> tuple[np.ndarray, np.ndarray, int]:
    """(document lengths, patches per image, tokens) of a plait.Batch."""
    patches = mb.image_grid.prod(axis=1) if mb.image_grid is not None else np.zeros(0, np.int64)
    return np.diff(mb.cu_seqlens), patches, mb.num_tokens


def torch_shape(mb: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """The same of a per-rank DataLoader's micro-batch (a dict of tensors)."""
    cu = mb["cu_seqlens"].numpy()
    return np.diff(cu), mb["image_grid"].numpy().prod(axis=1), int(cu[-1])


# ----- the synchronous step clock ----------------------------------------------------------------
@dataclass
class Trace:
    """What the ranks did, per step and rank: seconds waiting for data, seconds computing, tokens; and
    when each step ended (every rank done), on perf_counter's clock from `start`."""

    start: float
    waits: np.ndarray  # [steps, ranks]
    computes: np.ndarray  # [steps, ranks]
    tokens: np.ndarray  # [steps, ranks]
    step_ends: np.ndarray  # [steps]


def run_synchronous(streams: list, steps: int, microbatches: int, clock: GpuClock, shape) -> Trace:
    """Run `steps` synchronous steps: rank r takes `microbatches` micro-batches of `streams[r]` per step,
    computing each for the clock's time (a sleep), then waits at the step's barrier."""
    ranks = len(streams)
    waits, computes, tokens = (np.zeros((steps, ranks)) for _ in range(3))
    ends = np.zeros(steps)
    done = [0]

    def step_ended():  # run by one thread once all have arrived
        ends[done[0]] = time.perf_counter()
        done[0] += 1

    barrier = threading.Barrier(ranks, action=step_ended)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        it = iter(streams[r])
        try:
            for s in range(steps):
                for _ in range(microbatches):
                    t = time.perf_counter()
                    mb = next(it)
                    waits[s, r] += time.perf_counter() - t
                    lengths, patches, n = shape(mb)
                    seconds = clock.seconds(lengths, patches)
                    time.sleep(seconds)
                    computes[s, r] += seconds
                    tokens[s, r] += n
                barrier.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)
            barrier.abort()

    start = time.perf_counter()
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Trace(start, waits, computes, tokens, ends)


def balance_loss(computes: np.ndarray) -> float:
    """Mean over steps of 1 - mean/max of the ranks' compute times (0: perfectly balanced)."""
    c = np.asarray(computes, dtype=np.float64)
    top = c.max(axis=1)
    loss = np.where(top > 0, 1.0 - c.mean(axis=1) / np.where(top > 0, top, 1.0), 0.0)
    return float(loss.mean()) if len(loss) else 0.0


def summarize(trace: Trace, warmup: int) -> dict:
    """Rates over the steps after `warmup` (at least one step is kept)."""
    steps, ranks = trace.waits.shape
    w = max(0, min(warmup, steps - 1))
    t0 = trace.step_ends[w - 1] if w > 0 else trace.start
    wall = max(float(trace.step_ends[-1] - t0), 1e-9)
    measured = steps - w
    computes = trace.computes[w:]
    return {
        "steps": int(steps), "measured_steps": int(measured), "seconds": wall,
        "steps_per_s": measured / wall,
        "wait_fraction": float(trace.waits[w:].sum() / (ranks * wall)),
        "compute_fraction": float(computes.sum() / (ranks * wall)),
        "balance_loss": balance_loss(computes),
        "compute_bound_steps_per_s": measured / max(float(computes.max(axis=1).sum()), 1e-9),
        "tokens_per_s": float(trace.tokens[w:].sum() / wall),
        "tokens_per_step": float(trace.tokens.sum() / steps),
        "startup_s": float(trace.step_ends[w - 1] - trace.start) if w > 0 else 0.0,
    }


# ----- the two strategies ------------------------------------------------------------------------
def run_per_rank(spec, args, clock: GpuClock) -> dict:
    import gc

    from plait.cli.bench.e2e_per_rank import rank_loaders
    from plait.kernels import warm_up

    warm_up()  # compiled before the workers fork, as plait's actors compile theirs at start
    workers = max(1, args.cpus // spec.topology.dp)
    t0 = time.perf_counter()
    streams = rank_loaders(spec, workers)
    trace = run_synchronous(streams, args.steps, args.microbatches, clock, torch_shape)
    trace.start = t0
    row = summarize(trace, args.warmup)
    del streams, trace
    gc.collect()  # ends the DataLoaders' worker processes now
    row.update(workers_per_rank=workers, processes=workers * spec.topology.dp)
    return row


def autoscale_available() -> bool:
    from plait.runtime.ray.runtime import RayRuntime

    return "autoscale" in RayRuntime.option_names()


def run_plait(spec, args, clock: GpuClock, autoscale: bool) -> dict:
    import plait

    ranks = spec.topology.dp
    options = {"loaders": "auto", **({"autoscale": True} if autoscale else {})}
    job = f"bench-e2e-{os.getpid()}-{time.time_ns()}"
    t0 = time.perf_counter()
    loaders = [plait.Loader(spec, dp_rank=r, runtime="ray", job=job, attach=r > 0, steps=args.steps, **options)
               for r in range(ranks)]  # rank 0 creates the job, the others join it
    try:
        trace = run_synchronous(loaders, args.steps, args.microbatches, clock, plait_shape)
        trace.start = t0
        row = summarize(trace, args.warmup)
        layout = loaders[0].runtime.layout
        report = loaders[0].scaling_report() if hasattr(loaders[0], "scaling_report") else None
    finally:
        for ld in loaders:
            ld.close()
    events = (report or {}).get("events") or []
    row.update(loaders_at_start=layout.loaders, autoscale=autoscale,
               loaders_at_end=events[-1]["loaders"] if events else layout.loaders,
               rescale_events=None if report is None else len(events))
    return row


# ----- the command -------------------------------------------------------------------------------
def parse(args) -> list[int]:
    from plait.errors import PlaitError

    if args.quick:  # smaller defaults; what was given explicitly stays
        defaults = {"dp": ",".join(map(str, DPS)), "steps": 14, "warmup": 3, "cpus": 8, "images": 480}
        for name, value in {"dp": "2", "steps": 6, "warmup": 2, "cpus": 4, "images": 160}.items():
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
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
    if not (args.gpu_tflops > 0):
        raise PlaitError(f"--gpu-tflops must be > 0, got {args.gpu_tflops}")
    if not 0 < args.image_weight < 1:
        raise PlaitError(f"--image-weight must be between 0 and 1 (exclusive), got {args.image_weight}")
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not args.strategy_list or set(args.strategy_list) - {"per-rank", "plait"}:
        raise PlaitError(f"--strategies: choose from per-rank, plait; got {args.strategies!r}")
    return dps


def run(args) -> int:
    from rich.console import Console

    from plait.cli.bench.e2e_per_rank import require_torch

    dps = parse(args)
    if "per-rank" in args.strategy_list:
        require_torch()
    err = Console(stderr=True)
    demo, image_dir = prepare_data(Path(args.cache) if args.cache else None, args.images)
    specs = {dp: e2e_spec(demo, image_dir, dp, args) for dp in dps}
    clock = GpuClock.of_spec(specs[dps[0]], args.gpu_tflops)
    autoscale = autoscale_available() and not args.no_autoscale
    rows: list[dict] = []
    # per-rank first: its workers fork from this process, which must not hold Ray's threads yet
    if "per-rank" in args.strategy_list:
        for dp in dps:
            err.print(f"[bold]e2e[/] per-rank, DP {dp} ...")
            rows.append({"strategy": "per-rank", "dp": dp, **run_per_rank(specs[dp], args, clock)})
    if "plait" in args.strategy_list:
        import ray

        started = not ray.is_initialized()  # (a caller's instance is used as it is, and left running)
        if started:
            ray.init(num_cpus=args.cpus, include_dashboard=False, namespace="plait", log_to_driver=False,
                     configure_logging=False)
        try:
            for dp in dps:
                err.print(f"[bold]e2e[/] plait on ray, DP {dp} ...")
                rows.append({"strategy": "plait", "dp": dp, **run_plait(specs[dp], args, clock, autoscale)})
        finally:
            if started:
                ray.shutdown()
    result = {"gpu_tflops": args.gpu_tflops, "cpus": args.cpus, "machine_cores": os.cpu_count(),
              "seq_len": args.seq_len, "microbatches": args.microbatches, "image_weight": args.image_weight,
              "autoscale": autoscale, "rows": rows, "ratios": ratios(rows)}
    if not args.quiet:
        table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        err.print(f"rows written to {args.json}")
    return 0


def ratios(rows: list[dict]) -> list[dict]:
    """Per DP: steps/s of plait over per-rank (both measured in this run)."""
    by = {(r["strategy"], r["dp"]): r for r in rows}
    out = []
    for dp in sorted({r["dp"] for r in rows}):
        a, b = by.get(("plait", dp)), by.get(("per-rank", dp))
        if a and b:
            out.append({"dp": dp, "steps_per_s_ratio": a["steps_per_s"] / max(b["steps_per_s"], 1e-12),
                        "tokens_per_s_ratio": a["tokens_per_s"] / max(b["tokens_per_s"], 1e-12)})
    return out


def table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    out = Console(width=max(Console().width, 120))
    plait_label = "auto loaders + autoscale" if result["autoscale"] else "auto loaders, no autoscale"
    t = Table(title=f"end to end: synchronous DP, simulated GPU {result['gpu_tflops']:g} TFLOP/s per rank, "
                    f"seq_len {result['seq_len']} x {result['microbatches']} micro-batches, "
                    f"{result['cpus']} CPUs budget on {result['machine_cores']} cores")
    for col, just in (("strategy", "left"), ("dp", "right"), ("loaders", "right"), ("steps/s", "right"),
                      ("GPU-bound steps/s", "right"), ("wait", "right"), ("balance loss", "right"),
                      ("tokens/s", "right"), ("start-up s", "right")):
        t.add_column(col, justify=just)
    for r in result["rows"]:
        procs = (f"{r['processes']} workers ({r['workers_per_rank']}/rank)" if r["strategy"] == "per-rank"
                 else f"{r['loaders_at_start']}->{r['loaders_at_end']} actors" + (
                     f" ({r['rescale_events']} resc.)" if r.get("rescale_events") is not None else ""))
        t.add_row(r["strategy"], str(r["dp"]), procs,
                  f"{r['steps_per_s']:.3f}", f"{r['compute_bound_steps_per_s']:.3f}", f"{r['wait_fraction']:.1%}",
                  f"{r['balance_loss']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['startup_s']:.1f}")
    out.print(t)
    out.print(f"per-rank: a torch DataLoader per rank, greedy packing in arrival order; plait: ray runtime, {plait_label}. "
              "wait: rank-time spent waiting for data; balance loss: mean over steps of 1 - mean/max rank compute; "
              "GPU-bound steps/s: what the ranks' compute alone allows with that imbalance (no waiting for data); "
              "resc.: rescale events of the autoscaler.")
    for q in result["ratios"]:
        out.print(f"DP {q['dp']}: plait / per-rank steps/s = [bold]{q['steps_per_s_ratio']:.2f}x[/] "
                  f"(tokens/s {q['tokens_per_s_ratio']:.2f}x); MegaScale-Data reports 4.5x")
    out.print(f"Both strategies get the same {result['cpus']}-CPU budget on this {result['machine_cores']}-core "
              "machine, so the loaders of both are CPU-bound on the same cores.")
