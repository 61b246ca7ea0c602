"""Images: header-only sizes for the Planner, decode + patchify for the loader, bad-image reasons.

Why two halves. The Planner balances micro-batches by patches and cost before any pixel is read, so it
needs every image's size cheaply: `image_size` opens the image lazily (Pillow reads the header only)
and applies the EXIF orientation to the reported size without decoding. The loader later calls
`decode`, which must produce exactly the patch count the Planner counted; both go through the same
pure `ImagePolicy.plan` (media/image_policy.py) on the same oriented header size, so they agree.
`DECODES` counts pixel decodes so tests can assert that planning decoded nothing.

Decoding (`decode`), in order:
  1. `Image.open` restricted to FORMATS (no EPS/ghostscript & co. on untrusted bytes), with Pillow's
     decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`) enforced as an error, warning included;
  2. the plan from the oriented header size; only with `policy.fast_jpeg`, for a JPEG shrunk by >= 2x
     on both sides, `Image.draft` lets libjpeg decode at 1/2, 1/4 or 1/8 scale (DCT scaling), never
     below the target size. Off by default: the draft's pixels differ from the full decode + BICUBIC
     resize that Hugging Face's processors do (measured in docs/multimodal-images.md);
  3. to RGB: alpha (RGBA, LA, PA, P with transparency) is composited onto white, as Qwen2-VL's
     loader does; 16-bit greyscale keeps its top 8 bits; everything else via `convert("RGB")`;
  4. resize with BICUBIC to the plan's size (in stored orientation), then the EXIF transpose (same
     result as `ImageOps.exif_transpose` first, on far fewer pixels; a TIFF's orientation Pillow applies
     itself on load); tiles: a BICUBIC tile x tile thumbnail of the (drafted) source image, if planned;
  5. patchify with one reshape/transpose (no Python loop per patch): tiles in row-major order, then the
     thumbnail; inside each tile (or the whole image for `dynamic`) patches in raster (row-major)
     order, each flattened as (patch, patch, 3) -> patch*patch*3 uint8. `merge_order` gives the
     permutation to Qwen2-VL's order (each merge x merge window contiguous) for a model that wants it.
Any failure is a `BadImage` with a one-line reason (truncated, not an image, bomb, empty, too thin).
Note: `ImageFile.LOAD_TRUNCATED_IMAGES = True` (a process-wide Pillow switch) would let truncated
JPEGs decode with grey filling; plait leaves it alone.

Placeholders. An image becomes a run of `plan.tokens` copies of the spec's `image_token_id` in
`input_ids`, where the image sits in the text (`placeholder_run`). Labels are input_ids shifted left
by one (packing.py), so a label equal to the image token id asks the model to predict a placeholder:
`mask_placeholder_labels` sets those to IGNORE_INDEX (-100). The last placeholder's label, the text
after the image, is kept.
"""

from __future__ import annotations

import io
import threading
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
from PIL import Image, UnidentifiedImageError

from plait.batch import image_fields, merge_window_order
from plait.media.base import DecodeCounter
from plait.packing import IGNORE_INDEX
from plait.media.image_policy import (
    MAX_ASPECT,
    BadImage,
    ImagePlan,
    ImagePolicy,
    smart_resize,
)

__all__ = [
    "DECODES",
    "FORMATS",
    "MAX_ASPECT",
    "MEDIUM",
    "BadImage",
    "Decoded",
    "ImagePlan",
    "ImagePolicy",
    "bench_decode",
    "bench_pillow",
    "decode",
    "image_size",
    "mask_placeholder_labels",
    "merge_order",
    "patchify",
    "placeholder_run",
    "resize_bicubic",
    "smart_resize",
]

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow format ids tried by Image.open (JPEG covers MPO)
ORIENTATION_TAG = 0x0112
TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
             4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270,
             7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}  # as ImageOps.exif_transpose
SWAPS = frozenset((5, 6, 7, 8))  # orientations whose display size is the stored size transposed
BACKGROUND = (255, 255, 255)  # alpha is composited onto white
ALPHA_MODES = frozenset(("RGBA", "LA", "PA", "RGBa", "La"))
WIDE_GREY = frozenset(("I;16", "I;16L", "I;16B", "I;16N", "I"))
ImageData = bytes | bytearray | memoryview | BinaryIO

_OPEN_LOCK = threading.Lock()  # warnings.catch_warnings is process state: one opener at a time


DECODES = DecodeCounter()  # how many times `decode` ran in this process; `image_size` never adds


class Decoded(NamedTuple):
    """`decode`'s result: uint8 patches [plan.patches, patch*patch*3], the plan, and the JPEG draft
    scale used (1 when no draft: fast_jpeg off, not a JPEG, or not shrunk by 2x or more)."""

    patches: np.ndarray
    plan: ImagePlan
    draft: int

    @property
    def grid(self) -> tuple[int, int, int]:
        """(t, h, w) in patches: `image_grid` for this image."""
        return self.plan.grid


