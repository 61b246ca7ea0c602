"""Video: header-only probes for the Planner, the Qwen2-VL frame rule, seeking decode + patchify at gather.

The same split as images (media/image.py). Planning calls `probe`, which opens the container and
reads its stream headers only (duration, average frame rate, frame count, frame size): no packet is
decoded (`FRAME_DECODES` counts every frame any decoder here produced, so a test can assert it stays
0 while planning). `VideoPolicy.plan` turns that `VideoInfo` into a `VideoPlan` (the sampled frame
indices, the resized frame size, the grid and the placeholder count), and the loader's `decode_video`
later decodes exactly those frames, once per delivery (`VIDEO_DECODES` counts decode passes).

The Qwen2-VL rule (`policy: qwen2vl`; as qwen-vl-utils 0.0.14's `smart_nframes` and `fetch_video` publish
it, video_spec.QWEN_VL_UTILS), with tp = temporal_patch (FRAME_FACTOR), factor = patch * merge:

    frames  = round(nframes / tp) * tp                             when `nframes` is set, else
    frames  = floor(clamp(total / fps_video * fps,
                          ceil(min_frames / tp) * tp,
                          floor(min(max_frames, total) / tp) * tp) / tp) * tp
    indices = round(linspace(0, total - 1, frames))                (round half to even, as torch.round)
    budget  = min(max_pixels, max(min(768 * factor**2, total_pixels / frames * tp), int(min_pixels * 1.05)))
    (h', w') = smart_resize(h, w, factor, min_pixels, budget)      (media/image_policy.py)
    grid    = (t, h, w) = (frames / tp, h' / patch, w' / patch);   patches = t*h*w;   tokens = patches / merge**2

A video shorter than tp frames, or for which the rule asks more frames than it holds, is a bad video.
`clip: true` (long videos): the frame count is not capped by max_frames; instead the frames are split
into windows of at most max_frames (each a multiple of tp), and every window becomes a sample of its own
(`VideoPlan.window`, see sources/video.py), so a two-hour video does not become one giant sample.

Frame times. Index i is the frame shown at time i / fps_video after the stream's start (for a constant
frame rate, exactly frame i). For a variable frame rate the same times are used with the average rate,
and the frame taken is the first whose timestamp reaches the time minus half an average interval.

Decoding (`decode_video`): the sampled times in order; before a time more than SEEK_GAP seconds past the
last decoded frame (and before the first) the demuxer seeks to the keyframe at or before it, then frames
are decoded forward. Each wanted frame is converted to full-size RGB24 (PyAV's `to_ndarray`, as the
reference readers decode) and resized by the image path's resize (`image.resize_bicubic`, Pillow
BICUBIC), so a frame equals Hugging Face's Qwen2-VL image processor's resize of that RGB frame bit for
bit. A decoded frame that several sampled times take (an index the rule repeats, a variable-rate frame
held over two times) is resized once and copied to the others. `fast_resize` converts and resizes in one swscale pass instead (`reformat`, BICUBIC): faster, other
pixels (docs/video.md measures both). Patch layout: frames grouped by tp; rows of patch*patch*3 uint8, ordered (temporal
group, patch row, patch column, frame in group), so `rows.reshape(t*h*w, tp*patch*patch*3)` gives
Qwen2-VL's video patches (tp, patch, patch, 3) in raster order. Failures are `BadVideo` (one line).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from typing import BinaryIO, ClassVar, NamedTuple

import numpy as np
from PIL import Image

from plait.media.base import DecodeCounter, MediaError, open_container
from plait.media.image import resize_bicubic
from plait.media.container_size import check_size
from plait.media.image_policy import BadImage, BadVideo, smart_resize
from plait.video_batch import video_fields
from plait.video_spec import TOTAL_PIXELS, VIDEO_MAX_TOKENS, VIDEO_MIN_TOKENS

__all__ = ["FRAME_DECODES", "MEDIUM", "VIDEO_DECODES", "VIDEO_EXTENSIONS", "BadVideo", "VideoInfo", "VideoPlan",
           "VideoPolicy", "VideoRef", "decode_video", "patchify_frames", "probe"]

VIDEO_EXTENSIONS = ("mp4", "webm", "mkv", "mov", "avi")
END_SLACK = 0.5  # seconds a stream's last packet may end before the duration its headers give
SEEK_GAP = 1.0  # seconds: a wanted frame further ahead than this is reached by seeking, not decoding through
FRAME_DECODES = DecodeCounter()  # frames produced by a decoder (planning must add none)
VIDEO_DECODES = DecodeCounter()  # decode passes (one per delivered video)
VideoData = bytes | bytearray | memoryview | str | BinaryIO  # bytes, a local path, or a seekable file


@dataclass(frozen=True)
class VideoRef:
    """A video in a record: `ref` is what the reader resolves (bytes, a member name, a path); `window`
    the clip window this sample takes; `plan`, once planned, what it becomes (kept for the gather)."""

    kind: ClassVar[str] = "video"  # media.registry.kind_of
    ref: bytes | str
    window: int = 0
    plan: "VideoPlan | None" = None

    def __len__(self) -> int:  # byte accounting: an inline video's bytes (a path's length otherwise)
        return len(self.ref)


class VideoInfo(NamedTuple):
    """What the headers say: frame size, frame count, average frames per second, duration (seconds),
    codec name, and whether the stream's frame rate varies (average rate != base rate)."""

    width: int
    height: int
    frames: int
    fps: float
    duration: float
    codec: str
    variable: bool = False


