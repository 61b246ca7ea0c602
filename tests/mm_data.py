"""Small image-text datasets for the multimodal tests: LLaVA JSON (interleaved images), WebDataset tar
shards, Parquet with an image column. Images are JPEG/PNG/WebP of varied sizes and aspect ratios."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

FORMATS = ("JPEG", "PNG", "WEBP")
EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
TOKEN_ID = 300  # the placeholder id (byte-level text ids are 0..255; eos 257)
EOS = 257
IMAGES = {"image_token_id": TOKEN_ID, "patch": 14, "merge": 2, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16}


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x * y + seed) % 256], axis=-1)
    arr = (arr + rng.integers(0, 8, arr.shape)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt)
    return buf.getvalue()


def sizes(i: int) -> tuple[int, int, str]:
    """A varied (width, height, format) for image i: aspect ratios from 1:3 to 3:1."""
    rng = np.random.default_rng(1000 + i)
    w, h = (int(v) for v in rng.integers(20, 200, size=2))
    return w, h, FORMATS[i % 3]


def llava(folder: Path, n: int = 24, *, max_images: int = 3, jsonl: bool = False, bad: dict | None = None) -> dict:
    """A LLaVA-style JSON (array) of n conversations with 0..max_images images each, images in
    folder/images; `bad` maps a record index to a replacement record. Returns the source's spec entry."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    recs = []
    for i in range(n):
        names = []
        for j in range(i % (max_images + 1)):
            w, h, fmt = sizes(i * 7 + j)
            name = f"images/{i:04d}_{j}.{EXT[fmt]}"
            (folder / name).write_bytes(image_bytes(w, h, fmt, seed=i * 7 + j))
            names.append(name)
        question = "what is " + " and ".join("<image>" for _ in names) + f" in picture {i}?"
        conv = [{"from": "human", "value": question}, {"from": "gpt", "value": f"it is thing {i}. " * (1 + i % 4)}]
        recs.append({"id": str(i), "image": names[0] if len(names) == 1 else names, "conversations": conv})
    for i, rec in (bad or {}).items():
        recs[i] = rec
    path = folder / ("data.jsonl" if jsonl else "data.json")
    path.write_text("\n".join(json.dumps(r) for r in recs) if jsonl else json.dumps(recs))
    return {"name": "llava", "path": str(path), "format": "jsonl", "text_field": "conversations",
            "image_field": "image", "image_root": str(folder), "template": "chat", "eos": EOS}


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def webdataset(folder: Path, shards: int = 3, per_shard: int = 10, *, extra: dict | None = None) -> dict:
    """`shards` tar shards shards-000000.tar... of per_shard caption samples (key.{jpg,png,webp} +
    key.txt); `extra[shard]` lists (member name, bytes) appended to that shard."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(folder / f"shards-{s:06d}.tar", "w") as tar:
            for k in range(per_shard):
                key = f"{s:03d}{k:05d}"
                w, h, fmt = sizes(s * 100 + k)
                add_member(tar, f"{key}.{EXT[fmt]}", image_bytes(w, h, fmt, seed=s * 100 + k))
                add_member(tar, f"{key}.txt", f"a caption of sample {key} ".encode() * (1 + k % 3))
            for name, data in (extra or {}).get(s, []):
                add_member(tar, name, data)
    return {"name": "wds", "path": str(folder / f"shards-{{000000..{shards - 1:06d}}}.tar"), "format": "webdataset",
            "text_field": "txt", "image_field": "jpg;png;webp", "eos": EOS}


def parquet(folder: Path, n: int = 20, *, row_group_size: int = 5, bad: dict | None = None) -> dict:
    """A Parquet file with a caption column and an image column of struct<bytes, path> (the Hugging
    Face `Image` feature's layout); `bad[i]` replaces row i's image bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    images, captions = [], []
    for i in range(n):
        w, h, fmt = sizes(500 + i)
        data = (bad or {}).get(i, image_bytes(w, h, fmt, seed=500 + i))
        images.append({"bytes": data, "path": f"img{i}.{EXT[fmt]}"})
        captions.append(f"caption number {i} " * (1 + i % 3))
    t = pa.table({"caption": captions, "image": pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))})
    pq.write_table(t, folder / "data.parquet", row_group_size=row_group_size)
    return {"name": "pq", "path": str(folder / "data.parquet"), "text_field": "caption", "image_field": "image",
            "eos": EOS}


def mm_spec(sources: list[dict], *, seq_len: int = 256, microbatches: int = 2, dp: int = 2, max_patches: int = 200,
            **extra) -> dict:
    spec = {"sources": sources, "images": dict(IMAGES),
            "packing": {"seq_len": seq_len, "microbatches": microbatches, "max_patches": max_patches},
            "topology": {"dp": dp}, "cost": {"linear": 1.0, "quadratic": 0.001, "encoder": {"linear": 2.0, "quadratic": 0.01}}}
    spec.update(extra)
    return spec
