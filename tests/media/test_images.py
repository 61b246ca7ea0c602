"""Images: resize policies against their formulas (property tests), header-only sizes that never decode,
decode + patchify producing exactly the planned patches, EXIF orientation, JPEG draft, bad images."""

from __future__ import annotations

import io
import math
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from plait.packing import IGNORE_INDEX
from plait.media.image import (
    DECODES,
    BadImage,
    ImagePolicy,
    bench_decode,
    bench_pillow,
    decode,
    image_size,
    mask_placeholder_labels,
    merge_order,
    patchify,
    placeholder_run,
)
from plait.media.image_policy import MAX_ASPECT, tile_grids

FAST = settings(max_examples=300, deadline=None)
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- helpers

def qwen2vl_smart_resize(height, width, factor, min_pixels, max_pixels):
    """Transcribed from Qwen2-VL's image processor (transformers), the reference for `dynamic`."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("aspect")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def picture(width, height, seed=0, mode="RGB"):
    """A smooth-ish test picture (gradients + a little noise): realistic compression, fast to encode."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], axis=-1)
    arr = (arr + rng.integers(0, 16, arr.shape)).clip(0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB").convert(mode)


def encode(img, fmt, orientation=None, **kw):
    buf = io.BytesIO()
    if orientation is not None and fmt == "TIFF":
        kw["tiffinfo"] = {0x0112: orientation}
    elif orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png_header(width, height):
    """A PNG whose IHDR claims width x height, followed by a tiny (wrong) IDAT: header-only tests."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 8)) \
        + chunk(b"IEND", b"")


sides = st.one_of(st.integers(1, 8000), st.integers(1, 64))
patches_merges = st.tuples(st.sampled_from([14, 16]), st.sampled_from([1, 2]))


# ---------------------------------------------------------------- dynamic (Qwen2-VL)

@FAST
@given(w=sides, h=sides, pm=patches_merges, min_steps=st.integers(1, 1024), span=st.integers(1, 4096))
def test_dynamic_plan_matches_qwen2vl_formulas(w, h, pm, min_steps, span):
    assume(max(w, h) / min(w, h) <= MAX_ASPECT)
    patch, merge = pm
    factor = patch * merge
    min_pixels = min_steps * factor * factor
    max_pixels = min_pixels * span
    policy = ImagePolicy("dynamic", patch=patch, merge=merge, min_pixels=min_pixels, max_pixels=max_pixels)
    plan = policy.plan(w, h)
    assert (plan.height, plan.width) == qwen2vl_smart_resize(h, w, factor, min_pixels, max_pixels)
    assert plan.width % factor == 0 and plan.height % factor == 0 and min(plan.width, plan.height) >= factor
    assert plan.grid == (1, plan.height // patch, plan.width // patch)
    assert plan.patches == (plan.height // patch) * (plan.width // patch)
    assert plan.tokens * merge * merge == plan.patches
    assert (plan.cols, plan.rows, plan.thumbnail) == (1, 1, False)


@FAST
@given(w=sides, h=sides, pm=patches_merges, min_steps=st.integers(1, 1024), span=st.integers(1, 4096))
def test_dynamic_pixels_bounded_and_aspect_kept(w, h, pm, min_steps, span):
    assume(max(w, h) / min(w, h) <= MAX_ASPECT)
    patch, merge = pm
    f = patch * merge
    min_pixels, max_pixels = min_steps * f * f, min_steps * f * f * span
    plan = ImagePolicy("dynamic", patch=patch, merge=merge, min_pixels=min_pixels, max_pixels=max_pixels).plan(w, h)
    pixels = plan.width * plan.height
    rounded = max(f, round(h / f) * f) * max(f, round(w / f) * f)
    if rounded > max_pixels:  # shrunk: within max unless a side had to stay at one factor
        assert pixels <= max_pixels or min(plan.width, plan.height) == f
    elif rounded < min_pixels:  # grown: at least min
        assert pixels >= min_pixels
    else:
        assert min_pixels <= pixels <= max_pixels
    # aspect kept within one factor step: w'h - h'w = e_w h - e_h w with |e| <= factor
    assert abs(plan.width * h - plan.height * w) <= f * (h + w)


def test_dynamic_known_sizes():
    policy = ImagePolicy("dynamic", patch=14, merge=2, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
    plan = policy.plan(1920, 1080)  # shrunk under 1280 tokens
    assert (plan.width, plan.height) == qwen2vl_smart_resize(1080, 1920, 28, 56 * 56, 28 * 28 * 1280)[::-1]
    assert plan.tokens <= 1280 and plan.patches == 4 * plan.tokens
    assert policy.plan(56, 56).patches == 16 and policy.plan(56, 56).tokens == 4
    assert policy.plan(28, 28) == policy.plan(56, 56)  # grown to min_pixels
    assert (policy.plan(1, 1).width, policy.plan(1, 1).height) == (56, 56)


@pytest.mark.parametrize("policy", [ImagePolicy("dynamic"), ImagePolicy("tiles")])
@pytest.mark.parametrize("size", [(0, 10), (10, 0), (201, 1), (1, 4001)])
def test_empty_or_too_thin_sizes_are_bad(policy, size):
    with pytest.raises(BadImage, match="empty|aspect ratio"):
        policy.plan(*size)


def test_policy_checks_its_fields():
    with pytest.raises(ValueError, match="multiple of patch"):
        ImagePolicy("tiles", patch=14, merge=2, tile=210)
    with pytest.raises(ValueError, match="kind"):
        ImagePolicy("crop")
    with pytest.raises(ValueError, match="min_pixels"):
        ImagePolicy(min_pixels=10, max_pixels=5)


# ---------------------------------------------------------------- tiles (LLaVA-NeXT / InternVL)

@FAST
@given(w=sides, h=sides, pm=patches_merges, lo=st.integers(1, 4), extra=st.integers(0, 12), thumb=st.booleans())
def test_tiles_plan_matches_internvl_rule(w, h, pm, lo, extra, thumb):
    assume(max(w, h) / min(w, h) <= MAX_ASPECT)
    patch, merge = pm
    tile = patch * merge * 16 if patch == 14 else 448
    policy = ImagePolicy("tiles", patch=patch, merge=merge, tile=tile, min_tiles=lo, max_tiles=lo + extra,
                         thumbnail=thumb)
    plan = policy.plan(w, h)
    n = plan.cols * plan.rows
    assert lo <= n <= lo + extra
    # closest aspect among all candidates; ties: the last tied grid the image covers > half of, else the first
    grids = tile_grids(lo, lo + extra)
    diffs = [abs(w / h - c / r) for c, r in grids]
    tied = [g for g, d in zip(grids, diffs) if d == min(diffs)]
    covering = [g for g in tied[1:] if w * h > 0.5 * tile * tile * g[0] * g[1]]
    assert (plan.cols, plan.rows) == (covering[-1] if covering else tied[0])
    assert (plan.width, plan.height) == (plan.cols * tile, plan.rows * tile)
    tiles = n + (1 if thumb and n > 1 else 0)
    assert plan.thumbnail == (tiles > n)
    assert plan.grid == (tiles, tile // patch, tile // patch)
    assert plan.patches == tiles * (tile // patch) ** 2
    assert plan.tokens == tiles * (tile // patch) ** 2 // merge**2


def test_tiles_known_sizes():
    policy = ImagePolicy("tiles")  # InternVL: 448 tiles, patch 14, pixel shuffle 2 -> 256 tokens a tile
    plan = policy.plan(800, 600)
    assert (plan.cols, plan.rows, plan.grid, plan.tokens) == (4, 3, (13, 32, 32), 13 * 256)
    one = policy.plan(300, 300)  # square and small: 1x1, no thumbnail
    assert (one.cols, one.rows, one.grid, one.tokens) == (1, 1, (1, 32, 32), 256)
    big_square = policy.plan(2000, 2000)  # ties (1,1), (2,2), (3,3): the largest it covers wins
    assert (big_square.cols, big_square.rows) == (3, 3)


# ---------------------------------------------------------------- decode + patchify

FORMATS = ["JPEG", "PNG", "WEBP"]
SIZES = [(1, 1), (37, 500), (640, 480), (2000, 300), (333, 1200), (1500, 1100)]
POLICIES = [ImagePolicy("dynamic", patch=14, merge=2, max_pixels=28 * 28 * 256),
            ImagePolicy("dynamic", patch=16, merge=1, min_pixels=16 * 16, max_pixels=16 * 16 * 300),
            ImagePolicy("tiles", patch=14, merge=2, tile=224, max_tiles=6),
            ImagePolicy("tiles", patch=16, merge=2, tile=256, max_tiles=4, thumbnail=False)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("size", SIZES)
def test_decode_yields_exactly_the_planned_patches(fmt, size):
    blob = encode(picture(*size), fmt)
    for policy in POLICIES:
        plan = policy.plan(*image_size(blob))
        out = decode(blob, policy)
        assert out.plan == plan
        assert out.patches.dtype == np.uint8
        assert out.patches.shape == (plan.patches, policy.patch * policy.patch * 3)
        assert out.grid == plan.grid


@SLOW
@given(w=st.integers(1, 700), h=st.integers(1, 700), fmt=st.sampled_from(FORMATS), which=st.integers(0, 3),
       mode=st.sampled_from(["RGB", "L", "RGBA", "P"]))
def test_decode_patch_count_property(w, h, fmt, which, mode):
    assume(max(w, h) / min(w, h) <= MAX_ASPECT)
    assume(not (fmt == "JPEG" and mode in ("RGBA", "P")))
    policy = POLICIES[which]
    blob = encode(picture(w, h, mode=mode), fmt)
    out = decode(blob, policy)
    assert out.patches.shape == (policy.plan(*image_size(blob)).patches, policy.patch ** 2 * 3)


def test_patches_are_raster_order_of_the_pixels():
    policy = ImagePolicy("dynamic", patch=14, merge=2, min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    img = picture(84, 56, seed=3)  # already multiples of 28: no resize, lossless PNG -> exact pixels
    out = decode(encode(img, "PNG"), policy)
    _, gh, gw = out.grid
    back = out.patches.reshape(gh, gw, 14, 14, 3).transpose(0, 2, 1, 3, 4).reshape(gh * 14, gw * 14, 3)
    assert np.array_equal(back, np.asarray(img))


def test_tiles_are_row_major_then_thumbnail():
    policy = ImagePolicy("tiles", patch=14, merge=2, tile=56, max_tiles=6)
    img = picture(168, 112, seed=4)  # exactly a 3x2 grid of 56-pixel tiles
    out = decode(encode(img, "PNG"), policy)
    assert (out.plan.cols, out.plan.rows, out.grid) == (3, 2, (7, 4, 4))
    arr = np.asarray(img)
    per_tile = out.patches.reshape(7, 16, -1)
    for k in range(6):
        r, c = divmod(k, 3)
        expected = patchify(arr[r * 56:(r + 1) * 56, c * 56:(c + 1) * 56], 1, 1, 14)
        assert np.array_equal(per_tile[k], expected)
    thumb = np.asarray(img.resize((56, 56), Image.Resampling.BICUBIC))
    assert np.array_equal(per_tile[6], patchify(thumb, 1, 1, 14))
    small = picture(150, 100, seed=5)  # the thumbnail comes from the source image, not the resized grid
    out = decode(encode(small, "PNG"), policy)
    assert out.grid == (7, 4, 4)
    thumb = np.asarray(small.resize((56, 56), Image.Resampling.BICUBIC))
    assert np.array_equal(out.patches[-16:], patchify(thumb, 1, 1, 14))


def test_merge_order_groups_windows():
    idx = merge_order(4, 6, 2)
    assert sorted(idx.tolist()) == list(range(24))
    assert idx[:8].tolist() == [0, 1, 6, 7, 2, 3, 8, 9]


def test_alpha_goes_onto_white_and_16_bit_grey_keeps_its_top_bits():
    policy = ImagePolicy("dynamic", patch=14, merge=1, min_pixels=14 * 14, max_pixels=14 * 14 * 16)
    clear = Image.new("RGBA", (28, 28), (0, 0, 0, 0))
    assert (decode(encode(clear, "PNG"), policy).patches == 255).all()
    grey16 = Image.fromarray(np.full((28, 28), 0x8000, np.uint16))
    assert (decode(encode(grey16, "PNG"), policy).patches == 0x80).all()


# ---------------------------------------------------------------- EXIF orientation, draft, header-only

@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_applies_to_reported_size_and_decoded_pixels(fmt, orientation):
    policy = ImagePolicy("dynamic", patch=14, merge=2, min_pixels=28 * 28, max_pixels=28 * 28 * 64)
    blob = encode(picture(168, 84, seed=5), fmt, orientation=orientation, **({"lossless": True} if fmt == "WEBP" else {}))
    swapped = orientation >= 5
    assert image_size(blob) == ((84, 168) if swapped else (168, 84))
    out = decode(blob, policy)
    assert out.grid == ((1, 12, 6) if swapped else (1, 6, 12))
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(blob)).convert("RGB"))
    assert upright.size == (out.plan.width, out.plan.height)  # 168x84 and 84x168 are multiples of 28
    diff = np.abs(out.patches.astype(int) - patchify(np.asarray(upright), 1, 1, 14).astype(int))
    assert diff.max() == 0


def test_exif_orientation_6_on_a_downscaled_jpeg():
    policy = ImagePolicy("dynamic", patch=14, merge=2, max_pixels=28 * 28 * 100)
    blob = encode(picture(1600, 800), "JPEG", orientation=6, quality=95)
    assert image_size(blob) == (800, 1600)
    out = decode(blob, policy)
    assert out.plan == policy.plan(800, 1600) and out.grid[1] > out.grid[2]  # taller than wide
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(blob)).convert("RGB"))
    ref = np.asarray(upright.resize((out.plan.width, out.plan.height), Image.Resampling.BICUBIC))
    assert np.abs(out.patches.astype(int) - patchify(ref, 1, 1, 14).astype(int)).mean() < 6


def test_jpeg_draft_only_with_fast_jpeg():
    blob = encode(picture(2400, 1600), "JPEG")
    small = ImagePolicy("dynamic", patch=14, merge=2, max_pixels=28 * 28 * 64, fast_jpeg=True)  # ~ 8x smaller per side
    out = decode(blob, small)
    assert out.draft >= 2 and out.patches.shape[0] == small.plan(2400, 1600).patches
    near = ImagePolicy("dynamic", patch=14, merge=2, max_pixels=2400 * 1600, fast_jpeg=True)  # barely resized
    assert decode(blob, near).draft == 1
    assert decode(encode(picture(2400, 1600), "PNG"), small).draft == 1  # not a JPEG


def test_large_jpeg_decodes_to_reference_pixels_by_default():
    """Default: no draft, so a large JPEG gives exactly Pillow's full decode + BICUBIC resize (what Hugging
    Face's processors do); fast_jpeg's draft gives different pixels (so the comparison can fail)."""
    blob = encode(picture(2400, 1600, seed=3), "JPEG", quality=90)
    policy = ImagePolicy("dynamic", patch=14, merge=2, max_pixels=28 * 28 * 64)
    out = decode(blob, policy)
    assert out.draft == 1
    ref = Image.open(io.BytesIO(blob)).convert("RGB").resize((out.plan.width, out.plan.height), Image.Resampling.BICUBIC)
    expected = patchify(np.asarray(ref), 1, 1, 14)
    assert np.array_equal(out.patches, expected)
    fast = decode(blob, ImagePolicy("dynamic", patch=14, merge=2, max_pixels=28 * 28 * 64, fast_jpeg=True))
    assert fast.draft >= 2 and not np.array_equal(fast.patches, expected)


def test_fast_jpeg_is_a_validated_spec_field():
    from plait.errors import PlaitError
    from plait.sources.multimodal import policy_of
    from plait.spec import load_spec

    base = {"sources": [{"name": "a", "path": "x/*.parquet", "text_field": "t"}], "images": {"image_token_id": 5}}
    assert policy_of(load_spec(base)).fast_jpeg is False
    on = load_spec({**base, "images": {"image_token_id": 5, "fast_jpeg": True}})
    assert policy_of(on).fast_jpeg is True
    assert on.data_fingerprint() == load_spec(base).data_fingerprint()  # pixels only: same sample order
    with pytest.raises(PlaitError, match="fast_jpeg"):
        load_spec({**base, "images": {"image_token_id": 5, "fast_jpeg": "sometimes"}})


def test_image_size_never_decodes():
    blobs = [encode(picture(w, h, seed=w), fmt) for fmt in ["JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"]
             for w, h in [(640, 480), (31, 700)]]
    before = DECODES.count
    sizes = [image_size(b) for b in blobs] + [image_size(io.BytesIO(b)) for b in blobs]
    assert DECODES.count == before
    assert sizes[:2] == [(640, 480), (31, 700)]
    decode(blobs[0], ImagePolicy())
    assert DECODES.count == before + 1
    # no pixel is read: a body cut short still has a size, though it cannot decode
    for fmt in ["JPEG", "PNG"]:
        cut = encode(picture(800, 600), fmt)[:700]
        assert image_size(cut) == (800, 600)
        with pytest.raises(BadImage, match="truncated"):
            decode(cut, ImagePolicy())


# ---------------------------------------------------------------- bad images

def ppm():
    return encode(picture(20, 20), "PPM")


BAD = {
    "truncated body": (lambda: encode(picture(640, 480), "JPEG")[:3000], "truncated", False),
    "truncated header": (lambda: encode(picture(640, 480), "PNG")[:20], "header|format", True),
    "not an image": (lambda: b"{\"text\": \"hello\"}" * 20, "format", True),
    "empty bytes": (lambda: b"", "empty file \\(0 bytes\\)", True),
    "bomb over 2x limit": (lambda: png_header(20_000, 20_000), "decompression bomb", True),
    "bomb over limit": (lambda: png_header(10_000, 10_000), "decompression bomb", True),
    "zero size": (lambda: png_header(0, 50), "format|empty", True),
    "unknown format": (ppm, "format", True),
    "too thin": (lambda: encode(picture(1000, 3), "PNG"), "aspect ratio", False),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_images_raise_bad_image_with_a_reason(case):
    make, reason, header_bad = BAD[case]
    blob = make()
    for policy in (ImagePolicy("dynamic"), ImagePolicy("tiles")):
        with pytest.raises(BadImage, match=reason) as err:
            decode(blob, policy)
        assert "\n" not in str(err.value) and str(err.value)
    if header_bad:
        with pytest.raises(BadImage, match=reason):
            image_size(blob)
    else:
        image_size(blob)


# ---------------------------------------------------------------- placeholders, bench

def test_placeholder_run_and_labels():
    run = placeholder_run(151655, 4)
    assert run.dtype == np.int32 and run.tolist() == [151655] * 4
    ids = np.concatenate([[1, 2], run, [3]]).astype(np.int32)
    labels = np.append(ids[1:], IGNORE_INDEX).astype(np.int32)  # packing's shift
    masked = mask_placeholder_labels(labels, 151655)
    assert masked.tolist() == [2, -100, -100, -100, -100, 3, -100]


def test_bench_functions_run(tmp_path):
    paths = []
    for i, fmt in enumerate(["JPEG", "PNG"]):
        paths.append(tmp_path / f"{i}.{fmt.lower()}")
        paths[-1].write_bytes(encode(picture(300, 200), fmt))
    assert bench_decode(paths, ImagePolicy()) > 0 and bench_pillow(paths, ImagePolicy()) > 0
