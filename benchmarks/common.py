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
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

# The three-source pre-tokenized corpus the recovery benchmarks (and the chaos tests' own copy) use:
# (name, files, docs per file, row group size, length range (lo, hi), weight)
MIXED_SOURCES = (
    ("short", 6, 240, 40, (8, 120), 0.3),
    ("mid", 4, 160, 32, (60, 600), 0.4),
    ("long", 3, 24, 6, (300, 1500), 0.3),
)

_LOAD_AT_START = os.getloadavg()
_COMMAND = [Path(sys.executable).name, *sys.argv]  # main() records the `python -m benchmarks.NAME ...` form


def write_token_parquet(path: Path, lengths: np.ndarray, rng: np.random.Generator, *, row_group_size: int | None = None,
                        vocab: tuple[int, int] = (2, 30000), compression: str = "snappy") -> None:
    """One Parquet file of pre-tokenized documents (`input_ids`: list<int32>) with the given lengths and
    random ids in [vocab[0], vocab[1])."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = rng.integers(vocab[0], vocab[1], size=int(offsets[-1]), dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    pq.write_table(pa.table({"input_ids": column}), path, row_group_size=row_group_size, compression=compression)


def mixed_sources(root: Path, *, scale: int = 1, seed: int = 0) -> list[dict]:
    """Write MIXED_SOURCES under `root` (once; later calls reuse the files); return their spec entries."""
    rng = np.random.default_rng(seed)
    entries = []
    for name, files, docs, row_group, (lo, hi), weight in MIXED_SOURCES:
        folder = root / name
        if not folder.exists():
            folder.mkdir(parents=True)
            for f in range(files):
                lengths = rng.integers(lo, hi + 1, size=docs * scale)
                write_token_parquet(folder / f"{name}-{f:03d}.parquet", lengths, rng, row_group_size=row_group)
        entries.append({"name": name, "path": str(folder / "*.parquet"), "tokens_field": "input_ids", "eos": 1,
                        "weight": weight})
    return entries


def mixed_spec(root: Path, *, dp: int = 8, seq_len: int = 256, microbatches: int = 2, seed: int = 7,
               shadows: int = 0, **extra):
    """A loaded Spec over `mixed_sources(root)` with a simple explicit cost model."""
    from plait.spec import load_spec

    sources = mixed_sources(root)
    if shadows:
        sources = [{**s, "shadows": shadows} for s in sources]
    return load_spec({"seed": seed, "sources": sources, "packing": {"seq_len": seq_len, "microbatches": microbatches},
                      "topology": {"dp": dp}, "cost": {"linear": 1.0, "quadratic": 0.001}, **extra})


def demo_spec(cache: str | None = None, **overrides):
    """The demo dataset's text spec (generated once into the demo cache), with `overrides` applied."""
    from plait.cli.demo_data import default_cache_dir, generate
    from plait.spec import load_spec

    return load_spec(generate(Path(cache) if cache else default_cache_dir())).with_overrides(**overrides)


def compare_streams(reference: list[np.ndarray], observed: list[np.ndarray]) -> dict:
    """lost / duplicated / same order between two streams of sample-id arrays ([n, 5] each)."""
    ref = np.concatenate(reference) if reference else np.zeros((0, 5), np.int64)
    got = np.concatenate(observed) if observed else np.zeros((0, 5), np.int64)
    ref_set = {tuple(r) for r in ref.tolist()}
    got_list = [tuple(r) for r in got.tolist()]
    got_set = set(got_list)
    return {"delivered": len(got_list), "lost": len(ref_set - got_set),
            "duplicated": len(got_list) - len(got_set) + len(got_set - ref_set),
            "same_order": bool(ref.shape == got.shape and np.array_equal(ref, got))}


def kill_points(steps: int, failures: int, seed: int, num_loaders: int) -> dict[int, int]:
    """step -> loader (source) index to kill at that step: seeded, distinct steps, not the first two."""
    rng = np.random.default_rng(seed)
    at = sorted(rng.choice(np.arange(2, max(3, steps - 1)), size=min(failures, max(1, steps - 3)), replace=False).tolist())
    first = int(rng.integers(num_loaders))
    return {int(s): (first + j) % num_loaders for j, s in enumerate(at)}


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
