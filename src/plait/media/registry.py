"""The media kinds a sample may hold, and what the rest of plait asks of each: its marker in a chat
template, the spec section and placeholder id it takes, its encoder, and its module's `Medium`.

Every medium's module (media/image.py, media/video.py, media/audio.py) gives one `MEDIUM` with the same
five things under the same names (the `Medium` protocol): `policy(spec)` (its spec section as a policy),
`probe` (the metadata read while planning: headers only, no decode, counted), `plan` (what the media
becomes, `placeholder_tokens(plan)` of them in input_ids), `decode` (once per delivery, at gather),
`encoder_units(plan)` (what its encoder's cost is computed on: plait.cost.EncoderCost.of_units) and
`batch_fields` (its part of a micro-batch). The rest of plait reaches a medium through `kind_of(ref)` and
`MediaKind.medium`, not through per-medium cases: the record pipeline (sources/multimodal.py) places each
media at its kind's marker, plans and decodes it by its medium, and expands its placeholder run with its
kind's id; the Planner adds each kind's encoder cost; the Constructor puts its fields in the micro-batch.

A fourth medium is a module here (its MEDIUM, whose `reference` wraps a record's media in a type with `kind`
set to its name), its spec
section (with its source field and, for WebDataset, `<name>_extensions`), and an entry in KINDS; the format
readers take every medium a source reads from `source_media` and `MediaKind.references`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

__all__ = ["AUDIO", "BY_NAME", "IMAGE", "KINDS", "MARKERS", "VIDEO", "MediaKind", "Medium", "audio_policy",
           "kind_of", "placeholder_ids", "source_media"]


class Medium(Protocol):
    """What plait asks of one medium; its module's `MEDIUM` gives it (module docstring)."""

    def policy(self, spec):
        """The spec's section for this medium as its policy (None: the spec has none)."""

    def probe(self, data, name: str | None = None):
        """Planning: what the headers say (no decode; a decode counter stays put). MediaError if unusable."""

    def plan(self, policy, info, window: int = 0):
        """What the media (its clip `window`, for a medium that cuts one into several samples) becomes."""

    def decode(self, data, planned, policy, name: str | None = None, out=None):
        """Gather: one decode of what `planned` (what planning kept) says, into `out` where it fits."""

    def placeholder_tokens(self, planned) -> int:
        """Placeholder ids the media takes in input_ids."""

    def encoder_units(self, planned) -> tuple[int, int]:
        """(units, squared units) of the media for its encoder's cost (plait.cost.EncoderCost.of_units):
        an image's patches, a video's patches attending per temporal patch, a clip's attention spans."""

    def batch_fields(self, payload, a: int, b: int) -> dict:
        """The media's fields in the micro-batch holding items a..b-1 of a rank's payload."""

    def reference(self, data):
        """One of a record's media (bytes, a path, a member name) as it stands in the record: its reference
        type (with `kind` its medium's name), or the data itself (an image's)."""


@dataclass(frozen=True)
class MediaKind:
    """One medium: `name`, its chat `marker`, the source field that lists it, the spec `section`, the
    section's placeholder-id field, the `encoder` that costs it (media sharing one share its capacity and
    coefficients) and the `module` under plait.media that gives its MEDIUM."""

    name: str
    marker: str
    source_field: str
    section: str
    token_field: str
    encoder: str
    module: str

    def token_id(self, spec) -> int | None:
        """This medium's placeholder id in `spec` (None: the spec has no section for it)."""
        section = getattr(spec, self.section, None)
        return None if section is None else int(getattr(section, self.token_field))

    @property
    def medium(self) -> Medium:
        """Its module's MEDIUM (imported on first use: a text-only job never loads Pillow or PyAV)."""
        return importlib.import_module(f"plait.media.{self.module}").MEDIUM

    def references(self, data: list) -> list:
        """A record's media of this kind (bytes, paths, member names) as they stand in the record
        (`Medium.reference`)."""
        reference = self.medium.reference
        return [reference(d) for d in data]

    def extensions(self, source) -> list[str]:
        """webdataset: the member extensions `source` lists for this medium (its `<name>_extensions`)."""
        return getattr(source, f"{self.name}_extensions")


IMAGE = MediaKind("image", "<image>", "image_field", "images", "image_token_id", "vision", "image")
VIDEO = MediaKind("video", "<video>", "video_field", "videos", "video_token_id", "vision", "video")
AUDIO = MediaKind("audio", "<audio>", "audio_field", "audio", "audio_token_id", "audio", "audio")
KINDS = (IMAGE, VIDEO, AUDIO)
MARKERS = {k.marker: k for k in KINDS}
BY_NAME = {k.name: k for k in KINDS}


def kind_of(ref) -> MediaKind:
    """The kind of a media reference in a record: its type's `kind` (a VideoRef's, an AudioRef's); an
    image is plain bytes or a path."""
    return BY_NAME[getattr(ref, "kind", "image")]


def source_media(source) -> list[tuple[MediaKind, str]]:
    """The media a source reads: (kind, its field: a column, a JSON key, webdataset extensions) for each
    kind whose `source_field` the source sets, in KINDS order."""
    return [(k, getattr(source, k.source_field)) for k in KINDS if getattr(source, k.source_field) is not None]


def placeholder_ids(spec) -> dict[str, int]:
    """Each medium's placeholder id that `spec` sets, by medium name."""
    return {k.name: k.token_id(spec) for k in KINDS if k.token_id(spec) is not None}


def audio_policy(spec):
    """The AudioPolicy of the spec's `audio` section (None without one): AUDIO.medium.policy."""
    return AUDIO.medium.policy(spec)
