"""Constructor: turns one DP rank's share of a step plan into packed micro-batches.

It pulls each micro-batch's payload from the SourceLoaders in one gather per block, then computes the
padding-free fields (packing.py). TP/PP ranks of a replica share the result; CP ranks take a shard.

The payload contract (`PayloadSource.fetch(items)`): the items' tokens concatenated in request order,
as an int32 array (text), or a `Payload(tokens, images)` where `images` (an ImagePayload or None) holds
the uint8 patches of the items' images concatenated in item order, each image's grid and the index of
its item, and the items dropped (an image that failed to decode after planning, under on_error: skip:
the whole sample leaves its micro-batch, which gets shorter; `stats["dropped_samples"]` counts them and
`stats["dropped_label_tokens"]` their labels, which the step's `global_label_tokens` still counts: every
micro-batch carries both, 0 when nothing was dropped, so a trainer's loss normaliser is one all-reduce).
The Constructor then adds `pixel_values`, `image_grid`, `image_cu_seqlens` and `image_document` to
each micro-batch and sets the labels that would predict a placeholder (inside documents with images)
to -100.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import numpy as np

from plait.audio_batch import AudioPayload, audio_fields, audio_stats
from plait.batch import ImagePayload, MicroBatch, Payload, image_fields, merge_payloads
from plait.packing import IGNORE_INDEX, multi_token_labels, pack_fields
from plait.video_batch import split_videos, video_fields, video_stats
from plait.plan import Items, RankPlan


class PayloadSource(Protocol):
    """Where a Constructor gets payloads: `fetch(items)` returns their tokens, concatenated, or a
    Payload (tokens and images; see the module docstring)."""

    def fetch(self, items: Items) -> np.ndarray | Payload: ...


class LoaderPayloads:
    """Payloads gathered from SourceLoader objects in this process (one loader per source or shared).

    `lock` (optional): held while a gather touches a loader's block cache, which several build threads
    share; the media found there are decoded after it is released (SourceLoader.decode_gathered), so the
    builds of different ranks decode at once and planning is not held up by a decode."""

    def __init__(self, loader_for: Callable[[int], object], lock=None):
        self._loader_for = loader_for
        self.lock = lock if lock is not None else contextlib.nullcontext()

    def fetch(self, items: Items) -> np.ndarray | Payload:
        """Tokens (text), or a Payload with the images when an item holds images."""
        if not len(items):
            return np.zeros(0, dtype=np.int32)
        keys, block_index = items.block_keys()
        # Group by owning loader; locally that is a single call. The loaders are held while grouping: an
        # id names an object only while it lives (a router made per call would hand its id to the next).
        by_loader: dict[int, tuple[object, list[int]]] = {}
        for b, key in enumerate(keys):
            loader = self._loader_for(key[0])
            by_loader.setdefault(id(loader), (loader, []))[1].append(b)
        images = items.has_images
        if len(by_loader) == 1:
            return self._part(next(iter(by_loader.values()))[0], items, keys, block_index, None, images)
        parts = []
        for loader, blocks in by_loader.values():
            sel = np.flatnonzero(np.isin(block_index, blocks))
            parts.append((sel, self._part(loader, items, keys, block_index, sel, images)))
        return merge_payloads(items.length, parts)

    def _part(self, loader, items: Items, keys, block_index, sel, images: bool):
        """One loader's part of a fetch (`sel`: the items it owns; None: all of them)."""
        cols = [items.source, block_index, items.position, items.offset, items.length]
        source, index, position, offset, length = cols if sel is None else [c[sel] for c in cols]
        with self.lock:
            if not images:
                return loader.gather(source, keys, index, position, offset, length)
            gathered = loader.gather_media(source, keys, index, position, offset, length)
        return loader.decode_gathered(gathered)


