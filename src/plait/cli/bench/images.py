"""`plait bench images`: image throughput of the loader against plain Pillow, and decodes per image.

On N generated images (JPEG and PNG, 64..640 px sides, aspect ratios up to 4:1) or the first N of yours
(--path), as a LLaVA-style source: the loader plans --steps global steps on the local runtime (DP --dp) and
builds every rank's micro-batches with loading.workers = --workers (read, decode, orient, resize, patchify);
a plain Pillow loop (open, resize BICUBIC to the same planned size, numpy.asarray; one core) reads the same
files. ratio_wall = loader images/s / (workers x Pillow images/s), wall against wall (target >= 0.8);
ratio_cpu per CPU-second; decodes per delivered image (target exactly 1) and while planning (target 0).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from plait.cli.bench.media_bench import Media, build_steps, loader_spec
from plait.cli.common import positive_int

HELP = "images/s of the loader (decode, resize, patchify) vs a plain Pillow loop; decodes per delivered image"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    MEDIA.add_arguments(p, steps=8, dp=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 256, help="images.max_pixels (dynamic policy)")
    p.add_argument("--max-side", type=int, default=640, help="largest generated image side in pixels")
    p.add_argument("--rounds", type=int, default=2, help="passes of the Pillow loop over the files")
    p.add_argument("--workers", type=positive_int, default=None, help="the loader's loading.workers (default: the cores "
                   "this process may use)")


def image_spec(jsonl: Path, args):
    source = {"name": "image", "path": str(jsonl), "format": "jsonl", "text_field": "caption", "image_field": "image",
              "image_root": str(jsonl.parent), "eos": 257, "on_error": "skip"}
    return loader_spec(args, source, loading={"workers": args.workers}, images={
        "policy": "dynamic", "min_pixels": 28 * 28 * 4, "max_pixels": args.max_pixels})


def generate(args, folder: Path) -> list[Path]:
    from plait.cli.demo_data import write_image_source

    write_image_source(folder / "image", args.images, max_side=args.max_side)
    return sorted((folder / "image" / "img").iterdir())


def measure(args, files: list[Path], folder: Path) -> dict:
    from plait.media.image import DECODES, BadImage, ImageMedium, bench_pillow, image_size
    from plait.sources.workers import available_cpus

    args.workers = available_cpus() if args.workers is None else args.workers
    jsonl = folder / "captions.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"image-{i}", "image": str(f), "caption": f"a picture: {f.name}"}) + "\n"
                             for i, f in enumerate(files)))
    spec = image_spec(jsonl, args)
    delivered = [0, 0]  # images, patches

    def count(mb):
        if mb.image_grid is not None:
            delivered[0] += len(mb.image_grid)
            delivered[1] += len(mb.pixel_values)

    loader = build_steps(spec, args.steps, (DECODES, DECODES), count)
    readable = []
    for f in files:  # the baseline loop has no skip policy: it opens the files whose headers read
        try:
            image_size(f.read_bytes())
            readable.append(f)
        except BadImage:
            pass
    c0 = time.process_time()
    pillow = bench_pillow(readable, ImageMedium().policy(spec), rounds=args.rounds)
    pillow_cpu = len(readable) * args.rounds / max(time.process_time() - c0, 1e-9)
    n = delivered[0]
    per_cpu, wall = n / max(loader["build_cpu_s"], 1e-9), n / max(loader["build_wall_s"], 1e-9)
    return {"images_files": len(files), "steps": args.steps, "dp": args.dp, "max_pixels": args.max_pixels,
            "delivered_images": n, "patches": delivered[1], "workers": args.workers,
            "loader_images_per_cpu_s": per_cpu, "loader_images_per_s_wall": wall,
            "pillow_images_per_s": pillow, "pillow_images_per_cpu_s": pillow_cpu,
            "ratio_wall": wall / max(args.workers * pillow, 1e-9), "ratio_cpu": per_cpu / max(pillow_cpu, 1e-9),
            "target_ratio": 0.8, "plan_s": loader["plan_s"], "planning_decodes": loader["planning_decodes"],
            "decodes_local": loader["decodes"], "decodes_per_image_local": loader["decodes"] / max(n, 1),
            "skipped": loader["skipped"], "errors": loader["errors"]}


def rows(r: dict) -> list[tuple[str, str]]:
    return [(f"images delivered (all ranks, {r['steps']} steps)", f"{r['delivered_images']:,}"),
            (f"loader images / s, {r['workers']} workers (decode, resize, patchify, batch)",
             f"{r['loader_images_per_s_wall']:,.1f}"),
            ("Pillow open-resize-asarray images / s (1 core)", f"{r['pillow_images_per_s']:,.1f}"),
            (f"ratio_wall = loader / ({r['workers']} x Pillow), wall vs wall (target >= 0.8)", f"{r['ratio_wall']:.2f}"),
            ("ratio_cpu = images per CPU-s, loader / Pillow", f"{r['ratio_cpu']:.2f}"),
            ("decodes while planning (target 0)", f"{r['planning_decodes']}"),
            ("decodes per delivered image (target 1)", f"{r['decodes_per_image_local']:.3f}")]


MEDIA = Media("images", "image", ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff"), "images", 300,
              generate, measure, rows, lambda r: f"images: loader (local, DP {r['dp']}) vs plain Pillow, {r['images_files']} "
                                       f"files ({r['source']})")

run = MEDIA.run
