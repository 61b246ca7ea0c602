"""Small, fast dataset builders and stream collectors shared by the test suite.

Every builder writes into a folder you give it (use pytest's tmp_path) and returns a `Dataset`: the
source's spec entry (a dict, ready for `make_spec`) plus the ground truth read back independently of
plait: `docs[(shard, row)]` is the document's raw value (token ids as an int array, or text), where
`shard` is the file's index in the sorted file list (what plait's sample ids use).

    ds = token_parquet(tmp_path / "tok", files=3, docs_per_file=20, row_group_size=5)
    spec = plait.load_spec(make_spec([ds.source], seq_len=64))
    batches = collect(plait.Loader(spec, steps=4))
    expected = expected_tokens(ds)          # (shard, row) -> token ids as plait must deliver them
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

_WORDS = "ka lo mi ra ten su vo ph ex an de ri ol um ba ne sti qu ar el in on is at pr ch sh th wo ü é 日本".split()


@dataclass
class Dataset:
    source: dict[str, Any]  # the spec entry for this source
    files: list[str]  # sorted, as plait lists them (shard i is files[i])
    docs: dict[tuple[int, int], Any] = field(default_factory=dict)  # (shard, row) -> np.ndarray | str
    bad: set[tuple[int, int]] = field(default_factory=set)  # (shard, row) of records written bad on purpose

    @property
    def name(self) -> str:
        return self.source["name"]

    def with_options(self, **options) -> "Dataset":
        """The same files with other spec options (bos, eos, tokenizer, on_error, weight, name, ...)."""
        return Dataset({**self.source, **options}, list(self.files), dict(self.docs), set(self.bad))


# ----- raw values --------------------------------------------------------------------------------
def token_docs(n: int, *, lo: int = 1, hi: int = 100, vocab: int = 1000, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, size=n)
    return [rng.integers(0, vocab, size=int(L)).astype(np.int32) for L in lengths]


def texts(n: int, *, lo: int = 1, hi: int = 40, seed: int = 0) -> list[str]:
    """Short texts of lo..hi words (some multi-byte UTF-8)."""
    rng = np.random.default_rng(seed)
    out = []
    for L in rng.integers(lo, hi + 1, size=n):
        out.append(" ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=int(L))))
    return out


# ----- file writers ------------------------------------------------------------------------------
def write_token_parquet(path, docs: list[np.ndarray], *, row_group_size: int = 8, field: str = "input_ids",
                        value_type: pa.DataType = pa.int32(), extra_column: bool = True) -> None:
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=value_type))
    cols = {field: tokens}
    if extra_column:  # a column plait must not read
        cols["meta"] = pa.array([f"doc-{i}" for i in range(len(docs))])
    pq.write_table(pa.table(cols), str(path), row_group_size=row_group_size)


def write_text_parquet(path, values: list[str | None], *, row_group_size: int = 8, field: str = "text") -> None:
    table = pa.table({"id": pa.array(range(len(values)), pa.int64()), field: pa.array(values, pa.string())})
    pq.write_table(table, str(path), row_group_size=row_group_size)


def write_jsonl(path, records: Iterable[dict | str], *, compression: str | None = None) -> None:
    """One record per line; a str record is written verbatim (to make malformed lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records]
    data = ("\n".join(lines) + "\n").encode()
    path = str(path)
    if compression is None:
        compression = "gzip" if path.endswith(".gz") else "zstd" if path.endswith(".zst") else None
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zstd":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    Path(path).write_bytes(data)