class Constructor:
    def __init__(self, payloads: PayloadSource):
        self.payloads = payloads

    def build(self, plan: RankPlan, only: set[int] | None = None) -> list[MicroBatch]:
        micros = [m for m in range(plan.microbatches) if only is None or m in only]
        if not micros:
            return []
        # One fetch for all wanted micro-batches of the rank, ordered by micro-batch, then split.
        sel = np.flatnonzero(np.isin(plan.micro, micros)) if only is not None else np.arange(len(plan.micro))
        sel = sel[np.argsort(plan.micro[sel], kind="stable")]
        items = plan.items.take(sel)
        tokens = self.payloads.fetch(items)
        images = audio = videos = None
        stats = plan.stats
        short = np.zeros(plan.microbatches, dtype=np.int64)  # samples dropped per micro-batch
        lost = np.zeros(plan.microbatches, dtype=np.int64)  # their labels (global_label_tokens counted them)
        if isinstance(tokens, Payload):
            tokens, images, dropped, dropped_labels, audio, videos = tokens
            if dropped is not None:  # a media failed after planning (skip): its sample is not delivered
                short = np.bincount(plan.micro[sel[dropped]], minlength=plan.microbatches)
                lost = np.bincount(plan.micro[sel[dropped]], weights=dropped_labels,
                                   minlength=plan.microbatches).astype(np.int64)
                items, sel, images, audio, videos = without_dropped(items, sel, images, dropped, audio, videos)
        # Positions and labels for the whole rank in one pass; every micro-batch boundary is also a
        # document boundary, so each micro-batch is a slice.
        fields = pack_fields(tokens, items.length)
        cu_all, positions, labels = fields["cu_seqlens"], fields["position_ids"], fields["labels"]
        # a label predicting a placeholder is not trained on; only inside documents with images or videos
        # (where the id means nothing else: multimodal.ImageDocs), so that the Planner's
        # global_label_tokens is exact
        if videos is None:  # a payload whose images still hold its videos (plait.video_batch)
            images, videos = split_videos(images)
        pictures = images if images is not None else videos
        media_ids = (() if pictures is None else (pictures.token_id, pictures.video_token_id)) + \
            (() if audio is None else (audio.token_id,))
        in_images = np.repeat(items.media, items.length) if media_ids else None
        placeholders = media_ids
        if media_ids:
            labels[in_images & np.isin(labels, placeholders)] = IGNORE_INDEX
        if pictures is not None:
            # the qwen2vl layout finds each medium's placeholder run by these (plait.qwen2vl_layout)
            stats = {**stats, "image_token_id": int(pictures.token_id), "video_token_id": int(pictures.video_token_id)}
        counts = np.bincount(plan.micro[sel], minlength=plan.microbatches)
        item_bounds = np.concatenate([[0], np.cumsum(counts)])
        sample_ids = items.sample_ids()
        source_ids = items.source.astype(np.int32)
        out = []
        for m in micros:
            a, b = item_bounds[m], item_bounds[m + 1]
            t0, t1 = cu_all[a], cu_all[b]
            out.append(
                MicroBatch(
                    step=plan.step, microbatch=m, num_microbatches=plan.microbatches, dp_rank=plan.dp_rank,
                    input_ids=tokens[t0:t1], labels=labels[t0:t1], position_ids=positions[t0:t1],
                    cu_seqlens=cu_all[a : b + 1] - t0, sample_ids=sample_ids[a:b], source_ids=source_ids[a:b],
                    stats={**stats, "dropped_samples": int(short[m]), "dropped_label_tokens": int(lost[m]),
                           **video_stats(videos, a, b), **audio_stats(audio, a, b)},
                    **image_fields(images, a, b), **video_fields(videos, a, b), **audio_fields(audio, a, b),
                )
            )
        horizon = int(stats.get("label_horizon", 1))
        if horizon > 1:  # multi-token prediction: labels k ahead, never across a document or chunk
            for mb in out:
                mb.mtp_labels = multi_token_labels(mb.input_ids, mb.cu_seqlens, horizon)
                if media_ids:
                    t0 = cu_all[item_bounds[mb.microbatch]]
                    mine = in_images[t0:t0 + len(mb.input_ids)]
                    mb.mtp_labels[mine[None, :] & np.isin(mb.mtp_labels, placeholders)] = IGNORE_INDEX
        return out


def without_dropped(items: Items, sel: np.ndarray, images: ImagePayload | None, dropped: np.ndarray,
                    audio: AudioPayload | None = None, videos: ImagePayload | None = None):
    """The request's items, their indices into the rank plan, their images and clips, less the dropped
    items (each micro-batch keeps its other samples, in order; media item numbers follow the kept items)."""
    keep = np.ones(len(items), dtype=bool)
    keep[dropped] = False
    kept = np.flatnonzero(keep)
    renumber = np.cumsum(keep) - 1
    if images is not None:
        images = images._replace(item=renumber[images.item])
    if audio is not None:
        audio = audio._replace(item=renumber[audio.item])
    if videos is not None:
        videos = videos._replace(item=renumber[videos.item])
    return items.take(kept), sel[kept], images, audio, videos
