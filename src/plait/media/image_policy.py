"""Image resize policies: pure functions from an image's (width, height) to what the model will see.

The Planner needs an image's patch and placeholder-token counts long before any worker decodes it,
and the loader must produce exactly that many patches later. Both sides therefore call the same pure
function on header sizes (`ImagePolicy.plan`); nothing here touches pixels or Pillow.

Two policies, as the two model families define them:

* ``dynamic`` -- Qwen2-VL's "smart resize". With ``factor = patch * merge``::

      h' = max(factor, round(h / factor) * factor)          (Python round: ties to even, as Qwen2-VL)
      w' = max(factor, round(w / factor) * factor)
      if h' * w' > max_pixels:  beta = sqrt(h * w / max_pixels)
                                h' = max(factor, floor(h / beta / factor) * factor)   (w' likewise)
      elif h' * w' < min_pixels: beta = sqrt(min_pixels / (h * w))
                                h' = ceil(h * beta / factor) * factor                 (w' likewise)
      patches = (h' / patch) * (w' / patch)
      tokens  = patches / merge**2                (placeholder ids in input_ids; merge x merge patches -> 1)
      grid    = (t, h, w) = (1, h' / patch, w' / patch)

  An aspect ratio max(h, w) / min(h, w) above 200 is rejected as a bad image (as Qwen2-VL does).

* ``tiles`` -- LLaVA-NeXT / InternVL dynamic tiling. Among the grids (cols, rows) with
  ``min_tiles <= cols * rows <= max_tiles``, take the one whose aspect ``cols / rows`` is closest to
  ``w / h``; on a tie, InternVL's `find_closest_aspect_ratio` rule: the later (larger-area) grid wins when
  ``w * h > 0.5 * tile**2 * cols * rows``. Candidates are visited by (area, cols, rows). The image is
  resized to (cols * tile, rows * tile) and cut into cols * rows tiles (row-major), plus one
  tile x tile thumbnail of the whole image when ``thumbnail`` and there is more than one tile::

      tiles            = cols * rows + (1 if thumbnail and cols * rows > 1 else 0)
      patches per tile = (tile / patch)**2
      tokens per tile  = (tile / patch)**2 / merge**2      (InternVL: 448 / 14 = 32, pixel-shuffle 2 -> 256)
      grid             = (t, h, w) = (tiles, tile / patch, tile / patch)

  The same aspect-ratio limit (200) applies.

Patches are always counted as ``t * h * w`` of the grid, and tokens as ``patches / merge**2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from plait.media.base import MediaError

MAX_ASPECT = 200  # Qwen2-VL's limit on max(h, w) / min(h, w)
KINDS = ("dynamic", "tiles")


class BadImage(MediaError):
    """An image that cannot be used: unreadable, truncated, a decompression bomb, empty, too thin.
    The message is one line, its reason: the decoder sees bytes, so the reader names the image
    (sources/multimodal.py) and a Source wraps it in a SourceError naming source, shard and record."""

    def __init__(self, reason: str, name: str = ""):
        super().__init__(name, reason)


class BadVideo(BadImage):
    """A video that cannot be used (no video stream, unknown duration, corrupt, truncated, unsupported
    codec, too short). A BadImage, so that every path that names and counts bad images handles it
    (media/video.py and media/container_size.py raise it)."""


@dataclass(frozen=True)
class ImagePlan:
    """What one image becomes. `width`/`height`: the pixel size it is resized to (for tiles, the whole
    cols x rows grid before cutting); `cols`/`rows`: the tile grid (1 x 1 for dynamic); `grid`: (t, h, w)
    in patches, as `image_grid` reports it; `patches` = t * h * w; `tokens` = patches / merge**2."""

    width: int
    height: int
    cols: int
    rows: int
    grid: tuple[int, int, int]
    patches: int
    tokens: int

    @property
    def thumbnail(self) -> bool:
        """Whether a thumbnail tile follows the grid's tiles."""
        return self.grid[0] > self.cols * self.rows


