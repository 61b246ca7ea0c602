"""Small real videos for the video tests, encoded with PyAV: several codecs, sizes, frame rates and
durations, one with a variable frame rate. Every frame's colour encodes its index, so a test can tell
which frame was decoded."""

from __future__ import annotations

import functools
import io
import json
import tarfile
from fractions import Fraction
from pathlib import Path

import numpy as np

av = __import__("pytest").importorskip("av")

TOKEN_ID = 300
VIDEO_TOKEN_ID = 301
EOS = 257
IMAGES = {"image_token_id": TOKEN_ID, "patch": 14, "merge": 2, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}
VIDEOS = {"video_token_id": VIDEO_TOKEN_ID, "fps": 2.0, "min_frames": 4, "max_frames": 16,
          "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 8, "total_pixels": 28 * 28 * 64}
# (codec, container, width, height, fps, seconds)
KINDS = [("libx264", "mp4", 96, 64, 24, 2.0), ("mpeg4", "mp4", 64, 64, 10, 3.0), ("libvpx-vp9", "webm", 80, 48, 12, 1.5),
         ("libx264", "mkv", 128, 72, 30, 4.0), ("mpeg4", "mov", 160, 96, 15, 1.0)]


def frame_pixels(i: int, width: int, height: int) -> np.ndarray:
    """Frame i: a gradient whose level moves with i (so frames differ, and compress)."""
    y, x = np.mgrid[0:height, 0:width]
    r = (x * 255 // max(width - 1, 1) + 9 * i) % 256
    g = (y * 255 // max(height - 1, 1) + 5 * i) % 256
    b = np.full_like(x, (40 + 7 * i) % 256)
    return np.stack([r, g, b], axis=-1).astype(np.uint8)


@functools.lru_cache(maxsize=64)  # the same few videos serve many tests: encode each once per process
def encode(codec: str = "libx264", container: str = "mp4", width: int = 96, height: int = 64, fps: int = 24,
           seconds: float = 2.0, *, vfr: bool = False, gop: int = 12) -> bytes:
    """An encoded video in memory. `vfr`: frame times jitter (intervals of 1/2, 1 and 3/2 frames)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format={"mkv": "matroska", "mov": "mov"}.get(container, container)) as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.codec_context.gop_size = gop
        if vfr:
            s.codec_context.time_base = Fraction(1, fps * 2)
        n = int(round(seconds * fps))
        t = 0
        for i in range(n):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            if vfr:
                frame.pts, frame.time_base = t, Fraction(1, fps * 2)
                t += (1, 2, 3)[i % 3]
            for packet in s.encode(frame):
                out.mux(packet)
        for packet in s.encode():
            out.mux(packet)
    return buf.getvalue()


def write_videos(folder: Path, kinds=KINDS) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (codec, ext, w, h, fps, sec) in enumerate(kinds):
        p = folder / f"v{i:02d}.{ext}"
        p.write_bytes(encode(codec, ext, w, h, fps, sec))
        paths.append(p)
    return paths


def llava_video(folder: Path, n: int = 6, *, with_images: bool = True, bad: dict | None = None) -> dict:
    """A LLaVA-Video JSON: record i has one video (and, every other record, an image before it)."""
    from tests.mm_data import image_bytes

    folder.mkdir(parents=True, exist_ok=True)
    videos = write_videos(folder / "videos", [KINDS[i % len(KINDS)] for i in range(n)])
    recs = []
    for i, v in enumerate(videos):
        rec = {"id": str(i), "video": str(v.relative_to(folder))}
        question = f"<video>\nwhat happens in clip {i}?"
        if with_images and i % 2:
            name = f"img{i}.png"
            (folder / name).write_bytes(image_bytes(40 + i * 7, 30 + i * 5, "PNG", seed=i))
            rec["image"] = name
            question = "<image> and " + question
        rec["conversations"] = [{"from": "human", "value": question}, {"from": "gpt", "value": f"thing {i} moves."}]
        recs.append(rec)
    for i, rec in (bad or {}).items():
        recs[i] = rec
    path = folder / "data.json"
    path.write_text(json.dumps(recs))
    return {"name": "llava_video", "path": str(path), "format": "jsonl", "text_field": "conversations",
            "image_field": "image", "video_field": "video", "image_root": str(folder), "template": "chat", "eos": EOS}


def webdataset_video(folder: Path, shards: int = 2, per_shard: int = 3, *, extra: dict | None = None) -> dict:
    """Tar shards of key.{mp4,webm,mkv,mov} + key.json ({"caption": ...})."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(folder / f"shards-{s:06d}.tar", "w") as tar:
            for k in range(per_shard):
                codec, ext, w, h, fps, sec = KINDS[(s * per_shard + k) % len(KINDS)]
                key = f"{s:03d}{k:05d}"
                _add(tar, f"{key}.{ext}", encode(codec, ext, w, h, fps, sec))
                _add(tar, f"{key}.json", json.dumps({"caption": f"clip {key} of a moving gradient"}).encode())
            for name, data in (extra or {}).get(s, []):
                _add(tar, name, data)
    return {"name": "wds_video", "path": str(folder) + "/shards-{000000..%06d}.tar" % (shards - 1),
            "format": "webdataset", "text_field": "json:caption", "video_field": "mp4;webm;mkv;mov", "eos": EOS}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def parquet_video(folder: Path, n: int = 6, *, inline: bool = True) -> dict:
    """A Parquet file with a caption column and a video column of bytes (`inline`) or of paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    kinds = [KINDS[(i + 2) % len(KINDS)] for i in range(n)]
    if inline:
        column = pa.array([encode(*k) for k in kinds], pa.binary())
    else:
        column = pa.array([p.name for p in write_videos(folder, kinds)], pa.string())
    table = pa.table({"caption": [f"parquet clip {i}" for i in range(n)], "video": column})
    pq.write_table(table, folder / "data.parquet", row_group_size=4)
    return {"name": "pq_video" if inline else "pq_video_paths", "path": str(folder / "data.parquet"), "format": "parquet", "text_field": "caption",
            "video_field": "video", "eos": EOS, **({} if inline else {"image_root": str(folder)})}


def video_spec(sources: list[dict], *, seq_len: int = 512, microbatches: int = 2, dp: int = 2,
               max_patches: int = 800, **extra) -> dict:
    spec = {"sources": sources, "images": dict(IMAGES), "videos": dict(VIDEOS),
            "packing": {"seq_len": seq_len, "microbatches": microbatches, "max_patches": max_patches},
            "topology": {"dp": dp}, "cost": {"linear": 1.0, "quadratic": 0.001, "encoder": {"linear": 2.0, "quadratic": 0.01}}}
    spec.update(extra)
    return spec


def audio_only() -> bytes:
    """A Matroska file with one audio stream and no video stream."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        s = out.add_stream("mp2", rate=16000)
        for i in range(10):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1152), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = 16000, i * 1152, Fraction(1, 16000)
            for p in s.encode(frame):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()