# ----- whole sources -----------------------------------------------------------------------------
def token_parquet(root, *, name: str = "tok", files: int = 3, docs_per_file: int = 20, row_group_size: int = 5,
                  lo: int = 1, hi: int = 100, vocab: int = 1000, seed: int = 0,
                  value_type: pa.DataType = pa.int32(), **options) -> Dataset:
    """A pre-tokenized Parquet source: `files` files of `docs_per_file` list<int> documents."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    for f in range(files):
        d = token_docs(docs_per_file, lo=lo, hi=hi, vocab=vocab, seed=seed * 1000 + f)
        write_token_parquet(root / f"part-{f:03d}.parquet", d, row_group_size=row_group_size, value_type=value_type)
        docs.update({(f, r): t for r, t in enumerate(d)})
    paths = sorted(str(p) for p in root.glob("*.parquet"))
    return Dataset({"name": name, "path": str(root / "*.parquet"), "tokens_field": "input_ids", **options}, paths, docs)


def text_source(root, *, fmt: str = "parquet", name: str = "txt", files: int = 2, docs_per_file: int = 20,
                row_group_size: int = 5, lo: int = 1, hi: int = 40, seed: int = 0, field: str = "text",
                **options) -> Dataset:
    """A raw-text source. fmt: parquet | jsonl | jsonl.gz | jsonl.zst."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    for f in range(files):
        t = texts(docs_per_file, lo=lo, hi=hi, seed=seed * 1000 + f)
        path = root / f"part-{f:03d}.{fmt}"
        if fmt == "parquet":
            write_text_parquet(path, t, row_group_size=row_group_size, field=field)
        else:
            write_jsonl(path, [{"id": i, field: s} for i, s in enumerate(t)])
        docs.update({(f, r): s for r, s in enumerate(t)})
    paths = sorted(str(p) for p in root.glob(f"*.{fmt}"))
    return Dataset({"name": name, "path": str(root / f"*.{fmt}"), "text_field": field, **options}, paths, docs)


def token_jsonl(root, *, name: str = "tokj", files: int = 2, docs_per_file: int = 15, lo: int = 1, hi: int = 60,
                seed: int = 0, compression: str = "", **options) -> Dataset:
    """A pre-tokenized JSONL source ({"ids": [...]}); compression: '' | 'gz' | 'zst'."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    ext = "jsonl" + (f".{compression}" if compression else "")
    docs = {}
    for f in range(files):
        d = token_docs(docs_per_file, lo=lo, hi=hi, seed=seed * 1000 + f + 7)
        write_jsonl(root / f"part-{f:03d}.{ext}", [{"ids": x.tolist()} for x in d])
        docs.update({(f, r): t for r, t in enumerate(d)})
    paths = sorted(str(p) for p in root.glob(f"*.{ext}"))
    return Dataset({"name": name, "path": str(root / f"*.{ext}"), "tokens_field": "ids", **options}, paths, docs)


def make_spec(sources: list[dict | Dataset], *, seq_len: int = 64, microbatches: int = 2, dp: int = 1,
              seed: int = 0, **extra) -> dict:
    """A spec dict over the given sources (Datasets or spec entries)."""
    srcs = [s.source if isinstance(s, Dataset) else s for s in sources]
    spec = {
        "sources": srcs,
        "packing": {"seq_len": seq_len, "microbatches": microbatches},
        "topology": {"dp": dp},
        "cost": {"linear": 1.0, "quadratic": 0.001},
        "seed": seed,
    }
    spec.update(extra)
    return spec


def train_tokenizer(path, vocab_size: int = 300) -> str:
    """A small byte-level BPE tokenizer.json, trained offline in well under a second."""
    from plait.transforms.tokenize import train_bpe_tokenizer

    return train_bpe_tokenizer(texts(300, seed=99), vocab_size, path)


def write_spec(path, spec: dict) -> str:
    """Write a spec dict as YAML (for CLI tests); returns the path."""
    import yaml

    Path(path).write_text(yaml.safe_dump(spec))
    return str(path)


# ----- expectations, independent of plait ---------------------------------------------------------
def read_back(ds: Dataset) -> dict[tuple[int, int], Any]:
    """The source's documents read straight from its files (pyarrow / json), keyed like `Dataset.docs`."""
    field = ds.source.get("text_field") or ds.source.get("tokens_field")
    out = {}
    for shard, path in enumerate(ds.files):
        if path.endswith((".parquet", ".pq")):
            values = pq.read_table(path, columns=[field]).column(0).to_pylist()
        else:
            data = Path(path).read_bytes()
            if path.endswith(".gz"):
                data = gzip.decompress(data)
            elif path.endswith(".zst"):
                import zstandard

                data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
            values = [json.loads(line).get(field) for line in data.decode().splitlines() if line.strip()]
        for row, v in enumerate(values):
            out[(shard, row)] = v if isinstance(v, str) or v is None else np.asarray(v, dtype=np.int64)
    return out