@dataclass(frozen=True)
class VideoPlan:
    """What one video (or one clip window of it) becomes: frame `indices` into the stream, the frame
    `fps_video` (to turn an index into a time), the resized frame size, `grid` (t, h, w) in patches,
    `patches` = t*h*w, `tokens` = patches / merge**2, and `window` (which clip window; 0 without clips)."""

    indices: tuple[int, ...]
    fps_video: float
    width: int
    height: int
    grid: tuple[int, int, int]
    patches: int
    tokens: int
    window: int = 0

    @property
    def rows(self) -> int:
        """uint8 rows of patch*patch*3 this video's pixels take: one per frame patch."""
        return len(self.indices) * self.grid[1] * self.grid[2]


@contextlib.contextmanager
def open_video(data: VideoData):
    """media.base's container for bytes, a local path or a file object, closed on exit; BadVideo when
    FFmpeg cannot read it (after check_file's plainer words for a missing, empty or folder path)."""
    check_file(data)
    with contextlib.ExitStack() as stack:
        try:
            container = stack.enter_context(open_container(data, ""))
        except MediaError as e:
            raise BadVideo(f"not a readable video container ({e.reason})") from None
        yield container


def check_file(data: VideoData) -> None:
    """BadVideo for what FFmpeg words badly ('<none>', 'Invalid data'): a missing file, a folder, no bytes."""
    if isinstance(data, str):
        if not os.path.exists(data):
            raise BadVideo(f"missing file: no file at {data}")
        if os.path.isdir(data):
            raise BadVideo(f"{data} is a folder, not a video file")
        empty = os.path.getsize(data) == 0
    else:
        empty = isinstance(data, (bytes, bytearray, memoryview)) and not len(data)
    if empty:
        raise BadVideo("empty file (0 bytes)")


def _stream(container):
    if not container.streams.video:
        raise BadVideo("no video stream in the container")
    return container.streams.video[0]


def probe(data: VideoData) -> VideoInfo:
    """The video's headers (see VideoInfo); never decodes a frame. BadVideo when they are unusable."""
    import av  # open_video has checked it is installed

    with open_video(data) as c:
        s = _stream(c)
        name = s.codec_context.name if s.codec_context is not None else "unknown"
        try:
            av.codec.Codec(name, "r")
        except Exception:  # noqa: BLE001 - no decoder for it in this FFmpeg build
            raise BadVideo(f"unsupported codec {name!r} (no decoder in this FFmpeg build)") from None
        rate = s.average_rate or s.guessed_rate or s.base_rate
        fps = float(rate) if rate else 0.0
        duration = None
        if s.duration is not None and s.time_base is not None:
            duration = float(s.duration * s.time_base)
        elif c.duration is not None:
            duration = c.duration / 1_000_000
        if not duration or duration <= 0 or fps <= 0:
            raise BadVideo(f"zero or unknown duration or frame rate (duration {duration}, fps {fps:g})")
        frames = int(s.frames) or int(round(duration * fps))
        width, height = int(s.codec_context.width), int(s.codec_context.height)
        if width <= 0 or height <= 0:
            raise BadVideo(f"empty frame size ({width}x{height})")
        variable = bool(s.base_rate) and abs(float(s.base_rate) - fps) > 0.01 * fps
        _check_end(c, s, duration, fps)
        return VideoInfo(width, height, frames, fps, duration, name, variable)


def _check_end(container, stream, duration: float, fps: float) -> None:
    """A file cut short often keeps its headers (Matroska, WebM, fragmented MP4): seek to its last
    keyframe and read the packets after it (demuxing, not decoding), so that a body shorter than its
    headers say is found while planning, where skipping it drops the sample cleanly."""
    start = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
    end = None
    try:
        container.seek(int((start + max(duration - 1.0 / fps, 0.0)) / stream.time_base), stream=stream, backward=True)
        for packet in container.demux(stream):
            if packet.pts is not None:
                t = float(packet.pts * stream.time_base) - start
                end = t if end is None else max(end, t)
    except Exception as e:  # noqa: BLE001 - corrupt data near the end
        raise BadVideo(f"unreadable near its end: {type(e).__name__}: {e}") from None
    if end is None or end + 1.0 / fps < duration - END_SLACK:
        raise BadVideo(f"its packets end at {end or 0:.3f} s of the {duration:.3f} s its headers give: truncated")