def check_size(width: int, height: int) -> None:
    """Raise BadImage for an empty image or an aspect ratio over MAX_ASPECT."""
    if width <= 0 or height <= 0:
        raise BadImage(f"empty image ({width}x{height})")
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise BadImage(f"aspect ratio of {width}x{height} is over {MAX_ASPECT}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's rule (see the module docstring): (h', w') multiples of `factor`, pixels within
    [min_pixels, max_pixels] when a side need not be clamped to `factor`, aspect kept within a step."""
    check_size(width, height)
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@lru_cache(maxsize=64)
def tile_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """All (cols, rows) with min_tiles <= cols * rows <= max_tiles, ordered by (area, cols, rows)."""
    grids = {(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles}
    return tuple(sorted(grids, key=lambda g: (g[0] * g[1], g[0], g[1])))


def closest_grid(width: int, height: int, tile: int, grids: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """InternVL's `find_closest_aspect_ratio`: the grid whose cols / rows is nearest width / height;
    on a tie the later grid wins when the image covers more than half of its pixel area."""
    aspect = width / height
    best, best_diff = grids[0], math.inf
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True)
class ImagePolicy:
    """How images are resized and cut into patches. `kind`: "dynamic" (Qwen2-VL) or "tiles"
    (LLaVA-NeXT / InternVL). `patch`: the ViT patch side in pixels; `merge`: merge x merge patches become
    one LLM token (Qwen2-VL's spatial merge, InternVL's pixel shuffle). Dynamic uses `min_pixels` /
    `max_pixels` (defaults: Qwen2-VL's 56*56 and the commonly used 28*28*1280); tiles uses `tile`,
    `min_tiles`, `max_tiles` and `thumbnail` (defaults: InternVL's 448, 1, 12, True). `fast_jpeg`: let
    libjpeg decode a JPEG shrunk by 2x or more at 1/2, 1/4 or 1/8 scale (Pillow's draft): faster, but
    its pixels differ from the reference processor's (off by default; docs/multimodal-images.md)."""

    kind: str = "dynamic"
    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    tile: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True
    fast_jpeg: bool = False

    def __post_init__(self):
        problems = []
        if self.kind not in KINDS:
            problems.append(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.patch < 1 or self.merge < 1:
            problems.append("patch and merge must be >= 1")
        elif self.tile % (self.patch * self.merge):
            problems.append(f"tile {self.tile} must be a multiple of patch * merge = {self.factor}")
        if not 0 < self.min_pixels <= self.max_pixels:
            problems.append("need 0 < min_pixels <= max_pixels")
        if not 1 <= self.min_tiles <= self.max_tiles:
            problems.append("need 1 <= min_tiles <= max_tiles")
        if problems:
            raise ValueError("bad ImagePolicy: " + "; ".join(problems))

    @property
    def factor(self) -> int:
        """Every resized side is a multiple of this: one merge group of patches."""
        return self.patch * self.merge

    def plan(self, width: int, height: int) -> ImagePlan:
        """The plan for an image of this (already EXIF-oriented) size; BadImage if it is unusable."""
        if self.kind == "dynamic":
            h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
            grid = (1, h // self.patch, w // self.patch)
            cols = rows = 1
        else:
            check_size(width, height)
            cols, rows = closest_grid(width, height, self.tile, tile_grids(self.min_tiles, self.max_tiles))
            w, h = cols * self.tile, rows * self.tile
            tiles = cols * rows + (1 if self.thumbnail and cols * rows > 1 else 0)
            side = self.tile // self.patch
            grid = (tiles, side, side)
        patches = grid[0] * grid[1] * grid[2]
        return ImagePlan(width=w, height=h, cols=cols, rows=rows, grid=grid, patches=patches,
                         tokens=patches // (self.merge * self.merge))