def encode_expected(value, source: dict) -> np.ndarray:
    """What plait must deliver for one raw document value under a source's options."""
    if isinstance(value, str):
        if source.get("tokenizer"):
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(source["tokenizer"])
            ids = np.asarray(tok.encode(value, add_special_tokens=False).ids, dtype=np.int64)
        else:
            ids = np.frombuffer(value.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    else:
        ids = np.asarray(value, dtype=np.int64)
    parts = []
    if source.get("bos") is not None:
        parts.append([source["bos"]])
    parts.append(ids)
    if source.get("eos") is not None:
        parts.append([source["eos"]])
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def expected_tokens(ds: Dataset) -> dict[tuple[int, int], np.ndarray]:
    """(shard, row) -> the full token sequence plait must deliver (bos/eos included), bad records left out."""
    tok_cache: dict = {}
    out = {}
    for key, value in ds.docs.items():
        if key in ds.bad:
            continue
        if isinstance(value, str) and ds.source.get("tokenizer"):
            from tokenizers import Tokenizer

            tok = tok_cache.setdefault("t", Tokenizer.from_file(ds.source["tokenizer"]))
            ids = np.asarray(tok.encode(value, add_special_tokens=False).ids, dtype=np.int64)
            out[key] = encode_expected(ids, ds.source)
        else:
            out[key] = encode_expected(value, ds.source)
    return out


# ----- streams -----------------------------------------------------------------------------------
def collect(batches: Iterable) -> list:
    return list(batches)


def batch_digest(batches: Iterable) -> str:
    h = hashlib.sha256()
    for mb in batches:
        for a in (mb.input_ids, mb.labels, mb.position_ids, mb.cu_seqlens, mb.sample_ids, mb.source_ids):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def assert_batches_equal(a: list, b: list) -> None:
    assert len(a) == len(b), f"{len(a)} vs {len(b)} micro-batches"
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x.step, x.microbatch, x.dp_rank) == (y.step, y.microbatch, y.dp_rank), f"batch {i}"
        for f in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids", "source_ids"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f), err_msg=f"batch {i} field {f}")


def run_all_ranks(spec, steps: int, *, record_drawn: bool = False):
    """Stream `steps` global steps for every DP rank with the local runtime.

    Returns (batches, runtime, drawn): batches in (step, rank, micro) order; `drawn` the Items the
    Planner drew from the sources (one per source per step) when record_drawn. Close the runtime.
    """
    from plait.runtime.local import LocalRuntime

    rt = LocalRuntime(spec)
    drawn = []
    if record_drawn:
        original = rt.planner.draw

        def spy(source):
            items = original(source)
            drawn.append(items)
            return items

        rt.planner.draw = spy
    out = []
    for _ in range(steps):
        plan = rt.plan()
        for r in range(plan.ranks):
            out.extend(rt.build(plan, r))
        rt.release()
    return out, rt, drawn


def docs_in_batch(mb):
    """[(sample_id tuple, tokens)] of one micro-batch, in order."""
    cu = mb.cu_seqlens
    return [(tuple(int(x) for x in mb.sample_ids[i]), mb.input_ids[cu[i] : cu[i + 1]]) for i in range(len(cu) - 1)]