def open_image(data: ImageData) -> Image.Image:
    """Open lazily (header only): BadImage for non-images, formats outside FORMATS, bombs, empty images."""
    if isinstance(data, (bytes, bytearray, memoryview)) and not len(data):
        raise BadImage("empty file (0 bytes)")
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    with _OPEN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(stream, formats=FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise BadImage(f"decompression bomb: {e}") from None
        except UnidentifiedImageError:
            raise BadImage(f"not an image in an accepted format ({', '.join(FORMATS)})") from None
        except Exception as e:  # noqa: BLE001 - any Pillow failure on untrusted bytes is a bad image
            raise BadImage(f"unreadable image header: {type(e).__name__}: {e}") from None
    if img.width <= 0 or img.height <= 0:
        img.close()
        raise BadImage(f"empty image ({img.width}x{img.height})")
    return img


def orientation(img: Image.Image) -> int:
    """EXIF orientation left for plait to apply (1..8; 1 when absent or broken), from the header only.
    A PNG's eXIf chunk placed after the pixel data is not visible without decoding and is ignored, by
    both paths alike; a TIFF's orientation is applied by Pillow itself (hence 1)."""
    if img.format == "PNG" and "exif" not in img.info:
        return 1  # PngImageFile.getexif() would decode the image to look further
    if img.format == "TIFF":
        return 1  # Pillow >= 11 applies a TIFF's orientation itself: upright `size`, transposed on load
    try:
        value = img.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block does not make a bad image
        return 1
    return value if value in TRANSPOSE else 1


def oriented_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) as displayed: the stored size, transposed for orientations 5..8."""
    w, h = img.size
    return (h, w) if orientation(img) in SWAPS else (w, h)


def image_size(data: ImageData) -> tuple[int, int]:
    """(width, height) after EXIF orientation, from the header: never decodes pixels. BadImage if the
    header is unusable. A file-like `data` is read from its current position and left open."""
    img = open_image(data)
    try:
        return oriented_size(img)
    finally:
        if isinstance(data, (bytes, bytearray, memoryview)):
            img.close()


def to_rgb(img: Image.Image) -> Image.Image:
    """Load and convert to RGB: alpha onto white, 16-bit grey scaled to 8 bits."""
    img.load()
    if img.mode == "RGB":
        return img
    if img.mode in ALPHA_MODES or "transparency" in img.info:
        rgba = img.convert("RGBA")
        out = Image.new("RGB", img.size, BACKGROUND)
        out.paste(rgba, mask=rgba.getchannel("A"))
        return out
    if img.mode in WIDE_GREY:
        grey = (np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    return img.convert("RGB")


def patchify(pixels: np.ndarray, rows: int, cols: int, patch: int, out: np.ndarray | None = None) -> np.ndarray:
    """[H, W, C] uint8 -> [rows*cols*(H/rows/patch)*(W/cols/patch), patch*patch*C]: the image cut into
    rows x cols tiles (row-major), each tile's patches in raster order, one patch = (patch, patch, C).
    One strided copy, into `out` (C-contiguous, that shape) when given."""
    height, width, channels = pixels.shape
    gh, gw = height // (rows * patch), width // (cols * patch)
    if gh * rows * patch != height or gw * cols * patch != width:
        raise ValueError(f"{width}x{height} is not a {cols}x{rows} grid of whole {patch}-pixel patches")
    x = pixels.reshape(rows, gh, patch, cols, gw, patch, channels).transpose(0, 3, 1, 4, 2, 5, 6)
    if out is None:
        return x.reshape(rows * cols * gh * gw, patch * patch * channels)
    np.copyto(out.reshape(x.shape), x)
    return out


def merge_order(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Permutation from raster patch order to merge-window order (Qwen2-VL's): `patches[merge_order(...)]`
    puts each merge x merge window's patches next to each other, windows in raster order."""
    return merge_window_order(grid_h, grid_w, merge)


