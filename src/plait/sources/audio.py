"""Audio clips in media-text records: references, header-only planning, decode at gather.

A reader that reads an `audio_field` puts each clip of a record among the record's media as an
`AudioRef`, in the order of the conversation's `<audio>` / `<image>` / `<video>` markers (caption
template: images, videos, then clips, then the text). `AudioDocs` is what the record pipeline
(sources/multimodal.py) calls for them:

  plan    probe the container's headers (plait.media.audio.probe: no packet decoded) and apply the
          spec's window policy; the plan and header info travel with the reference in the block's media
          table, so the gather needs no probe;
  decode  decode once at gather (fitted to the planned length) and compute the log-mel features.

Where the bytes come from: `FormatReader.video_input` (a local path is handed to FFmpeg as a path; a
WebDataset member, a remote file or inline bytes are read into memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from plait.errors import PlaitError
from plait.media.audio import AudioFeatures, AudioInfo, AudioPlan, probe
from plait.media.base import MediaError, field_media
from plait.media.registry import audio_policy
from plait.spec import Spec

__all__ = ["AudioDocs", "AudioRef", "ClipPlan", "audio_list"]


@dataclass(frozen=True)
class AudioRef:
    """One clip of a record: inline bytes, or what the reader resolves (a member name, a path); once
    planned, its header info and plan."""

    ref: bytes | str
    info: AudioInfo | None = None
    plan: AudioPlan | None = None


class ClipPlan(NamedTuple):
    """What the media table keeps of a planned clip (the shape every medium's plan gives it): its
    placeholder tokens, no image patches, no grid; `spans`, `spans_sq`: the audio encoder's units."""

    tokens: int
    spans: int
    spans_sq: int
    ref: AudioRef
    patches: int = 0
    grid: tuple[int, int, int] = (0, 0, 0)


def audio_list(value, root: str | None) -> list[AudioRef]:
    """A record's audio field as references (media.base.field_media). ValueError for anything else."""
    return [AudioRef(data) for data in field_media(value, root, "audio")]


class AudioDocs:
    """Plans and decodes a source's clips (module docstring)."""

    def __init__(self, spec: Spec, reader):
        self.policy = audio_policy(spec)
        self.token_id = spec.audio.audio_token_id
        self.reader = reader

    def plan(self, path: str, aref: AudioRef) -> ClipPlan:
        """What the media table keeps of the clip, its reference planned (MediaError when the headers are
        unusable)."""
        name = describe_clip(aref)
        info = probe(self.reader.video_input(path, aref.ref), name)
        try:
            plan = self.policy.plan(info)
        except PlaitError as e:  # too short to give a token
            raise MediaError(name, str(e)) from None
        spans = [int(s) for s in plan.spans]
        return ClipPlan(plan.tokens, sum(spans), sum(s * s for s in spans), AudioRef(aref.ref, info, plan))

    def decode(self, path: str, aref: AudioRef) -> AudioFeatures:
        """The clip's features (one decode pass; MediaError on failure)."""
        if aref.plan is None:
            raise MediaError(describe_clip(aref), "an audio reference reached the gather unplanned")
        features = self.policy.load(self.reader.video_input(path, aref.ref), aref.info, describe_clip(aref))
        if features.plan.tokens != aref.plan.tokens:
            raise MediaError(describe_clip(aref), f"decodes to {features.plan.tokens} tokens, planned at "
                                                  f"{aref.plan.tokens} from its headers")
        return features


def describe_clip(aref: AudioRef) -> str:
    return f"audio <{len(aref.ref)} inline bytes>" if isinstance(aref.ref, bytes) else f"audio {aref.ref}"
