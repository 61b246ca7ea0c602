"""The embedded demo: a small multi-source dataset, generated once, and two specs over it.

Five sources with clearly different document-length distributions and formats:
  chat  short chat turns              JSONL (.jsonl.gz), text, median ~70 tokens
  web   web pages                     Parquet, text,       median ~250 tokens, tail to ~4k
  code  source files                  JSONL (.jsonl.zst), text, median ~2.8k tokens, tail to ~35k
  long  long documents                Parquet, pre-tokenized list<int32>, 4k .. 64k tokens (median ~10k)
  image image-text pairs              LLaVA-style JSONL + image_root: 300 JPEG/PNG images, 64..640 px
                                      sides, aspect ratios 1:4..4:1, each with a short caption (4..40 words);
                                      at most 400 patches (100 tokens) per image
Text sources use a byte-level BPE tokenizer trained here with Hugging Face `tokenizers` (no download).
demo.yaml streams all five (images: dynamic policy, placeholder id 4096, max_patches, a ViT-L-like
cost.encoder); demo-text.yaml the four text sources alone (demo-v1's demo.yaml: same stream digest).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

DEMO_VERSION = "v2"
VOCAB_SIZE = 4096
IMAGE_TOKEN_ID = VOCAB_SIZE  # the placeholder id: one past the text vocabulary (an added special token)
AUDIO_TOKEN_ID = VOCAB_SIZE + 2  # `plait demo --audio`'s (video's is VOCAB_SIZE + 1)
N_IMAGES = 300


def default_cache_dir() -> Path:
    root = os.environ.get("PLAIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "plait")
    return Path(root) / f"demo-{DEMO_VERSION}"


_SYLLABLES = np.array(
    "ka lo mi ra ten su vo ph ex an de ri ol um ba ne sti qu ar el in on is at pr ch sh th wo".split()
)


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    lens = rng.integers(1, 4, size=n)
    idx = rng.integers(0, len(_SYLLABLES), size=int(lens.sum()))
    parts = _SYLLABLES[idx]
    bounds = np.cumsum(lens)[:-1]
    return np.array(["".join(p) for p in np.split(parts, bounds)])


def _texts(rng: np.random.Generator, vocab: np.ndarray, lengths: np.ndarray, joiner: str = " ") -> list[str]:
    zipf = np.minimum(rng.zipf(1.3, size=int(lengths.sum())), len(vocab)) - 1
    words = vocab[zipf]
    out, start = [], 0
    for L in lengths:
        out.append(joiner.join(words[start : start + L]))
        start += L
    return out


def _lognormal(rng, n, median, sigma, lo, hi) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(median), sigma, size=n), lo, hi).astype(np.int64)


def generate(cache_dir: Path | None = None, *, force: bool = False, images: bool = False) -> Path:
    """Write the demo dataset and its two specs (once). Returns, with `images`, demo.yaml (the five
    sources, what `plait demo` streams), else demo-text.yaml (the four text sources: demo-v1's demo.yaml,
    same stream digest)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    spec_path, text_path = root / "demo.yaml", root / "demo-text.yaml"
    if spec_path.exists() and text_path.exists() and not force:
        return spec_path if images else text_path
    rng = np.random.default_rng(20261129)
    vocab = _words(rng, 3000)
    for sub in ("chat", "web", "code", "long"):
        (root / sub).mkdir(parents=True, exist_ok=True)

    # chat: short turns, 4 gzipped JSONL shards
    for shard in range(4):
        n = 1500
        turns = _lognormal(rng, n, 60, 0.8, 3, 1500)
        body = _texts(rng, vocab, turns)
        with gzip.open(root / "chat" / f"chat-{shard:03d}.jsonl.gz", "wt") as f:
            for i, t in enumerate(body):
                role = "user" if i % 2 == 0 else "assistant"
                f.write(json.dumps({"text": f"<|{role}|> {t}", "id": f"chat-{shard}-{i}"}) + "\n")

    # web: Parquet text, 4 files x 4 row groups
    for shard in range(4):
        n = 1200
        lengths = _lognormal(rng, n, 250, 1.0, 20, 12000)
        table = pa.table({"url": [f"https://example.org/{shard}/{i}" for i in range(n)], "text": _texts(rng, vocab, lengths)})
        pq.write_table(table, root / "web" / f"web-{shard:03d}.parquet", row_group_size=300)

    # code: zstd JSONL text with newlines and indentation
    import zstandard

    for shard in range(3):
        n = 500
        lengths = _lognormal(rng, n, 350, 0.9, 20, 8000)
        bodies = _texts(rng, vocab, lengths, joiner="(x)\n    ")
        lines = [json.dumps({"content": f"def f_{shard}_{i}():\n    " + b + "\n", "lang": "python"}) for i, b in enumerate(bodies)]
        data = ("\n".join(lines) + "\n").encode()
        (root / "code" / f"code-{shard:03d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))

    # long: pre-tokenized documents of 4k..64k tokens
    for shard in range(4):
        n = 12
        lengths = _lognormal(rng, n, 12000, 0.8, 4096, 65536)
        flat = (np.minimum(rng.zipf(1.2, size=int(lengths.sum())), VOCAB_SIZE - 1)).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
        pq.write_table(pa.table({"input_ids": tokens}), root / "long" / f"long-{shard:03d}.parquet", row_group_size=4)

    _train_tokenizer(root, rng, vocab)
    write_image_source(root / "image")  # its own rng: the text sources are byte-identical to demo-v1's
    spec = {
        "seed": 1234,
        "sources": [
            {"name": "chat", "path": "chat/*.jsonl.gz", "text_field": "text", "tokenizer": "tokenizer.json", "eos": 1, "weight": 0.15},
            {"name": "web", "path": "web/*.parquet", "text_field": "text", "tokenizer": "tokenizer.json", "eos": 1, "weight": 0.40},
            {"name": "code", "path": "code/*.jsonl.zst", "text_field": "content", "tokenizer": "tokenizer.json", "eos": 1, "weight": 0.20},
            {"name": "long", "path": "long/*.parquet", "tokens_field": "input_ids", "bos": 0, "eos": 1, "weight": 0.25},
        ],
        "packing": {"seq_len": 8192, "microbatches": 2},
        "topology": {"dp": 8},
        "cost": {"hidden": 4096, "layers": 32, "ffn": 11008, "heads": 32},
        "steps": 50,
    }
    # demo-text.yaml: the four text sources alone (its stream digest is the one of demo-v1's demo.yaml)
    text_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    spec["sources"] = [dict(s, weight=w) for s, w in zip(spec["sources"], (0.13, 0.36, 0.18, 0.21))]
    spec["sources"].append({"name": "image", "path": "image/captions.jsonl", "format": "jsonl", "text_field": "caption",
                            "image_field": "image", "image_root": "image", "tokenizer": "tokenizer.json", "bos": 0,
                            "eos": 1, "weight": 0.12})
    spec["images"] = {"policy": "dynamic", "patch": 14, "merge": 2, "min_pixels": 28 * 28 * 4,
                      "max_pixels": 28 * 28 * 100, "image_token_id": IMAGE_TOKEN_ID}
    spec["packing"]["max_patches"] = 4096
    spec["cost"]["encoder"] = {"hidden": 1024, "layers": 24, "ffn": 4096}  # a ViT-L-like tower
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))  # last: its presence means "generated"
    return spec_path if images else text_path


