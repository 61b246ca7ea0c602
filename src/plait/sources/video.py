"""Videos in image-text records: references, header-only planning, decode at gather, clip windows.

A reader that reads a `video_field` puts each video of a record among the record's media as a
`VideoRef` (media/video.py), in the order of the conversation's `<video>` / `<image>` markers
(caption template: images, then videos, then the text). `VideoDocs` is what the record pipeline
(sources/multimodal.py) calls for them:

  plan    probe the container's headers (no frame is decoded) and apply the spec's `videos` rule; the
          plan travels with the reference in the block's media table, so the gather needs no probe;
  decode  open the video again at gather, seek and decode the planned frames only, patchify
          (one decode pass per delivered video);
  clips   with `videos.clip`, a record holding one video whose frames exceed `max_frames` becomes one
          record per window (`clip_block`): each window is its own sample, with its own sample id.

Where the bytes come from: `FormatReader.video_input` (a local path is handed to FFmpeg as a path, so a
probe reads only the headers; a WebDataset member, a remote file or inline bytes are read into memory).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa

from plait.media.registry import KINDS, VIDEO
from plait.media.video import BadVideo, VideoPlan, VideoPolicy, VideoRef
from plait.sources.reader import RawBlock
from plait.spec import Spec

MAX_WINDOWS = 4096  # clip windows per record (a 2-hour video at 2 fps and 768 frames a window needs 19)
VIDEO_KIND = KINDS.index(VIDEO)  # ImagePayload.kind of a video (0: an image)


def video_policy(spec: Spec) -> VideoPolicy | None:
    """The spec's video rule (None without a `videos` and an `images` section): the video medium's."""
    return VIDEO.medium.policy(spec)


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
        medium = VIDEO.medium
        return medium.plan(self.policy, medium.probe(self.reader.video_input(path, vref.ref)), vref.window)

    def planned_ref(self, vref: VideoRef, plan: VideoPlan) -> VideoRef:
        """The reference the media table keeps: with its plan."""
        return replace(vref, plan=plan)

    def decode(self, path: str, vref: VideoRef, out: np.ndarray | None = None) -> np.ndarray:
        """The planned frames as uint8 patch rows [plan.rows, patch*patch*3], into `out` when given
        (BadVideo on failure)."""
        if vref.plan is None:
            raise BadVideo("a video reference reached the gather unplanned")
        return VIDEO.medium.decode(self.reader.video_input(path, vref.ref), vref.plan, self.policy, out=out)

    def payload_grid(self, plan: VideoPlan) -> tuple[int, int, int]:
        """The grid of its pixel rows in a payload: (frames, h, w), t*temporal_patch frames."""
        return len(plan.indices), plan.grid[1], plan.grid[2]

    def clip_block(self, path: str, raw: RawBlock, bad) -> RawBlock:
        """With `clip`: the block with every record that holds exactly one video replaced by one record per
        clip window of its frames (others stay whole). A block's positions are then its windows: record r
        takes positions offset_r .. offset_r + windows_r - 1 (a bad record one), and its windows' rows are
        first_row * MAX_WINDOWS + those positions (unique across blocks while a record has at most
        MAX_WINDOWS windows). A video whose headers fail is reported (`bad(path, name, reason)`) and its
        record dropped."""
        windows = np.ones(raw.num_records, np.int64)
        plans: dict[int, list] = {}
        for rec, r in zip(raw.records or [], raw.ok_index):
            videos = [m for m in rec.images if isinstance(m, VideoRef)]
            if len(videos) != 1:
                continue
            try:
                info = VIDEO.medium.probe(self.reader.video_input(path, videos[0].ref))
                n = min(self.policy.windows(info), MAX_WINDOWS)
                plans[int(r)] = [self.policy.plan(info, w) for w in range(n)]
            except BadVideo as e:
                bad(path, rec.name, f"video {videos[0].ref if isinstance(videos[0].ref, str) else '<bytes>'}: {e}")
                plans[int(r)] = []
            windows[int(r)] = max(1, len(plans[int(r)]))
        offset = np.cumsum(windows) - windows
        records, ok = [], []
        for rec, r in zip(raw.records or [], raw.ok_index):
            r = int(r)
            if r not in plans:
                records.append(rec)
                ok.append(offset[r])
                continue
            for w, plan in enumerate(plans[r]):
                media = [replace(m, window=w, plan=plan) if isinstance(m, VideoRef) else m for m in rec.images]
                records.append(replace(rec, images=media, name=rec.name if len(plans[r]) == 1 else f"{rec.name}#clip{w}"))
                ok.append(offset[r] + w)
        return RawBlock(raw.first_row * MAX_WINDOWS, int(windows.sum()), np.asarray(ok, np.int64),
                        pa.array([""] * len(records), pa.string()), [], records)
