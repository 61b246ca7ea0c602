"""The public micro-batch type: what every rank receives (`plait.Batch`).

Fields are numpy arrays (views into one packed build where possible); `to_torch()` turns them into
tensors. The padding-free layout: documents are concatenated, `cu_seqlens` marks where each starts,
`position_ids` restart at 0 in each document, and `labels` never cross a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from plait.audio_batch import AudioPayload, merge_audio
from plait.qwen2vl_layout import CLIP_MEAN, CLIP_STD, merge_window_order, model_inputs, numpy_layout, torch_layout
from plait.ragged import ragged_arange

__all__ = ["CLIP_MEAN", "CLIP_STD", "LAYOUTS", "Batch", "ImagePayload", "MicroBatch", "Payload", "TorchBatch",
           "image_fields", "merge_images", "merge_payloads", "merge_window_order"]
LAYOUTS = ("plait", "qwen2vl", "megatron_thd", "qwen2audio")


class ImagePayload(NamedTuple):
    """The images of fetched items: uint8 patches of all images concatenated in item order, each image's
    grid (t, h, w in patches), the index of its item in the fetch request, the placeholder id (labels
    predicting it are masked) and the patch side."""

    pixels: np.ndarray  # uint8 [total_patches, patch*patch*3]
    grid: np.ndarray  # int64 [images, 3]
    item: np.ndarray  # int64 [images], increasing
    token_id: int
    patch: int
    # video sources (plait.video_batch): per entry 0 (image) or 1 (video: grid (frames, h, w), one
    # patch*patch*3 row per frame patch), the video placeholder id and frames per temporal patch
    kind: np.ndarray | None = None
    video_token_id: int = -1
    temporal_patch: int = 1
    # each video's sampled source frame indices (grid[0] of them), concatenated in entry order; images none
    frames: np.ndarray | None = None


class Payload(NamedTuple):
    """What `PayloadSource.fetch(items)` returns for media sources: tokens (int32, the items' spans
    concatenated in request order, placeholder runs included; dropped items' spans left out), their
    images (None: none; `item` numbers the request's items; their clips in `audio`, videos in `videos`), the request indices of the items dropped
    because an image failed to decode after planning (on_error: skip; None: none) and, per dropped item,
    the labels it would have had that are not -100 (the step's `global_label_tokens` counted them)."""

    tokens: np.ndarray
    images: ImagePayload | None
    dropped: np.ndarray | None = None
    dropped_labels: np.ndarray | None = None
    audio: AudioPayload | None = None  # the items' clips (plait.audio_batch); None: none
    videos: ImagePayload | None = None  # the items' videos (kind VIDEO_KIND, plait.video_batch); None: none


def merge_payloads(lengths: np.ndarray, parts: list[tuple[np.ndarray, np.ndarray | Payload]]) -> np.ndarray | Payload:
    """One payload for a request of items with these `lengths`, from the parts fetched for its items
    `sel` (each part's items numbered in its own order; a part is tokens, or a Payload)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = np.ones(len(lengths), dtype=bool)
    lost_labels = np.zeros(len(lengths), dtype=np.int64)
    for sel, part in parts:
        if isinstance(part, Payload) and part.dropped is not None:
            keep[np.asarray(sel)[part.dropped]] = False
            if part.dropped_labels is not None:
                lost_labels[np.asarray(sel)[part.dropped]] = part.dropped_labels
    kept = np.where(keep, lengths, 0)
    starts = np.cumsum(kept) - kept
    out = np.empty(int(kept.sum()), dtype=np.int32)
    for sel, part in parts:
        mine = np.asarray(sel)[keep[sel]]
        out[ragged_arange(starts[mine], lengths[mine])] = part.tokens if isinstance(part, Payload) else part
    if not any(isinstance(part, Payload) for _, part in parts):
        return out
    dropped = np.flatnonzero(~keep)
    images = merge_images([(sel, part.images) for sel, part in parts if isinstance(part, Payload)])
    audio = merge_audio([(sel, part.audio) for sel, part in parts if isinstance(part, Payload)])
    videos = merge_images([(sel, part.videos) for sel, part in parts if isinstance(part, Payload)])
    return Payload(out, images, *((dropped, lost_labels[dropped]) if len(dropped) else (None, None)), audio, videos)


def merge_images(parts: list[tuple[np.ndarray, ImagePayload | None]]) -> ImagePayload | None:
    """One ImagePayload of parts fetched for the request's items `sel` (each part's items numbered in
    its own order), ordered by item (stable: an item's images keep their order)."""
    parts = [(sel, p) for sel, p in parts if p is not None and len(p.item)]
    if not parts:
        return None
    item = np.concatenate([np.asarray(sel)[p.item] for sel, p in parts])
    grid = np.concatenate([p.grid for _, p in parts])
    pixels = np.concatenate([p.pixels for _, p in parts])
    order = np.argsort(item, kind="stable")
    sizes = grid.prod(axis=1)
    starts = np.cumsum(sizes) - sizes
    rows = ragged_arange(starts[order], sizes[order])  # each image's patch rows, in item order
    first = next((p for _, p in parts if p.kind is not None), parts[0][1])
    kind = None if first.kind is None else np.concatenate(
        [p.kind if p.kind is not None else np.zeros(len(p.item), np.int64) for _, p in parts])[order]
    frames = None
    if any(p.frames is not None for _, p in parts):
        counts = np.concatenate([frame_counts(p) for _, p in parts])
        flat = np.concatenate([p.frames for _, p in parts if p.frames is not None])
        frames = flat[ragged_arange((np.cumsum(counts) - counts)[order], counts[order])]
    return ImagePayload(pixels[rows], grid[order], item[order], first.token_id, first.patch, kind,
                        first.video_token_id, first.temporal_patch, frames)


def image_fields(images: ImagePayload | None, a: int, b: int) -> dict:
    """The image fields of the micro-batch holding items a..b-1 (of the rank's fetch): none when the
    rank fetched no image; empty arrays when this micro-batch holds none of them."""
    if images is None:
        return {}
    lo, hi = np.searchsorted(images.item, [a, b])
    row = np.concatenate([[0], np.cumsum(images.grid.prod(axis=1))])
    grid = images.grid[lo:hi]
    frames = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])  # encoder sequences: one per image or tile
    cu = np.zeros(len(frames) + 1, dtype=np.int32)
    np.cumsum(frames, out=cu[1:])
    return {"pixel_values": images.pixels[row[lo]:row[hi]], "image_grid": grid, "image_cu_seqlens": cu,
            "image_document": images.item[lo:hi] - a}


def frame_counts(p: ImagePayload) -> np.ndarray:
    """Per entry of `p`, how many of `p.frames` are its own: a video's frames, none for an image."""
    if p.frames is None or p.kind is None:
        return np.zeros(len(p.item), np.int64)
    return np.where(p.kind != 0, p.grid[:, 0], 0).astype(np.int64)


@dataclass
class MicroBatch:
    """One micro-batch of one DP rank (`plait.Batch`): packed documents, no padding.

    `input_ids`, `labels` (next token; −100 at each document's last token and over image placeholders),
    `position_ids` (restart per document) and `cu_seqlens` (FlashAttention varlen layout) describe the
    packed sequence; `sample_ids` ([docs, 5]: source, epoch, shard, row, chunk) and `source_ids` name
    every document. Image sources add `pixel_values`, `image_grid`, `image_cu_seqlens`, `image_document`
    (None otherwise). `stats` holds the whole step's figures (tokens, `global_label_tokens` for loss
    normalisation, balance certificate, fill / padding, vocab_size). `to_torch()` gives tensors.
    """

    step: int
    microbatch: int
    num_microbatches: int
    dp_rank: int
    input_ids: np.ndarray  # int32 [T]
    labels: np.ndarray  # int32 [T], IGNORE_INDEX at each document's last token
    position_ids: np.ndarray  # int32 [T]
    cu_seqlens: np.ndarray  # int32 [docs+1]
    sample_ids: np.ndarray  # int64 [docs, 5]: source, epoch, shard, row, chunk
    source_ids: np.ndarray  # int32 [docs]
    stats: dict = field(default_factory=dict)
    # Images (None in a micro-batch without images): uint8 patches of every image, concatenated in
    # document order; per image its grid (t, h, w in patches) and its document's index in this
    # micro-batch; image_cu_seqlens (int32) bounds the encoder's attention sequences: one per image
    # (dynamic policy), one per tile (tiles policy: t per image).
    pixel_values: np.ndarray | None = None  # uint8 [total_patches, patch*patch*3]
    image_grid: np.ndarray | None = None  # int64 [images, 3]
    image_cu_seqlens: np.ndarray | None = None  # int32 [sequences + 1]
    image_document: np.ndarray | None = None  # int64 [images]
    mtp_labels: np.ndarray | None = None  # int32 [k, tokens] with packing.label_horizon k > 1 (row 0 = labels)
    # Videos (None without video sources; plait.video_batch): uint8 patches [t*h*w, tp*patch*patch*3]
    # ((tp, patch, patch, 3) each), per video its grid (t, h, w) and document; video_cu_seqlens: one
    # encoder sequence per temporal patch (h*w patches), as Qwen2-VL's vision tower attends.
    pixel_values_videos: np.ndarray | None = None
    video_grid: np.ndarray | None = None  # int64 [videos, 3]
    video_cu_seqlens: np.ndarray | None = None  # int32 [sequences + 1]
    video_document: np.ndarray | None = None  # int64 [videos]
    # Audio (None without audio sources; plait.audio_batch): every window of every clip, in document
    # order, as the Hugging Face Qwen2-Audio processor gives them; per clip its windows and document.
    input_features: np.ndarray | None = None  # float32 [windows, mel_bins, 3000]
    feature_attention_mask: np.ndarray | None = None  # int32 [windows, 3000]
    audio_windows: np.ndarray | None = None  # int64 [clips]
    audio_document: np.ndarray | None = None  # int64 [clips]

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid is None else int(len(self.image_grid))

    @property
    def num_patches(self) -> int:
        return 0 if self.pixel_values is None else int(len(self.pixel_values))

    @property
    def num_tokens(self) -> int:
        return int(len(self.input_ids))

    def qwen2vl(self, mean=CLIP_MEAN, std=CLIP_STD, *, merge: int = 2, temporal_patch: int = 2) -> dict:
        """The micro-batch in Hugging Face Qwen2-VL / Qwen2.5-VL's layout, as numpy (no torch needed):
        `input_ids`, `labels` (plait's: already shifted, -100 where not trained) and `mm_token_type_ids`
        [1, T]; `position_ids` int64 [4, 1, T] (plait's per-document positions, then each document's
        M-RoPE index: the model's packed form); `pixel_values` float32 [patches, 3 * temporal_patch *
        patch * patch] and `image_grid_thw` (empty without images) as `Qwen2VLImageProcessor` gives them,
        bit for bit under the same resize settings (needs the `dynamic` image policy); with videos
        `pixel_values_videos` and `video_grid_thw` as `Qwen2VLVideoProcessor` gives them for the same
        frames. Layout and rules: plait.qwen2vl_layout."""
        return numpy_layout(self, (mean, std), merge, temporal_patch)

    def to_torch(self, device=None, *, pin_memory: bool = False, non_blocking: bool = False,
                 normalize: tuple | None = None, layout: str = "plait") -> "TorchBatch":
        """The batch as torch tensors: ids, labels and positions int64, the rest int32 (needs plait[torch]).

        Returns a dict of tensors only; `max_seqlen` (for varlen attention kernels) is an attribute.
        `layout="megatron_thd"` adds Megatron-Core's PackedSeqParams fields, as one dict, under
        "packed_seq_params" (plait.megatron_layout; the group's view of a dynamic-CP shard).
        `pin_memory=True` pins the host tensors so that `non_blocking=True` copies to a CUDA `device`
        overlap with compute. With images: `pixel_values` (uint8, or with `normalize=(mean, std)` (each a
        number or 3 per-channel values, on the 0..1 scale) float32 (x/255 - mean) / std, normalised on
        `device`), `image_grid`, `image_cu_seqlens`, `image_document`.
        `layout="qwen2vl"`: the fields a Hugging Face Qwen2-VL / Qwen2.5-VL model takes, in its layout
        (see `qwen2vl()`): `input_ids`, `labels`, `mm_token_type_ids` [1, T], `position_ids` [4, 1, T]
        (per-document M-RoPE), `pixel_values` / `image_grid_thw` and `pixel_values_videos` /
        `video_grid_thw` (float32, normalised on `device` with `normalize`, default CLIP's mean / std);
        `model_inputs()` picks what the forward takes. plait's other fields stay as they are.
        With audio: `input_features` (float32 [windows, mel_bins, 3000]) and `feature_attention_mask`
        (int32 [windows, 3000]) as Qwen2-Audio's processor returns them, plus `audio_windows` and
        `audio_document` per clip; `layout="qwen2audio"` gives the processor's two fields only.
        """
        import torch

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")

        def t(a, dtype):
            if not a.flags.writeable:  # batches from Ray's object store are read-only views
                a = a.copy()
            x = torch.from_numpy(a).to(dtype=dtype)
            if pin_memory and torch.cuda.is_available():
                x = x.pin_memory()
            return x.to(device, non_blocking=non_blocking) if device is not None else x

        out = TorchBatch(
            input_ids=t(self.input_ids, torch.long),
            labels=t(self.labels, torch.long),
            position_ids=t(self.position_ids, torch.long),
            cu_seqlens=t(self.cu_seqlens, torch.int32),
            sample_ids=t(self.sample_ids, torch.long),
            source_ids=t(self.source_ids, torch.int32),
        )
        if self.pixel_values is not None:
            if layout == "plait":  # qwen2vl: its own pixels below
                out["pixel_values"] = _pixels(t(self.pixel_values, torch.uint8), normalize)
            out["image_grid"] = t(self.image_grid, torch.long)
            out["image_cu_seqlens"] = t(self.image_cu_seqlens, torch.int32)
            out["image_document"] = t(self.image_document, torch.long)
        if self.pixel_values_videos is not None:
            if layout == "plait":
                out["pixel_values_videos"] = t(self.pixel_values_videos, torch.uint8)
            for name in ("video_grid", "video_document"):
                out[name] = t(getattr(self, name), torch.long)
            out["video_cu_seqlens"] = t(self.video_cu_seqlens, torch.int32)
        if self.input_features is not None:  # the processor's dtypes: float32 features, int32 mask
            out["input_features"] = t(self.input_features, torch.float32)
            out["feature_attention_mask"] = t(self.feature_attention_mask, torch.int32)
            if layout != "qwen2audio":
                out["audio_windows"] = t(self.audio_windows, torch.long)
                out["audio_document"] = t(self.audio_document, torch.long)
        if self.mtp_labels is not None:
            out["mtp_labels"] = t(self.mtp_labels, torch.long)
        if layout == "qwen2vl":
            out.update(torch_layout(self, t, normalize or (CLIP_MEAN, CLIP_STD), 2, 2))
        if layout == "megatron_thd":
            from plait.megatron_layout import megatron_thd

            out["packed_seq_params"] = megatron_thd(self.stats, self.cu_seqlens, lambda a: t(a, torch.int32))
        out.max_seqlen = self.max_seqlen
        return out

    @property
    def max_token_id(self) -> int:
        """The largest id in `input_ids` (-1 when empty): must stay below the model's vocabulary."""
        return int(self.input_ids.max()) if len(self.input_ids) else -1

    @property
    def fill(self) -> float:
        """Tokens / seq_len of this micro-batch (`stats["fill"]` is the whole step's)."""
        capacity = self.stats.get("capacity", 0)
        return self.num_tokens / capacity if capacity else 0.0

    @property
    def padding_fraction(self) -> float:
        """Unfilled seq_len capacity of this micro-batch: what a padded loader would fill with padding."""
        return 1.0 - self.fill if self.stats.get("capacity") else 0.0

    def labels_mtp(self, horizon: int) -> np.ndarray:
        """Multi-token prediction labels, int32 `[horizon, tokens]`: row j is the token j+1 ahead, -100
        where that would cross a document or chunk boundary (row 0 equals `labels`)."""
        from plait.packing import multi_token_labels

        return multi_token_labels(self.input_ids, self.cu_seqlens, horizon)

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max()) if len(self.cu_seqlens) > 1 else 0


def _pixels(x, normalize):
    """uint8 patches [P, patch*patch*3] as they are, or float32 (x / 255 - mean) / std per channel
    (channels are the last axis of each flattened (patch, patch, 3) patch)."""
    if normalize is None:
        return x
    import torch

    mean, std = (torch.as_tensor(v, dtype=torch.float32, device=x.device) for v in normalize)
    # explicit widths: a micro-batch of text only has [0, width] patches, where -1 cannot be inferred
    width = int(x.shape[1])
    y = x.to(torch.float32).view(len(x), width // 3, 3) / 255.0
    return ((y - mean) / std).view(len(x), width)


class TorchBatch(dict):
    """A dict of tensors (what a training step unpacks) with the batch's scalars as attributes."""

    max_seqlen: int = 0

    def model_inputs(self) -> dict:
        """With `layout="qwen2vl"`: the keyword arguments of the Hugging Face model's forward (token fields,
        M-RoPE positions, the media it holds); labels are left out (plait's are already shifted)."""
        return model_inputs(self)


Batch = MicroBatch
