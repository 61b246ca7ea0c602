"""Command line: plait demo | run | plan | inspect | fit-cost | bench <name>.

User mistakes (PlaitError: bad spec, bad data, bad arguments) print a one-paragraph error and exit 2,
without a stack trace. Every command is a module registered in the tables below; each exposes HELP, add_arguments(parser) and run(args) -> int.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.markup import escape

from plait.cli.common import console
from plait.errors import PlaitError

# name -> module with HELP, add_arguments(parser), run(args)
COMMAND_MODULES = {
    "demo": "plait.cli.demo",
    "run": "plait.cli.run",
    "inspect": "plait.cli.inspect",
    "plan": "plait.cli.plan",
    "fit-cost": "plait.cli.fit_cost",
    "jobs": "plait.cli.jobs",
    "mix": "plait.cli.mix",
    "top": "plait.cli.top",
    "serve": "plait.cli.serve",
}
# Only what a user runs on their own spec, files or machine; the project's measurement suite (plait measuring
# itself on synthetic data: soak, multimodal balance, the long-context and cpu-pool workloads, scale, recovery,
# ...) is benchmarks/ at the repository's top level.
BENCH_MODULES = {
    "throughput": "plait.cli.bench.throughput",
    "balance": "plait.cli.bench.balance",
    "memory": "plait.cli.bench.memory",
    "images": "plait.cli.bench.images",
    "video": "plait.cli.bench.video",
    "audio": "plait.cli.bench.audio",
    "e2e": "plait.cli.bench.e2e",
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            return None
        raise


def add_commands(sub, modules: dict[str, str]) -> None:
    """One sub-command per module (HELP, DESCRIPTION, add_arguments, run); a missing module is left out."""
    for name, module_name in modules.items():
        mod = _load(module_name)
        if mod is None:
            continue
        c = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP))
        mod.add_arguments(c)
        c.set_defaults(func=mod.run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="plait", description="plait: compute-balanced, padding-free, exactly-once data loading for LLM training."
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    add_commands(sub, COMMAND_MODULES)
    b = sub.add_parser("bench", help="benchmarks on your data and machine (ratios against a same-run baseline)",
                       description="Benchmarks on your own data and machine. Each reports a ratio against a baseline "
                       "measured in the same run. The project's own measurement suite is benchmarks/ in the repository.")
    add_commands(b.add_subparsers(dest="bench", metavar="BENCH", required=True), BENCH_MODULES)
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


if __name__ == "__main__":
    sys.exit(main())
