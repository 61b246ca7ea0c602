"""The skeleton `plait bench images`, `video` and `audio` share: generated files or the user's own (`--path`,
a folder searched recursively or a glob; a file that fails is skipped, counted and named), plait against a
plain reference loop over the same files in the same run, one table and `--json`. Each command is a `Media`:
what differs (its files, its two sides, its table rows)."""

from __future__ import annotations

import glob
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plait.cli.common import console, positive_int, print_table, write_json
from plait.errors import PlaitError


@dataclass(frozen=True)
class Media:
    name: str  # the command: images, video, audio
    what: str  # one file's kind, as the user's --path error names it
    extensions: tuple[str, ...]
    count: str  # the option giving how many files: --images, --videos, --clips
    default: int  # files generated
    generate: Callable  # (args, folder) -> generated files
    measure: Callable  # (args, files, folder) -> the result's figures
    rows: Callable  # (result) -> [(measure, value)] of the table
    title: Callable  # (result) -> the table's title

    def add_arguments(self, p, steps: int | None = None, dp: int | None = None) -> None:
        """--path, the count, --json, --quiet; and where the loader plans and builds, --steps and --dp."""
        p.add_argument("--path", help=f"a folder (searched recursively) or a glob of your {self.what} files "
                       f"({', '.join(self.extensions)}) to measure instead of generated ones")
        p.add_argument(f"--{self.count}", type=positive_int, default=self.default, help=f"{self.what} files (with --path: "
                       f"the first N found; default {self.default})")
        p.add_argument("--json", metavar="PATH", help="write the results as JSON")
        p.add_argument("--quiet", action="store_true", help="no table")
        if steps is not None:
            p.add_argument("--steps", type=positive_int, default=steps, help="global steps the loader plans and builds")
            p.add_argument("--dp", type=positive_int, default=dp, help="data-parallel ranks (all built in this process)")

    def run(self, args) -> int:
        load = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix=f"plait-bench-{self.name}-") as tmp:
            folder = Path(tmp)
            if args.path:
                files = find_files(args.path, self.extensions, getattr(args, self.count), self.what)
            else:
                with console.status(f"writing the {self.what} files…", spinner="dots"):
                    files = self.generate(args, folder)
            figures = self.measure(args, files, folder)
        result = {"path": args.path, "source": args.path or "generated", **figures, "cpus": os.cpu_count(),
                  "loadavg": [round(x, 2) for x in (*load, *os.getloadavg())]}
        if not args.quiet:
            print_table(self.title(result), self.rows(result) + [
                ("bad files skipped", str(result["skipped"])),
                ("load average (start, end)", f"{load[0]:.1f}, {result['loadavg'][3]:.1f}")])
        for line in result["errors"][:10]:
            console.print(f"  left out: {line}", highlight=False, soft_wrap=True, markup=False)
        write_json(args.json, result)
        return 0


def find_files(path: str, extensions: tuple[str, ...], limit: int, what: str) -> list[Path]:
    """The first `limit` files (sorted) under the folder `path` (recursively) or matching the glob `path`
    whose extension is one of `extensions`; a PlaitError naming `path` when there is none."""
    found = (str(p) for p in Path(path).rglob("*")) if os.path.isdir(path) else \
        glob.glob(os.path.expanduser(path), recursive=True)
    files = sorted(Path(f).resolve() for f in found if os.path.isfile(f) and f.rsplit(".", 1)[-1].lower() in extensions)
    if not files:
        raise PlaitError(f"--path {path}: no {what} files there (extensions: {', '.join(extensions)})")
    return files[:limit]


def loader_spec(args, source: dict, **sections):
    """The spec images and video measure: one source, DP --dp, packing --seq-len with room for 4 x seq_len
    patches, a cost model with an encoder; `sections` add to (images) or extend it."""
    from plait.spec import load_spec

    images = {"patch": 14, "merge": 2, "image_token_id": 300, **sections.pop("images", {})}
    return load_spec({"seed": 7, "sources": [source], "images": images, "topology": {"dp": args.dp},
                      "packing": {"seq_len": args.seq_len, "microbatches": 1, "max_patches": 4 * args.seq_len},
                      "cost": {"linear": 1.0, "quadratic": 0.0001, "encoder": {"linear": 2.0, "quadratic": 0.001}},
                      **sections})


def build_steps(spec, steps: int, counters: tuple, on_batch) -> dict:
    """Plan and build `steps` global steps of `spec` on the local runtime, every rank's micro-batches
    (`on_batch(mb)` each): wall and CPU time of planning and building, and the counters' increments
    (counters: (decodes, planning decodes), plait.metrics.Counter-like) while building and planning."""
    from plait.kernels import warm_up
    from plait.runtime import make_runtime

    warm_up()  # the planner's compiled kernels: once per process, not per file
    decodes, planning = counters
    rt = make_runtime(spec, "local")
    out = {"plan_s": 0.0, "build_cpu_s": 0.0, "build_wall_s": 0.0, "planning_decodes": 0}
    start = decodes.count
    try:
        for _ in range(steps):
            t0, p0 = time.perf_counter(), planning.count
            plan = rt.plan()
            out["plan_s"] += time.perf_counter() - t0
            out["planning_decodes"] += planning.count - p0
            c0, w0 = time.process_time(), time.perf_counter()
            for rank in range(plan.ranks):
                for mb in rt.build(plan, rank):
                    on_batch(mb)
            out["build_cpu_s"] += time.process_time() - c0
            out["build_wall_s"] += time.perf_counter() - w0
            rt.release()
        out["decodes"] = decodes.count - start
        errors = rt.error_report()
    finally:
        rt.close()
    return {**out, "skipped": sum(e["skipped"] for e in errors.values()),
            "errors": [m for e in errors.values() for m in e["messages"][:5]]}
