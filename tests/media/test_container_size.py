"""A video container shorter than its headers say is a bad video while planning (media/container_size.py):
MP4/MOV boxes and sample tables, Matroska/WebM segments, cut by as little as one byte, from bytes or a path;
in a source, such a file is a bad record at planning, never a sample dropped after its step was planned."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from video_data import frame_pixels, llava_video, video_spec

import plait
from plait.packing import IGNORE_INDEX
from plait.runtime import make_runtime
from plait.media.container_size import check_size
from plait.media.video import BadVideo, probe

av = pytest.importorskip("av")


def encode_file(tmp_path, container: str, *, faststart: bool = False, seconds: float = 2.0) -> bytes:
    """A small video written through a file (a faststart MP4 needs one: the muxer moves moov forward)."""
    path = tmp_path / f"clip-{container}-{faststart}.{container}"
    fmt = {"mkv": "matroska"}.get(container, container)
    with av.open(str(path), mode="w", format=fmt, options={"movflags": "faststart"} if faststart else {}) as out:
        s = out.add_stream("libvpx-vp9" if container == "webm" else "libx264", rate=24)
        s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
        for i in range(int(24 * seconds)):
            for packet in s.encode(av.VideoFrame.from_ndarray(frame_pixels(i, 96, 64), format="rgb24")):
                out.mux(packet)
        for packet in s.encode():
            out.mux(packet)
    return path.read_bytes()


CONTAINERS = [("mp4", True), ("mp4", False), ("mov", True), ("mkv", False), ("webm", False)]


@pytest.mark.parametrize("container,faststart", CONTAINERS)
def test_a_container_cut_short_is_truncated(tmp_path, container, faststart):
    whole = encode_file(tmp_path, container, faststart=faststart)
    check_size(whole)
    path = tmp_path / f"whole.{container}"
    path.write_bytes(whole)
    check_size(str(path))
    for cut in (1, 20, 200, 2000):
        with pytest.raises(BadVideo, match=f"but the file holds {len(whole) - cut} bytes: truncated"):
            check_size(whole[:-cut])
        path.write_bytes(whole[:-cut])
        with pytest.raises(BadVideo, match="truncated"):
            check_size(str(path))


def test_ffmpeg_s_probe_alone_passes_a_faststart_mp4_cut_by_200_bytes(tmp_path):
    """Why the check exists: the headers and the last keyframe's packets still read."""
    whole = encode_file(tmp_path, "mp4", faststart=True)
    probe(whole[:-200])


def test_a_sample_table_pointing_past_the_end(tmp_path):
    """An mdat box of size 0 (it runs to the end of the file) says nothing; moov's chunk offsets do."""
    whole = bytearray(encode_file(tmp_path, "mp4", faststart=True))
    at = bytes(whole).index(b"mdat") - 4
    whole[at:at + 4] = struct.pack(">I", 0)
    check_size(bytes(whole))
    with pytest.raises(BadVideo, match="sample table says its samples end at byte"):
        check_size(bytes(whole[: len(whole) - 2000]))


def test_other_bytes_are_left_to_ffmpeg():
    check_size(b"definitely not a video" * 50)
    check_size(b"")


def test_a_cut_faststart_mp4_is_a_bad_record_while_planning_not_a_late_drop(tmp_path):
    src = llava_video(tmp_path / "v", n=6, with_images=False)
    video = tmp_path / "v" / "videos" / "v00.mp4"
    video.write_bytes(encode_file(tmp_path, "mp4", faststart=True)[:-200])
    spec = plait.load_spec(video_spec([{**src, "on_error": "skip"}]))
    rt = make_runtime(spec, "local")
    try:
        for _ in range(4):
            plan = rt.plan()
            batches = [mb for r in range(plan.ranks) for mb in rt.build(plan, r)]
            rt.release()
            direct = sum(int(np.count_nonzero(mb.labels != IGNORE_INDEX)) for mb in batches)
            assert all(mb.stats["dropped_samples"] == 0 for mb in batches)
            assert {mb.stats["global_label_tokens"] for mb in batches} == {direct}
            assert all(int(s[3]) != 0 for mb in batches for s in mb.sample_ids)  # record 0 never delivered
        report = rt.error_report()["llava_video"]
    finally:
        rt.close()
    assert report["skipped"] >= 1
    assert any("v00.mp4" in m and "bytes: truncated" in m for m in report["messages"])


def test_a_constant_sample_size_with_a_huge_count_builds_no_table():
    """A corrupt stsz (one size for every sample, a count of 4 billion) is priced per chunk: no table of
    count entries (32 GiB) is built; the stated end still says the file is short."""
    import struct

    from plait.media.container_size import check_size
    from plait.media.video import BadVideo

    def box(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", 8 + len(body)) + kind + body

    def full(kind: bytes, *fields: int) -> bytes:
        return box(kind, b"\0\0\0\0" + struct.pack(f">{len(fields)}I", *fields))

    stbl = box(b"stbl", full(b"stco", 1, 64) + full(b"stsc", 1, 1, 2, 1) + full(b"stsz", 100, 2**32 - 1))
    moov = box(b"moov", box(b"trak", box(b"mdia", box(b"minf", stbl))))
    data = box(b"ftyp", b"isom\0\0\2\0isom") + moov
    with pytest.raises(BadVideo, match="truncated"):  # two 100-byte samples from byte 64: past the end
        check_size(data)
