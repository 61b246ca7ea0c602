"""Hugging Face Qwen2-VL / Qwen2.5-VL's input layout of a packed micro-batch (`layout="qwen2vl"`).

Pixels. plait keeps uint8 patch rows in raster order, each row (frames, patch, patch, C). The model takes
its processors' layout: each merge x merge window's patches contiguous (per temporal patch for videos),
each row flattened as (C, temporal_patch, patch, patch) -- an image repeated over the temporal patch --
rescaled and normalised with the processor's own float32 arithmetic. A 256-entry table per channel gives
those values exactly: the image processor rescales then normalises, the video processor fuses both into
one (x - 255 mean) / (255 std), so the two tables differ in the last bit of some values.

Positions. The model's M-RoPE (its `get_rope_index`) numbers one sequence: a text token takes the next
position on all three axes; a medium whose placeholder run starts at position s takes (s + t, s + h,
s + w) for its merged patch (t, h, w), and the text after it continues at s + max(h, w) / merge (the rule
of transformers 5.x; Qwen2-VL's first release continued at s + max(t, h / merge, w / merge), which
differs only for a video with more temporal patches than merged rows and columns). Here the rule runs
per packed document, vectorised, each document starting at its own first position, and the model gets
plait's per-document `position_ids` as a fourth row in front (its packed form, [4, batch, tokens]): from
it the model finds the documents and keeps their attention apart (no attention mask, no cache).
"""

from __future__ import annotations

import numpy as np

from plait.ragged import ragged_arange

# Qwen2-VL's processor defaults (OpenAI CLIP's mean / std on the 0..1 scale, a temporal patch of 2 frames)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TEXT, IMAGE, VIDEO = 0, 1, 2  # the model's mm_token_type_ids


def normalize_table(mean, std) -> np.ndarray:
    """float32 [3, 256]: what each uint8 value of each channel becomes, computed as Hugging Face's image
    processors do it (x as float64 times 1/255, cast to float32, then (x - mean) / std in float32), so a
    lookup gives their values bit for bit."""
    mean32 = np.broadcast_to(np.asarray(mean, np.float32), (3,))
    std32 = np.broadcast_to(np.asarray(std, np.float32), (3,))
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return ((scaled[None, :] - mean32[:, None]) / std32[:, None]).astype(np.float32)


def video_normalize_table(mean, std) -> np.ndarray:
    """float32 [3, 256] as the video processor computes it (torchvision backend, rescale fused into the
    normalisation: mean and std scaled by 1 / (1/255) in float32, then (x - mean) / std in float32)."""
    scale = np.float32(1.0 / (1 / 255))
    mean32 = np.broadcast_to(np.asarray(mean, np.float32), (3,)) * scale
    std32 = np.broadcast_to(np.asarray(std, np.float32), (3,)) * scale
    values = np.arange(256, dtype=np.float32)
    return ((values[None, :] - mean32[:, None]) / std32[:, None]).astype(np.float32)