class FakeProvider:
    """An in-memory MetadataProvider for the Planner: no files, no tokens, just document lengths.

    Source i has one file of `blocks` blocks of `docs_per_block` documents with lengths drawn from
    [lo_i, hi_i] (seeded). Use it to test planning logic (mixture, balance, carry) fast.
    """

    def __init__(self, length_ranges: list[tuple[int, int]], *, blocks: int = 4, docs_per_block: int = 16, seed: int = 0):
        self.ranges = length_ranges
        self.blocks = blocks
        self.docs_per_block = docs_per_block
        self.seed = seed

    def first_key(self, source: int):
        return (0, 0, 0)

    def block_meta(self, source: int, key):
        from plait.roles.source_loader import BlockMeta

        epoch, fpos, bpos = key
        rng = np.random.default_rng([self.seed, source, epoch, bpos])
        lo, hi = self.ranges[source]
        n = self.docs_per_block
        lengths = rng.integers(lo, hi + 1, size=n).astype(np.int64)
        next_key = (epoch, 0, bpos + 1) if bpos + 1 < self.blocks else (epoch + 1, 0, 0)
        return BlockMeta(source, tuple(key), next_key, 0, np.arange(n, dtype=np.int64),
                         bpos * n + np.arange(n, dtype=np.int64), lengths, n)

    def max_length(self, source: int) -> int:
        return self.ranges[source][1]


# ----- the read-only formats: writers from their published layouts ---------------------------------
# Each writes what the format's reference writer writes (megatron-core's IndexedDatasetBuilder,
# `datasets`' save_to_disk, streaming's MDSWriter), from the published layout, byte for byte where the
# layout fixes the bytes (tests/sources/test_formats.py checks against the reference writers when installed).
MEGATRON_DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
                        np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7,
                        np.dtype(np.uint16): 8}


def write_megatron(prefix, docs: list[np.ndarray], *, dtype=np.int32) -> None:
    """A Megatron-Core indexed dataset (prefix.bin + prefix.idx), one sequence per document."""
    dtype = np.dtype(dtype)
    sizes = np.array([len(d) for d in docs], dtype=np.int32)
    pointers = np.concatenate([[0], np.cumsum(sizes.astype(np.int64) * dtype.itemsize)[:-1]]).astype(np.int64)
    doc_idx = np.arange(len(docs) + 1, dtype=np.int64)  # [0, 1, ..., n]: each sequence ends a document
    Path(f"{prefix}.bin").write_bytes(b"".join(np.asarray(d, dtype=dtype).tobytes() for d in docs))
    header = b"MMIDIDX\x00\x00" + np.uint64(1).tobytes() + np.uint8(MEGATRON_DTYPE_CODES[dtype]).tobytes()
    counts = np.uint64(len(docs)).tobytes() + np.uint64(len(doc_idx)).tobytes()
    Path(f"{prefix}.idx").write_bytes(header + counts + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def write_arrow_stream(path, columns: dict[str, pa.Array], *, batch_rows: int = 8) -> None:
    """An Arrow IPC stream of record batches of `batch_rows` rows (what `datasets` writes)."""
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)


def mds_encode(encoding: str, value) -> bytes:
    """One column value as streaming's MDS encodings store it (str, ints, ndarray[:dtype[:shape]])."""
    if encoding == "str":
        return value.encode("utf-8")
    if encoding == "int":
        return np.int64(value).tobytes()
    parts = encoding.split(":")
    if parts[0] != "ndarray":
        return np.asarray(value, dtype=np.dtype(encoding)).tobytes()
    arr = np.asarray(value, dtype=parts[1] if len(parts) > 1 else None)
    head = b""
    if len(parts) == 1:  # the dtype is stored
        codes = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "uint32": 32, "int32": 33, "uint64": 64, "int64": 65}
        head += bytes([codes[arr.dtype.name]])
    if len(parts) < 3:  # the shape is stored, in the smallest unsigned type that holds it
        code = next(i for i, lim in enumerate((1 << 8, 1 << 16, 1 << 32, 1 << 64)) if max(arr.shape) < lim)
        head += bytes([(arr.ndim << 2) | code]) + np.asarray(arr.shape, dtype=f"<u{2 ** code}").tobytes()
    return head + arr.tobytes()


