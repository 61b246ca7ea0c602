"""Tokenization: HF tokenizer.json, byte-level fallback, BOS/EOS (vectorised insertion)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import plait
from plait.transforms.tokenize import BYTE_VOCAB, TextEncoder, add_special_tokens, ragged_positions
from helpers import collect, docs_in_batch, expected_tokens, make_spec, text_source, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_byte_fallback_is_utf8_bytes():
    texts = ["hello", "", "ünï 日本", "a\nb"]
    flat, offsets = TextEncoder(None).encode(pa.array(texts))
    assert flat.dtype == np.int32 and offsets.tolist()[0] == 0
    for i, t in enumerate(texts):
        assert flat[offsets[i] : offsets[i + 1]].tolist() == list(t.encode("utf-8"))
    assert TextEncoder(None).vocab_size == BYTE_VOCAB


def test_byte_fallback_on_sliced_and_large_string_arrays():
    arr = pa.array(["xx", "abc", "dé", "zz"])
    flat, offsets = TextEncoder(None).encode(arr.slice(1, 2))
    assert flat.tolist() == list(b"abc") + list("dé".encode())
    assert offsets.tolist() == [0, 3, 6]
    flat2, offsets2 = TextEncoder(None).encode(pa.array(["abc", "dé"], pa.large_string()))
    assert flat2.tolist() == flat.tolist() and offsets2.tolist() == offsets.tolist()


def test_hf_tokenizer_matches_tokenizers(tokenizer_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    texts = ["ka lo mi ra", "", "sti qu ar el in on is at", "日本 é ü"]
    enc = TextEncoder(tokenizer_path)
    flat, offsets = enc.encode(pa.array(texts))
    assert enc.vocab_size == tok.get_vocab_size()
    for i, t in enumerate(texts):
        assert flat[offsets[i] : offsets[i + 1]].tolist() == tok.encode(t, add_special_tokens=False).ids
    # a trained BPE merges: fewer tokens than bytes
    assert offsets[3] - offsets[2] < len(texts[2].encode())


def test_add_special_tokens_example():
    flat = np.array([10, 11, 12, 20], dtype=np.int32)
    offsets = np.array([0, 3, 3, 4])
    out, off = add_special_tokens(flat, offsets, 1, 2)
    assert out.tolist() == [1, 10, 11, 12, 2, 1, 2, 1, 20, 2]
    assert off.tolist() == [0, 5, 7, 10]
    out, off = add_special_tokens(flat, offsets, None, 2)
    assert out.tolist() == [10, 11, 12, 2, 2, 20, 2] and off.tolist() == [0, 4, 5, 7]
    out, off = add_special_tokens(flat, offsets, 1, None)
    assert out.tolist() == [1, 10, 11, 12, 1, 1, 20] and off.tolist() == [0, 4, 5, 7]
    out, off = add_special_tokens(flat, offsets, None, None)
    assert out is flat and off is offsets


@given(
    docs=st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=12), max_size=12),
    bos=st.none() | st.integers(0, 2**31 - 1),
    eos=st.none() | st.integers(0, 2**31 - 1),
)
def test_add_special_tokens_matches_a_loop(docs, bos, eos):
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    flat = np.array([t for d in docs for t in d], dtype=np.int32)
    out, new_offsets = add_special_tokens(flat, offsets, bos, eos)
    expected = [([bos] if bos is not None else []) + d + ([eos] if eos is not None else []) for d in docs]
    assert out.dtype == np.int32
    assert len(new_offsets) == len(docs) + 1 and new_offsets[0] == 0
    assert [out[new_offsets[i] : new_offsets[i + 1]].tolist() for i in range(len(docs))] == expected
    assert len(out) == new_offsets[-1]


@given(st.lists(st.integers(0, 20), max_size=20))
def test_ragged_positions(lengths):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    assert ragged_positions(offsets).tolist() == [i for L in lengths for i in range(L)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl.zst"])
@pytest.mark.parametrize("use_tokenizer", [False, True])
def test_text_source_delivers_tokenized_docs_with_bos_eos(tmp_path, tokenizer_path, fmt, use_tokenizer):
    """Through the whole loader: each delivered document = [bos] + encode(text) + [eos], at those positions."""
    opts = {"bos": 0, "eos": 1, "tokenizer": tokenizer_path} if use_tokenizer else {"bos": 256, "eos": 257}
    ds = text_source(tmp_path, fmt=fmt, files=2, docs_per_file=12, **opts)
    expected = expected_tokens(ds)
    spec = make_spec([ds], seq_len=4096, microbatches=1)
    seen = 0
    for mb in collect(plait.Loader(spec, steps=2, read_ahead=0)):
        for sid, toks in docs_in_batch(mb):
            full = expected[(sid[2], sid[3])]
            assert toks[0] == opts["bos"] and toks[-1] == opts["eos"]
            np.testing.assert_array_equal(toks, full)
            seen += 1
    assert seen >= len(expected)
