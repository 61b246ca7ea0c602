"""Image-text sources: the spec's image fields, WebDataset tar shards (brace-expanded), Parquet image
columns and LLaVA JSON with interleaved images become documents with placeholder runs and an image table,
from image headers only; every kind of bad input follows on_error, named by shard and record."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from mm_data import EOS, TOKEN_ID, image_bytes, llava, mm_spec, parquet, webdataset
from PIL import Image

import plait
from plait.errors import SourceError, SpecError
from plait.roles.source_loader import SourceLoader
from plait.runtime.local import LocalRuntime
from plait.sources.webdataset import expand_braces
from plait.media.image import DECODES, ImagePolicy, image_size


def all_docs(loader: SourceLoader, source: int = 0):
    """Every block of the source's first epoch: (block, doc index) pairs, via the loader."""
    src = loader.sources[source]
    key = src.first_key()
    out = []
    while key[0] == 0:
        block = loader.block(source, key)
        out += [(block, d) for d in range(len(block.positions))]
        key = src.next_key(key)
    return out


def policy():
    return ImagePolicy(patch=14, merge=2, min_pixels=28 * 28, max_pixels=28 * 28 * 16)


# ----- spec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, field", [
    ({"images": None}, "images"),
    ({"sources": [{"name": "w", "path": "x.tar", "format": "webdataset", "text_field": "txt", "image_field": "jpg;heic"}]},
     "image_field"),
    ({"sources": [{"name": "w", "path": "x.tar", "format": "webdataset", "text_field": "txt"}]}, "webdataset"),
    ({"sources": [{"name": "t", "path": "x.jsonl", "text_field": "t", "template": "chat"}], "images": None}, "image_field"),
    ({"sources": [{"name": "t", "path": "x.jsonl", "text_field": "t", "image_field": "i", "length_field": "n"}]},
     "length_field"),
    ({"sources": [{"name": "t", "path": "x.bin", "format": "megatron", "image_field": "i"}]}, "image_field"),
    ({"vocab_size": 200}, "image_token_id"),
    ({"cost": {"encoder": {"hidden": 10}}}, "linear and quadratic"),
])
def test_invalid_image_specs_fail_at_load_naming_the_field(change, field):
    spec = mm_spec([{"name": "t", "path": "x.jsonl", "text_field": "t", "image_field": "i"}])
    spec.update(change)
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(SpecError, match=field):
        plait.load_spec(spec)


def test_max_patches_needs_images():
    with pytest.raises(SpecError, match="max_patches"):
        plait.load_spec({"sources": [{"name": "t", "path": "x.jsonl", "text_field": "t"}],
                         "packing": {"max_patches": 100}})


def test_text_only_fingerprints_do_not_see_the_new_fields():
    """New fields enter the data fingerprint only when set: text-only states keep loading."""
    base = {"sources": [{"name": "t", "path": "x.jsonl", "text_field": "t", "eos": 1}], "seed": 3}
    spec = plait.load_spec(base)
    dump = spec.sources[0].model_dump(mode="json")
    for key in ("on_error", "storage_options", "shadows", "length_field", "weight", "start_step", "stop_step",
                "image_field", "image_root", "template"):
        dump.pop(key)
    old = hashlib.sha256(json.dumps({"sources": [dump], "seed": 3}, sort_keys=True).encode()).hexdigest()[:16]
    assert spec.data_fingerprint() == old
    images = plait.load_spec({**base, "images": {"image_token_id": 5}})
    assert images.data_fingerprint() != old  # the image policy decides documents' tokens


def test_brace_expansion():
    assert expand_braces("s-{000..003}.tar") == [f"s-{i:03d}.tar" for i in range(4)]
    assert expand_braces("{a,b}/x-{1..2}.tar") == ["a/x-1.tar", "a/x-2.tar", "b/x-1.tar", "b/x-2.tar"]
    assert expand_braces("{a,{b,c}}z") == ["az", "bz", "cz"]
    assert expand_braces("plain.tar") == ["plain.tar"]