def write_mds(folder, samples: list[dict], columns: dict[str, str], *, compression: str | None = None,
              samples_per_shard: int = 10**9) -> list[str]:
    """An MDS folder (index.json + shard.NNNNN.mds[.zstd]); returns the shard files plait reads."""
    import zstandard

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(columns)  # MDSWriter sorts the columns
    encodings = [columns[n] for n in names]
    fixed = {"int": 8, **{k: np.dtype(k).itemsize for k in ("uint8", "uint16", "uint32", "uint64", "int8", "int16",
                                                           "int32", "int64")}}
    sizes = []
    for e in encodings:
        parts = e.split(":")
        sizes.append(fixed.get(e) if parts[0] != "ndarray" else
                     (int(np.prod([int(d) for d in parts[2].split(",")])) * np.dtype(parts[1]).itemsize
                      if len(parts) == 3 else None))
    config = {"column_encodings": encodings, "column_names": names, "column_sizes": sizes,
              "compression": compression, "format": "mds", "hashes": [], "size_limit": None, "version": 2}
    config_bytes = json.dumps(config, sort_keys=True).encode()
    shards, files = [], []
    for s, lo in enumerate(range(0, len(samples), samples_per_shard)):
        encoded = []
        for sample in samples[lo : lo + samples_per_shard]:
            data = [mds_encode(e, sample[n]) for n, e in zip(names, encodings)]
            head = np.array([len(d) for d, size in zip(data, sizes) if size is None], np.uint32).tobytes()
            encoded.append(head + b"".join(data))
        n = np.uint32(len(encoded))
        offsets = np.array([0] + [len(x) for x in encoded]).cumsum().astype(np.uint32)
        offsets += 4 + len(offsets.tobytes()) + len(config_bytes)
        raw = n.tobytes() + offsets.tobytes() + config_bytes + b"".join(encoded)
        raw_name = f"shard.{s:05}.mds"
        entry = {**config, "raw_data": {"basename": raw_name, "bytes": len(raw), "hashes": {}},
                 "samples": len(encoded), "zip_data": None}
        if compression == "zstd":
            zipped = zstandard.ZstdCompressor().compress(raw)
            (folder / (raw_name + ".zstd")).write_bytes(zipped)
            entry["zip_data"] = {"basename": raw_name + ".zstd", "bytes": len(zipped), "hashes": {}}
            files.append(str(folder / (raw_name + ".zstd")))
        else:
            (folder / raw_name).write_bytes(raw)
            files.append(str(folder / raw_name))
        shards.append(entry)
    (folder / "index.json").write_text(json.dumps({"shards": shards, "version": 2}, sort_keys=True))
    return files


def megatron_source(root, *, name: str = "meg", files: int = 2, docs_per_file: int = 30, lo: int = 1, hi: int = 60,
                    dtype=np.int32, vocab: int = 1000, seed: int = 0, **options) -> Dataset:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    docs, prefixes = {}, []
    for f in range(files):
        d = token_docs(docs_per_file, lo=lo, hi=hi, vocab=vocab, seed=seed * 1000 + f + 11)
        prefix = str(root / f"corpus{f}_text_document")
        write_megatron(prefix, d, dtype=dtype)
        prefixes.append(prefix)
        docs.update({(f, r): t for r, t in enumerate(d)})
    return Dataset({"name": name, "path": prefixes, "format": "megatron", **options}, sorted(prefixes), docs)


