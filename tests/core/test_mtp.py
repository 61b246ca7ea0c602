"""Multi-token prediction labels: never across a document or chunk boundary (property test)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.packing import IGNORE_INDEX, multi_token_labels, pack_fields


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8), horizon=st.integers(1, 5))
def test_multi_token_labels_respect_boundaries(lengths, horizon):
    n = sum(lengths)
    ids = np.arange(1000, 1000 + n, dtype=np.int32)
    fields = pack_fields(ids, np.array(lengths))
    mtp = multi_token_labels(ids, fields["cu_seqlens"], horizon)
    assert mtp.shape == (horizon, n) and mtp.dtype == np.int32
    np.testing.assert_array_equal(mtp[0], fields["labels"])  # row 0: the ordinary labels
    start = 0
    for L in lengths:  # reference, token by token
        for t in range(start, start + L):
            for j in range(horizon):
                want = ids[t + j + 1] if t + j + 1 < start + L else IGNORE_INDEX
                assert mtp[j, t] == want
        start += L


def test_label_horizon_in_the_spec_fills_mtp_labels(tmp_path):
    import plait
    from plait.packing import multi_token_labels
    from helpers import make_spec, token_parquet

    ds = token_parquet(tmp_path / "a", files=1, docs_per_file=30, row_group_size=10, lo=3, hi=40)
    spec = make_spec([ds], seq_len=64, microbatches=2)
    spec["packing"]["label_horizon"] = 3
    batches = list(plait.Loader(spec, steps=2, read_ahead=0))
    assert batches
    for mb in batches:
        assert mb.mtp_labels.shape == (3, mb.num_tokens)
        assert (mb.mtp_labels[0] == mb.labels).all()
        assert (mb.mtp_labels == multi_token_labels(mb.input_ids, mb.cu_seqlens, 3)).all()
        ends = mb.cu_seqlens[1:] - 1  # the last two positions of a document have no target 2 or 3 ahead
        assert (mb.mtp_labels[1][ends] == -100).all() and (mb.mtp_labels[2][ends] == -100).all()
    spec["packing"]["label_horizon"] = 1
    assert next(iter(plait.Loader(spec, steps=1, read_ahead=0))).mtp_labels is None