# ----- formats -------------------------------------------------------------------------------------
def check_document(block, d, expected_images: list[bytes]):
    """Placeholder runs where the images are, of each image's planned size (from its header)."""
    tab = block.images
    doc = block.tokens[block.starts[d]: block.starts[d] + block.lengths[d]]
    first, count = int(tab.start[d]), int(tab.count[d])
    assert count == len(expected_images)
    assert int((doc == TOKEN_ID).sum()) == int(tab.tokens[first:first + count].sum())
    for j, data in zip(range(first, first + count), expected_images):
        plan = policy().plan(*image_size(data))
        assert (int(tab.patches[j]), tuple(tab.grid[j])) == (plan.patches, plan.grid)
        at = int(tab.at[j])
        assert (doc[at: at + plan.tokens] == TOKEN_ID).all()
        assert doc[at - 1] != TOKEN_ID or at == 0 or (j > first and int(tab.at[j - 1] + tab.tokens[j - 1]) == at)
    assert doc[-1] == EOS
    return doc


def test_llava_json_interleaved_images(tmp_path):
    src = llava(tmp_path, n=12, max_images=3)
    spec = plait.load_spec(mm_spec([src]))
    before = DECODES.count
    loader = SourceLoader(spec)
    docs = all_docs(loader)
    assert DECODES.count == before  # headers only
    recs = json.loads((tmp_path / "data.json").read_text())
    seen = set()
    for block, d in docs:
        row = int(block.rows[d])
        names = recs[row]["image"]
        names = [names] if isinstance(names, str) else names
        doc = check_document(block, d, [(tmp_path / n).read_bytes() for n in names])
        text = bytes(int(t) for t in doc if t < 256).decode()
        assert text.startswith("user: what is ") and f"assistant: it is thing {row}." in text
        seen.add(row)
    assert seen == set(range(12))
    assert {int(block.images.count[d]) for block, d in docs} == {0, 1, 2, 3}


def test_webdataset_shards_brace_expanded_and_grouped_by_key(tmp_path):
    src = webdataset(tmp_path, shards=3, per_shard=7)
    spec = plait.load_spec(mm_spec([src]))
    loader = SourceLoader(spec)
    assert len(loader.sources[0].files) == 3
    docs = all_docs(loader)
    assert len(docs) == 21
    import tarfile
    for block, d in docs:
        shard, row = int(block.shard), int(block.rows[d])
        with tarfile.open(loader.sources[0].files[shard]) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith((".jpg", ".png", ".webp"))]
            data = tar.extractfile(members[row]).read()
            key = members[row].name.split(".")[0]
            caption = tar.extractfile(f"{key}.txt").read()
        doc = check_document(block, d, [data])
        assert bytes(int(t) for t in doc if t < 256) == caption


def test_webdataset_blocks_are_runs_of_samples_and_resume_from_their_key(tmp_path, monkeypatch):
    from plait.sources.webdataset import WebDatasetReader

    monkeypatch.setattr(WebDatasetReader, "SAMPLES_PER_BLOCK", 3)
    spec = plait.load_spec(mm_spec([webdataset(tmp_path, shards=2, per_shard=7)]))
    a = SourceLoader(spec)
    assert a.sources[0].num_blocks(0) == 3
    key = a.sources[0].next_key(a.sources[0].first_key())
    one = a.block(0, key)
    two = SourceLoader(spec).block(0, key)  # a fresh process decodes the same block from its key alone
    np.testing.assert_array_equal(one.tokens, two.tokens)
    np.testing.assert_array_equal(one.rows, two.rows)
    assert one.images.refs == two.images.refs


