"""Command line: plait demo | run | plan | inspect | fit-cost | bench <name>.

User mistakes (PlaitError: bad spec, bad data, bad arguments) print a one-paragraph error and exit 2,
without a stack trace. Commands that live in their own modules register through the tables below;
each such module exposes HELP, add_arguments(parser) and run(args) -> int.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from plait.errors import PlaitError

console = Console(stderr=True)

# name -> module with HELP, add_arguments(parser), run(args)
COMMAND_MODULES = {
    "plan": "plait.planview",
    "fit-cost": "plait.cost_fit",
}
BENCH_MODULES = {
    "throughput": "plait.bench.throughput",
    "ray-throughput": "plait.bench.ray_throughput",
    "balance": "plait.bench.balance",
    "memory": "plait.bench.memory",
    "startup": "plait.bench.startup",
    "recovery": "plait.bench.recovery",
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None
        raise


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (`--steps 0` must not silently mean the default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


def loaders_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected `auto` or a positive integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait", description="plait: compute-balanced, padding-free, exactly-once data loading for LLM training."
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    d = sub.add_parser("demo", help="generate the embedded sample dataset (once) and stream it for 8 DP ranks",
                       description="Generate a small 4-source dataset in a cache folder (once), stream it for a "
                       "simulated job of 8 data-parallel ranks and print throughput, mixture and balance.")
    d.add_argument("--steps", type=positive_int, default=None, help="global steps to stream (default: the demo spec's 50)")
    d.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    d.add_argument("--cache", metavar="DIR", help="where the sample dataset lives (default: ~/.cache/plait/demo-v1)")
    d.add_argument("--plot", metavar="PATH", help="draw per-step mixture and balance to a PNG (needs matplotlib)")
    d.add_argument("--runtime", choices=["local", "ray"], default="local", help="where the roles run")
    d.set_defaults(func=cmd_demo)

    r = sub.add_parser("run", help="stream a spec for every DP rank and report",
                       description="Stream SPEC for every DP rank of its topology, as a job would, and report "
                       "throughput, mixture and balance. --digest prints a sha256 of each rank's batch stream.")
    r.add_argument("spec", help="the spec (YAML)")
    r.add_argument("--steps", type=positive_int, default=None, help="global steps (default: the spec's `steps`, else 100)")
    r.add_argument("--dp", type=positive_int, default=None, help="override topology.dp")
    r.add_argument("--digest", action="store_true", help="print a stable sha256 of every rank's batch stream")
    r.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    r.add_argument("--runtime", choices=["local", "ray"], default="local", help="where the roles run")
    r.add_argument("--address", default=None, help="Ray cluster address (auto, ray://...); default: start a local one")
    r.add_argument("--loaders", type=loaders_arg, default="auto",
                   help="ray runtime: SourceLoader actors, `auto` (default: from each source's measured cost and "
                   "mixture share) or a number")
    r.add_argument("--step-time", type=float, default=None, metavar="S",
                   help="ray runtime, --loaders auto: seconds per training step the loaders must keep up with "
                   "(default 1)")
    r.add_argument("--resume", metavar="STATE", help="start from a data state saved with --save-state")
    r.add_argument("--save-state", metavar="PATH", help="write the data state after the last step (JSON)")
    r.add_argument("--quiet", action="store_true", help="no progress bar or tables")
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="show a spec's sources, files and a few documents",
                       description="Validate SPEC and show each source's files, format, first block and "
                       "document-length statistics, without streaming.")
    i.add_argument("spec", help="the spec (YAML)")
    i.add_argument("--docs", type=int, default=3, help="documents to preview per source")
    i.set_defaults(func=cmd_inspect)

    for name, module_name in COMMAND_MODULES.items():
        mod = _load(module_name)
        if mod is None:
            continue
        c = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(c)
        c.set_defaults(func=mod.run)

    b = sub.add_parser("bench", help="benchmarks (ratios against a baseline measured in the same run)",
                       description="Benchmarks. Each reports a ratio against a baseline measured in the same run.")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, module_name in BENCH_MODULES.items():
        mod = _load(module_name)
        if mod is None:
            continue
        c = bsub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(c)
        c.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlaitError as e:
        # escape: messages quote user text ("[...]" is not markup); soft_wrap: never break a path or field
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130


# ----- demo / run ------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    from plait.demo import default_cache_dir, generate
    from plait.spec import load_spec
    from plait.stream import print_summary, stream

    cache = Path(args.cache) if args.cache else default_cache_dir()
    existed = (cache / "demo.yaml").exists()
    with console.status("generating the demo dataset (once)…", spinner="dots"):
        spec_path = generate(cache)
    console.print(f"dataset: {cache} ({'cached' if existed else 'generated'}); spec: {spec_path}")
    spec = load_spec(spec_path)
    summary = stream(spec, steps=args.steps or spec.steps or 50, runtime=args.runtime, progress=True, plot=args.plot)
    print_summary(spec, summary, console=Console())
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {args.json}")
    return 0


def cmd_run(args) -> int:
    from plait.spec import load_spec
    from plait.stream import print_summary, stream

    spec = load_spec(args.spec)
    if args.dp:
        spec = spec.with_overrides(topology={"dp": args.dp})
    resume = json.loads(Path(args.resume).read_text()) if args.resume else None
    options = {}
    if args.runtime == "ray":
        options = {k: v for k, v in (("address", args.address), ("loaders", args.loaders),
                                     ("step_time", args.step_time)) if v is not None}
        if not args.quiet:
            options["on_layout"] = print_layout
    summary = stream(
        spec, steps=args.steps or spec.steps or 100, runtime=args.runtime, progress=not args.quiet,
        resume=resume, save_state=args.save_state, runtime_options=options,
    )
    if not args.quiet:
        print_summary(spec, summary, console=Console())
    if args.digest:
        from plait.metrics import combined_digest

        for rank, d in summary["digests"].items():
            print(f"rank {rank}: {d}")
        print(f"digest: {combined_digest(summary['digests'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


def print_layout(rows: list[dict]) -> None:
    """The ray runtime's loader layout: which sources and partitions each SourceLoader owns."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="SourceLoaders (ray)")
    for col in ("loader", "sources [partitions/of] (measured µs per 1k tokens)", "demand (cores)"):
        table.add_column(escape(col), justify="left" if col.startswith("sources") else "right")
    for r in rows:
        dem = "-" if math.isnan(r["demand"]) else f"{r['demand']:.3f}"
        table.add_row(str(r["loader"]), escape(r["sources"]), dem)
    console.print(table)


