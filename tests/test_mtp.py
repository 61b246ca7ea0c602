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