def arrow_source(root, *, name: str = "hf", files: int = 2, docs_per_file: int = 30, batch_rows: int = 8,
                 lo: int = 1, hi: int = 60, seed: int = 0, lengths: bool = False, **options) -> Dataset:
    """A `save_to_disk`-like folder: data-0000i-of-0000N.arrow streams (input_ids, text) + the json files."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    docs = {}
    for f in range(files):
        d = token_docs(docs_per_file, lo=lo, hi=hi, seed=seed * 1000 + f + 23)
        cols = {"input_ids": pa.array([x.tolist() for x in d], pa.list_(pa.int32())),
                "text": pa.array([f"doc {f}-{i}" for i in range(len(d))])}
        if lengths:
            cols["n_tokens"] = pa.array([len(x) for x in d], pa.int32())
        write_arrow_stream(root / f"data-{f:05d}-of-{files:05d}.arrow", cols, batch_rows=batch_rows)
        docs.update({(f, r): t for r, t in enumerate(d)})
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": p.name} for p in sorted(root.glob("*.arrow"))]}))
    (root / "dataset_info.json").write_text("{}")
    files_ = sorted(str(p) for p in root.glob("*.arrow"))
    return Dataset({"name": name, "path": str(root), "tokens_field": "input_ids", **options}, files_, docs)


def mds_source(root, *, name: str = "mds", docs: int = 40, per_shard: int = 15, lo: int = 1, hi: int = 60,
               seed: int = 0, compression: str | None = None, encoding: str = "ndarray:int32", text: bool = True,
               **options) -> Dataset:
    """An MDS folder of token arrays (`ids`), a stored length (`n_tokens`) and, when `text`, a str column."""
    d = token_docs(docs, lo=lo, hi=hi, seed=seed + 31)
    columns = {"ids": encoding, "n_tokens": "int32"}
    if text:
        columns["text"] = "str"
    samples = [{"ids": x.astype(np.int32 if ":" not in encoding else encoding.split(":")[1]), "n_tokens": len(x),
                "text": f"sample {i}"} for i, x in enumerate(d)]
    files = write_mds(root, samples, columns, compression=compression, samples_per_shard=per_shard)
    docs_ = {(i // per_shard, i % per_shard): x for i, x in enumerate(d)}
    return Dataset({"name": name, "path": str(root), "format": "mds", "tokens_field": "ids", **options},
                   sorted(files), docs_)


def scrape_metrics(port: int) -> dict:
    """A /metrics page as {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def boundary_state_without_next(spec, steps: int = 2) -> dict:
    """A Loader's state at the boundary after `steps` steps on `spec`'s layout, without the data state
    after its step (`next`), as an older plait wrote it: resuming it on another layout must re-plan."""
    import plait
    from plait.state.schema import seal

    with plait.Loader(spec, dp_rank=0, steps=steps, read_ahead=0) as ld:
        list(ld)
        full = json.loads(json.dumps(ld.state_dict()))
    return seal({k: v for k, v in full.items() if k not in ("next", "checksum")})


def local_resume_ids(spec, state: dict, dp_rank: int, steps: int) -> list[list]:
    """Sample ids a local Loader of `dp_rank` reads for `steps` steps resuming `state` on `spec`."""
    import plait

    with plait.Loader(spec, dp_rank=dp_rank, steps=steps, read_ahead=0) as local:
        local.load_state_dict(state)
        return [mb.sample_ids.tolist() for mb in local]


def run_spawned_ranks(target, spec, tmp_path, ranks: int = 2, timeout: float = 120) -> list:
    """`target(rank, spec, init_method, out_path)` in `ranks` spawned processes (a gloo job's ranks, joined by
    a file rendezvous in tmp_path); each writes its JSON result to out_path: the results in rank order."""
    import json
    from pathlib import Path

    import torch.multiprocessing as mp

    outs = [str(tmp_path / f"rank{r}.json") for r in range(ranks)]
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [mp.get_context("spawn").Process(target=target, args=(r, spec, init, outs[r])) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0
    return [json.loads(Path(o).read_text()) for o in outs]


def free_port() -> int:
    """A TCP port free on loopback now (for a server a test starts: a Ray head, torchrun's master, Flight)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_ray_head(proc, grace: float = 5.0) -> int | None:
    """End a `ray start --head --block` started in a session of its own (start_new_session): SIGINT (it then
    stops what it started), and after `grace` seconds SIGKILL of its whole session. An idle head ends in
    ~1.3 s; one that served a test's jobs often did not within 30 s (measured in CI: 30 s of three modules'
    teardowns each), and its session is killed either way."""
    import os
    import signal
    import subprocess

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        return None
