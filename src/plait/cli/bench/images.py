"""`plait bench images`: image throughput of the loader against plain Pillow, and decodes per image.

It writes N images (JPEG and PNG, 64..640 px sides, aspect ratios up to 4:1; `plait demo`'s generator)
with short captions as a LLaVA-style JSONL source, or, with `--path` (a folder or a glob), lists the first
N of your own image files in one (a file that fails is skipped, counted and named), then in one run:

  loader   plans a few global steps of that source on the local runtime (DP --dp) and builds every
           rank's micro-batches with `loading.workers` = N (`--workers`, default: the cores this process
           may use): read, decode, orient, resize, patchify and assemble `pixel_values`. Images per
           second of wall time of the building (planning, which never decodes, is timed apart).
  pillow   a plain Pillow loop over the same files: open -> resize (BICUBIC, to the same planned size)
           -> numpy.asarray, files read into memory first (`plait.media.image.bench_pillow`).
           Images per second of wall time, on one core, in the same run.

ratio_wall = loader images/s / (N x Pillow images/s), wall against wall (target >= 0.8: N workers on N
cores give at least 0.8 of N plain loops). `ratio_cpu` is images per CPU-second of both, CPU against CPU. And decodes per delivered image on the local runtime (the
process's DECODES counter over the images the micro-batches carry; target exactly 1: the Planner
reads headers only and each image is decoded once, for the rank that gets it). The ray runtime's
decodes happen inside its SourceLoader actors, which report them (`--ray` measures them too).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from plait.cli.bench.user_files import find_files

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff")
HELP = "images/s of the loader (decode, resize, patchify) vs a plain Pillow loop; decodes per delivered image"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    p.add_argument("--images", type=int, default=300, help="distinct image files (with --path: the first N found)")
    p.add_argument("--path", help="a folder (searched recursively) or a glob of your image files (jpg, png, webp, "
                   "gif, bmp, tiff) to measure instead of generated ones")
    p.add_argument("--steps", type=int, default=8, help="global steps the loader plans and builds")
    p.add_argument("--dp", type=int, default=8, help="data-parallel ranks (all built in this process)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 256, help="images.max_pixels (dynamic policy)")
    p.add_argument("--max-side", type=int, default=640, help="largest image side in pixels")
    p.add_argument("--rounds", type=int, default=2, help="passes of the Pillow loop over the files")
    p.add_argument("--workers", type=int, default=None, help="the loader's loading.workers (default: the cores "
                   "this process may use)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quiet", action="store_true", help="no table")
    p.add_argument("--ray", action="store_true", help="also count decodes per delivered image on the ray runtime "
                   "(starts a local Ray instance; the SourceLoader actors report their decodes)")


def image_spec(jsonl: Path, args):
    from plait.spec import load_spec

    return load_spec({
        "seed": 7,
        "sources": [{"name": "image", "path": str(jsonl), "format": "jsonl", "text_field": "caption",
                     "image_field": "image", "image_root": str(jsonl.parent), "eos": 257,
                     "on_error": "skip" if args.path else "raise"}],
        "images": {"policy": "dynamic", "patch": 14, "merge": 2, "min_pixels": 28 * 28 * 4,
                   "max_pixels": args.max_pixels, "image_token_id": 300},
        "packing": {"seq_len": args.seq_len, "microbatches": 1, "max_patches": 4 * args.seq_len},
        "loading": {"workers": args.workers},
        "topology": {"dp": args.dp},
        "cost": {"linear": 1.0, "quadratic": 0.0001, "encoder": {"linear": 2.0, "quadratic": 0.001}},
    })


def measure_loader(spec, steps: int) -> dict:
    """Plan `steps` global steps on the local runtime and build every rank's micro-batches."""
    from plait.kernels import warm_up
    from plait.runtime import make_runtime
    from plait.media.image import DECODES

    warm_up()
    rt = make_runtime(spec, "local")
    images = patches = 0
    plan_s = build_cpu = build_wall = 0.0
    planning_decodes = 0
    start = DECODES.count
    try:
        for _ in range(steps):
            t0, d0 = time.perf_counter(), DECODES.count
            plan = rt.plan()
            plan_s += time.perf_counter() - t0
            planning_decodes += DECODES.count - d0
            c0, w0 = time.process_time(), time.perf_counter()
            for rank in range(plan.ranks):
                for mb in rt.build(plan, rank):
                    if mb.image_grid is not None:
                        images += len(mb.image_grid)
                        patches += len(mb.pixel_values)
            build_cpu += time.process_time() - c0
            build_wall += time.perf_counter() - w0
            rt.release()
        decodes = DECODES.count - start
        errors = rt.error_report()
    finally:
        rt.close()
    return {"images": images, "patches": patches, "plan_s": plan_s, "build_cpu_s": build_cpu,
            "build_wall_s": build_wall, "planning_decodes": planning_decodes, "decodes": decodes,
            "skipped": sum(e["skipped"] for e in errors.values()),
            "errors": [m for e in errors.values() for m in e["messages"][:5]]}


