"""`python -m benchmarks.images_ray`: decodes per delivered image on the ray runtime.

The source of `plait bench images` (its generated images, or yours with --path), planned and built for
--steps steps on the ray runtime with two SourceLoader actors and no build-ahead (so that the images
decoded are those of the delivered steps); the actors report the images they decoded (target: exactly
one decode per delivered image, as on the local runtime, which `plait bench images` checks).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.common import main, own_ray_instance, write_result
from plait.cli.bench import images as product
from plait.cli.bench.media_bench import find_files

HELP = "decodes per delivered image on the ray runtime (the SourceLoader actors report their decodes)"
DESCRIPTION = __doc__


def add_arguments(p) -> None:
    product.add_arguments(p)


def run(args) -> int:
    from plait.runtime import make_runtime

    with tempfile.TemporaryDirectory(prefix="plait-images-ray-") as tmp:
        folder = Path(tmp)
        files = (find_files(args.path, product.MEDIA.extensions, args.images, "image") if args.path
                 else product.generate(args, folder))
        jsonl = folder / "captions.jsonl"
        jsonl.write_text("".join(json.dumps({"id": f"image-{i}", "image": str(f), "caption": f.name}) + "\n"
                                 for i, f in enumerate(files)))
        images = 0
        with own_ray_instance("plait-images-ray-"):
            rt = make_runtime(product.image_spec(jsonl, args), "ray", loaders=2, build_ahead=0)
            try:
                for _ in range(args.steps):
                    plan = rt.plan()
                    for rank in range(plan.ranks):
                        images += sum(len(mb.image_grid) for mb in rt.build(plan, rank) if mb.image_grid is not None)
                    rt.release()
                decodes = sum(int(s.get("images_decoded", 0)) for s in rt.stats()["loaders"])
            finally:
                rt.close()
    print(f"ray runtime: {images} images delivered, {decodes} decoded: {decodes / max(images, 1):.3f} per image (target 1)")
    write_result(args.json, {"delivered_images_ray": images, "decodes_ray": decodes,
                             "decodes_per_image_ray": decodes / max(images, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
