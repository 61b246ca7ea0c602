"""A source: its shards, its deterministic order, and decoded blocks of documents.

Order. A source's documents come in a fixed, seed-determined order per epoch:
files (shards) are shuffled, each file's blocks (Parquet row groups; a whole JSONL file) are shuffled,
and each block's rows are shuffled. A position in that order is a *block key*
(epoch, file_pos, block_pos) plus a row position inside the block; a cursor is exactly that, four
integers. Nothing is indexed up front: a file's footer is read when the order first reaches it.

Blocks. `read_block(key)` returns a DocBlock: the block's documents, tokenized, in shuffled order, as one
flat int32 token array with offsets, plus each document's data coordinates (shard, row in the file),
which become its sample id. Bad records are dropped from the block (policy `skip`, counted) or raise
(policy `raise`) with source, shard and record named.

Bad files. A file that cannot be read as a whole (corrupt or truncated, whatever the codec; not of its
format; missing the field; holding no records at all) is, like a bad record, an error under `raise` and
a counted, named skip under `skip`. A source keeps going as long as one of its files is readable; when
every file is bad it stops with an error naming them.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import fsspec
import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.ragged import ragged_arange
from plait.sources.formats import EXTENSIONS, FORMATS, infer_format, reader_for, supported
from plait.sources.mds import shard_files
from plait.sources.multimodal import ImageDocs
from plait.sources.placeholder_ids import PlaceholderCheck, placeholder_id_names
from plait.sources.bad_records import BadRecords
from plait.sources.blocks import BlockKey, BlockLengths, DocBlock, reconcile
from plait.sources.reader import FormatReader, RawBlock, RawLengths, describe
from plait.sources.token_columns import TokenColumn
from plait.sources.webdataset import expand_braces
from plait.spec import SourceSpec, Spec
from plait.transforms.tokenize import TextEncoder

__all__ = ["BlockKey", "BlockLengths", "DocBlock", "FormatReader", "RawBlock", "RawLengths", "Source", "file_order"]

# Blocks whose lengths are kept after planning read them, for the check when their tokens are decoded
# (a step's plan runs ahead of its gathers by up to a step's worth of blocks; lengths are small).
LENGTHS_KEPT = 256


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key])))


def file_order(seed: int, source: int, epoch: int, num_files: int) -> np.ndarray:
    """Source `source`'s file order in `epoch`: a seeded permutation of its sorted file list.

    Public because the ray runtime's placement (which loader owns a block) needs the order without
    opening the source; `Source.file_order` is this function (cached)."""
    return _rng(seed, source, epoch).permutation(num_files)


class Source:
    """One source's files, order, and block decoding. Cheap to create: lists files, reads nothing.

    Lengths without tokens. When the reader can give a block's lengths alone (`reads_lengths`: a
    `length_field`, or a format whose index holds them), `read_lengths` serves planning and the tokens
    are decoded only by `read_block`, which then checks them against those lengths: a record whose
    tokens disagree (or that turns out unreadable) is a bad record: every rank's plan holds it, so under
    `skip` it is counted, named and dropped from its batch (blocks.py); under `raise` it stops the run.

    Its parts: the policy over bad records and files is `bad` (bad_records.py), the column-to-tokens
    checks are `column` (token_columns.py), the lengths check is blocks.reconcile."""

    @classmethod
    def of_job(cls, job: Spec, index: int) -> "Source":
        """Source `index` of a whole spec, with everything it takes from the job (seed, vocabulary, images)."""
        return cls(job.sources[index], index, job.seed, vocab_size=job.vocab_size, job=job)

    def __init__(self, spec: SourceSpec, index: int, seed: int, *, vocab_size: int | None = None,
                 job: Spec | None = None):
        """`job`: the whole spec, needed by image sources (image policy, seq_len, max_patches)."""
        self.spec = spec
        self.vocab_size = vocab_size  # ids at or above it are bad records (the model has no row for them)
        self.index = index
        self.name = spec.name
        self.seed = seed
        self.files, self.fs = _list_files(spec)
        self.reader: FormatReader = reader_for(spec, self.files[0], self.fs)
        self.encoder = _make_encoder(spec)
        # bad records and files under the on_error policy (bad_records.py); errors, error_log: its counts
        self.bad = BadRecords(spec.name, spec.on_error, len(self.files))
        self.errors, self.error_log = self.bad.errors, self.bad.error_log
        self.column = TokenColumn(spec, self.reader.field, self.encoder, vocab_size, self.bad)
        self._num_blocks: dict[int, int] = {}
        self._block_runs: dict[int, np.ndarray | None] = {}  # per file: blocks read in sequence (reader.block_runs)
        self._file_orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self.report_lock = threading.Lock()  # bad images are reported from a SourceLoader's worker threads
        self._lengths: OrderedDict[BlockKey, BlockLengths] = OrderedDict()
        self.images: ImageDocs | None = None
        if spec.multimodal:
            if job is None or (job.images is None and job.audio is None):
                raise SourceError(self.name, None, None, "a media source needs the spec's `images` or `audio` section")
            self.images = ImageDocs(job, spec, self.encoder, self.reader, self.bad.record)
        # media placeholder ids in documents without media: counted, refused or replaced (placeholder_ids.py)
        self.placeholders = PlaceholderCheck(spec.name, spec.placeholder_ids, spec.placeholder_replacement,
                                             placeholder_id_names(job), self.bad)

    # ----- order -------------------------------------------------------------------------------
    def file_order(self, epoch: int) -> np.ndarray:
        order = self._file_orders.get(epoch)
        if order is None:
            order = file_order(self.seed, self.index, epoch, len(self.files))
            self._file_orders[epoch] = order
            while len(self._file_orders) > 2:
                self._file_orders.popitem(last=False)
        return order

    def num_blocks(self, file_idx: int) -> int:
        n = self._num_blocks.get(file_idx)
        if n is None:
            path = self.files[file_idx]
            try:
                n = self.reader.num_blocks(path)
                self._block_runs[file_idx] = self.reader.block_runs(path)
            except SourceError as e:  # e.g. the column is missing: the policy decides, as for any bad shard
                self.bad.file(path, e.record, e.reason)
                n = 0
            except Exception as e:  # corrupt footer, unreadable file, ...
                self.bad.file(path, None, f"cannot open: {describe(e)}")
                n = 0
            self._num_blocks[file_idx] = n
        return n

    def block_order(self, epoch: int, file_idx: int) -> np.ndarray:
        """A seeded permutation of a file's blocks. Blocks read in sequence (`FormatReader.block_runs`)
        stay together and in order: the runs are permuted (the same permutation as of single blocks when
        every run is one block, so splitting nothing changes nothing)."""
        rng = _rng(self.seed, self.index, epoch, file_idx, 0x5EED)
        n = self.num_blocks(file_idx)
        runs = self._block_runs.get(file_idx)
        if runs is None or len(runs) == n:
            return rng.permutation(n)
        order = rng.permutation(len(runs))
        return ragged_arange((np.cumsum(runs) - runs)[order], runs[order])

    def first_key(self, epoch: int = 0) -> BlockKey:
        return self._settle((epoch, 0, 0))

    def next_key(self, key: BlockKey) -> BlockKey:
        epoch, fpos, bpos = key
        return self._settle((epoch, fpos, bpos + 1))

    def _settle(self, key: BlockKey) -> BlockKey:
        """Move a key past file ends (and epoch ends) to the next block that exists.

        Only files found to hold no blocks count toward giving up (the file being left, which had
        blocks, does not): the search stops with an error once every file is known to be empty, and
        otherwise reaches a readable file within the next epoch.
        """
        epoch, fpos, bpos = key
        empty: set[int] = set()
        while True:
            if fpos >= len(self.files):
                epoch, fpos, bpos = epoch + 1, 0, 0
            file_idx = int(self.file_order(epoch)[fpos])
            with self.bad.reading(epoch):
                n = self.num_blocks(file_idx)
            if bpos < n:
                return (epoch, fpos, bpos)
            if n == 0:
                self.bad.passed_file(self.files[file_idx], epoch)  # a bad file counts in every epoch it is met
                empty.add(file_idx)
                if len(empty) == len(self.files):
                    raise SourceError(self.name, None, None, "no readable blocks in any file" + self.bad.hint())
            fpos, bpos = fpos + 1, 0

    # ----- lengths (planning) ------------------------------------------------------------------
    def reads_lengths(self, key: BlockKey) -> bool:
        """Whether the block's lengths can be read without its tokens (class docstring); never under
        placeholder_ids: refuse, whose refusals planning must see (placeholder_ids.py)."""
        refuses = self.placeholders.policy == "refuse" and len(self.placeholders.ids)
        return not refuses and self.reader.reads_lengths(self.files[int(self.file_order(key[0])[key[1]])])

    def read_lengths(self, key: BlockKey) -> BlockLengths:
        key = tuple(int(k) for k in key)
        cached = self._lengths.get(key)
        if cached is not None:
            return cached
        with self.bad.reading(key[0]):  # what is bad here counts for this epoch (bad_records.py)
            return self._read_lengths(key)

    def _read_lengths(self, key: BlockKey) -> BlockLengths:
        epoch, file_idx, block_idx, path = self._locate(key)
        try:
            raw = self.reader.read_lengths(path, block_idx)
        except Exception as e:
            self._read_failed(e, path, file_idx, block_idx)
            raw = RawLengths(0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64))
        for record, reason in raw.bad:
            self.bad.record(path, str(record), reason)
        lengths = np.asarray(raw.lengths, np.int64) + (self.spec.bos is not None) + (self.spec.eos is not None)
        kept_pos, order = self._shuffle(epoch, file_idx, block_idx, raw.num_records, raw.ok_index)
        out = BlockLengths(self.index, key, file_idx, kept_pos[order], raw.first_row + raw.ok_index[order],
                           lengths[order], raw.num_records)
        self._lengths[key] = out
        while len(self._lengths) > LENGTHS_KEPT:
            self._lengths.popitem(last=False)
        return out

    # ----- decoding ----------------------------------------------------------------------------
    def read_block(self, key: BlockKey) -> DocBlock:
        with self.bad.reading(key[0]):  # what is bad here counts for this epoch (bad_records.py)
            block = self._decode(key)
            pa.default_memory_pool().release_unused()  # the decoded column's freed pages (docs/memory.md)
            if not self.reads_lengths(key):
                return block
            return reconcile(block, self.read_lengths(key), self.spec, self.files[block.shard], self.bad.record)

    def _locate(self, key: BlockKey) -> tuple[int, int, int, str]:
        epoch, fpos, bpos = key
        file_idx = int(self.file_order(epoch)[fpos])
        block_idx = int(self.block_order(epoch, file_idx)[bpos])
        return epoch, file_idx, block_idx, self.files[file_idx]

    def _read_failed(self, e: Exception, path: str, file_idx: int, block_idx: int) -> None:
        """A reader raised on a block: the policy decides (a whole file when the reader says so)."""
        if isinstance(e, SourceError):  # the reader named the problem (a corrupt or empty file, ...)
            whole_file = e.record is None or self.num_blocks(file_idx) == 1
            (self.bad.file if whole_file else self.bad.record)(path, e.record, e.reason)
        else:
            whole_file = self.num_blocks(file_idx) == 1
            (self.bad.file if whole_file else self.bad.record)(path, f"block {block_idx}", f"cannot read: {describe(e)}")

    def _shuffle(self, epoch: int, file_idx: int, block_idx: int, num_records: int, ok_index: np.ndarray):
        """Shuffled positions of the kept records, and the order that sorts them.

        The shuffle is over every record position of the block, bad ones included, so that a record's
        position never depends on which other records were readable."""
        perm = _rng(self.seed, self.index, epoch, file_idx, block_idx + 1).permutation(num_records)
        position_of_record = np.empty(num_records, dtype=np.int64)
        position_of_record[perm] = np.arange(num_records, dtype=np.int64)
        kept_pos = position_of_record[ok_index]
        return kept_pos, np.argsort(kept_pos, kind="stable")

    def _decode(self, key: BlockKey) -> DocBlock:
        epoch, file_idx, block_idx, path = self._locate(key)
        try:
            raw = self.reader.read_block(path, block_idx)
        except Exception as e:
            self._read_failed(e, path, file_idx, block_idx)
            raw = self.column.empty_raw()
        for record, reason in raw.bad:
            self.bad.record(path, str(record), reason)
        if self.images is not None:
            return self.placeholders.apply(self._decode_images(key, raw, path, (epoch, file_idx, block_idx)), path)
        values, ok_index = self.column.clean(raw.values, raw.ok_index, path, raw.first_row)
        try:
            tokens, offsets = self.column.tokens(values, path)
        except SourceError as e:  # wrong column type, ids out of range: the whole block is bad
            self.bad.record(path, e.record or f"block {block_idx}", e.reason)
            raw, ok_index = self.column.empty_raw(), np.zeros(0, np.int64)
            tokens, offsets = self.column.tokens(raw.values, path)
        if self.vocab_size is not None:
            tokens, offsets, ok_index = self.column.drop_out_of_vocab(tokens, offsets, ok_index, path, raw.first_row)
        kept_pos, order = self._shuffle(epoch, file_idx, block_idx, raw.num_records, ok_index)
        return self.placeholders.apply(DocBlock(
            source=self.index,
            key=key,
            shard=file_idx,
            positions=kept_pos[order],
            rows=raw.first_row + ok_index[order].astype(np.int64),
            tokens=tokens,
            starts=offsets[:-1][order],
            lengths=np.diff(offsets)[order],
            num_positions=raw.num_records,
        ), path)

    def _decode_images(self, key: BlockKey, raw: RawBlock, path: str, where: tuple[int, int, int]) -> DocBlock:
        """An image source's block: documents with placeholder runs, and their image table (headers only)."""
        epoch, file_idx, block_idx = where
        if self.images.videos is not None and self.images.videos.policy.clip:
            raw = self.images.videos.clip_block(path, raw, self.bad.record)
        records = raw.records or []
        tokens, offsets, kept, table = self.images.build(path, records)
        ok_index = raw.ok_index[kept] if len(kept) else np.zeros(0, np.int64)
        kept_pos, order = self._shuffle(epoch, file_idx, block_idx, raw.num_records, ok_index)
        return DocBlock(self.index, key, file_idx, kept_pos[order], raw.first_row + ok_index[order].astype(np.int64),
                        tokens, offsets[:-1][order], np.diff(offsets)[order], raw.num_records, table.take_docs(order))

    def image_pixels(self, block: DocBlock, image: int, out: np.ndarray | None = None) -> np.ndarray | None:
        """Image `image` (an index into block.images) decoded to uint8 patches (into `out` when given), once
        per delivery. A body that does not decode: an error under `raise`; under `skip` None (its sample is
        not delivered), counted once per epoch (a later epoch plans it again; bad_records.py) and
        named. Thread-safe: a SourceLoader decodes a gather's images on its worker pool."""
        path = self.files[block.shard]
        pixels, why = self.images.decode_pixels(path, block.images, image, out)
        if why is not None:
            if self.spec.on_error != "raise":
                why = f"{why}; its sample is dropped from its micro-batch"
            with self.report_lock:
                self.bad.record(path, str(block.images.records[image]), why, epoch=int(block.key[0]))
        return pixels

    # ----- errors (bad_records.py) ------------------------------------------------------------------
    @property
    def bad_records(self) -> list[tuple[str, str | None, int | None]]:
        """(file, record, epoch) of every bad record (or shard: record None) this process counted."""
        return self.bad.records

    def close(self) -> None:
        self.reader.close()


