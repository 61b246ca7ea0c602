"""Video: header probes (no frame decoded), the Qwen2-VL frame rule against the published formulas,
frames decoded at the rule's indices and equal to a plain PyAV decode + the same resize (full-size RGB, then
Pillow BICUBIC; test_video_reference.py holds them against transformers), the patch layout, bad videos'
messages, and the spec's `videos` section."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from PIL import Image
from hypothesis import given
from hypothesis import strategies as st
from video_data import KINDS, VIDEOS, audio_only, encode, frame_pixels

import plait
from plait.errors import SpecError
from plait.media.video import (
    FRAME_DECODES,
    VIDEO_DECODES,
    BadVideo,
    VideoInfo,
    VideoPolicy,
    decode_video,
    patchify_frames,
    probe,
    read_frames,
)

av = pytest.importorskip("av")
SMALL = VideoPolicy(min_pixels=28 * 28, max_pixels=28 * 28 * 8, total_pixels=28 * 28 * 64, max_frames=16)


@pytest.fixture(scope="module")
def videos():
    return {k: encode(*k) for k in KINDS}


@pytest.fixture(scope="module")
def vfr():
    return encode(vfr=True)


# ----- probe -----------------------------------------------------------------------------------------
def test_probe_reads_headers_only(videos):
    before = FRAME_DECODES.count
    for (codec, ext, w, h, fps, sec), data in videos.items():
        info = probe(data)
        assert (info.width, info.height) == (w, h)
        assert info.frames == round(fps * sec) and math.isclose(info.fps, fps, rel_tol=1e-3)
        assert math.isclose(info.duration, sec, rel_tol=0.05)
        assert info.codec == {"libx264": "h264", "libvpx-vp9": "vp9"}.get(codec, codec)
        assert not info.variable
    assert FRAME_DECODES.count == before


def test_probe_flags_a_variable_frame_rate(vfr):
    info = probe(vfr)
    assert info.variable and info.frames == 48


# ----- the rule, against the published formulas (qwen-vl-utils) written out here ----------------------
def ref_nframes(total, video_fps, fps, min_frames, max_frames, factor, nframes=None):
    if nframes is not None:
        return round(nframes / factor) * factor
    lo = math.ceil(min_frames / factor) * factor
    hi = math.floor(min(max_frames, total) / factor) * factor
    n = min(max(total / video_fps * fps, lo), hi)
    return math.floor(n / factor) * factor


def ref_smart_resize(height, width, factor, min_pixels, max_pixels):
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@given(total=st.integers(1, 5000), fps_video=st.sampled_from([5.0, 12.0, 23.976, 25.0, 30.0, 60.0]),
       fps=st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_frames=st.integers(1, 8), max_frames=st.integers(2, 64),
       tp=st.sampled_from([1, 2, 4]), width=st.integers(16, 1920), height=st.integers(16, 1080),
       nframes=st.one_of(st.none(), st.integers(1, 40)), total_pixels=st.integers(28 * 28 * 4, 28 * 28 * 2000),
       max_tokens=st.sampled_from([256, 768, 1500]))
def test_rule_matches_the_published_formulas(total, fps_video, fps, min_frames, max_frames, tp, width, height,
                                             nframes, total_pixels, max_tokens):
    if min_frames > max_frames or max_frames < tp or max(width, height) / min(width, height) > 200:
        return
    pol = VideoPolicy(fps=fps, min_frames=min_frames, max_frames=max_frames, temporal_patch=tp, nframes=nframes,
                      min_pixels=28 * 28 * 4, max_pixels=28 * 28 * max_tokens, total_pixels=total_pixels)
    info = VideoInfo(width, height, total, fps_video, total / fps_video, "h264")
    n = ref_nframes(total, fps_video, fps, min_frames, max_frames, tp, nframes)
    if not tp <= n <= total:
        with pytest.raises(BadVideo):
            pol.plan(info)
        return
    plan = pol.plan(info)
    assert list(plan.indices) == [int(x) for x in np.round(np.linspace(0, total - 1, n))]
    assert len(plan.indices) % tp == 0 and plan.indices[0] == 0 and (n == 1 or plan.indices[-1] == total - 1)
    # qwen-vl-utils 0.0.14: a per-frame ceiling of 768 tokens, then a caller's max_pixels can only lower it
    budget = min(28 * 28 * max_tokens, max(min(28 * 28 * 768, total_pixels / n * tp), int(28 * 28 * 4 * 1.05)))
    h, w = ref_smart_resize(height, width, 28, 28 * 28 * 4, budget)
    assert (plan.height, plan.width) == (h, w)
    assert plan.grid == (n // tp, h // 14, w // 14)
    assert plan.patches == (n // tp) * (h // 14) * (w // 14) and plan.tokens == plan.patches // 4


@given(total=st.integers(2, 20000), max_frames=st.integers(2, 64))
def test_clip_windows_cover_the_frames(total, max_frames):
    """With clip: windows of at most max_frames (a multiple of tp), together the unclipped frame sequence."""
    pol = VideoPolicy(max_frames=max_frames, clip=True, min_frames=2)
    info = VideoInfo(64, 48, total, 25.0, total / 25.0, "h264")
    n = ref_nframes(total, 25.0, 2.0, 2, total, 2)
    if n < 2:
        return
    plans = [pol.plan(info, w) for w in range(pol.windows(info))]
    assert [i for p in plans for i in p.indices] == [int(x) for x in np.round(np.linspace(0, total - 1, n))]
    assert all(len(p.indices) <= max_frames and len(p.indices) % 2 == 0 for p in plans)
    with pytest.raises(BadVideo):
        pol.plan(info, len(plans))


def test_fixed_nframes():
    info = VideoInfo(64, 48, 100, 25.0, 4.0, "h264")
    assert len(VideoPolicy(nframes=9).plan(info).indices) == 8  # round(9 / 2) * 2
    with pytest.raises(BadVideo, match="cannot give"):
        VideoPolicy(nframes=200).plan(info)


# ----- decode ----------------------------------------------------------------------------------------
def plain_frames(data: bytes) -> list:
    """Every frame, decoded by plain PyAV in order (the reference)."""
    with av.open(__import__("io").BytesIO(data)) as c:
        return list(c.decode(video=0))


def resized(frame, plan) -> np.ndarray:
    """A PyAV frame as the reference readers and processors make it: full-size RGB, Pillow BICUBIC resize."""
    rgb = Image.fromarray(frame.to_ndarray(format="rgb24"))
    return np.asarray(rgb.resize((plan.width, plan.height), Image.Resampling.BICUBIC))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k[0]}-{k[1]}")
def test_frames_are_the_rule_s_frames(videos, kind):
    """Each sampled frame equals PyAV's decode of frame `index` resized the reference's way."""
    data = videos[kind]
    plan = SMALL.plan(probe(data))
    got = read_frames(data, plan)
    ref = plain_frames(data)
    for k, i in enumerate(plan.indices):
        np.testing.assert_array_equal(got[k], resized(ref[i], plan))
    # frames differ from their neighbours, so the comparison above tells frame i from i + 1
    i = plan.indices[1]
    assert not np.array_equal(got[1], resized(ref[i + 1], plan))


def test_seeking_decodes_fewer_frames_than_the_video_holds():
    """A 20 s video sampled at 0.5 fps: the decoder seeks between far-apart frames."""
    data = encode("libx264", "mp4", 64, 48, 10, 20.0, gop=10)
    pol = VideoPolicy(fps=0.5, min_frames=2, max_frames=16, min_pixels=28 * 28, max_pixels=28 * 28 * 4)
    plan = pol.plan(probe(data))
    before, passes = FRAME_DECODES.count, VIDEO_DECODES.count
    got = read_frames(data, plan)
    assert VIDEO_DECODES.count - passes == 1
    assert FRAME_DECODES.count - before < 200 / 2  # far fewer than the 200 frames
    ref = plain_frames(data)
    for k, i in enumerate(plan.indices):
        np.testing.assert_array_equal(got[k], resized(ref[i], plan))


def test_variable_frame_rate_takes_the_frame_at_each_time(vfr):
    info = probe(vfr)
    plan = SMALL.plan(info)
    got = read_frames(vfr, plan)
    ref = plain_frames(vfr)
    times = np.array([float(f.time) for f in ref])
    for k, i in enumerate(plan.indices):
        j = int(np.flatnonzero(times >= i / info.fps - 0.5 / info.fps)[0])
        np.testing.assert_array_equal(got[k], resized(ref[j], plan))


def test_a_frame_taken_twice_is_resized_once(videos, monkeypatch):
    """A decoded frame that several sampled times take -- an index the plan repeats, or times denser than the
    frames (as a variable-rate frame held over two times) -- is resized once and copied: the pixels of a
    resize per time, fewer resizes (counted)."""
    from plait.media import video as video_module

    data = videos[KINDS[1]]  # mpeg4 in mp4, 64x64, 10 fps, 30 frames
    info = probe(data)
    base, ref = SMALL.plan(info), plain_frames(data)
    real, calls = video_module.resized_frame, []
    monkeypatch.setattr(video_module, "resized_frame", lambda *a, **k: calls.append(1) or real(*a, **k))
    repeated = dataclasses.replace(base, indices=(0, 0, 4, 4, 4, 9))
    got = read_frames(data, repeated)
    assert len(calls) == 3  # one per distinct frame, not 6
    for k, i in enumerate(repeated.indices):
        np.testing.assert_array_equal(got[k], resized(ref[i], base))
    calls.clear()
    dense = dataclasses.replace(base, indices=tuple(range(8)), fps_video=info.fps * 2)  # 2 times per frame
    got = read_frames(data, dense)
    assert len(calls) == 5  # frames 0..4 for 8 times
    for k, i in enumerate([0, 1, 1, 2, 2, 3, 3, 4]):
        np.testing.assert_array_equal(got[k], resized(ref[i], base))


def test_patch_layout():
    """Rows: (temporal group, patch row, patch col, frame in group); reshaped, Qwen2-VL's (tp, p, p, 3)."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4, 28, 42, 3), dtype=np.uint8)
    rows = patchify_frames(frames, 14, 2)
    assert rows.shape == (4 * 2 * 3, 14 * 14 * 3)
    video = rows.reshape(-1, 2 * 14 * 14 * 3)
    k = 0
    for t in range(2):
        for r in range(2):
            for c in range(3):
                want = frames[2 * t: 2 * t + 2, 14 * r: 14 * r + 14, 14 * c: 14 * c + 14]
                np.testing.assert_array_equal(video[k], want.reshape(-1))
                k += 1


