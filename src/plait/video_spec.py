"""The spec's video parts: the `videos` section (the Qwen2-VL frame rule) and a source's `video_field` checks.

Apart from spec.py (which imports them) to keep that file small; see docs/video.md for the fields.
The defaults are those of qwen-vl-utils QWEN_VL_UTILS (its VIDEO_MIN_TOKEN_NUM, VIDEO_MAX_TOKEN_NUM, FPS,
FPS_MIN_FRAMES, FPS_MAX_FRAMES, FRAME_FACTOR and the total budget MODEL_SEQ_LEN * 28**2 * 0.9), for
Qwen2-VL's 28-pixel merge groups (patch 14, merge 2).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

QWEN_VL_UTILS = "0.0.14"  # the qwen-vl-utils release whose video rule and defaults plait follows
VIDEO_MIN_TOKENS, VIDEO_MAX_TOKENS = 128, 768  # merged tokens of one frame: min/max pixels = that * factor**2
MODEL_SEQ_LEN = 128_000  # qwen-vl-utils' default model context: all frames of a video share 90% of it
TOTAL_PIXELS = int(MODEL_SEQ_LEN * 28 * 28 * 0.9)  # 90,316,800
IMAGE_FORMATS = ("parquet", "jsonl", "webdataset")  # formats that read an image_field or a video_field
VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi")  # webdataset video members
VIDEO_FIELD_HELP = ("the sample's video(s): webdataset: member extensions ('mp4;webm;mkv;mov'); parquet: a column of "
                    "paths or video bytes; jsonl/json (LLaVA-Video): a key holding a path or a list of paths (relative "
                    "to image_root). Needs the top-level `videos` and `images` sections")


class VideosSpec(BaseModel):
    """How videos become frames, patches and placeholder tokens (plait.media.video.VideoPolicy, the
    Qwen2-VL rule; patch and merge are the `images` section's). Defaults: qwen-vl-utils QWEN_VL_UTILS's."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)  # as StrictModel

    policy: Literal["qwen2vl"] = "qwen2vl"
    fps: float = Field(2.0, gt=0, description="frames sampled per second of video")
    min_frames: int = Field(4, ge=1)
    max_frames: int = Field(768, ge=1, description="most frames of one sample (with clip: of one window)")
    nframes: int | None = Field(None, ge=1, description="a fixed frame count (overrides fps, min/max_frames)")
    min_pixels: int = Field(VIDEO_MIN_TOKENS * 28 * 28, ge=1, description="fewest pixels of one resized frame")
    max_pixels: int = Field(VIDEO_MAX_TOKENS * 28 * 28, ge=1, description="most pixels of one resized frame "
                            f"(at most {VIDEO_MAX_TOKENS} * (patch * merge)**2 are used, as qwen-vl-utils caps it)")
    total_pixels: int = Field(TOTAL_PIXELS, ge=1, description="pixel budget of all a sample's frames")
    temporal_patch: int = Field(2, ge=1, description="frames per temporal patch (the frame count's multiple)")
    clip: bool = Field(False, description="long videos: one sample per window of at most max_frames frames")
    fast_resize: bool = Field(False, description="convert and resize each frame in one swscale pass: faster, but "
                              "its pixels differ from the reference's full-size RGB + BICUBIC resize (docs/video.md)")
    video_token_id: int = Field(ge=0, le=2**31 - 1, description="the placeholder id videos occupy in input_ids")

    @model_validator(mode="after")
    def _consistent(self) -> "VideosSpec":
        if self.min_pixels > self.max_pixels:
            raise ValueError("min_pixels must be at most max_pixels")
        if self.min_frames > self.max_frames or self.max_frames < self.temporal_patch:
            raise ValueError("need min_frames <= max_frames and max_frames >= temporal_patch")
        return self


def videos_used(v: VideosSpec | None, info: ValidationInfo) -> VideosSpec | None:
    """Spec's check of its `videos` section: there when a source reads videos, with `images` beside it."""
    needing = [s.name for s in info.data.get("sources") or [] if s.video_field is not None]
    if v is None and needing:
        raise ValueError(f"sources {needing} read videos: give `videos: {{video_token_id: ..., fps: ...}}`")
    if needing and info.data.get("images") is None:
        raise ValueError("video sources also need the `images` section (patch, merge, image_token_id)")
    return v


def check_video_field(self) -> None:
    """SourceSpec's checks of `video_field` (format, text field, webdataset extensions)."""
    if self.format is not None and self.format not in IMAGE_FORMATS:
        raise ValueError(f"video_field: format {self.format} holds no videos (formats: {', '.join(IMAGE_FORMATS)})")
    if self.text_field is None or self.length_field is not None:
        raise ValueError("video_field: a video source needs text_field and no length_field")
    exts = [e.strip().lower().lstrip(".") for e in self.video_field.split(";") if e.strip()]
    if self.format == "webdataset" and (not exts or set(exts) - set(VIDEO_EXTENSIONS)):
        raise ValueError(f"video_field: unknown video extension(s) in {self.video_field!r} "
                         f"(known: {', '.join(VIDEO_EXTENSIONS)})")
