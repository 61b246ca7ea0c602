"""The media kinds a sample may hold, and what the rest of plait asks of each: its marker in a chat
template, the spec section and placeholder id it takes, and how a spec's section becomes its policy.

A reader finds a sample's media by kind (a source's `image_field`, `video_field`, `audio_field`); the
record pipeline (sources/multimodal.py) places each at its kind's marker, plans it by its kind's probe
and policy, and expands its placeholder run with its kind's id; the Planner adds each kind's encoder
cost (planning/step_costs.py, from plait.cost.EncoderCost); a gather decodes it once; the Constructor
puts its arrays in the micro-batch. A fourth medium is a module here, its spec section and an entry in
KINDS.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUDIO", "IMAGE", "KINDS", "MARKERS", "VIDEO", "MediaKind", "audio_policy", "placeholder_ids"]


@dataclass(frozen=True)
class MediaKind:
    """One medium: `name`, its chat `marker`, the source field that lists it, the spec `section` and
    the section's placeholder-id field."""

    name: str
    marker: str
    source_field: str
    section: str
    token_field: str

    def token_id(self, spec) -> int | None:
        """This medium's placeholder id in `spec` (None: the spec has no section for it)."""
        section = getattr(spec, self.section, None)
        return None if section is None else int(getattr(section, self.token_field))


IMAGE = MediaKind("image", "<image>", "image_field", "images", "image_token_id")
VIDEO = MediaKind("video", "<video>", "video_field", "videos", "video_token_id")
AUDIO = MediaKind("audio", "<audio>", "audio_field", "audio", "audio_token_id")
KINDS = (IMAGE, VIDEO, AUDIO)
MARKERS = {k.marker: k for k in KINDS}


def placeholder_ids(spec) -> dict[str, int]:
    """Each medium's placeholder id that `spec` sets, by medium name."""
    return {k.name: k.token_id(spec) for k in KINDS if k.token_id(spec) is not None}


def audio_policy(spec):
    """The AudioPolicy of the spec's `audio` section (None without one)."""
    from plait.media.audio import AudioPolicy

    a = spec.audio
    return None if a is None else AudioPolicy(kind=a.policy, mel_bins=a.mel_bins, chunk_seconds=a.chunk_seconds)