def test_parquet_image_column(tmp_path):
    src = parquet(tmp_path, n=10, row_group_size=4)
    spec = plait.load_spec(mm_spec([src]))
    docs = all_docs(SourceLoader(spec))
    import pyarrow.parquet as pq
    table = pq.read_table(tmp_path / "data.parquet").to_pylist()
    assert sorted(int(b.rows[d]) for b, d in docs) == list(range(10))
    for block, d in docs:
        row = int(block.rows[d])
        doc = check_document(block, d, [table[row]["image"]["bytes"]])
        assert bytes(int(t) for t in doc if t < 256).decode() == table[row]["caption"]
        assert doc[0] == TOKEN_ID  # caption template: the image first


def test_parquet_image_paths_relative_to_image_root(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(image_bytes(50, 30, "PNG"))
    pq.write_table(pa.table({"caption": ["hello"], "image": [{"bytes": None, "path": "a.png"}]}), tmp_path / "p.parquet")
    spec = plait.load_spec(mm_spec([{"name": "p", "path": str(tmp_path / "p.parquet"), "text_field": "caption",
                                     "image_field": "image", "image_root": str(tmp_path / "img"), "eos": EOS}]))
    (block, d), = all_docs(SourceLoader(spec))
    check_document(block, d, [(tmp_path / "img" / "a.png").read_bytes()])


def test_planning_decodes_no_image(tmp_path):
    """The Planner sees patch counts from headers: planning steps of every format decodes nothing."""
    sources = [webdataset(tmp_path / "w"), parquet(tmp_path / "p"), llava(tmp_path / "l")]
    rt = LocalRuntime(plait.load_spec(mm_spec(sources)))
    before = DECODES.count
    plans = [rt.plan() for _ in range(4)]
    assert DECODES.count == before
    assert all(p.items.patches.sum() > 0 for p in plans)
    assert rt.loader.images_decoded == 0


# ----- bad input -----------------------------------------------------------------------------------
def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def run_all(spec_dict, steps=3):
    rt = LocalRuntime(plait.load_spec(spec_dict))
    batches = []
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            batches += rt.build(plan, r)
    return rt, batches


def llava_bad(tmp_path, what: str) -> tuple[dict, str]:
    """A LLaVA source whose record 5 has a bad image (or names a missing one); the expected message."""
    src = llava(tmp_path, n=12, max_images=1)
    path = tmp_path / json.loads((tmp_path / "data.json").read_text())[5]["image"]
    if what == "not an image":
        path.write_bytes(b"this is not an image at all" * 10)
    elif what == "zero bytes":
        path.write_bytes(b"")
    elif what == "missing":
        path.unlink()
    elif what == "bomb":
        path.write_bytes(image_bytes(600, 600, "PNG"))
    return src, {"not an image": "not an image", "zero bytes": "empty file", "missing": "No such file",
                 "bomb": "decompression bomb"}[what]


@pytest.mark.parametrize("what", ["not an image", "zero bytes", "missing", "bomb"])
def test_bad_image_headers_follow_on_error(tmp_path, monkeypatch, what):
    src, message = llava_bad(tmp_path, what)
    if what == "bomb":  # Pillow's limit, made small: a 600x600 image is over it; the others (< 200x200) are not
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)
    with pytest.raises(SourceError, match=message) as e:
        run_all(mm_spec([src]))
    assert e.value.record == "5" and e.value.shard.endswith("data.json")
    rt, batches = run_all(mm_spec([{**src, "on_error": "skip"}]))
    report = rt.error_report()["llava"]
    assert report["bad_records"] == 1 and "record 5" in report["messages"][0] and message in report["messages"][0]
    rows = {int(r) for b in batches for r in b.sample_ids[:, 3]}
    assert 5 not in rows and 6 in rows