def _make_encoder(spec: SourceSpec) -> TextEncoder | None:
    if not spec.text_field:
        return None
    try:
        return TextEncoder(spec.tokenizer, spec.storage_options)
    except Exception as e:  # missing or invalid tokenizer.json: a problem with this source, named as such
        raise SourceError(spec.name, None, None, f"cannot load tokenizer {spec.tokenizer!r}: {describe(e)}") from None


def _list_files(spec: SourceSpec) -> tuple[list[str], fsspec.AbstractFileSystem]:
    files: list[str] = []
    fs = None
    for pattern in [p for given in spec.paths for p in (expand_braces(given) if "{" in given else [given])]:
        try:
            fs_i, _ = fsspec.core.url_to_fs(pattern, **spec.storage_options)
        except Exception as e:  # unknown protocol, its package missing, bad storage_options
            raise SourceError(spec.name, pattern, None, f"cannot open the filesystem: {describe(e)}") from None
        fs = fs or fs_i
        try:
            if any(ch in pattern for ch in "*?["):
                matches = fs_i.glob(pattern)
                if spec.format == "megatron" and not matches:  # a glob of prefixes
                    matches = fs_i.glob(pattern + ".idx")
                matches = _data_files(matches, spec, fs_i) if spec.format in ("megatron", "mds") else matches
            elif fs_i.isdir(pattern):
                matches = _data_files(fs_i.find(pattern), spec, fs_i)
            elif fs_i.exists(pattern):
                matches = _data_files([pattern], spec, fs_i) if infer_format(pattern) in ("megatron", "mds") else [pattern]
            elif spec.format in ("megatron", None) and fs_i.exists(pattern + ".idx"):
                matches = [pattern]  # a Megatron prefix: the pair's common name
            else:
                raise SourceError(spec.name, pattern, None, "no such file or folder")
        except SourceError:
            raise
        except Exception as e:
            raise SourceError(spec.name, pattern, None, f"cannot list: {describe(e)}") from None
        protocol = fs_i.protocol if isinstance(fs_i.protocol, str) else fs_i.protocol[0]
        for m in matches:
            files.append(m if protocol in ("file", "local") or "://" in m else f"{protocol}://{m}")
    files = sorted(set(files))
    if not files:
        relative = [p for p in spec.paths if "://" not in p and not os.path.isabs(p)]
        hint = (f"; relative paths were looked up from the current directory {os.getcwd()} (a spec given as a "
                "dict has no folder of its own: pass load_spec(d, base_dir=...) or absolute paths)") if relative else ""
        raise SourceError(spec.name, ", ".join(spec.paths), None, f"matches no files (empty source){hint}")
    return files, fs


