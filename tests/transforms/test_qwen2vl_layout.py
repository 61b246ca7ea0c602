"""The qwen2vl reference layout: plait's decoded patches, reordered and normalised by `MicroBatch.qwen2vl()`
and `to_torch(layout="qwen2vl")`, are bit-identical to Hugging Face's Qwen2-VL image processor (its PIL /
numpy path) on generated images of several sizes and modes, under the same resize settings."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from plait.batch import MicroBatch
from plait.transforms.images import ImagePolicy, decode

transformers = pytest.importorskip("transformers")
try:  # transformers >= 5: the PIL / numpy path has its own class (the default one is torchvision's)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Qwen2VLPil
except ImportError:  # 4.x: the default processor is the PIL / numpy one
    from transformers import Qwen2VLImageProcessor as Qwen2VLPil

MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 64
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
    z = np.zeros(1, np.int32)
    return MicroBatch(0, 0, 1, 0, z, z, z, np.array([0, 1], np.int32), np.zeros((1, 5), np.int64), z,
                      pixel_values=np.concatenate([d.patches for d in decoded]),
                      image_grid=np.asarray([d.grid for d in decoded], np.int64),
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