@dataclass(frozen=True)
class VideoPolicy:
    """The Qwen2-VL video rule (module docstring). Defaults: qwen-vl-utils 0.0.14's (fps 2, 4..768 frames,
    128*28*28 .. 768*28*28 pixels per frame, 128000*28*28*0.9 in total, frames in pairs). `fast_resize`:
    decode with the one-pass swscale resize instead of the reference's (planning is the same)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = VIDEO_MIN_TOKENS * 28 * 28
    max_pixels: int = VIDEO_MAX_TOKENS * 28 * 28
    total_pixels: int = TOTAL_PIXELS
    temporal_patch: int = 2
    nframes: int | None = None
    patch: int = 14
    merge: int = 2
    clip: bool = False
    fast_resize: bool = False

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def frame_budget(self, frames: int) -> float:
        """Most pixels of one resized frame of a sample of `frames` frames: the total budget shared by the
        temporal patches, within qwen-vl-utils' per-frame ceiling, never under its 1.05 * min_pixels floor,
        and never over `max_pixels` (as qwen-vl-utils applies a caller's max_pixels)."""
        shared = min(VIDEO_MAX_TOKENS * self.factor**2, self.total_pixels / frames * self.temporal_patch)
        return min(self.max_pixels, max(shared, int(self.min_pixels * 1.05)))

    def _floor(self, x: float) -> int:
        return math.floor(x / self.temporal_patch) * self.temporal_patch

    def num_frames(self, info: VideoInfo) -> int:
        """Frames sampled from the whole video (before clip windows). BadVideo when it cannot give them."""
        tp, total = self.temporal_patch, info.frames
        if self.nframes is not None:
            n = round(self.nframes / tp) * tp
        else:
            lo = math.ceil(self.min_frames / tp) * tp
            hi = self._floor(total if self.clip else min(self.max_frames, total))
            n = self._floor(min(max(total / info.fps * self.fps, lo), hi))
        if not tp <= n <= total:
            raise BadVideo(f"{total} frame(s) cannot give {n} sampled frame(s) (at least {tp}, at most the video's)")
        return n

    def windows(self, info: VideoInfo) -> int:
        """How many samples the video becomes: 1, or with `clip` one per window of at most max_frames."""
        if not self.clip:
            return 1
        return -(-self.num_frames(info) // max(self._floor(self.max_frames), self.temporal_patch))

    def plan(self, info: VideoInfo, window: int = 0) -> VideoPlan:
        """The plan for clip window `window` (0: the whole video without `clip`)."""
        tp = self.temporal_patch
        n = self.num_frames(info)
        indices = np.linspace(0, info.frames - 1, n).round().astype(np.int64)
        if self.clip:
            size = max(self._floor(self.max_frames), tp)
            indices = indices[window * size:(window + 1) * size]
            if not len(indices):
                raise BadVideo(f"clip window {window} is past the video's {n} sampled frames")
        frames = len(indices)
        try:
            h, w = smart_resize(info.height, info.width, self.factor, self.min_pixels, self.frame_budget(frames))
        except BadImage as e:
            raise BadVideo(str(e)) from None
        grid = (frames // tp, h // self.patch, w // self.patch)
        patches = grid[0] * grid[1] * grid[2]
        return VideoPlan(tuple(int(i) for i in indices), info.fps, w, h, grid, patches,
                         patches // (self.merge * self.merge), window)


def patchify_frames(frames: np.ndarray, patch: int, temporal_patch: int) -> np.ndarray:
    """[n, H, W, 3] uint8 (n a multiple of temporal_patch) -> [n * (H/patch) * (W/patch), patch*patch*3],
    ordered (temporal group, patch row, patch column, frame in group): one strided copy."""
    n, height, width, ch = frames.shape
    t, gh, gw = n // temporal_patch, height // patch, width // patch
    x = frames.reshape(t, temporal_patch, gh, patch, gw, patch, ch).transpose(0, 2, 4, 1, 3, 5, 6)
    return x.reshape(t * gh * gw * temporal_patch, patch * patch * ch)


def _frame_time(frame, start: float) -> float:
    if frame.time is None:
        raise BadVideo("a frame has no timestamp")
    return float(frame.time) - start


def resized_frame(frame, plan: VideoPlan, fast_resize: bool = False) -> np.ndarray:
    """A decoded frame at the plan's size, uint8 [height, width, 3]: full-size RGB then the image path's
    BICUBIC resize (the reference), or with `fast_resize` one swscale conversion + resize."""
    if fast_resize:
        return frame.to_ndarray(width=plan.width, height=plan.height, format="rgb24", interpolation="BICUBIC")
    rgb = Image.fromarray(frame.to_ndarray(format="rgb24"))  # not frame.to_image(): the same pixels, 20x slower
    return np.asarray(resize_bicubic(rgb, (plan.width, plan.height)))


def read_frames(data: VideoData, plan: VideoPlan, fast_resize: bool = False) -> np.ndarray:
    """The plan's frames, decoded with seeking and resized: uint8 [frames, height, width, 3]."""
    times = np.asarray(plan.indices, dtype=np.float64) / plan.fps_video
    half = 0.5 / plan.fps_video
    out = np.empty((len(times), plan.height, plan.width, 3), dtype=np.uint8)
    VIDEO_DECODES.add()
    with open_video(data) as c:
        s = _stream(c)
        s.thread_type = "AUTO"
        start = float(s.start_time * s.time_base) if s.start_time is not None and s.time_base is not None else 0.0
        k, pos, sought = 0, None, -1
        try:
            while k < len(times):
                if pos is None or times[k] - pos > SEEK_GAP:
                    c.seek(int((start + times[k]) / s.time_base), stream=s, backward=True, any_frame=False)
                    sought = k  # decode forward to frame k whatever the seek landed on (no second seek for it)
                ended = True
                for frame in c.decode(s):
                    FRAME_DECODES.add()
                    pos = _frame_time(frame, start)
                    first = k  # a frame several times map to (a repeated index, a VFR frame held
                    while k < len(times) and pos >= times[k] - half:  # long) is resized once, then copied
                        out[k] = resized_frame(frame, plan, fast_resize) if k == first else out[first]
                        k += 1
                    if k == len(times) or (k != sought and times[k] - pos > SEEK_GAP):
                        ended = False
                        break
                if ended and k < len(times):
                    raise BadVideo(f"stream ends at {pos or 0:.3f} s, before frame {plan.indices[k]} "
                                   f"({times[k]:.3f} s): truncated, or shorter than its headers say")
        except BadVideo:
            raise
        except Exception as e:  # noqa: BLE001 - a corrupt packet: FFmpeg raises many error types
            raise BadVideo(f"cannot decode frame {plan.indices[min(k, len(times) - 1)]}: {type(e).__name__}: {e}") from None
    return out


def decode_video(data: VideoData, plan: VideoPlan, policy: VideoPolicy) -> np.ndarray:
    """The plan's frames as uint8 patch rows [plan.rows, patch*patch*3] (module docstring), decoded and
    cut as `policy` says. BadVideo on any failure; the caller checks nothing else (the plan came from the
    same headers)."""
    return patchify_frames(read_frames(data, plan, policy.fast_resize), policy.patch, policy.temporal_patch)


class VideoMedium:
    """The video medium (plait.media.registry.Medium): headers -> VideoPlan (per clip window), decode ->
    patch rows of the planned frames."""

    def policy(self, spec) -> VideoPolicy | None:
        v, im = spec.videos, spec.images
        if v is None or im is None:
            return None
        return VideoPolicy(fps=v.fps, min_frames=v.min_frames, max_frames=v.max_frames, min_pixels=v.min_pixels,
                           max_pixels=v.max_pixels, total_pixels=v.total_pixels, temporal_patch=v.temporal_patch,
                           nframes=v.nframes, patch=im.patch, merge=im.merge, clip=v.clip, fast_resize=v.fast_resize)

    def probe(self, data: VideoData, name: str | None = None) -> VideoInfo:
        """`probe`, after checking that the container is not shorter than its headers say
        (media/container_size.py; BadVideo if so)."""
        check_file(data)  # a missing or empty file is said so before its sizes are read
        check_size(data)
        return probe(data)

    def plan(self, policy: VideoPolicy, info: VideoInfo, window: int = 0) -> VideoPlan:
        return policy.plan(info, window)

    def decode(self, data: VideoData, planned: VideoPlan, policy: VideoPolicy, name: str | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        rows = decode_video(data, planned, policy)
        if out is None:
            return rows
        out[...] = rows
        return out

    def placeholder_tokens(self, planned: VideoPlan) -> int:
        return planned.tokens

    def encoder_units(self, planned: VideoPlan) -> tuple[int, int]:
        """Its patches, and t * (h*w)^2: the encoder attends within each temporal patch, as Qwen2-VL's does."""
        return planned.patches, planned.patches * planned.patches // max(planned.grid[0], 1)

    def batch_fields(self, payload, a: int, b: int) -> dict:
        return video_fields(payload, a, b)

    reference = VideoRef  # a record's video: plait.media.registry.Medium.reference


MEDIUM = VideoMedium()
