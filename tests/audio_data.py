"""Audio test data: generated speech-like clips (plait.media.audio_synth) in WebDataset shards, a LLaVA-style
JSONL manifest with `<audio>` markers and a Parquet file of Hugging Face audio structs; the spec around them."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from mm_data import EOS, add_member

from plait.media.audio_synth import encode, speech_like

AUDIO_TOKEN_ID = 301
AUDIO = {"audio_token_id": AUDIO_TOKEN_ID, "policy": "qwen2audio", "mel_bins": 80}
# (extension, rate, channels, seconds): several containers, rates and channel counts
CLIPS = [("wav", 16000, 1, 1.3), ("flac", 22050, 2, 2.1), ("mp3", 44100, 1, 1.7), ("ogg", 48000, 2, 0.9),
         ("m4a", 24000, 1, 1.1), ("wav", 8000, 2, 31.5)]


def clip(k: int) -> tuple[str, bytes]:
    ext, rate, channels, seconds = CLIPS[k % len(CLIPS)]
    return ext, encode(speech_like(rate, seconds, channels, seed=k), rate, ext)


def webdataset_audio(folder: Path, shards: int = 2, per_shard: int = 4, *, extra: dict | None = None) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(folder / f"speech-{s:06d}.tar", "w") as tar:
            for k in range(per_shard):
                key = f"{s:03d}{k:05d}"
                ext, data = clip(s * per_shard + k)
                add_member(tar, f"{key}.{ext}", data)
                add_member(tar, f"{key}.txt", f"transcript of {key} ".encode() * (1 + k % 2))
            for name, data in (extra or {}).get(s, []):
                add_member(tar, name, data)
    return {"name": "wds_audio", "path": str(folder / f"speech-{{000000..{shards - 1:06d}}}.tar"),
            "format": "webdataset", "text_field": "txt", "audio_field": "wav;flac;mp3;ogg;m4a", "eos": EOS}


def llava_audio(folder: Path, n: int = 5) -> dict:
    """A JSONL manifest of conversations with `<audio>` markers and a key of clip paths."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        paths = []
        for j in range(1 + i % 2):
            ext, data = clip(10 + 2 * i + j)
            (folder / f"c{i}_{j}.{ext}").write_bytes(data)
            paths.append(f"c{i}_{j}.{ext}")
        turns = [{"from": "human", "value": "listen: " + " and ".join(["<audio>"] * len(paths))},
                 {"from": "gpt", "value": f"answer {i}"}]
        lines.append(json.dumps({"conversations": turns, "audio": paths}))
    (folder / "speech.jsonl").write_text("\n".join(lines) + "\n")
    return {"name": "llava_audio", "path": str(folder / "speech.jsonl"), "format": "jsonl", "text_field": "conversations",
            "audio_field": "audio", "template": "chat", "eos": EOS}


def parquet_audio(folder: Path, n: int = 4) -> dict:
    """A Parquet file of Hugging Face `Audio` structs {bytes, path}."""
    folder.mkdir(parents=True, exist_ok=True)
    structs = [{"bytes": clip(20 + i)[1], "path": f"a{i}.{clip(20 + i)[0]}"} for i in range(n)]
    t = pa.table({"text": [f"said {i}" for i in range(n)],
                  "audio": pa.array(structs, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))})
    pq.write_table(t, folder / "speech.parquet", row_group_size=2)
    return {"name": "pq_audio", "path": str(folder / "speech.parquet"), "text_field": "text", "audio_field": "audio",
            "eos": EOS}


def audio_spec(sources: list[dict], *, seq_len: int = 2048, microbatches: int = 2, dp: int = 2, **extra) -> dict:
    spec = {"sources": sources, "audio": dict(AUDIO),
            "packing": {"seq_len": seq_len, "microbatches": microbatches}, "topology": {"dp": dp},
            "cost": {"linear": 1.0, "quadratic": 0.001}}
    spec.update(extra)
    return spec