def merge_window_order(grid_h: int, grid_w: int, merge: int) -> np.ndarray:
    """Permutation from raster patch order to merge-window order (Qwen2-VL's): `patches[order]` puts each
    merge x merge window's patches next to each other, windows in raster order."""
    idx = np.arange(grid_h * grid_w, dtype=np.int64).reshape(grid_h // merge, merge, grid_w // merge, merge)
    return idx.transpose(0, 2, 1, 3).reshape(-1)


def _check_windows(grid: np.ndarray, merge: int, what: str) -> None:
    bad = (grid[:, 1:] % merge).any(axis=1)
    if bad.any():
        raise ValueError(f"{what} grid {grid[bad][0].tolist()} is not made of whole {merge}x{merge} merge windows")


def window_rows(grid: np.ndarray, merge: int) -> np.ndarray:
    """The row order that takes raster patch rows (medium after medium, each (t, h, w) rows in raster
    order per t) to merge-window order within each temporal patch."""
    if not len(grid):
        return np.zeros(0, np.int64)
    sizes = grid.prod(axis=1)
    starts = np.cumsum(sizes) - sizes
    # one small permutation per medium (a few per micro-batch), then a single gather of all patch rows
    return np.concatenate([s + (np.arange(t)[:, None] * h * w + merge_window_order(h, w, merge)[None]).reshape(-1)
                           for s, (t, h, w) in zip(starts.tolist(), grid.tolist())])


def qwen2vl_order(pixels: np.ndarray | None, grid: np.ndarray, merge: int) -> tuple[int, np.ndarray]:
    """The patch side and the row order that takes plait's raster image patches to Qwen2-VL's
    merge-window order. ValueError for tiles (t > 1) or a grid not made of whole windows."""
    patch = 0 if pixels is None else int(round((pixels.shape[1] // 3) ** 0.5))
    if pixels is None or not len(grid):
        return patch, np.zeros(0, np.int64)
    if (grid[:, 0] != 1).any():
        raise ValueError("the qwen2vl layout needs one frame per image (images.policy: dynamic), not tiles")
    _check_windows(grid, merge, "an image")
    return patch, window_rows(grid, merge)


def video_order(pixels: np.ndarray, grid: np.ndarray, merge: int, temporal_patch: int) -> tuple[int, np.ndarray]:
    """The patch side and the row order that takes plait's video rows [t*h*w, tp*patch*patch*3] (raster
    order per temporal patch) to Qwen2-VL's merge-window order per temporal patch."""
    side = (pixels.shape[1] // (3 * temporal_patch)) ** 0.5
    if pixels.shape[1] != 3 * temporal_patch * round(side) ** 2:
        raise ValueError(f"video rows of {pixels.shape[1]} values are not {temporal_patch} frame(s) of square "
                         f"RGB patches: the videos' temporal_patch is not the layout's {temporal_patch}")
    _check_windows(grid, merge, "a video")
    return int(round(side)), window_rows(grid, merge)


def processor_rows(x: np.ndarray, lut: np.ndarray, patch: int, temporal_patch: int) -> np.ndarray:
    """uint8 rows [n, frames*patch*patch*3] ((frames, patch, patch, C) each; frames 1 for an image, then
    repeated over the temporal patch) -> float32 [n, 3*temporal_patch*patch*patch] ((C, T, patch, patch))."""
    n = len(x)
    frames = x.shape[1] // (patch * patch * 3) if n else temporal_patch
    planes = x.reshape(n, frames, patch, patch, 3).transpose(4, 0, 1, 2, 3)  # a view: channel first
    out = np.empty((n, 3, temporal_patch, patch, patch), np.float32)
    for c in range(3):  # one table lookup per channel, straight into its plane of the output
        out[:, c, :frames] = np.take(lut[c], planes[c])
    out[:, :, frames:] = out[:, :, :1]  # an image is its one frame repeated over the temporal patch
    return out.reshape(n, 3 * temporal_patch * patch * patch)


def torch_processor_rows(x, lut: np.ndarray, patch: int, temporal_patch: int):
    """`processor_rows` in torch on x's device (x a uint8 tensor [n, frames*patch*patch*3])."""
    import torch

    n = len(x)
    frames = int(x.shape[1]) // (patch * patch * 3) if n else temporal_patch
    table = torch.from_numpy(np.ascontiguousarray(lut).reshape(-1)).to(x.device)
    index = x.view(n, frames, patch, patch, 3).permute(0, 4, 1, 2, 3).contiguous().long()  # [n, C, frames, p, p]
    index += torch.arange(0, 3 * 256, 256, device=x.device).view(1, 3, 1, 1, 1)  # channel c's table
    y = torch.take(table, index)
    return y.expand(n, 3, temporal_patch, patch, patch).reshape(n, 3 * temporal_patch * patch * patch)


def token_types(input_ids: np.ndarray, cu_seqlens: np.ndarray, media_documents: np.ndarray,
                image_token_id: int, video_token_id: int) -> np.ndarray:
    """int32 [T]: the model's mm_token_type_ids (0 text, 1 image, 2 video placeholder), placeholders
    counted only inside documents that hold media (elsewhere the id is text to plait)."""
    types = np.zeros(len(input_ids), np.int32)
    if not len(media_documents):
        return types
    docs = np.unique(media_documents)
    inside = ragged_arange(cu_seqlens[docs], cu_seqlens[docs + 1] - cu_seqlens[docs])
    ids = input_ids[inside]
    types[inside] = np.where(ids == image_token_id, IMAGE, np.where(ids == video_token_id, VIDEO, TEXT))
    return types


class Media:
    """The media of one kind in a micro-batch: per medium its LLM grid (t, h, w after merging), its
    document and its placeholder count."""

    def __init__(self, grid: np.ndarray | None, document: np.ndarray | None, merge: int):
        grid = np.zeros((0, 3), np.int64) if grid is None else np.asarray(grid, np.int64)
        self.llm_grid = grid // np.array([1, merge, merge])
        self.document = np.zeros(0, np.int64) if document is None else np.asarray(document, np.int64)
        self.tokens = self.llm_grid.prod(axis=1)


def mrope_positions(types: np.ndarray, cu_seqlens: np.ndarray, position_ids: np.ndarray, media: dict,
                    sample_ids: np.ndarray | None = None) -> np.ndarray:
    """int64 [3, T]: each packed document's M-RoPE index (module docstring), starting at the document's
    first plait position. `media`: {IMAGE: Media, VIDEO: Media}. ValueError when a document's placeholder
    runs do not match its media."""
    n = len(types)
    doc = np.repeat(np.arange(len(cu_seqlens) - 1), np.diff(cu_seqlens))
    advance = (types == TEXT).astype(np.int64)
    rows = np.zeros((3, n), np.int64)
    runs = []
    for kind, m in media.items():
        where = np.flatnonzero(types == kind)
        _check_runs(kind, m, where, doc, sample_ids)
        if not len(where):
            continue
        first = np.cumsum(m.tokens) - m.tokens  # each medium's first placeholder, in `where`
        medium = np.repeat(np.arange(len(m.tokens)), m.tokens)
        local = np.arange(len(where)) - first[medium]
        t, h, w = m.llm_grid[medium].T
        rows[:, where] = np.stack([local // (h * w), local // w % h, local % w])
        advance[where[first]] = m.llm_grid[:, 1:].max(axis=1)
        runs.append((where, where[first][medium]))
    ahead = np.cumsum(advance) - advance  # positions taken before each token in the micro-batch
    start = ahead - ahead[cu_seqlens[:-1]][doc] + position_ids[cu_seqlens[:-1]][doc]
    for where, run_first in runs:
        start[where] = start[run_first]
    return rows + start[None, :]


def _check_runs(kind: int, m: Media, where: np.ndarray, doc: np.ndarray, sample_ids) -> None:
    """Each medium's placeholders: one contiguous run, in its own document."""
    name = {IMAGE: "image", VIDEO: "video"}[kind]
    if len(where) != int(m.tokens.sum()):
        raise ValueError(f"the micro-batch holds {len(where)} {name} placeholder(s) for {len(m.tokens)} {name}(s) "
                         f"of {int(m.tokens.sum())} token(s): the spec's placeholder id is not the model's, or "
                         f"a document holds the id as text")
    if not len(where):
        return
    first = np.cumsum(m.tokens) - m.tokens
    last = first + m.tokens - 1
    bad = (where[last] - where[first] != m.tokens - 1) | (doc[where[first]] != m.document) | (doc[where[last]] != m.document)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        named = f" (sample {sample_ids[m.document[i]].tolist()})" if sample_ids is not None else ""
        raise ValueError(f"{name} {i} of the micro-batch does not match the placeholder run of its document "
                         f"{int(m.document[i])}{named}")


# ----- a micro-batch in the model's layout (plait.Batch.qwen2vl, to_torch(layout="qwen2vl")) ----------------
MODEL_INPUTS = ("input_ids", "position_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                "pixel_values_videos", "video_grid_thw")


def token_layout(mb, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(mm_token_type_ids int32 [T], position_ids int64 [4, T]: plait's per-document positions, then each
    document's M-RoPE index) of a micro-batch; the placeholder ids come from its stats (the Constructor's)."""
    images = Media(mb.image_grid, mb.image_document, merge)
    videos = Media(mb.video_grid, mb.video_document, merge)
    image_id, video_id = (int((mb.stats or {}).get(k, -1)) for k in ("image_token_id", "video_token_id"))
    for media, ident, name in ((images, image_id, "image"), (videos, video_id, "video")):
        if len(media.tokens) and ident < 0:
            raise ValueError(f"the qwen2vl layout needs the {name} placeholder id: stats['{name}_token_id'] "
                             f"(set by plait's Constructor) is missing from this micro-batch")
    cu = np.asarray(mb.cu_seqlens, np.int64)
    positions = np.asarray(mb.position_ids, np.int64)
    types = token_types(mb.input_ids, cu, np.concatenate([images.document, videos.document]), image_id, video_id)
    rope = mrope_positions(types, cu, positions, {IMAGE: images, VIDEO: videos}, mb.sample_ids)
    return types, np.concatenate([positions[None], rope])


def numpy_layout(mb, normalize: tuple, merge: int, temporal_patch: int) -> dict:
    """The whole micro-batch as numpy arrays in the model's layout (see `plait.Batch.qwen2vl`)."""
    types, positions = token_layout(mb, merge)
    out = {"input_ids": mb.input_ids[None].astype(np.int64), "labels": mb.labels[None].astype(np.int64),
           "position_ids": positions[:, None], "mm_token_type_ids": types[None]}
    grid = np.zeros((0, 3), np.int64) if mb.image_grid is None else mb.image_grid.astype(np.int64)
    patch, order = qwen2vl_order(mb.pixel_values, grid, merge)
    lut = normalize_table(*normalize)
    out["pixel_values"] = processor_rows(mb.pixel_values[order], lut, patch, temporal_patch) if len(order) else \
        np.zeros((0, 3 * temporal_patch * patch * patch), np.float32)
    out["image_grid_thw"] = grid
    if mb.pixel_values_videos is not None:
        grid = mb.video_grid.astype(np.int64)
        patch, order = video_order(mb.pixel_values_videos, grid, merge, temporal_patch)
        lut = video_normalize_table(*normalize)
        out["pixel_values_videos"] = processor_rows(mb.pixel_values_videos[order], lut, patch, temporal_patch)
        out["video_grid_thw"] = grid
    return out


def torch_layout(mb, tensor, normalize: tuple, merge: int, temporal_patch: int) -> dict:
    """The model's fields as tensors, made by `tensor(array, dtype)` (to_torch's: on its device). Pixels
    are normalised on that device: with numpy on the host (faster there than torch's gathers), by a torch
    gather of the uint8 rows on an accelerator (a quarter of the bytes to copy)."""
    import torch

    types, positions = token_layout(mb, merge)
    out = {"input_ids": tensor(mb.input_ids, torch.long)[None], "labels": tensor(mb.labels, torch.long)[None],
           "position_ids": tensor(positions, torch.long)[:, None], "mm_token_type_ids": tensor(types, torch.int32)[None]}
    on_host = out["input_ids"].device.type == "cpu"

    def pixels(rows: np.ndarray, lut: np.ndarray, patch: int):
        if on_host:
            return tensor(processor_rows(rows, lut, patch, temporal_patch), torch.float32)
        return torch_processor_rows(tensor(rows, torch.uint8), lut, patch, temporal_patch)

    if mb.pixel_values is not None:
        patch, order = qwen2vl_order(mb.pixel_values, mb.image_grid, merge)
        out["pixel_values"] = pixels(mb.pixel_values[order], normalize_table(*normalize), patch)
        out["image_grid_thw"] = tensor(mb.image_grid, torch.long)
    if mb.pixel_values_videos is not None:
        patch, order = video_order(mb.pixel_values_videos, mb.video_grid, merge, temporal_patch)
        out["pixel_values_videos"] = pixels(mb.pixel_values_videos[order], video_normalize_table(*normalize), patch)
        out["video_grid_thw"] = tensor(mb.video_grid, torch.long)
    return out


def model_inputs(fields: dict) -> dict:
    """What the model's forward takes of a qwen2vl-layout batch: its token fields, and the pixels and
    grids of the media kinds the micro-batch holds (an empty kind left out: the vision tower wants none)."""
    out = {k: fields[k] for k in MODEL_INPUTS if k in fields}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if grid in out and not len(out[grid]):
            del out[pixels], out[grid]
    return out
