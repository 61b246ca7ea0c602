"""Audio clips in media-text records: references, header-only planning, decode at gather.

A reader that reads an `audio_field` puts each clip of a record among the record's media as an
`AudioRef` (plait.media.audio), in the order of the conversation's `<audio>` / `<image>` / `<video>`
markers (caption template: images, videos, then clips, then the text). `AudioDocs` is what the record pipeline
(sources/multimodal.py) calls for them:

  plan    probe the container's headers (plait.media.audio.probe: no packet decoded) and apply the
          spec's window policy; the plan and header info travel with the reference in the block's media
          table, so the gather needs no probe;
  decode  decode once at gather (fitted to the planned length) and compute the log-mel features.

Where the bytes come from: `FormatReader.video_input` (a local path is handed to FFmpeg as a path; a
WebDataset member, a remote file or inline bytes are read into memory).
"""

from __future__ import annotations

from typing import NamedTuple

from plait.errors import PlaitError
from plait.media.audio import AudioFeatures, AudioInfo, AudioPlan, AudioRef, PlannedClip
from plait.media.base import MediaError
from plait.media.registry import AUDIO
from plait.spec import Spec

__all__ = ["AudioDocs", "ClipPlan"]


class ClipPlan(NamedTuple):
    """What the media table keeps of a planned clip (the shape every medium's plan gives it): its
    placeholder tokens, its planned reference, no image patches, no grid."""

    tokens: int
    ref: AudioRef
    patches: int = 0
    grid: tuple[int, int, int] = (0, 0, 0)

    @property
    def plan(self) -> AudioPlan:
        """The clip's AudioPlan (what the audio medium's encoder_units reads)."""
        return self.ref.plan


class AudioDocs:
    """Plans and decodes a source's clips (module docstring)."""

    def __init__(self, spec: Spec, reader):
        self.policy = AUDIO.medium.policy(spec)
        self.token_id = spec.audio.audio_token_id
        self.reader = reader

    def plan(self, path: str, aref: AudioRef) -> ClipPlan:
        """What the media table keeps of the clip, its reference planned (MediaError when the headers are
        unusable)."""
        name, medium = describe_clip(aref), AUDIO.medium
        info = medium.probe(self.reader.video_input(path, aref.ref), name)
        try:
            planned = medium.plan(self.policy, info)
        except PlaitError as e:  # too short to give a token
            raise MediaError(name, str(e)) from None
        return ClipPlan(medium.placeholder_tokens(planned), AudioRef(aref.ref, info, planned.plan))

    def planned_ref(self, aref: AudioRef, plan: ClipPlan) -> AudioRef:
        """The reference the media table keeps: with its header info and plan."""
        return plan.ref

    def decode(self, path: str, aref: AudioRef, out=None) -> AudioFeatures:
        """The clip's features (one decode pass; MediaError on failure)."""
        if aref.plan is None:
            raise MediaError(describe_clip(aref), "an audio reference reached the gather unplanned")
        features = AUDIO.medium.decode(self.reader.video_input(path, aref.ref), PlannedClip(aref.info, aref.plan),
                                       self.policy, describe_clip(aref))
        if features.plan.tokens != aref.plan.tokens:
            raise MediaError(describe_clip(aref), f"decodes to {features.plan.tokens} tokens, planned at "
                                                  f"{aref.plan.tokens} from its headers")
        return features


def describe_clip(aref: AudioRef) -> str:
    return f"audio <{len(aref.ref)} inline bytes>" if isinstance(aref.ref, bytes) else f"audio {aref.ref}"
