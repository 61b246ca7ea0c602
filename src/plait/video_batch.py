"""The video fields of a micro-batch: a payload's videos apart from its images, and their layout.

A SourceLoader's payload holds a fetch's videos in a payload of their own (plait.batch.Payload.videos, an
ImagePayload with `kind`): rows of patch*patch*3 uint8, a video's grid counted in frames (frames, h, w); a
payload made before that, with videos among its images, is separated once per rank fetch (`split_videos`).
The Constructor cuts each micro-batch's share (`video_fields`): a video's rows become its spatio-temporal patches, [t*h*w, tp*patch*patch*3] with
t = frames / tp (each row a (tp, patch, patch, 3) uint8 block, raster order per temporal patch), its grid
(t, h, w), and `video_cu_seqlens` one encoder sequence of h*w patches per temporal patch. The Hugging Face
layout (merge-window order, (C, tp, patch, patch) rows, the video processor's normalisation) is made from
these by plait.qwen2vl_layout.
"""

from __future__ import annotations

import numpy as np

from plait.batch import ImagePayload, frame_counts
from plait.ragged import ragged_arange


def _subset(p: ImagePayload, keep: np.ndarray, kind) -> ImagePayload:
    sizes = p.grid.prod(axis=1)
    starts = np.cumsum(sizes) - sizes
    rows = ragged_arange(starts[keep], sizes[keep])
    frames = None
    if kind is not None and p.frames is not None:
        counts = frame_counts(p)
        frames = p.frames[ragged_arange((np.cumsum(counts) - counts)[keep], counts[keep])]
    return p._replace(pixels=p.pixels[rows], grid=p.grid[keep], item=p.item[keep], kind=kind, frames=frames)


def split_videos(p: ImagePayload | None) -> tuple[ImagePayload | None, ImagePayload | None]:
    """(the images, the videos) of a payload; either None when it holds none (images stay None-kind)."""
    if p is None or p.kind is None or not p.kind.any():
        return p, None
    video = p.kind != 0
    images = _subset(p, np.flatnonzero(~video), None) if (~video).any() else None
    return images, _subset(p, np.flatnonzero(video), p.kind[video])


def video_fields(videos: ImagePayload | None, a: int, b: int) -> dict:
    """The video fields of the micro-batch holding items a..b-1: none when the rank fetched no video,
    empty arrays when this micro-batch holds none of them."""
    if videos is None:
        return {}
    tp = videos.temporal_patch
    lo, hi = np.searchsorted(videos.item, [a, b])
    row = np.concatenate([[0], np.cumsum(videos.grid.prod(axis=1))])
    grid = videos.grid[lo:hi].copy()
    grid[:, 0] //= tp
    pixels = videos.pixels[row[lo]:row[hi]]
    seqs = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(seqs, out=cu[1:])
    return {"pixel_values_videos": pixels.reshape(len(pixels) // tp, tp * pixels.shape[1]), "video_grid": grid,
            "video_cu_seqlens": cu, "video_document": videos.item[lo:hi] - a}


def video_stats(videos: ImagePayload | None, a: int, b: int) -> dict:
    """The micro-batch's `stats["video_frames"]` (items a..b-1): per video, in `video_grid`'s order, the
    source frame indices the rule sampled (what a trainer logs or checks against its own reader); none
    when the rank fetched no video."""
    if videos is None or videos.frames is None:
        return {}
    lo, hi = np.searchsorted(videos.item, [a, b])
    ends = np.cumsum(videos.grid[:, 0])
    starts = ends - videos.grid[:, 0]
    return {"video_frames": [videos.frames[starts[k]:ends[k]].tolist() for k in range(lo, hi)]}
