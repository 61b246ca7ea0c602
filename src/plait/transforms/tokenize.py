"""Text -> token ids, a whole block of records at a time.

`tokenizers` (Hugging Face, Rust) encodes a batch in native code. Without a tokenizer, a byte-level
fallback maps UTF-8 bytes to ids 0..255 straight from the Arrow string buffer (no Python per token).
BOS/EOS insertion is vectorised for both.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

BYTE_VOCAB = 256  # byte fallback ids are 0..255; a spec's bos/eos may use 256 and up


def ragged_positions(offsets: np.ndarray) -> np.ndarray:
    """For each token of a flat ragged array: its index inside its own document."""
    lengths = np.diff(offsets)
    total = int(offsets[-1] - offsets[0])
    return np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)


def add_special_tokens(flat: np.ndarray, offsets: np.ndarray, bos: int | None, eos: int | None):
    """Insert bos before and eos after every document of a flat ragged array."""
    extra = (bos is not None) + (eos is not None)
    if not extra:
        return flat, offsets
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    new_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths + extra, out=new_offsets[1:])
    out = np.empty(int(new_offsets[-1]), dtype=flat.dtype)
    shift = np.repeat(np.arange(n, dtype=np.int64) * extra + (1 if bos is not None else 0), lengths)
    out[np.arange(len(flat), dtype=np.int64) + shift] = flat
    if bos is not None:
        out[new_offsets[:-1]] = bos
    if eos is not None:
        out[new_offsets[1:] - 1] = eos
    return out, new_offsets


class TextEncoder:
    """Encodes an Arrow string array to (flat int32 token ids, int64 offsets)."""

    def __init__(self, tokenizer_path: str | None = None, storage_options: dict | None = None):
        self.tokenizer_path = tokenizer_path
        self._tok = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer
            import fsspec

            with fsspec.open(tokenizer_path, "r", **(storage_options or {})) as f:
                self._tok = Tokenizer.from_str(f.read())

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size() if self._tok is not None else BYTE_VOCAB

    def encode(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks()
        if pa.types.is_large_string(texts.type):
            texts = texts.cast(pa.string())
        if self._tok is None:
            return self._encode_bytes(texts)
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        encodings = encode(texts.to_pylist(), add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.empty(int(offsets[-1]), dtype=np.int32)
        for e, start, stop in zip(encodings, offsets[:-1], offsets[1:]):
            flat[start:stop] = e.ids  # one C-level copy per document
        return flat, offsets

    @staticmethod
    def _encode_bytes(texts: pa.StringArray) -> tuple[np.ndarray, np.ndarray]:
        # An Arrow string array already is a flat UTF-8 buffer plus offsets: the byte ids, zero-copy.
        _, off_buf, data_buf = texts.buffers()
        n = len(texts)
        offsets = np.frombuffer(off_buf, dtype=np.int32, count=n + 1, offset=texts.offset * 4).astype(np.int64)
        data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        flat = data[offsets[0] : offsets[-1]].astype(np.int32)
        return flat, offsets - offsets[0]


def train_bpe_tokenizer(texts, vocab_size: int, path: str) -> str:
    """Train a byte-level BPE tokenizer.json offline (demo data, tests); returns its path.

    Ids 0 and 1 are the special tokens <|bos|> and <|eos|>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return str(path)