def resize_bicubic(img: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`img` at `size` (width, height) by Pillow's BICUBIC on 8-bit RGB, as Hugging Face's PIL image
    processors resize: the one resize of images and (by default) of video frames."""
    return img if img.size == size else img.resize(size, Image.Resampling.BICUBIC)


def upright(img: Image.Image, orient: int) -> Image.Image:
    """`img` turned per EXIF orientation `orient` (ImageOps.exif_transpose's mapping)."""
    return img.transpose(TRANSPOSE[orient]) if orient in TRANSPOSE else img


def decode(data: ImageData, policy: ImagePolicy, out: np.ndarray | None = None) -> Decoded:
    """Decode, orient, resize and patchify one image per `policy` (see the module docstring).
    The patch count equals `policy.plan(*image_size(data)).patches` exactly. BadImage on any failure.
    `out`: where the patches go (a slice of a payload's pixel buffer, so they are written once), if
    it has their shape."""
    DECODES.add()
    img = open_image(data)
    try:
        orient = orientation(img)
        plan = policy.plan(*oriented_size(img))
        stored = img.size
        target = (plan.height, plan.width) if orient in SWAPS else (plan.width, plan.height)
        draft = 1
        shrink = policy.fast_jpeg and img.format in ("JPEG", "MPO") and stored[0] >= 2 * target[0] and stored[1] >= 2 * target[1]
        if shrink and img.draft("RGB", target) is not None:
            draft = round(stored[0] / img.size[0])
        try:
            rgb = to_rgb(img)
        except Exception as e:  # noqa: BLE001 - truncated, corrupt: Pillow raises many types
            raise BadImage(f"cannot decode {img.format} image: {type(e).__name__}: {e}") from None
        shape = (plan.patches, policy.patch * policy.patch * 3)
        patches = out if out is not None and out.shape == shape else np.empty(shape, dtype=np.uint8)
        main = plan.patches - (plan.grid[1] * plan.grid[2] if plan.thumbnail else 0)
        if plan.thumbnail:  # from the source, as InternVL does (and far cheaper than from the resized grid)
            thumb = upright(rgb.resize((policy.tile, policy.tile), Image.Resampling.BICUBIC), orient)
            patchify(np.asarray(thumb), 1, 1, policy.patch, out=patches[main:])
        rgb = resize_bicubic(rgb, target)
        patchify(np.asarray(upright(rgb, orient)), plan.rows, plan.cols, policy.patch, out=patches[:main])
        return Decoded(patches, plan, draft)
    finally:
        if isinstance(data, (bytes, bytearray, memoryview)):
            img.close()


class ImageMedium:
    """The image medium (plait.media.registry.Medium): header size -> ImagePlan, decode -> patch rows."""

    def policy(self, spec) -> ImagePolicy | None:
        im = spec.images
        if im is None:
            return None
        return ImagePolicy(kind=im.policy, patch=im.patch, merge=im.merge, min_pixels=im.min_pixels,
                           max_pixels=im.max_pixels, tile=im.tile, min_tiles=im.min_tiles, max_tiles=im.max_tiles,
                           thumbnail=im.thumbnail, fast_jpeg=im.fast_jpeg)

    def probe(self, data: ImageData, name: str | None = None) -> tuple[int, int]:
        return image_size(data)

    def plan(self, policy: ImagePolicy, info: tuple[int, int], window: int = 0) -> ImagePlan:
        return policy.plan(*info)

    def decode(self, data: ImageData, planned, policy: ImagePolicy, name: str | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """The patches (into `out` when it fits); BadImage when they are not the `planned.patches` counted
        from the header (a file changed since)."""
        got = decode(data, policy, out)
        if got.plan.patches != planned.patches:
            raise BadImage(f"decodes to {got.plan.patches} patches, planned at {planned.patches} from its header",
                           name or "")
        return got.patches

    def placeholder_tokens(self, planned) -> int:
        return planned.tokens

    def encoder_units(self, planned) -> tuple[int, int]:
        return planned.patches, planned.patches * planned.patches

    def batch_fields(self, payload, a: int, b: int) -> dict:
        return image_fields(payload, a, b)

    def reference(self, data):
        return data  # an image stands in its record as its bytes or path


MEDIUM = ImageMedium()


def placeholder_run(token_id: int, n: int, dtype=np.int32) -> np.ndarray:
    """The n placeholder ids an image occupies in input_ids (n = its plan's `tokens`)."""
    return np.full(n, token_id, dtype=dtype)


def mask_placeholder_labels(labels: np.ndarray, token_id: int) -> np.ndarray:
    """Labels (input_ids shifted left) with every prediction of a placeholder set to IGNORE_INDEX."""
    return np.where(labels == token_id, np.asarray(IGNORE_INDEX, dtype=labels.dtype), labels)


def read_all(paths: Iterable[str | Path]) -> list[bytes]:
    """The bytes of each file, so a benchmark times decoding, not storage."""
    return [Path(p).read_bytes() for p in paths]


def bench_decode(paths: Iterable[str | Path], policy: ImagePolicy, rounds: int = 1) -> float:
    """Images per second through `decode` (files read into memory first; one thread)."""
    blobs = read_all(paths)
    start = time.perf_counter()
    for _ in range(rounds):
        for blob in blobs:
            decode(blob, policy)
    return len(blobs) * rounds / max(time.perf_counter() - start, 1e-9)


def bench_pillow(paths: Iterable[str | Path], policy: ImagePolicy, rounds: int = 1) -> float:
    """The baseline for `bench_decode`: plain Pillow open -> resize (BICUBIC, to the plan's size) ->
    numpy.asarray per image, no draft, orientation or patchify. Images per second."""
    blobs = read_all(paths)
    start = time.perf_counter()
    for _ in range(rounds):
        for blob in blobs:
            img = Image.open(io.BytesIO(blob))
            plan = policy.plan(*img.size)
            np.asarray(img.resize((plan.width, plan.height), Image.Resampling.BICUBIC))
    return len(blobs) * rounds / max(time.perf_counter() - start, 1e-9)
