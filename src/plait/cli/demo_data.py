"""The embedded demo: a small multi-source dataset, generated once, and a spec over it.

Four sources with clearly different document-length distributions and formats:
  chat  short chat turns              JSONL (.jsonl.gz), text, median ~70 tokens
  web   web pages                     Parquet, text,       median ~250 tokens, tail to ~4k
  code  source files                  JSONL (.jsonl.zst), text, median ~2.8k tokens, tail to ~35k
  long  long documents                Parquet, pre-tokenized list<int32>, 4k .. 64k tokens (median ~10k)
Text sources use a byte-level BPE tokenizer trained here with Hugging Face `tokenizers` (no download).
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

DEMO_VERSION = "v1"
VOCAB_SIZE = 4096


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


def generate(cache_dir: Path | None = None, *, force: bool = False) -> Path:
    """Write the demo dataset and spec (once); return the spec's path."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    spec_path = root / "demo.yaml"
    if spec_path.exists() and not force:
        return spec_path
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
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec_path


def _train_tokenizer(root: Path, rng, vocab) -> None:
    from plait.transforms.tokenize import train_bpe_tokenizer

    train_bpe_tokenizer(_texts(rng, vocab, np.full(400, 200)), VOCAB_SIZE, str(root / "tokenizer.json"))
