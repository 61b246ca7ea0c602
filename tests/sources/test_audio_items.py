"""Carried chunks with audio: the Planner's audio columns survive a data state (16 integers a row), and a
state written before them (11 or 13 integers a row) still reads."""

import numpy as np

from plait.plan import ALL_COLUMNS, ITEM_AUDIO_COLUMNS, ITEM_IMAGE_COLUMNS, ITEM_INT_COLUMNS, Items


def items(n: int, *, images: bool, audio: bool) -> Items:
    rng = np.random.default_rng(n)
    cols = {c: rng.integers(0, 100, n) for c in ITEM_INT_COLUMNS}
    if images:
        cols.update({c: rng.integers(1, 50, n) for c in ITEM_IMAGE_COLUMNS})
    if audio:
        cols.update({c: rng.integers(1, 3000, n) for c in ITEM_AUDIO_COLUMNS})
    return Items(**cols)


def test_rows_keep_the_audio_columns_only_when_an_item_has_audio():
    for images, audio, width in ((False, False, 11), (True, False, 13), (False, True, 16), (True, True, 16)):
        it = items(7, images=images, audio=audio)
        rows = it.to_rows()
        assert {len(r) for r in rows} == {width}
        back = Items.from_rows(rows)
        for c in ALL_COLUMNS:
            np.testing.assert_array_equal(getattr(back, c), getattr(it, c))
        assert it.has_images == (images or audio)
        np.testing.assert_array_equal(it.media, (it.patches > 0) | (it.audio_tokens > 0))


def test_a_data_state_takes_carried_rows_with_audio(tmp_path):
    """A state whose carried chunks hold the audio columns loads; a row of another width is refused."""
    import pytest
    from audio_data import audio_spec, webdataset_audio

    import plait
    from plait.errors import PlaitError
    from plait.runtime.local import LocalRuntime

    spec = plait.load_spec(audio_spec([webdataset_audio(tmp_path, shards=1, per_shard=2)], dp=1))
    state = LocalRuntime(spec).state_dict()
    row = items(1, images=False, audio=True).to_rows()[0]
    row[:4] = [0, 0, 0, 0]  # source 0, epoch 0, first file, first block
    for width in (11, 13, 16):
        LocalRuntime(spec).load_state_dict({**state, "carry": [row[:width]]})
    with pytest.raises(PlaitError, match="malformed"):
        LocalRuntime(spec).load_state_dict({**state, "carry": [row[:14]]})
