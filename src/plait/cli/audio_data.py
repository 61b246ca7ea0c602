"""Generated speech-like clips for `plait demo --audio` and `plait bench audio` (needs PyAV).

The clips come from plait.media.audio_synth (a voiced source gliding 90-240 Hz with syllable-rate
loudness, a chirp and noise), in every container the audio module reads -- WAV, FLAC, MP3, Ogg/Opus,
M4A/AAC -- at 8, 16, 22.05, 44.1 and 48 kHz (Opus: the rates libopus takes) in 1, 2 or 6 channels (MP3:
at most 2). `write_audio_source` writes them with a LLaVA-style JSON ({id, audio, conversations} with an
`<audio>` marker), paths relative to the folder (the source's image_root).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RATES = (8000, 16000, 22050, 44100, 48000)
CHANNELS = (1, 2, 1, 6)  # mostly mono and stereo, now and then 5.1
DEMO_CLIPS = 48  # `plait demo --audio`: more tokens than its share of one step


def write_clips(folder: Path, n: int, *, shortest: float = 2.0, longest: float = 20.0, seed: int = 0) -> list[Path]:
    """n clips in folder, the containers in turn, rates, channels and durations drawn from `seed`."""
    from plait.media.audio_synth import CONTAINERS, OPUS_RATES, STEREO_ONLY, encode, speech_like

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    exts = list(CONTAINERS)
    paths = []
    for i in range(n):
        ext = exts[i % len(exts)]
        rate = int(rng.choice([r for r in RATES if r in OPUS_RATES] if ext == "ogg" else RATES))
        channels = CHANNELS[i % len(CHANNELS)]
        channels = min(channels, 2) if ext in STEREO_ONLY else channels
        seconds = float(rng.uniform(shortest, longest))
        path = folder / f"clip{i:04d}.{ext}"
        path.write_bytes(encode(speech_like(rate, seconds, channels, seed=seed + i), rate, ext))
        paths.append(path)
    return paths


def write_audio_source(folder: Path, n: int = 16, *, longest: float = 20.0, seed: int = 20261205) -> Path:
    """n clips in folder/audio and folder/audio.json (LLaVA-style, one `<audio>` per record). Returns the
    JSON's path."""
    rng = np.random.default_rng(seed)
    clips = write_clips(folder / "audio", n, shortest=1.0, longest=longest, seed=seed)
    questions = ("What is said in this clip?", "Transcribe the speech.", "Who is speaking, and how?",
                 "Summarise what you hear.")
    recs = []
    for i, path in enumerate(clips):
        answer = " ".join(rng.choice(["ka", "lo", "mira", "ten", "su", "vo", "rapha", "el"], size=int(rng.integers(4, 24))))
        recs.append({"id": f"audio-{i}", "audio": f"audio/{path.name}", "conversations": [
            {"from": "human", "value": f"<audio>\n{questions[i % len(questions)]}"},
            {"from": "gpt", "value": answer}]})
    path = folder / "audio.json"
    path.write_text(json.dumps(recs))
    return path


def audio_source_spec(path: Path, *, name: str = "audio") -> dict:
    """The source entry of `write_audio_source`'s JSON (byte-level text: eos 257)."""
    return {"name": name, "path": str(path), "format": "jsonl", "text_field": "conversations", "audio_field": "audio",
            "image_root": str(path.parent), "template": "chat", "eos": 257}


def demo_audio_spec(base: Path, audio_token_id: int, clips: int | None = None) -> Path:
    """`plait demo --audio`: beside the demo's spec `base` (demo.yaml, or demo-video.yaml with --video), the
    same spec plus `clips` (DEMO_CLIPS) generated clips (LLaVA-style JSON in base's folder/audio, written once) as
    base-audio.yaml. `base` and its digest stay as they are."""
    import yaml

    cache = base.parent
    path = cache / f"{base.stem}-audio.yaml"
    if path.exists():
        return path
    if not (cache / "audio" / "audio.json").exists():
        write_audio_source(cache / "audio", clips or DEMO_CLIPS, longest=12.0)
    spec = yaml.safe_load(base.read_text())
    spec["sources"].append({"name": "audio", "path": "audio/audio.json", "format": "jsonl",
                            "text_field": "conversations", "audio_field": "audio", "image_root": "audio",
                            "template": "chat", "tokenizer": "tokenizer.json", "bos": 0, "eos": 1, "weight": 0.05})
    spec["audio"] = {"audio_token_id": audio_token_id, "policy": "qwen2audio", "mel_bins": 128}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
