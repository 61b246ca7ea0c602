"""Short generated videos for `plait demo --video` and `plait bench video` (needs plait[video]).

Each video is a moving gradient with a bouncing square, encoded with PyAV: H.264 in MP4 (most), MPEG-4
Part 2 in MOV and VP9 in WebM where the FFmpeg build has the encoder; sides 96..320 px, 10..30 fps,
1..`max_seconds` s. `write_video_source` writes them with a LLaVA-Video JSON ({id, video, conversations}
with a `<video>` marker), paths relative to the folder (the source's image_root).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CODECS = (("libx264", "mp4"), ("libx264", "mp4"), ("mpeg4", "mov"), ("libvpx-vp9", "webm"))


def encode_video(path: Path, codec: str, width: int, height: int, fps: int, frames: int, seed: int) -> None:
    import av

    rng = np.random.default_rng(seed)
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    y, x = np.ogrid[0:height, 0:width]
    fmt = {"mov": "mov", "webm": "webm", "mp4": "mp4"}[path.suffix[1:]]
    with av.open(str(path), mode="w", format=fmt) as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.codec_context.gop_size = 2 * fps
        for i in range(frames):
            t = ((x / width + y / height) / 2 + i / max(frames, 1)) % 1.0
            arr = (c0 * (1 - t[..., None]) + c1 * t[..., None]).astype(np.uint8)
            side = max(8, min(width, height) // 4)
            px = int((np.sin(i / 7 + seed) + 1) / 2 * (width - side))
            py = int((np.cos(i / 5 + seed) + 1) / 2 * (height - side))
            arr[py:py + side, px:px + side] = 255 - c0
            for packet in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in s.encode():
            out.mux(packet)


def write_video_source(folder: Path, n: int = 8, *, seed: int = 20261202, max_seconds: float = 6.0,
                       max_side: int = 320) -> Path:
    """n videos in folder/video and folder/videos.json (LLaVA-Video). Returns the JSON's path."""
    import av

    rng = np.random.default_rng(seed)
    (folder / "video").mkdir(parents=True, exist_ok=True)
    codecs = [c for c in CODECS if c[0] in av.codecs_available] or [("mpeg4", "mp4")]
    recs = []
    for i in range(n):
        codec, ext = codecs[i % len(codecs)]
        w, h = (int(v) // 16 * 16 for v in rng.integers(96, max_side + 1, size=2))
        fps = int(rng.choice([10, 15, 24, 30]))
        seconds = float(rng.uniform(1.0, max_seconds))
        name = f"video/{i:04d}.{ext}"
        encode_video(folder / name, codec, w, h, fps, max(2, int(seconds * fps)), seed + i)
        question = f"<video>\nWhat moves in clip {i}?"
        answer = f"A square bounces over a gradient for {seconds:.1f} seconds."
        recs.append({"id": f"video-{i}", "video": name,
                     "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    path = folder / "videos.json"
    path.write_text(json.dumps(recs))
    return path


def video_source_spec(path: Path, *, name: str = "video") -> dict:
    """The source entry of `write_video_source`'s JSON (byte-level text: eos 257)."""
    return {"name": name, "path": str(path), "format": "jsonl", "text_field": "conversations", "video_field": "video",
            "image_root": str(path.parent), "template": "chat", "eos": 257}


def demo_video_spec(cache: Path, image_token_id: int) -> Path:
    """`plait demo --video`: demo-video.yaml beside demo.yaml, its sources plus 12 short videos (LLaVA-
    Video JSON in cache/video, written once). demo.yaml and its digest stay as they are."""
    import yaml

    path = cache / "demo-video.yaml"
    if path.exists():
        return path
    write_video_source(cache / "video", 12)
    spec = yaml.safe_load((cache / "demo.yaml").read_text())
    spec["sources"].append({"name": "video", "path": "video/videos.json", "format": "jsonl",
                            "text_field": "conversations", "video_field": "video", "image_root": "video",
                            "template": "chat", "tokenizer": "tokenizer.json", "bos": 0, "eos": 1, "weight": 0.08})
    spec["videos"] = {"video_token_id": image_token_id + 1, "fps": 2.0, "min_frames": 4, "max_frames": 16,
                      "min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64, "total_pixels": 28 * 28 * 512}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