def _data_files(paths: list[str], spec: SourceSpec, fs: fsspec.AbstractFileSystem) -> list[str]:
    """The files of a folder that hold this source's data: those of its format (by extension)."""
    kinds = {p: infer_format(p) for p in paths}
    if spec.format == "jsonl":  # a JSON file is data here, whatever its name
        kinds = {p: "jsonl" if p.lower().endswith(EXTENSIONS["jsonl"]) else k for p, k in kinds.items()}
    formats = {k for k in kinds.values() if k is not None}
    if spec.format is None and len(formats) > 1:
        raise SourceError(spec.name, None, None, f"the folder holds several formats {sorted(formats)}; set `format`")
    if spec.format is None and not formats and paths:
        raise SourceError(spec.name, None, None, f"the folder holds no file of a supported format "
                          f"({', '.join(FORMATS)}); supported: {supported()}")
    wanted = spec.format or (formats.pop() if formats else None)
    files = [p for p, k in kinds.items() if k is not None and k == wanted]
    if wanted == "megatron":  # a pair's two files name one dataset: its prefix
        return sorted({p.rsplit(".", 1)[0] for p in files})
    if wanted == "mds":  # the shards the folders' index.json files list (shards of no index are not read)
        indexes = [p for p in files if p.rsplit("/", 1)[-1] == "index.json"]
        return [shard for index in indexes for shard in shard_files(fs, index)] if indexes else files
    return files