def test_decode_video_rows_match_the_plan(videos):
    data = videos[KINDS[0]]
    plan = SMALL.plan(probe(data))
    rows = decode_video(data, plan, SMALL)
    assert rows.shape == (plan.rows, 14 * 14 * 3) and rows.dtype == np.uint8
    assert plan.rows == plan.patches * 2


# ----- bad videos (one line each) ----------------------------------------------------------------------
def test_bad_videos_are_named(videos, monkeypatch):
    data = videos[KINDS[0]]
    with pytest.raises(BadVideo, match="not a readable video container"):
        probe(b"definitely not a video" * 50)
    with pytest.raises(BadVideo, match="not a readable video container"):
        probe(data[: len(data) // 2])  # mp4 without its index (moov at the end)
    with pytest.raises(BadVideo, match="no video stream"):
        probe(audio_only())
    with pytest.raises(BadVideo, match="cannot give"):
        SMALL.plan(probe(encode("mpeg4", "mp4", 32, 32, 10, 0.1)))  # one frame: no temporal pair
    # a Matroska file cut short keeps its headers: its packets end early (demuxed, not decoded)
    mkv = videos[KINDS[3]]
    cut = mkv[: len(mkv) * 2 // 5]
    before = FRAME_DECODES.count
    with pytest.raises(BadVideo, match="truncated"):
        probe(cut)
    assert FRAME_DECODES.count == before
    # a file cut after it was planned: the gather seeks past its end
    with pytest.raises(BadVideo, match="stream ends|cannot decode"):
        read_frames(cut, SMALL.plan(probe(mkv)))
    # an unsupported codec (no decoder in the FFmpeg build): simulated, as every codec here has one
    real = av.codec.Codec
    monkeypatch.setattr(av.codec, "Codec", lambda name, mode="r": real("nonexistent-codec", mode))
    with pytest.raises(BadVideo, match="unsupported codec 'h264'"):
        probe(data)


def test_unknown_duration():
    """A raw H.264 elementary stream has no container index: no duration in its headers."""
    import io

    buf = io.BytesIO()
    with av.open(buf, "w", format="h264") as out:
        s = out.add_stream("libx264", rate=10)
        s.width = s.height = 32
        for i in range(10):
            for p in s.encode(av.VideoFrame.from_ndarray(frame_pixels(i, 32, 32), format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    with pytest.raises(BadVideo, match="zero or unknown duration"):
        probe(buf.getvalue())


# ----- spec --------------------------------------------------------------------------------------------
def spec_with(videos=VIDEOS, **src):
    source = {"name": "v", "path": "/nonexistent/x.json", "format": "jsonl", "text_field": "c", "video_field": "video",
              **src}
    d = {"sources": [source], "images": {"image_token_id": 300}}
    if videos is not None:
        d["videos"] = videos
    return d


@pytest.mark.parametrize("change,field", [
    ({"videos": None}, "videos"),
    ({"videos": {**VIDEOS, "fps": 0}}, "videos.fps"),
    ({"videos": {**VIDEOS, "min_frames": 20, "max_frames": 10}}, "videos"),
    ({"videos": {**VIDEOS, "policy": "other"}}, "videos.policy"),
    ({"format": "megatron"}, "sources"),
])
def test_invalid_video_specs_fail_at_load_naming_the_field(change, field):
    with pytest.raises(SpecError) as e:
        plait.load_spec(spec_with(**change))
    assert any(f.startswith(field) for f, _ in e.value.problems), e.value.problems


def test_webdataset_video_extensions_are_checked():
    with pytest.raises(SpecError, match="unknown video extension"):
        plait.load_spec(spec_with(format="webdataset", path="/x/{0..1}.tar", video_field="mp4;gif"))


def test_text_and_image_fingerprints_do_not_see_the_video_fields():
    base = {"sources": [{"name": "t", "path": "/x.jsonl", "text_field": "text"}]}
    assert plait.load_spec(base).data_fingerprint() == plait.load_spec(dict(base)).data_fingerprint()
    assert "video_field" not in plait.load_spec(base).sources[0].model_dump(mode="json")
    assert "videos" not in plait.load_spec(base).model_dump(mode="json")


def test_frame_pixels_encode_the_index():
    assert frame_pixels(3, 4, 4)[0, 0, 2] == 40 + 21
