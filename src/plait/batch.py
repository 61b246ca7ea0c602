"""The public micro-batch type: what every rank receives (`plait.Batch`).

Fields are numpy arrays (views into one packed build where possible); `to_torch()` turns them into
tensors. The padding-free layout: documents are concatenated, `cu_seqlens` marks where each starts,
`position_ids` restart at 0 in each document, and `labels` never cross a document boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from plait.ragged import ragged_arange

# Qwen2-VL's processor defaults (OpenAI CLIP's mean / std on the 0..1 scale, a temporal patch of 2 frames)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
LAYOUTS = ("plait", "qwen2vl", "megatron_thd")


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


class Payload(NamedTuple):
    """What `PayloadSource.fetch(items)` returns for image sources: tokens (int32, the items' spans
    concatenated in request order, placeholder runs included; dropped items' spans left out), their
    images (None: none; `item` numbers the request's items), the request indices of the items dropped
    because an image failed to decode after planning (on_error: skip; None: none) and, per dropped item,
    the labels it would have had that are not -100 (the step's `global_label_tokens` counted them)."""

    tokens: np.ndarray
    images: ImagePayload | None
    dropped: np.ndarray | None = None
    dropped_labels: np.ndarray | None = None


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
    return Payload(out, images, *((dropped, lost_labels[dropped]) if len(dropped) else (None, None)))


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
    return ImagePayload(pixels[rows], grid[order], item[order], first.token_id, first.patch, kind,
                        first.video_token_id, first.temporal_patch)


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
        """The images in Hugging Face Qwen2-VL / Qwen2.5-VL's processor layout, as numpy (no torch needed):
        `pixel_values` float32 [patches, 3 * temporal_patch * patch * patch] (each image's merge x merge
        windows contiguous, each patch flattened as (C, T, patch, patch) with the image repeated over T,
        values rescaled and normalised exactly as the processor does them) and `image_grid_thw` int64
        [images, 3]. Bit-identical to `Qwen2VLImageProcessor` given the same resize settings; needs the
        `dynamic` image policy (one frame per image). Empty arrays when the micro-batch holds no image."""
        grid = np.zeros((0, 3), np.int64) if self.image_grid is None else self.image_grid
        patch, order = qwen2vl_order(self.pixel_values, grid, merge)
        width = 3 * temporal_patch * patch * patch
        if not len(order):
            return {"pixel_values": np.zeros((0, width), np.float32), "image_grid_thw": grid.astype(np.int64)}
        lut = normalize_table(mean, std)
        x = self.pixel_values[order].reshape(len(order), patch, patch, 3)
        y = lut[np.arange(3), x].transpose(0, 3, 1, 2)  # [P, C, p, p] float32
        y = np.broadcast_to(y[:, :, None], (len(order), 3, temporal_patch, patch, patch))
        return {"pixel_values": y.reshape(len(order), width), "image_grid_thw": grid.astype(np.int64)}

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
        `layout="qwen2vl"`: `pixel_values` in Qwen2-VL's processor layout instead (see `qwen2vl()`; float32,
        normalised on `device` with `normalize`, default the processor's CLIP mean / std) and
        `image_grid_thw` (= `image_grid`), what a Hugging Face Qwen2-VL / Qwen2.5-VL model takes.
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
        if self.pixel_values is not None and layout == "qwen2vl":
            patch, order = qwen2vl_order(self.pixel_values, self.image_grid, 2)
            out["pixel_values"] = _qwen2vl_pixels(t(self.pixel_values[order], torch.uint8), patch,
                                                  normalize or (CLIP_MEAN, CLIP_STD))
            out["image_grid_thw"] = t(self.image_grid, torch.long)
        elif self.pixel_values is not None:
            out["pixel_values"] = _pixels(t(self.pixel_values, torch.uint8), normalize)
        if self.pixel_values is not None:
            out["image_grid"] = t(self.image_grid, torch.long)
            out["image_cu_seqlens"] = t(self.image_cu_seqlens, torch.int32)
            out["image_document"] = t(self.image_document, torch.long)
        if self.pixel_values_videos is not None:
            out["pixel_values_videos"] = t(self.pixel_values_videos, torch.uint8)
            for name in ("video_grid", "video_document"):
                out[name] = t(getattr(self, name), torch.long)
            out["video_cu_seqlens"] = t(self.video_cu_seqlens, torch.int32)
        if self.mtp_labels is not None:
            out["mtp_labels"] = t(self.mtp_labels, torch.long)
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


def normalize_table(mean, std) -> np.ndarray:
    """float32 [3, 256]: what each uint8 value of each channel becomes, computed as Hugging Face's image
    processors do it (x as float64 times 1/255, cast to float32, then (x - mean) / std in float32), so a
    lookup gives their values bit for bit."""
    mean32 = np.broadcast_to(np.asarray(mean, np.float32), (3,))
    std32 = np.broadcast_to(np.asarray(std, np.float32), (3,))
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return ((scaled[None, :] - mean32[:, None]) / std32[:, None]).astype(np.float32)


def merge_window_order(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Permutation from raster patch order to merge-window order (Qwen2-VL's): `patches[order]` puts each
    merge x merge window's patches next to each other, windows in raster order."""
    idx = np.arange(grid_h * grid_w, dtype=np.int64).reshape(grid_h // merge, merge, grid_w // merge, merge)
    return idx.transpose(0, 2, 1, 3).reshape(-1)


def qwen2vl_order(pixels: np.ndarray | None, grid: np.ndarray, merge: int) -> tuple[int, np.ndarray]:
    """The patch side and the row order that takes plait's raster patches (image after image) to
    Qwen2-VL's merge-window order. ValueError for tiles (t > 1) or a grid not made of whole windows."""
    if pixels is None or not len(grid):
        return 0 if pixels is None else int(round((pixels.shape[1] // 3) ** 0.5)), np.zeros(0, np.int64)
    patch = int(round((pixels.shape[1] // 3) ** 0.5))
    if (grid[:, 0] != 1).any():
        raise ValueError("the qwen2vl layout needs one frame per image (images.policy: dynamic), not tiles")
    if (grid[:, 1:] % merge).any():
        raise ValueError(f"an image grid {grid[(grid[:, 1:] % merge).any(axis=1)][0].tolist()} is not made of "
                         f"whole {merge}x{merge} merge windows")
    sizes = grid.prod(axis=1)
    starts = np.cumsum(sizes) - sizes
    # one small permutation per image (a few per micro-batch), then a single gather of all patch rows
    order = np.concatenate([s + merge_window_order(int(h), int(w), merge) for s, (_, h, w) in zip(starts, grid)])
    return patch, order


def _qwen2vl_pixels(x, patch: int, normalize, temporal_patch: int = 2):
    """uint8 patches [P, patch*patch*3] in merge-window order -> Qwen2-VL's float32 [P, 3*T*patch*patch]."""
    import torch

    lut = torch.from_numpy(normalize_table(*normalize)).to(x.device)
    n = len(x)
    y = lut[torch.arange(3, device=x.device), x.view(n, patch, patch, 3).long()].permute(0, 3, 1, 2)
    return y.unsqueeze(2).expand(n, 3, temporal_patch, patch, patch).reshape(n, 3 * temporal_patch * patch * patch)


class TorchBatch(dict):
    """A dict of tensors (what a training step unpacks) with the batch's scalars as attributes."""

    max_seqlen: int = 0


Batch = MicroBatch
