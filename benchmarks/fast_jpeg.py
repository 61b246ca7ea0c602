"""fast_jpeg: decode speed and pixel difference of Pillow's JPEG draft against the reference decode.

Generates large JPEGs (photo-like: gradients, edges and noise), decodes each with plait's `decode` twice,
`fast_jpeg` off (the reference: full decode + BICUBIC resize, as Hugging Face's processors) and on
(libjpeg's DCT scaling first), and reports images/s of both, their ratio (same run, wall vs wall) and the
max / mean absolute pixel difference (0..255). Run: python benchmarks/fast_jpeg.py [--images N]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

import numpy as np
from PIL import Image

from plait.media.image import ImagePolicy, decode


def photo(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    arr = np.stack([128 + 100 * np.sin(x / (40 + 13 * c) + y / (70 + 7 * c) + seed) for c in range(3)], axis=-1)
    arr[(x // 97 + y // 61) % 5 == 0] = 250.0  # hard edges: where DCT scaling and BICUBIC part most
    arr += rng.normal(0, 12, arr.shape)
    buf = io.BytesIO()
    Image.fromarray(arr.clip(0, 255).astype(np.uint8), "RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def rate(blobs: list[bytes], policy: ImagePolicy, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        for blob in blobs:
            decode(blob, policy)
    return len(blobs) * rounds / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=6, help="JPEGs per size (default 6)")
    ap.add_argument("--rounds", type=int, default=2, help="decode rounds per measurement (default 2)")
    args = ap.parse_args()
    rows = []
    for (w, h), max_pixels in [((4000, 3000), 28 * 28 * 1280), ((4000, 3000), 28 * 28 * 256), ((2400, 1600), 28 * 28 * 64)]:
        blobs = [photo(w, h, seed) for seed in range(args.images)]
        ref, fast = (ImagePolicy("dynamic", patch=14, merge=2, max_pixels=max_pixels, fast_jpeg=f) for f in (False, True))
        diffs = [np.abs(decode(b, ref).patches.astype(np.int16) - decode(b, fast).patches.astype(np.int16)) for b in blobs]
        drafts = sorted({decode(b, fast).draft for b in blobs})
        ref_rate, fast_rate = rate(blobs, ref, args.rounds), rate(blobs, fast, args.rounds)
        rows.append({"size": f"{w}x{h}", "max_pixels": max_pixels, "draft_scale": drafts,
                     "reference_img_s": round(ref_rate, 2), "fast_img_s": round(fast_rate, 2),
                     "speedup": round(fast_rate / ref_rate, 2), "max_abs_diff": int(max(d.max() for d in diffs)),
                     "mean_abs_diff": round(float(np.mean([d.mean() for d in diffs])), 2)})
        print(json.dumps(rows[-1]))
    print(json.dumps({"loadavg": os.getloadavg()}))


if __name__ == "__main__":
    main()
