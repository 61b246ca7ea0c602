"""Videos in image-text records: references, header-only planning, decode at gather, clip windows.

A reader that reads a `video_field` puts each video of a record among the record's media as a
`VideoRef` (transforms/video.py), in the order of the conversation's `<video>` / `<image>` markers
(caption template: images, then videos, then the text). `VideoDocs` is what the record pipeline
(sources/multimodal.py) calls for them:

  plan    probe the container's headers (no frame is decoded) and apply the spec's `videos` rule; the
          plan travels with the reference in the block's media table, so the gather needs no probe;
  decode  open the video again at gather, seek and decode the planned frames only, patchify
          (one decode pass per delivered video);
  clips   with `videos.clip`, a record holding one video whose frames exceed `max_frames` becomes one
          record per window (`expand_clips`): each window is its own sample, with its own sample id
          (its row is the record's row * MAX_WINDOWS + window, so ids stay unique across blocks).

Where the bytes come from: `FormatReader.video_input` (a local path is handed to FFmpeg as a path, so a
probe reads only the headers; a WebDataset member, a remote file or inline bytes are read into memory).
"""

from __future__ import annotations

import numpy as np
from dataclasses import replace

from plait.spec import Spec
from plait.transforms.video import BadVideo, VideoPlan, VideoPolicy, VideoRef, decode_video, probe

MAX_WINDOWS = 4096  # clip windows per record (a 2-hour video at 2 fps and 768 frames a window needs 19)
VIDEO_KIND = 1  # ImagePayload.kind of a video (0: an image)


def video_policy(spec: Spec) -> VideoPolicy | None:
    v, im = spec.videos, spec.images
    if v is None or im is None:
        return None
    return VideoPolicy(fps=v.fps, min_frames=v.min_frames, max_frames=v.max_frames, min_pixels=v.min_pixels,
                       max_pixels=v.max_pixels, total_pixels=v.total_pixels, temporal_patch=v.temporal_patch,
                       nframes=v.nframes, patch=im.patch, merge=im.merge, clip=v.clip)


def video_list(value, root: str | None) -> list[VideoRef]:
    """A record's video field as references: None -> none; a path, bytes, or a list of them (relative
    paths joined to `root`). ValueError for anything else."""
    import posixpath

    if value is None:
        return []
    out = []
    for v in value if isinstance(value, list) else [value]:
        if isinstance(v, dict):
            v = v.get("bytes") if v.get("bytes") is not None else v.get("path")
        if isinstance(v, (bytes, bytearray)):
            out.append(VideoRef(bytes(v)))
        elif isinstance(v, str) and v:
            out.append(VideoRef(v if (root is None or "://" in v or posixpath.isabs(v)) else posixpath.join(root, v)))
        else:
            raise ValueError(f"video field holds {type(v).__name__}, not a path or video bytes")
    return out


class VideoDocs:
    """Plans and decodes a source's videos (module docstring)."""

    def __init__(self, spec: Spec, reader):
        self.policy = video_policy(spec)
        self.token_id = spec.videos.video_token_id
        self.reader = reader

    def plan(self, path: str, vref: VideoRef) -> VideoPlan:
        """From the headers (BadVideo when unusable); a reference planned while clips were expanded keeps
        that plan."""
        if vref.plan is not None:
            return vref.plan
        return self.policy.plan(probe(self.reader.video_input(path, vref.ref)), vref.window)

    def decode(self, path: str, vref: VideoRef) -> np.ndarray:
        """The planned frames as uint8 patch rows [plan.rows, patch*patch*3] (BadVideo on failure)."""
        if vref.plan is None:
            raise BadVideo("a video reference reached the gather unplanned")
        return decode_video(self.reader.video_input(path, vref.ref), vref.plan, self.policy.patch,
                            self.policy.temporal_patch)

    def payload_grid(self, plan: VideoPlan) -> tuple[int, int, int]:
        """The grid of its pixel rows in a payload: (frames, h, w), t*temporal_patch frames."""
        return len(plan.indices), plan.grid[1], plan.grid[2]

    def expand_clips(self, path: str, records: list, ok_index: np.ndarray, bad: list):
        """With `clip`: every record holding exactly one video becomes one record per window of its
        frames (others stay whole). Returns (records, ok_index in window rows, num_records); a video
        whose headers fail is reported into `bad` (record name, reason) and its record dropped."""
        out, rows = [], []
        for rec, row in zip(records, ok_index):
            videos = [m for m in rec.images if isinstance(m, VideoRef)]
            try:
                if len(videos) != 1:
                    windows, info = 1, None
                else:
                    info = probe(self.reader.video_input(path, videos[0].ref))
                    windows = min(self.policy.windows(info), MAX_WINDOWS)
            except BadVideo as e:
                bad.append((rec.name, f"video {videos[0].ref if isinstance(videos[0].ref, str) else '<bytes>'}: {e}"))
                continue
            for w in range(windows):
                media = [replace(m, window=w, plan=self.policy.plan(info, w)) if isinstance(m, VideoRef) else m
                         for m in rec.images] if info is not None else rec.images
                out.append(replace(rec, images=media, name=rec.name if windows == 1 else f"{rec.name}#clip{w}"))
                rows.append(int(row) * MAX_WINDOWS + w)
        return out, np.asarray(rows, np.int64)
