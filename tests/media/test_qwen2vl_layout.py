"""The qwen2vl reference layout: plait's decoded patches, reordered and normalised by `MicroBatch.qwen2vl()`
and `to_torch(layout="qwen2vl")`, are bit-identical to Hugging Face's Qwen2-VL image processor (its PIL /
numpy path) on generated images of several sizes and modes, under the same resize settings."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from plait.batch import MicroBatch
from plait.media.image import ImagePolicy, decode

transformers = pytest.importorskip("transformers")
try:  # transformers >= 5: the PIL / numpy path has its own class (the default one is torchvision's)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Qwen2VLPil
except ImportError:  # 4.x: the default processor is the PIL / numpy one
    from transformers import Qwen2VLImageProcessor as Qwen2VLPil

MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64
PLACEHOLDER = 300  # tests/qwen2vl_model.py's tiny model takes 300 (image) and 301 (video)
# (width, height, mode, format): upscaled, downscaled (a JPEG shrunk > 2x: the draft must be off), grey,
# palette, alpha, odd sizes and aspect ratios
IMAGES = [(64, 48, "RGB", "PNG"), (700, 500, "RGB", "JPEG"), (1300, 300, "RGB", "JPEG"), (90, 333, "L", "PNG"),
          (257, 129, "P", "PNG"), (150, 150, "RGBA", "PNG"), (41, 29, "RGB", "WEBP")]


def picture(width: int, height: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // width, y * 255 // height, (x * y + seed) % 256, (x + 3 * y) % 256], axis=-1)
    arr = (arr + rng.integers(0, 24, arr.shape)).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(arr, "RGBA")
    return img.convert("RGB").convert("P") if mode == "P" else img.convert(mode)


def blobs() -> list[bytes]:
    out = []
    for i, (w, h, mode, fmt) in enumerate(IMAGES):
        buf = io.BytesIO()
        picture(w, h, mode, i).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buf.getvalue())
    return out


def batch_of(data: list[bytes]) -> MicroBatch:
    """A micro-batch holding these images, as plait's Constructor lays them out (raster patches)."""
    policy = ImagePolicy("dynamic", patch=14, merge=2, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    decoded = [decode(b, policy) for b in data]
    assert all(d.draft == 1 for d in decoded)
    grid = np.asarray([d.grid for d in decoded], np.int64)
    # one document: a word, then each image's placeholder run
    ids = np.concatenate([[5, 6]] + [[7] + [PLACEHOLDER] * int(g.prod() // 4) for g in grid]).astype(np.int32)
    z = np.zeros(1, np.int32)
    return MicroBatch(0, 0, 1, 0, ids, ids, np.arange(len(ids), dtype=np.int32), np.array([0, len(ids)], np.int32),
                      np.zeros((1, 5), np.int64), z, stats={"image_token_id": PLACEHOLDER, "video_token_id": -1},
                      pixel_values=np.concatenate([d.patches for d in decoded]), image_grid=grid,
                      image_cu_seqlens=np.zeros(len(decoded) + 1, np.int32), image_document=np.zeros(len(decoded), np.int64))


def reference(data: list[bytes]) -> dict:
    proc = Qwen2VLPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2)
    return proc(images=[Image.open(io.BytesIO(b)) for b in data], return_tensors="np")


def test_qwen2vl_numpy_layout_is_bit_identical_to_the_processor():
    data = blobs()
    ours, ref = batch_of(data).qwen2vl(), reference(data)
    assert np.array_equal(ours["image_grid_thw"], ref["image_grid_thw"])
    assert ours["pixel_values"].dtype == np.float32 and ours["pixel_values"].shape == ref["pixel_values"].shape
    assert np.array_equal(ours["pixel_values"], ref["pixel_values"])


def test_qwen2vl_torch_layout_is_bit_identical_to_the_processor():
    torch = pytest.importorskip("torch")
    data = blobs()[:4]
    out, ref = batch_of(data).to_torch(layout="qwen2vl"), reference(data)
    assert out["pixel_values"].dtype == torch.float32
    assert torch.equal(out["pixel_values"], torch.from_numpy(np.ascontiguousarray(ref["pixel_values"])))
    assert out["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist() == out["image_grid"].tolist()
    # the default layout is unchanged: raster (h, w, C) uint8 patches
    assert torch.equal(batch_of(data).to_torch()["pixel_values"], torch.from_numpy(batch_of(data).pixel_values))


def test_qwen2vl_layout_refuses_tiles_and_unknown_layouts():
    mb = batch_of(blobs()[:1])
    mb.image_grid = np.array([[2, mb.image_grid[0, 1], mb.image_grid[0, 2] // 2]])
    with pytest.raises(ValueError, match="one frame per image"):
        mb.qwen2vl()
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="layout must be one of"):
        batch_of(blobs()[:1]).to_torch(layout="hf")


# ----- M-RoPE per packed document, against the model's own get_rope_index ---------------------------------
VIDEO_PLACEHOLDER = 301


def packed_documents(rng, docs: int) -> tuple[MicroBatch, list[dict]]:
    """A micro-batch of random documents (text runs, images, videos; a video with more temporal patches
    than merged rows and columns among them), its media as metadata only, and each document alone."""
    ids, image_grid, image_doc, video_grid, video_doc, alone = [], [], [], [], [], []
    for d in range(docs):
        tokens, images, videos = [], [], []
        for _ in range(rng.integers(0, 4)):
            tokens += rng.integers(0, 256, rng.integers(1, 4)).tolist()  # text between media
            h, w = 2 * rng.integers(1, 4, 2)
            if rng.random() < 0.5:
                images.append([1, h, w])
                tokens += [PLACEHOLDER] * int(h * w // 4)
            else:
                videos.append([int(rng.integers(1, 7)), h, w])
                tokens += [VIDEO_PLACEHOLDER] * int(np.prod(videos[-1]) // 4)
        tokens += rng.integers(0, 256, rng.integers(1, 5)).tolist()
        ids.append(tokens)
        image_grid += images
        video_grid += videos
        image_doc += [d] * len(images)
        video_doc += [d] * len(videos)
        alone.append({"input_ids": tokens, "image_grid": images, "video_grid": videos})
    lengths = [len(t) for t in ids]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate(ids).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    grid = lambda g: np.asarray(g, np.int64).reshape(-1, 3)  # noqa: E731
    mb = MicroBatch(0, 0, 1, 0, flat, flat, positions, cu, np.zeros((docs, 5), np.int64), np.zeros(docs, np.int32),
                    stats={"image_token_id": PLACEHOLDER, "video_token_id": VIDEO_PLACEHOLDER},
                    image_grid=grid(image_grid), image_document=np.asarray(image_doc, np.int64),
                    video_grid=grid(video_grid), video_document=np.asarray(video_doc, np.int64))
    return mb, alone


def test_mrope_positions_equal_the_models_get_rope_index_on_each_packed_document():
    from plait.qwen2vl_layout import token_layout

    torch = pytest.importorskip("torch")
    from qwen2vl_model import tiny_qwen2vl

    model = tiny_qwen2vl()
    rng = np.random.default_rng(0)
    tall_video = 0
    for _ in range(25):
        mb, alone = packed_documents(rng, int(rng.integers(1, 6)))
        types, positions = token_layout(mb, 2)
        assert np.array_equal(positions[0], mb.position_ids)  # the model's packed form: plait's row first
        for d, doc in enumerate(alone):
            a, b = mb.cu_seqlens[d], mb.cu_seqlens[d + 1]
            ids = torch.tensor([doc["input_ids"]])
            ref_types = (ids == PLACEHOLDER).int() + 2 * (ids == VIDEO_PLACEHOLDER).int()
            grids = [torch.tensor(doc[k]).reshape(-1, 3) if doc[k] else None for k in ("image_grid", "video_grid")]
            ref, _ = model.model.get_rope_index(ids, ref_types, *grids)
            assert np.array_equal(types[a:b], ref_types[0].numpy())
            assert np.array_equal(positions[1:, a:b], ref[:, 0].numpy()), d
            tall_video += any(t > max(h, w) // 2 for t, h, w in doc["video_grid"])
    assert tall_video  # a video whose text after it follows max(h, w) / merge, not t (transformers 5.x)


def test_mrope_positions_of_a_continued_text_chunk_keep_its_offset_and_text_only_batches_need_no_ids():
    ids = np.arange(10, dtype=np.int32)
    positions = np.array([40, 41, 42, 43, 0, 1, 2, 3, 4, 5], np.int32)  # a cut document's tail, then a new one
    mb = MicroBatch(0, 0, 1, 0, ids, ids, positions, np.array([0, 4, 10], np.int32), np.zeros((2, 5), np.int64),
                    np.zeros(2, np.int32))
    out = mb.qwen2vl()
    assert out["position_ids"].shape == (4, 1, 10)
    assert (out["position_ids"][:, 0] == positions).all() and not out["mm_token_type_ids"].any()
    assert out["pixel_values"].shape[0] == 0 and "pixel_values_videos" not in out


def test_the_layout_names_a_document_whose_placeholders_do_not_match_its_media():
    from plait.qwen2vl_layout import token_layout

    mb, _ = packed_documents(np.random.default_rng(1), 3)  # one image, in document 2
    assert mb.image_document.tolist() == [2]
    mb.sample_ids[:, 3] = [10, 11, 12]
    wrong = MicroBatch(**{**mb.__dict__, "stats": {"image_token_id": 299, "video_token_id": VIDEO_PLACEHOLDER}})
    with pytest.raises(ValueError, match="placeholder id is not the model's"):
        token_layout(wrong, 2)
    moved = MicroBatch(**{**mb.__dict__, "image_document": np.array([1])})
    with pytest.raises(ValueError, match=r"image 0 .* its document 1 \(sample \[0, 0, 0, 11, 0\]\)"):
        token_layout(moved, 2)
    unnamed = MicroBatch(**{**mb.__dict__, "stats": {}})
    with pytest.raises(ValueError, match="needs the image placeholder id"):
        token_layout(unnamed, 2)


def test_the_accelerator_path_normalises_as_the_host_path():
    """to_torch on a CUDA device gathers the uint8 rows in torch there; on the host numpy does: the same
    values, for image rows (one frame, repeated over the temporal patch) and video rows (two frames)."""
    torch = pytest.importorskip("torch")
    from plait.qwen2vl_layout import CLIP_MEAN, CLIP_STD, normalize_table, processor_rows, torch_processor_rows, \
        video_normalize_table

    rng = np.random.default_rng(5)
    for frames, lut in ((1, normalize_table(CLIP_MEAN, CLIP_STD)), (2, video_normalize_table(CLIP_MEAN, CLIP_STD))):
        rows = rng.integers(0, 256, (37, frames * 14 * 14 * 3), dtype=np.uint8)
        host = processor_rows(rows, lut, 14, 2)
        assert host.shape == (37, 1176)
        assert np.array_equal(torch_processor_rows(torch.from_numpy(rows), lut, 14, 2).numpy(), host)
        # (C, T, p, p) rows: channel c of frame f at patch pixel (i, j) is lut[c, rows (f, i, j, c)]
        block = rows.reshape(37, frames, 14, 14, 3)
        assert host.reshape(37, 3, 2, 14, 14)[4, 2, 1, 3, 5] == lut[2, block[4, frames - 1, 3, 5, 2]]
