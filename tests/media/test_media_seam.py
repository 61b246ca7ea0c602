"""The media seam: every registered medium gives the same interface (media.registry.Medium) under the same
names, and each one's probe decodes nothing, its decode runs once and agrees with its plan, its placeholder
count is its plan's and its encoder units are what the Planner's encoder cost reads (cost.EncoderCost)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from plait.cost import EncoderCost
from plait.media.registry import AUDIO, IMAGE, KINDS, VIDEO, Medium, kind_of

av = pytest.importorskip("av")

METHODS = [name for name in vars(Medium) if not name.startswith("_")]


def test_every_kind_gives_the_whole_interface():
    assert set(METHODS) == {"policy", "probe", "plan", "decode", "placeholder_tokens", "encoder_units", "batch_fields",
                            "reference"}
    for kind in KINDS:
        missing = [m for m in METHODS if not callable(getattr(kind.medium, m, None))]
        assert not missing, f"{kind.name} lacks {missing}"
    assert {k.medium.__class__.__module__ for k in KINDS} == {"plait.media.image", "plait.media.video", "plait.media.audio"}


def test_references_find_their_kind():
    from plait.media.video import VideoRef
    from plait.media.audio import AudioRef

    assert kind_of(b"\x89PNG") is IMAGE and kind_of("a/b.jpg") is IMAGE
    assert kind_of(VideoRef("v.mp4")) is VIDEO and kind_of(AudioRef("a.wav")) is AUDIO
    for kind in KINDS:  # what a reader puts in a record is found as its kind again
        assert [kind_of(r) for r in kind.references([b"data", "x/y"])] == [kind, kind]


def test_image_medium():
    from plait.media.image import DECODES, BadImage, ImagePolicy

    buf = io.BytesIO()
    Image.new("RGB", (300, 200), (10, 20, 30)).save(buf, "PNG")
    data, medium, policy = buf.getvalue(), IMAGE.medium, ImagePolicy(max_pixels=28 * 28 * 64)
    before = DECODES.count
    planned = medium.plan(policy, medium.probe(data))
    assert DECODES.count == before  # planning read the header only
    patches = medium.decode(data, planned, policy)
    assert DECODES.count == before + 1 and patches.shape == (planned.patches, 14 * 14 * 3)
    assert medium.placeholder_tokens(planned) == planned.patches // 4
    assert medium.encoder_units(planned) == (planned.patches, planned.patches**2)
    wrong = planned.__class__(**{**planned.__dict__, "patches": planned.patches + 1})
    with pytest.raises(BadImage, match="planned at"):  # a file changed since it was planned
        medium.decode(data, wrong, policy)


def test_video_medium():
    from video_data import encode

    from plait.media.video import FRAME_DECODES, VIDEO_DECODES, VideoPolicy

    data = encode("libx264", "mp4", 96, 64, 24, 2.0)
    medium = VIDEO.medium
    policy = VideoPolicy(min_pixels=28 * 28, max_pixels=28 * 28 * 8, total_pixels=28 * 28 * 64, max_frames=16)
    frames, passes = FRAME_DECODES.count, VIDEO_DECODES.count
    planned = medium.plan(policy, medium.probe(data))
    assert FRAME_DECODES.count == frames
    out = np.zeros((planned.rows, 14 * 14 * 3), np.uint8)
    assert medium.decode(data, planned, policy, out=out) is out and out.any()
    assert VIDEO_DECODES.count == passes + 1
    t, h, w = planned.grid
    assert medium.placeholder_tokens(planned) == t * h * w // 4
    assert medium.encoder_units(planned) == (t * h * w, t * (h * w) ** 2)  # attention per temporal patch


def test_audio_medium():
    from plait.media.audio import AUDIO_DECODES, AudioPolicy, encoder_cost
    from plait.media.audio_synth import encode, speech_like

    data = encode(speech_like(22050, 2.5, 2, seed=1), 22050, "flac")
    medium, policy = AUDIO.medium, AudioPolicy("chunked", mel_bins=80)
    before = AUDIO_DECODES.count
    planned = medium.plan(policy, medium.probe(data, "clip.flac"))
    assert AUDIO_DECODES.count == before
    features = medium.decode(data, planned, policy, "clip.flac")
    assert AUDIO_DECODES.count == before + 1 and features.input_features.shape == (1, 80, 3000)
    assert medium.placeholder_tokens(planned) == features.plan.tokens == 62  # 250 frames -> 125 after the conv -> 62 after the pooling
    units, squares = medium.encoder_units(planned)
    assert (units, squares) == (sum(planned.plan.spans), sum(s * s for s in planned.plan.spans))
    # one formula: the per-clip cost and the Planner's summed one agree
    assert encoder_cost(planned.plan, 2.0, 0.5) == float(EncoderCost(2.0, 0.5).of_units(units, squares))
