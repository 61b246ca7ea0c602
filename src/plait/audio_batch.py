"""The audio fields of a micro-batch: a payload's clips (their log-mel windows), cut per micro-batch.

A SourceLoader's payload holds a fetch's clips apart from its pixels (`AudioPayload`): every window of
every clip, in item order, as the Hugging Face Qwen2-Audio processor returns them -- `input_features`
[windows, mel_bins, 3000] float32 and `feature_attention_mask` [windows, 3000] int32 -- with per clip its
window count, its item, its seconds and placeholder tokens. The Constructor cuts each micro-batch's share
(`audio_fields`): the windows of the clips whose documents it holds, `audio_windows` and `audio_document`
per clip; `audio_stats` gives what `plait run` / `inspect` show (seconds, clips, per-clip windows/tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from plait.ragged import ragged_arange

__all__ = ["AudioPayload", "audio_fields", "audio_stats", "merge_audio", "subset_audio"]


class AudioPayload(NamedTuple):
    """The clips of fetched items, in item order (an item's clips in their document's order)."""

    features: np.ndarray  # float32 [windows, mel_bins, 3000]
    mask: np.ndarray  # int32 [windows, 3000]
    windows: np.ndarray  # int64 [clips]
    item: np.ndarray  # int64 [clips], increasing
    seconds: np.ndarray  # float64 [clips]: the planned clip's duration at 16 kHz
    tokens: np.ndarray  # int64 [clips]: its placeholder run
    token_id: int

    @classmethod
    def of_clips(cls, features: list, item: np.ndarray, token_id: int) -> "AudioPayload":
        """From per-clip plait.media.audio.AudioFeatures (item order)."""
        windows = np.asarray([len(f.input_features) for f in features], np.int64)
        return cls(np.concatenate([f.input_features for f in features]), np.concatenate([f.feature_attention_mask
                   for f in features]), windows, np.asarray(item, np.int64),
                   np.asarray([f.plan.seconds for f in features], np.float64),
                   np.asarray([f.plan.tokens for f in features], np.int64), int(token_id))


def subset_audio(p: AudioPayload, keep: np.ndarray) -> AudioPayload | None:
    """The clips `keep` (indices, increasing) of `p`; None when none is kept."""
    if not len(keep):
        return None
    rows = ragged_arange((np.cumsum(p.windows) - p.windows)[keep], p.windows[keep])
    return p._replace(features=p.features[rows], mask=p.mask[rows], windows=p.windows[keep], item=p.item[keep],
                      seconds=p.seconds[keep], tokens=p.tokens[keep])


def merge_audio(parts: list[tuple[np.ndarray, AudioPayload | None]]) -> AudioPayload | None:
    """One AudioPayload of parts fetched for the request's items `sel` (each part's items numbered in its
    own order), ordered by item (stable: an item's clips keep their order)."""
    parts = [(sel, p) for sel, p in parts if p is not None and len(p.item)]
    if not parts:
        return None
    if len(parts) == 1:
        sel, p = parts[0]
        return p._replace(item=np.asarray(sel)[p.item])
    item = np.concatenate([np.asarray(sel)[p.item] for sel, p in parts])
    joined = AudioPayload(*(np.concatenate([getattr(p, f) for _, p in parts]) for f in AudioPayload._fields[:-1]),
                          parts[0][1].token_id)._replace(item=item)
    return subset_audio(joined, np.argsort(item, kind="stable"))


def audio_fields(audio: AudioPayload | None, a: int, b: int) -> dict:
    """The audio fields of the micro-batch holding items a..b-1: none when the rank fetched no clip, empty
    arrays when this micro-batch holds none of them."""
    if audio is None:
        return {}
    lo, hi = np.searchsorted(audio.item, [a, b])
    row = np.concatenate([[0], np.cumsum(audio.windows)])
    return {"input_features": audio.features[row[lo]:row[hi]], "feature_attention_mask": audio.mask[row[lo]:row[hi]],
            "audio_windows": audio.windows[lo:hi], "audio_document": audio.item[lo:hi] - a}


def audio_stats(audio: AudioPayload | None, a: int, b: int) -> dict:
    """The micro-batch's audio figures (items a..b-1): clips, seconds, and per clip its seconds, windows
    and placeholder tokens (in `audio_document`'s order); none when the rank fetched no clip."""
    if audio is None:
        return {}
    lo, hi = np.searchsorted(audio.item, [a, b])
    seconds = audio.seconds[lo:hi]
    return {"audio_clips": int(hi - lo), "audio_seconds": float(seconds.sum()), "audio_clip_seconds": seconds.tolist(),
            "audio_clip_windows": audio.windows[lo:hi].tolist(), "audio_clip_tokens": audio.tokens[lo:hi].tolist(),
            "audio_token_id": int(audio.token_id)}
