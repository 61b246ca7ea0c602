"""Media placeholder ids in documents without media (plait.sources.placeholder_ids): counted and warned
about by default (planning, `error_report()`, `plait run`, `plait inspect`); `placeholder_ids: refuse`
makes such a document a bad record naming source, shard and record; `replace` rewrites the ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from helpers import token_parquet, write_token_parquet
from mm_data import TOKEN_ID, llava, mm_spec

import plait
from plait import cli
from plait.errors import SourceError, SpecError
from plait.runtime import make_runtime


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("ph")
    # ids 5..999: many text documents hold 300, the image token id
    text = token_parquet(base / "t", name="tok", files=2, docs_per_file=20, lo=5, hi=60, vocab=1000)
    return {"llava": llava(base / "l", n=12, max_images=1, jsonl=True), "tok": text}


def text_docs(sources, steps: int = 3, **tok_options):
    """Every rank's text documents of `steps` steps ({(shard, row): tokens}) and the job's error report."""
    spec = plait.load_spec(mm_spec([sources["llava"], {**sources["tok"].source, **tok_options}]))
    rt = make_runtime(spec, "local")
    docs = {}
    try:
        for _ in range(steps):
            plan = rt.plan()
            for rank in range(plan.ranks):
                for mb in rt.build(plan, rank):
                    for i, (source, _, shard, row, chunk) in enumerate(mb.sample_ids.tolist()):
                        if source == 1 and chunk == 0:
                            docs[(shard, row)] = mb.input_ids[mb.cu_seqlens[i]:mb.cu_seqlens[i + 1]]
            rt.release()
        return docs, rt.error_report()
    finally:
        rt.close()


def holding(docs: dict) -> set:
    return {k for k, toks in docs.items() if np.any(toks == TOKEN_ID)}


def test_by_default_they_are_delivered_counted_and_warned_about(sources, caplog):
    with caplog.at_level("WARNING", logger="plait.data"):
        docs, report = text_docs(sources)
    assert holding(docs), "the data must hold the id for this test"
    assert report["tok"]["placeholder_documents"] >= len(holding(docs))
    assert "placeholder_documents" not in report["llava"] and report["tok"]["skipped"] == 0
    said = [r.getMessage() for r in caplog.records if "without media" in r.getMessage()]
    assert len(said) == 1 and "source 'tok'" in said[0] and "300 (images.image_token_id)" in said[0]


def test_refuse_names_source_shard_and_record(sources):
    with pytest.raises(SourceError) as e:
        text_docs(sources, placeholder_ids="refuse")
    err = e.value
    assert err.source == "tok" and err.shard.endswith(".parquet") and err.record is not None
    assert "media placeholder id 300 (images.image_token_id) in a document without media" in str(err)


def test_refuse_under_skip_leaves_them_out_and_counts_them(sources):
    want, _ = text_docs(sources, steps=1)
    docs, report = text_docs(sources, steps=6, placeholder_ids="refuse", on_error="skip")
    assert not holding(docs) and docs
    assert set(docs) & holding(want) == set()
    assert report["tok"]["bad_records"] >= len(holding(want)) and "placeholder_documents" not in report["tok"]


def test_replace_rewrites_the_ids_and_keeps_the_documents(sources, tmp_path):
    want, _ = text_docs(sources)
    docs, report = text_docs(sources, placeholder_ids="replace", placeholder_replacement=7)
    assert docs.keys() == want.keys() and not holding(docs)
    for key, toks in want.items():
        np.testing.assert_array_equal(docs[key], np.where(toks == TOKEN_ID, 7, toks))
    assert "placeholder_documents" not in report["tok"]


def test_replace_needs_its_id(sources):
    spec = mm_spec([sources["llava"], {**sources["tok"].source, "placeholder_ids": "replace"}])
    with pytest.raises(SpecError, match="placeholder_replacement"):
        plait.load_spec(spec)
    base = plait.load_spec(mm_spec([sources["llava"], sources["tok"].source]))
    assert base.data_fingerprint() == plait.load_spec(mm_spec([sources["llava"], sources["tok"].source])).data_fingerprint()
    changed = plait.load_spec(mm_spec([sources["llava"], {**sources["tok"].source, "placeholder_ids": "refuse"}]))
    assert changed.data_fingerprint() != base.data_fingerprint()  # it changes what is delivered


def test_inspect_and_run_say_so(sources, tmp_path, capsys):
    rows = [[5, 6, TOKEN_ID, 7], [8, 9, 10], [TOKEN_ID, 11, 12]]  # rows 0 and 2 hold the image token id
    (tmp_path / "t").mkdir()
    write_token_parquet(tmp_path / "t" / "part-000.parquet", [np.asarray(r) for r in rows], row_group_size=3)
    text = {"name": "tok", "path": str(tmp_path / "t" / "*.parquet"), "tokens_field": "input_ids"}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(mm_spec([sources["llava"], text])))
    assert cli.main(["inspect", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "source 'tok': 2 document(s) of its first block without media hold a media placeholder id (300 " \
        "(images.image_token_id); rows 0, 2)" in out
    summary = tmp_path / "summary.json"
    assert cli.main(["run", str(path), "--steps", "2", "--quiet", "--json", str(summary)]) == 0
    assert json.loads(summary.read_text())["placeholder_documents"]["tok"] > 0


def test_refuse_on_a_source_planned_from_its_lengths_delivers_no_filler(sources, tmp_path):
    """A Megatron source plans from its index's lengths alone; under `refuse` it must read the tokens while
    planning, or a refused document would be planned and then delivered as filler of its planned length."""
    from helpers import megatron_source

    meg = megatron_source(tmp_path / "m", name="tok", files=1, docs_per_file=40, lo=5, hi=60, vocab=320)
    plain = dict(sources, tok=meg)
    want, _ = text_docs(plain, steps=3)
    assert holding(want), "the data must hold the id for this test"
    docs, report = text_docs(plain, steps=6, placeholder_ids="refuse", on_error="skip")
    assert docs and not holding(docs)
    for key, toks in docs.items():  # every delivered document is the corpus's own, not eos/0 filler
        assert np.array_equal(toks, meg.docs[key]), key
    assert set(docs) & holding(want) == set() and report["tok"]["bad_records"] >= len(holding(want))