def write_image_source(folder: Path, n: int = N_IMAGES, *, seed: int = 20261201, max_side: int = 640) -> Path:
    """n pictures (smooth gradients and a few shapes; JPEG, every 4th PNG) of 64..max_side px sides and
    aspect ratios up to 4:1, and folder/captions.jsonl of {id, image, caption} (image paths relative to
    folder, the source's image_root). Returns the JSONL's path. Also used by `plait bench images`."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    captions = _texts(rng, _words(rng, 3000), _lognormal(rng, n, 24, 0.4, 4, 40))
    lines = []
    for i in range(n):
        w, h = (int(v) for v in rng.integers(64, max_side + 1, size=2))
        if max(w, h) > 4 * min(w, h):
            h = max(h, w // 4) if w > h else h
            w = max(w, h // 4)
        y, x = np.ogrid[0:h, 0:w]
        c0, c1 = rng.integers(0, 256, size=(2, 3))
        t = (x / max(w - 1, 1) + y / max(h - 1, 1))[..., None] / 2
        arr = (c0 * (1 - t) + c1 * t).astype(np.uint8)
        img = Image.fromarray(arr)
        draw = ImageDraw.Draw(img)
        for _ in range(3):
            x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
            box = (x0, y0, x0 + int(rng.integers(8, w // 2 + 9)), y0 + int(rng.integers(8, h // 2 + 9)))
            fill = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
        name = f"img/{i:04d}.{'png' if i % 4 == 3 else 'jpg'}"
        img.save(folder / name, quality=85) if name.endswith("jpg") else img.save(folder / name)
        lines.append(json.dumps({"id": f"image-{i}", "image": name, "caption": captions[i]}))
    path = folder / "captions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _train_tokenizer(root: Path, rng, vocab) -> None:
    from plait.transforms.tokenize import train_bpe_tokenizer

    train_bpe_tokenizer(_texts(rng, vocab, np.full(400, 200)), VOCAB_SIZE, str(root / "tokenizer.json"))
