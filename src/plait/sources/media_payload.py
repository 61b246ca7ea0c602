"""The images and videos of a gather's payload: found in the decoded blocks, decoded on a worker pool.

A SourceLoader's `gather_payload` delivers each requested document's media decoded exactly once, in the
payload's item order, every media into its own slice of one pixel buffer: any worker may decode any
media and the bytes never depend on the number of workers. A document whose media fails to decode
(on_error: skip) is dropped whole: its tokens and media left out, its index in `Payload.dropped`.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from plait.audio_batch import AudioPayload
from plait.batch import ImagePayload, Payload
from plait.ragged import ragged_arange
from plait.media.registry import AUDIO, KINDS, kind_of
from plait.sources.base import DocBlock, Source
from plait.sources.video import VIDEO_KIND
from plait.sources.workers import WorkerPool

AUDIO_KIND = KINDS.index(AUDIO)  # an ImageWork task's kind for a clip (0 image, 1 video): features, not pixels


class ImageWork:
    """A gather's images and videos to decode: (item, source index, block, media index, source, payload
    grid, kind, sampled frame indices (a video's; () for an image)) per media, and the sources'
    placeholder ids, patch size and temporal patch."""

    def __init__(self):
        self.tasks: list[tuple[int, int, DocBlock, int, Source, np.ndarray, int, tuple[int, ...]]] = []
        self.token_id, self.patch = -1, 0  # -1: no placeholder (a token id never is): id 0 is a real token
        self.video_token_id, self.temporal_patch, self.audio_token_id = -1, 1, -1

    @classmethod
    def of_gather(cls, sources: dict[int, Source], block_of: Callable[[int, tuple], DocBlock], keys: list,
                  block_index: np.ndarray, position: np.ndarray) -> "ImageWork":
        """The media of the requested documents (only image sources' blocks are looked at; a document with
        images is never cut, so it is one span from offset 0). block_of(source, key): the decoded block."""
        work = cls()
        for b in np.unique(block_index):
            full = keys[int(b)]
            src = sources[full[0]]
            if src.images is not None:
                block = block_of(full[0], full[1:])
                sel = np.flatnonzero(block_index == b)
                work.add(full[0], src, block, sel, np.searchsorted(block.positions, position[sel]))
        return work

    def add(self, source: int, src: Source, block: DocBlock, items: np.ndarray, docs: np.ndarray) -> None:
        if src.images.policy is not None:
            self.token_id, self.patch = src.images.token_id, src.images.policy.patch
        if src.images.audio is not None:
            self.audio_token_id = src.images.audio.token_id
        if src.images.videos is not None:
            self.video_token_id = src.images.videos.token_id
            self.temporal_patch = src.images.videos.policy.temporal_patch
        for i, d in zip(items, docs):
            first, count = int(block.images.start[d]), int(block.images.count[d])
            for j in range(first, first + count):
                if kind_of(block.images.refs[j]) is AUDIO:
                    self.tasks.append((int(i), source, block, j, src, np.zeros(3, np.int64), AUDIO_KIND, ()))
                    continue
                grid, kind = src.images.payload_entry(block.images, j)
                frames = src.images.frame_indices(block.images, j)
                self.tasks.append((int(i), source, block, j, src, grid, kind, frames))


def decode_task(task: tuple, out: np.ndarray | list) -> tuple[float, bool]:
    """Decode one media of ImageWork into `out` (on a worker thread): an image's or video's pixels into
    its slice of the pixel buffer, a clip's features into the one-element list `out`. The seconds it
    took, and whether it decoded (False: skipped under on_error skip, its sample is dropped)."""
    t0 = time.perf_counter()
    _, _, block, j, src, *_ = task
    if task[6] == AUDIO_KIND:
        out[0] = src.image_pixels(block, j, None)
        return time.perf_counter() - t0, out[0] is not None
    ok = src.image_pixels(block, j, out) is not None
    return time.perf_counter() - t0, ok


def decode_payload(work: ImageWork, tokens: np.ndarray, length: np.ndarray,
                   pool: WorkerPool) -> tuple[Payload, list[tuple[float, bool]]]:
    """The payload of `tokens` (the items' spans, `length` tokens each) with `work`'s media decoded on
    `pool`, and per media (seconds, decoded). Items whose media did not decode leave the payload whole."""
    # Item order (the payload's), then each image's slice of one pixel buffer: every image is decoded
    # straight into its place, by any worker, so the bytes never depend on the number of workers.
    work.tasks.sort(key=lambda t: t[0])
    clip = np.asarray([t[6] == AUDIO_KIND for t in work.tasks], bool)
    clips = [[None] for _ in work.tasks]  # a clip's features land in its own list
    grids = np.asarray([t[5] for t in work.tasks], np.int64).reshape(-1, 3)
    rows = grids.prod(axis=1)
    pixels = np.empty((int(rows.sum()), work.patch * work.patch * 3), np.uint8)
    bounds = np.concatenate([[0], np.cumsum(rows)])
    done = pool.map(lambda k: decode_task(work.tasks[k], clips[k] if clip[k] else pixels[bounds[k]:bounds[k + 1]]),
                    range(len(work.tasks)))
    owner = np.asarray([t[0] for t in work.tasks], np.int64)
    kinds = np.asarray([t[6] for t in work.tasks], np.int64)
    frame_counts = np.asarray([len(t[7]) for t in work.tasks], np.int64)
    frames = np.fromiter((f for t in work.tasks for f in t[7]), np.int64, int(frame_counts.sum()))
    gone = None
    failed = np.asarray([not ok for _, ok in done])
    lost_labels = None
    kept = np.ones(len(work.tasks), dtype=bool)
    if failed.any():  # under skip: the whole sample of a media that did not decode leaves the payload
        gone = np.unique(owner[failed])
        keep_item = np.ones(len(length), dtype=bool)
        keep_item[gone] = False
        lost_labels = labels_of(tokens, np.asarray(length, dtype=np.int64), gone,
                                (int(work.token_id), int(work.video_token_id), int(work.audio_token_id)))
        tokens = tokens[np.repeat(keep_item, np.asarray(length, dtype=np.int64))]
        kept = keep_item[owner]
    audio = None
    if (kept & clip).any():  # items numbered in the request, as images are (the Constructor renumbers)
        take = np.flatnonzero(kept & clip)
        audio = AudioPayload.of_clips([clips[k][0] for k in take], owner[take], work.audio_token_id)
    images, videos = (_pictures(work, kept & ~clip & (kinds == k), pixels, rows, frames, frame_counts)
                      for k in (0, VIDEO_KIND))
    return Payload(tokens, images, gone, lost_labels, audio, videos), done


def rows_of(pixels: np.ndarray, sel: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The patch rows of the tasks `sel`: a view where they are one run (images alone, or videos alone: the
    decoders wrote them into the buffer the trainer gets), a copy only where images and videos interleave."""
    picked = np.flatnonzero(sel)
    if picked[-1] - picked[0] + 1 == len(picked):
        ends = np.cumsum(rows)
        return pixels[int(ends[picked[0]] - rows[picked[0]]) : int(ends[picked[-1]])]
    return pixels[np.repeat(sel, rows)]


def _pictures(work: ImageWork, sel: np.ndarray, pixels: np.ndarray, rows: np.ndarray, frames: np.ndarray,
              frame_counts: np.ndarray) -> ImagePayload | None:
    """The images (or the videos: `kind` and sampled frames kept) of the tasks `sel`, None for none."""
    if not sel.any():
        return None
    grids = np.asarray([t[5] for t in work.tasks], np.int64).reshape(-1, 3)[sel]
    owner = np.asarray([t[0] for t in work.tasks], np.int64)[sel]
    video = work.tasks[int(np.flatnonzero(sel)[0])][6] == VIDEO_KIND
    return ImagePayload(rows_of(pixels, sel, rows), grids, owner, int(work.token_id), int(work.patch),
                        np.full(len(owner), VIDEO_KIND, np.int64) if video else None, work.video_token_id,
                        work.temporal_patch, frames[np.repeat(sel, frame_counts)] if video else None)


def labels_of(tokens: np.ndarray, length: np.ndarray, items: np.ndarray, placeholders: tuple[int, int]) -> np.ndarray:
    """Per item of `items` (documents with media, never cut), the labels the Constructor would have kept:
    every token after the first predicts one, less those predicting a placeholder. What a dropped sample
    takes out of the step's `global_label_tokens` (a micro-batch's `stats["dropped_label_tokens"]`)."""
    starts = np.cumsum(length) - length
    predicting = (length[items] - 1).clip(min=0)
    kept = ~np.isin(tokens[ragged_arange(starts[items] + 1, predicting)], placeholders)
    owner = np.repeat(np.arange(len(items)), predicting)
    return np.bincount(owner, weights=kept, minlength=len(items)).astype(np.int64)