def test_truncated_image_body_is_found_at_gather(tmp_path):
    """A header that plans fine over a body that does not decode: raise stops at gather, naming it;
    skip drops its sample from its micro-batch (never delivered, no zero pixels), counted and named."""
    src = llava(tmp_path, n=12, max_images=1)
    name = json.loads((tmp_path / "data.json").read_text())[5]["image"]
    data = image_bytes(150, 120, "PNG", seed=3)
    (tmp_path / name).write_bytes(truncated(data))
    size = image_size(truncated(data))
    assert size == (150, 120)
    with pytest.raises(SourceError, match="record 5") as e:
        run_all(mm_spec([src]))
    assert name in str(e.value) and "zero pixels" not in str(e.value)
    rt, batches = run_all(mm_spec([{**src, "on_error": "skip"}]))
    report = rt.error_report()["llava"]
    assert report["skipped"] >= 1 and all("record 5 (epoch" in m and "dropped from its micro-batch" in m for m in report["messages"])
    rows = [int(r) for b in batches for r in b.sample_ids[:, 3]]
    assert 5 not in rows and 6 in rows


def test_webdataset_bad_members(tmp_path):
    """A member without its pair, an image of an unknown extension alone, a non-image image member."""
    extra = {1: [("lonely.jpg", image_bytes(40, 40, "JPEG")), ("orphan.txt", b"text without image"),
                 ("odd.heic", b"xx"), ("odd.txt", b"a caption"), ("junk.png", b"not a png"), ("junk.txt", b"caption")]}
    src = webdataset(tmp_path, shards=2, per_shard=3, extra=extra)
    with pytest.raises(SourceError, match="shards-000001.tar"):
        run_all(mm_spec([src]))
    rt, batches = run_all(mm_spec([{**src, "on_error": "skip"}]))
    messages = " | ".join(rt.error_report()["wds"]["messages"])
    assert rt.error_report()["wds"]["bad_records"] == 4
    assert "record lonely: sample 'lonely' has no 'txt' member" in messages
    assert "record orphan" in messages and "no image member" in messages
    assert "record odd" in messages and "has: heic, txt" in messages
    assert "record junk" in messages and "not an image" in messages
    assert len({tuple(s) for b in batches for s in b.sample_ids[:, 2:4]}) == 6


def test_truncated_tar_shard(tmp_path):
    src = webdataset(tmp_path, shards=2, per_shard=4)
    shard = tmp_path / "shards-000001.tar"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(SourceError, match="shards-000001.tar"):
        run_all(mm_spec([src]))
    rt, _ = run_all(mm_spec([{**src, "on_error": "skip"}]))
    assert rt.error_report()["wds"]["skipped"] >= 1
    assert any("cut short" in m or "truncated" in m or "not an image" in m for m in rt.error_report()["wds"]["messages"])


def test_documents_over_the_capacities_are_bad_records(tmp_path):
    """A document with images is never cut: longer than seq_len, or with more patches than
    max_patches, it is a bad record (on_error applies)."""
    src = llava(tmp_path, n=12, max_images=3)
    with pytest.raises(SourceError, match="never cut"):
        run_all(mm_spec([src], seq_len=64, max_patches=10_000))
    with pytest.raises(SourceError, match="max_patches"):
        run_all(mm_spec([src], seq_len=512, max_patches=20))
    rt, batches = run_all(mm_spec([{**src, "on_error": "skip"}], seq_len=512, max_patches=20), steps=2)
    assert rt.error_report()["llava"]["skipped"] > 0
    assert all(b.num_patches <= 20 for b in batches)


def test_conversation_markers_must_match_images(tmp_path):
    bad = {3: {"id": "3", "image": [], "conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}]},
           4: {"id": "4", "conversations": "not a list"}}
    src = llava(tmp_path, n=8, max_images=1, bad=bad)
    rt, _ = run_all(mm_spec([{**src, "on_error": "skip"}]), steps=1)
    messages = " | ".join(rt.error_report()["llava"]["messages"])
    assert "record 3" in messages and "1 <image> marker(s) for 0 image(s)" in messages
    assert "record 4" in messages