def cmd_inspect(args) -> int:
    import numpy as np
    from rich.table import Table

    from plait.roles.source_loader import SourceLoader
    from plait.spec import load_spec

    spec = load_spec(args.spec)
    loader = SourceLoader(spec)
    out = Console()
    table = Table(title=f"sources of {args.spec}")
    for col in ("source", "format", "files", "weight", "first block docs", "median len", "max len", "tokenizer"):
        table.add_column(col)
    previews = []
    for i, s in enumerate(spec.sources):
        src = loader.sources[i]
        key = loader.first_key(i)
        meta = loader.block_meta(i, key)
        fmt = type(src.reader).__name__.replace("Reader", "").lower()
        lens = meta.lengths
        table.add_row(s.name, fmt, str(len(src.files)), f"{s.weight:g}", str(len(lens)),
                      f"{np.median(lens):.0f}" if len(lens) else "-", str(int(lens.max())) if len(lens) else "-",
                      Path(s.tokenizer).name if s.tokenizer else ("bytes" if s.text_field else "pre-tokenized"))
        block = loader._block(i, key)
        for d in range(min(args.docs, len(lens))):
            toks = block.tokens[block.starts[d] : block.starts[d] + block.lengths[d]]
            previews.append((s.name, Path(src.files[block.shard]).name, int(block.rows[d]), len(toks), toks[:12].tolist()))
    out.print(table)
    prev = Table(title="first documents in order")
    for col in ("source", "shard", "row", "tokens", "first ids"):
        prev.add_column(col)
    for name, shard, row, n, ids in previews:
        prev.add_row(name, shard, str(row), str(n), " ".join(map(str, ids)))
    out.print(prev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