def measure_ray(spec, steps: int) -> dict:
    """The same steps on the ray runtime: images delivered, and the decodes the loader actors report."""
    from plait.runtime import make_runtime

    rt = make_runtime(spec, "ray", loaders=2, build_ahead=0)  # no build ahead: decodes = delivered steps
    images = 0
    try:
        for _ in range(steps):
            plan = rt.plan()
            for rank in range(plan.ranks):
                for mb in rt.build(plan, rank):
                    if mb.image_grid is not None:
                        images += len(mb.image_grid)
            rt.release()
        decodes = sum(int(s.get("images_decoded", 0)) for s in rt.stats()["loaders"])
    finally:
        rt.close()
    return {"images": images, "decodes": decodes}


def source_of(args, folder: Path) -> tuple[Path, list[Path]]:
    """The JSONL the loader reads and the files the Pillow loop opens: generated images, or the user's
    files that open as images (absolute paths)."""
    from plait.cli.demo_data import write_image_source
    from plait.media.image import BadImage, image_size

    if not args.path:
        jsonl = write_image_source(folder / "image", args.images, max_side=args.max_side)
        return jsonl, sorted((folder / "image" / "img").iterdir())
    files = find_files(args.path, IMAGE_EXTENSIONS, args.images, "image")
    jsonl = folder / "captions.jsonl"
    records = ({"id": f"image-{i}", "image": str(f), "caption": f"a picture: {f.name}"} for i, f in enumerate(files))
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    readable = []
    for f in files:  # the baseline loop has no skip policy: it opens the files whose headers read
        try:
            image_size(f.read_bytes())
            readable.append(f)
        except BadImage:
            pass
    return jsonl, readable


def run(args) -> int:
    from plait.errors import PlaitError
    from plait.sources.workers import available_cpus
    from plait.media.image import bench_pillow
    from plait.media.image_policy import ImagePolicy

    args.workers = available_cpus() if args.workers is None else args.workers
    if args.workers < 1:
        raise PlaitError(f"--workers must be >= 1, got {args.workers}")
    with tempfile.TemporaryDirectory(prefix="plait-bench-images-") as tmp:
        jsonl, files = source_of(args, Path(tmp))
        image_files = len(jsonl.read_text().splitlines())
        spec = image_spec(jsonl, args)
        loader = measure_loader(spec, args.steps)
        im = spec.images
        policy = ImagePolicy(kind=im.policy, patch=im.patch, merge=im.merge, min_pixels=im.min_pixels,
                             max_pixels=im.max_pixels)
        c0 = time.process_time()
        pillow = bench_pillow(files, policy, rounds=args.rounds)
        pillow_cpu = len(files) * args.rounds / max(time.process_time() - c0, 1e-9)
        on_ray = measure_ray(spec, args.steps) if args.ray else None
    per_core = loader["images"] / max(loader["build_cpu_s"], 1e-9)
    wall = loader["images"] / max(loader["build_wall_s"], 1e-9)
    result = {
        "images_files": image_files, "path": args.path, "steps": args.steps, "dp": args.dp,
        "max_pixels": args.max_pixels,
        "delivered_images": loader["images"], "patches": loader["patches"], "workers": args.workers,
        "loader_images_per_cpu_s": per_core, "loader_images_per_s_wall": wall,
        "pillow_images_per_s": pillow, "pillow_images_per_cpu_s": pillow_cpu,
        "ratio_wall": wall / max(args.workers * pillow, 1e-9), "ratio_cpu": per_core / max(pillow_cpu, 1e-9),
        "target_ratio": 0.8, "load_average": list(os.getloadavg()),
        "plan_s": loader["plan_s"], "planning_decodes": loader["planning_decodes"],
        "decodes_local": loader["decodes"],
        "decodes_per_image_local": loader["decodes"] / max(loader["images"], 1),
        "decodes_per_image_ray": None if on_ray is None else on_ray["decodes"] / max(on_ray["images"], 1),
        "delivered_images_ray": None if on_ray is None else on_ray["images"],
        "skipped": loader["skipped"], "errors": loader["errors"],
    }
    if not args.quiet:
        _table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"images: loader (local, DP {r['dp']}) vs plain Pillow, {r['images_files']} files "
                    f"({r['path'] or 'generated'})")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row(f"images delivered (all ranks, {r['steps']} steps)", f"{r['delivered_images']:,}")
    t.add_row(f"loader images / s, {r['workers']} workers (decode, resize, patchify, batch)",
              f"{r['loader_images_per_s_wall']:,.1f}")
    t.add_row("Pillow open-resize-asarray images / s (1 core)", f"{r['pillow_images_per_s']:,.1f}")
    t.add_row(f"ratio_wall = loader / ({r['workers']} x Pillow), wall vs wall (target >= 0.8)", f"{r['ratio_wall']:.2f}")
    t.add_row("ratio_cpu = images per CPU-s, loader / Pillow", f"{r['ratio_cpu']:.2f}")
    t.add_row("load average (1, 5, 15 min)", ", ".join(f"{x:.1f}" for x in r["load_average"]))
    t.add_row("decodes while planning", f"{r['planning_decodes']}")
    t.add_row("decodes per delivered image, local (target 1)", f"{r['decodes_per_image_local']:.3f}")
    ray = r["decodes_per_image_ray"]
    t.add_row("decodes per delivered image, ray (target 1)", "not run (--ray)" if ray is None else f"{ray:.3f}")
    t.add_row("bad images skipped", f"{r['skipped']}")
    Console().print(t)
    for line in r["errors"]:
        Console(stderr=True).print(f"  {line}", highlight=False, soft_wrap=True, markup=False)
