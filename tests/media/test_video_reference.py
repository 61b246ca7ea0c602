"""Video frames against the published references: each sampled frame equals Hugging Face's Qwen2-VL image
processor (its PIL path) run on PyAV's full-size RGB decode of that frame, bit for bit; `fast_resize` is the
one-pass swscale resize instead; and the frame rule's defaults are qwen-vl-utils 0.0.14's (a 40 s 720p clip
gets 28,800 tokens)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from video_data import VIDEO_TOKEN_ID, encode

import plait
from plait.sources.video import video_policy
from plait.media.video import VideoInfo, VideoPolicy, probe, read_frames

av = pytest.importorskip("av")
pytest.importorskip("transformers")
try:  # transformers >= 5: the PIL / numpy path has its own class (the default one is torchvision's)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Qwen2VLPil
except ImportError:  # 4.x: the default processor is the PIL / numpy one
    from transformers import Qwen2VLImageProcessor as Qwen2VLPil

# frames shrunk (a 320x240 H.264 and a 200x120 VP9 clip) and enlarged (a 64x48 MPEG-4 clip) by the rule
CLIPS = [("libx264", "mp4", 320, 240, 24, 2.0), ("libvpx-vp9", "webm", 200, 120, 12, 1.5),
         ("mpeg4", "mov", 64, 48, 10, 2.0)]
POLICY = VideoPolicy(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 32, total_pixels=28 * 28 * 256, max_frames=8)


def reference_frame(rgb: np.ndarray, min_pixels: int, max_pixels: float) -> tuple[np.ndarray, tuple]:
    """The Qwen2-VL image processor's resize of one RGB frame, read back from its patches as [H, W, 3]
    (no rescale or normalisation, so the values are the resized uint8 pixels), and its grid."""
    from PIL import Image

    proc = Qwen2VLPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2,
                      temporal_patch_size=2, do_rescale=False, do_normalize=False)
    out = proc(images=[Image.fromarray(rgb)], return_tensors="np")
    t, gh, gw = (int(x) for x in out["image_grid_thw"][0])
    # rows: merge windows (gh/2, gw/2, 2, 2), each patch (C, T, 14, 14); take T = 0 (a repeated image)
    x = out["pixel_values"].reshape(gh // 2, gw // 2, 2, 2, 3, 2, 14, 14)[:, :, :, :, :, 0]
    frame = x.transpose(0, 2, 5, 1, 3, 6, 4).reshape(gh * 14, gw * 14, 3)
    assert np.array_equal(frame, frame.round()) and frame.max() <= 255
    return frame.astype(np.uint8), (t, gh, gw)


def pyav_rgb_frames(data: bytes) -> list[np.ndarray]:
    """Every frame as plain PyAV decodes it to full-size RGB (what the reference readers hand on)."""
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}")
def test_frames_equal_the_qwen2vl_image_processor_bit_for_bit(clip):
    data = encode(*clip)
    plan = POLICY.plan(probe(data))
    got = read_frames(data, plan)
    rgb = pyav_rgb_frames(data)
    assert (plan.width, plan.height) != (clip[2], clip[3])  # every clip is resized
    for k, i in enumerate(plan.indices):
        want, grid = reference_frame(rgb[i], POLICY.min_pixels, POLICY.frame_budget(len(plan.indices)))
        assert grid[1:] == plan.grid[1:]  # the processor's smart_resize lands on the plan's size
        np.testing.assert_array_equal(got[k], want, err_msg=f"frame {i}")


def test_fast_resize_is_the_one_pass_swscale_resize_and_differs():
    data = encode(*CLIPS[0])
    plan = POLICY.plan(probe(data))
    fast, exact = read_frames(data, plan, fast_resize=True), read_frames(data, plan)
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(video=0))
    for k, i in enumerate(plan.indices):
        one_pass = frames[i].to_ndarray(width=plan.width, height=plan.height, format="rgb24", interpolation="BICUBIC")
        np.testing.assert_array_equal(fast[k], one_pass)
    assert not np.array_equal(fast, exact)


def test_spec_fast_resize_reaches_the_policy_and_not_the_fingerprint():
    base = {"sources": [{"name": "v", "path": "/x/v.json", "format": "jsonl", "text_field": "c", "video_field": "video"}],
            "images": {"image_token_id": 300}, "videos": {"video_token_id": VIDEO_TOKEN_ID}}
    fast = {**base, "videos": {"video_token_id": VIDEO_TOKEN_ID, "fast_resize": True}}
    a, b = plait.load_spec(base), plait.load_spec(fast)
    assert not video_policy(a).fast_resize and video_policy(b).fast_resize
    assert a.data_fingerprint() == b.data_fingerprint()  # pixels only: the same samples, tokens and order


# ----- qwen-vl-utils 0.0.14's defaults and formulas, written out here ----------------------------------
MODEL_SEQ_LEN, VIDEO_MIN_TOKEN_NUM, VIDEO_MAX_TOKEN_NUM = 128000, 128, 768


def ref_resized(height, width, frames, factor=28, min_pixels=None, max_pixels=None, total_pixels=None):
    """fetch_video's resize of 0.0.14: the per-frame ceiling, the total budget, a caller's max_pixels."""
    min_pixels = VIDEO_MIN_TOKEN_NUM * factor * factor if min_pixels is None else min_pixels
    total = MODEL_SEQ_LEN * factor * factor * 0.9 if total_pixels is None else total_pixels
    limit = max(min(VIDEO_MAX_TOKEN_NUM * factor * factor, total / frames * 2), int(min_pixels * 1.05))
    limit = min(max_pixels, limit) if max_pixels is not None else limit
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > limit:
        beta = math.sqrt(height * width / limit)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def default_policy() -> VideoPolicy:
    spec = plait.load_spec({"sources": [{"name": "v", "path": "/x/v.json", "format": "jsonl", "text_field": "c",
                                         "video_field": "video"}],
                            "images": {"image_token_id": 300}, "videos": {"video_token_id": VIDEO_TOKEN_ID}})
    return video_policy(spec)


def test_a_40_s_720p_clip_gets_28800_tokens_from_its_metadata():
    """At 30 fps: 80 frames at 2 fps; the 0.0.14 budget (128000 * 28**2 * 0.9 over 40 temporal patches)
    lets each frame reach the 768-token ceiling: 560 x 1008 (the 0.0.8 budget gave 504 x 924, 23,760)."""
    pol = default_policy()
    assert pol.total_pixels == 90_316_800 == MODEL_SEQ_LEN * 28 * 28 * 0.9
    plan = pol.plan(VideoInfo(1280, 720, 1200, 30.0, 40.0, "h264"))
    assert len(plan.indices) == 80 and (plan.height, plan.width) == ref_resized(720, 1280, 80) == (560, 1008)
    assert plan.grid == (40, 40, 72) and plan.tokens == 28_800


@pytest.mark.parametrize("height,width,seconds,fps_video,max_pixels", [
    (720, 1280, 40, 30.0, None), (1080, 1920, 600, 25.0, None), (1080, 1920, 3600, 30.0, None),
    (360, 640, 8, 24.0, None), (2160, 3840, 20, 60.0, None), (480, 854, 300, 29.97, 28 * 28 * 256),
    (1080, 1920, 10, 30.0, 28 * 28 * 2000),  # a max_pixels over the ceiling is capped at 768 * 28**2
    (100, 8000, 5, 10.0, None),
])
def test_the_resize_follows_qwen_vl_utils_0_0_14(height, width, seconds, fps_video, max_pixels):
    pol = default_policy()
    if max_pixels is not None:
        pol = VideoPolicy(**{**pol.__dict__, "max_pixels": max_pixels})
    total = round(seconds * fps_video)
    plan = pol.plan(VideoInfo(width, height, total, fps_video, seconds, "h264"))
    frames = len(plan.indices)
    assert frames == min(max(math.floor(total / fps_video * 2 / 2) * 2, 4), 768)
    assert (plan.height, plan.width) == ref_resized(height, width, frames, max_pixels=max_pixels)
    assert plan.height * plan.width <= VIDEO_MAX_TOKEN_NUM * 28 * 28
