"""What the project's benchmarks share: synthetic data, spec builders, the result writer, the entry point.

Each benchmark in this folder is a script with HELP, add_arguments(parser) and run(args) -> int, run as
`python -m benchmarks.NAME [--json PATH]` from the repository root (`--help` for its options). Results
are JSON objects written by `write_result`: the benchmark's figures plus the command line, the machine's
load average before and after, its CPU count and the time, so that every figure can be reproduced and
judged against how busy the machine was. `benchmarks/results/*.json` are the runs the docs cite
(docs/benchmarks pages are generated from them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

# The mixed corpus and the exactly-once checks live in the package, shared with the tests (which never
# import from this measurement suite): re-exported here for the benchmarks.
from plait.cli.mixed_corpus import MIXED_SOURCES, mixed_sources, mixed_spec, write_token_parquet
from plait.exactly_once import compare_streams, kill_points

__all__ = ["MIXED_SOURCES", "compare_streams", "demo_spec", "kill_points", "machine", "main", "mixed_sources",
           "mixed_spec", "write_result", "write_token_parquet"]

_LOAD_AT_START = os.getloadavg()
_COMMAND = [Path(sys.executable).name, *sys.argv]  # main() records the `python -m benchmarks.NAME ...` form


def demo_spec(cache: str | None = None, **overrides):
    """The demo dataset's text spec (generated once into the demo cache), with `overrides` applied."""
    from plait.cli.demo_data import default_cache_dir, generate
    from plait.spec import load_spec

    return load_spec(generate(Path(cache) if cache else default_cache_dir())).with_overrides(**overrides)


def machine() -> dict:
    """Where and under what load a result was measured."""
    return {"command": " ".join(shlex.quote(a) for a in _COMMAND),
            "loadavg_start": [round(x, 2) for x in _LOAD_AT_START],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "python": platform.python_version(), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_result(path: str | os.PathLike | None, result: dict) -> dict:
    """Add `machine()` under "run" and write `result` as JSON to `path` (nothing when path is None)."""
    out = {**result, "run": machine()}
    if path:
        Path(path).write_text(json.dumps(out, indent=2, default=float) + "\n")
    return out


def main(module, argv: list[str] | None = None) -> int:
    """`python -m benchmarks.NAME [ARGS]`: parse ARGS (default: the command line) with the module's
    add_arguments and call its run(args); a PlaitError prints one line and returns 2."""
    global _COMMAND
    argv = sys.argv[1:] if argv is None else list(argv)
    name = Path(module.__file__).stem
    _COMMAND = ["python", "-m", f"benchmarks.{name}", *argv]
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=getattr(module, "DESCRIPTION", None)
                                     or module.HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    from plait.errors import PlaitError

    try:
        return int(module.run(parser.parse_args(argv)) or 0)
    except PlaitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def own_ray_instance(prefix: str):
    """Ray for a benchmark: a caller's instance (the tests') is used as it is; otherwise one started as
    plait starts it (plait.runtime.ray.instance.start_ray) in a temp dir of its own, so that a soak
    running beside it does not count its processes, and shut down and removed afterwards (RAY_TMPDIR is
    then as it was: a later instance in the same process does not land in a removed directory)."""
    import ray

    from plait.runtime.ray.instance import start_ray

    if ray.is_initialized():
        yield
        return
    root = tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("TMPDIR") or "/tmp")
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = root
    try:
        start_ray(None)
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
