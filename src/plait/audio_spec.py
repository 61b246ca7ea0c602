"""The spec's audio parts: the `audio` section (window policy, placeholder id, mel bins, the audio encoder's
cost) and a source's `audio_field` checks.

Apart from spec.py (which imports them) to keep that file small; see docs/audio.md for the fields. The
policies are plait.media.audio's (`qwen2audio`: Qwen2-Audio's padded 30 s windows; `chunked`:
Qwen2.5-Omni's encoder on chunks of `chunk_seconds`), the encoder's default dimensions Whisper-large-v3's,
the encoder of both models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from plait.spec_sections import EncoderSpec

AUDIO_FORMATS = ("parquet", "jsonl", "webdataset")  # formats that read an audio_field
AUDIO_EXTENSIONS = ("wav", "flac", "mp3", "ogg", "opus", "oga", "m4a")  # webdataset audio members
WHISPER_LARGE = {"hidden": 1280, "layers": 32, "ffn": 5120}  # Qwen2-Audio's and Qwen2.5-Omni's audio encoder
AUDIO_FIELD_HELP = ("the sample's audio clip(s): webdataset: member extensions ('wav;flac;mp3;ogg;opus;m4a'); parquet: "
                    "a column of bytes, paths or Hugging Face's struct {bytes, path}; jsonl/json: a key holding a path, "
                    "a list of paths (relative to image_root) or {\"path\" | \"bytes\"}. Needs the top-level `audio` section")


class AudioSpec(BaseModel):
    """How audio clips become windows, log-mel features, placeholder tokens and encoder cost
    (plait.media.audio.AudioPolicy)."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)  # as StrictModel

    policy: Literal["qwen2audio", "chunked"] = Field(
        "qwen2audio", description="qwen2audio: 30 s windows, the encoder on each padded window (Qwen2-Audio); "
        "chunked: the same features and tokens, the encoder on chunks of chunk_seconds (Qwen2.5-Omni)")
    audio_token_id: int = Field(ge=0, le=2**31 - 1, description="the placeholder id audio occupies in input_ids")
    mel_bins: Literal[80, 128] = Field(128, description="log-mel bins (Whisper v1/v2: 80; Qwen2-Audio, Qwen2.5-Omni: 128)")
    chunk_seconds: float = Field(2.0, gt=0, description="chunked: the encoder's chunk, a multiple of 0.01 s")
    encoder: EncoderSpec = Field(default_factory=lambda: EncoderSpec(**WHISPER_LARGE),
                                 description="the audio encoder's cost per attention span S: linear*S + quadratic*S^2 "
                                 "(default: Whisper-large-v3's dimensions)")

    @field_validator("chunk_seconds")
    @classmethod
    def _hundredths(cls, v: float) -> float:
        if abs(v * 100 - round(v * 100)) > 1e-6:
            raise ValueError(f"chunk_seconds must be a multiple of 0.01 s (one feature frame), got {v}")
        return v


def audio_used(v: AudioSpec | None, info: ValidationInfo) -> AudioSpec | None:
    """Spec's check of its `audio` section: there when a source reads audio, its id inside the vocabulary
    and apart from the other media's placeholder ids."""
    needing = [s.name for s in info.data.get("sources") or [] if s.audio_field is not None]
    if v is None and needing:
        raise ValueError(f"sources {needing} read audio: give `audio: {{audio_token_id: ..., policy: ...}}`")
    if v is None:
        return v
    vocab = info.data.get("vocab_size")
    if vocab is not None and v.audio_token_id >= vocab:
        raise ValueError(f"audio_token_id {v.audio_token_id} is outside the vocabulary (vocab_size {vocab})")
    images, videos = info.data.get("images"), info.data.get("videos")
    others = {"images.image_token_id": getattr(images, "image_token_id", None),
              "videos.video_token_id": getattr(videos, "video_token_id", None)}
    same = [name for name, token in others.items() if token == v.audio_token_id]
    if same:
        raise ValueError(f"audio_token_id {v.audio_token_id} is also {same[0]}: each medium needs its own placeholder id")
    return v


def check_audio_field(self) -> None:
    """SourceSpec's checks of `audio_field` (format, text field, webdataset extensions)."""
    if self.format is not None and self.format not in AUDIO_FORMATS:
        raise ValueError(f"audio_field: format {self.format} holds no audio (formats: {', '.join(AUDIO_FORMATS)})")
    if self.text_field is None or self.length_field is not None:
        raise ValueError("audio_field: an audio source needs text_field (tokenized around the clips) and no "
                         "length_field (placeholder counts come from the clips' headers)")
    exts = self.audio_extensions
    if self.format == "webdataset" and (not exts or set(exts) - set(AUDIO_EXTENSIONS)):
        raise ValueError(f"audio_field: unknown audio extension(s) in {self.audio_field!r} "
                         f"(known: {', '.join(AUDIO_EXTENSIONS)})")
