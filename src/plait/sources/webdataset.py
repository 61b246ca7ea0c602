"""WebDataset: tar shards of samples grouped by key (`000123.jpg` + `000123.txt` / `000123.json`).

A shard is read with the standard library's `tarfile` over fsspec. Its member index (each sample's key
and, per extension, where the member's bytes sit in the tar) is built once per shard from the tar
headers, seeking over the data; after that any process reads any member directly at its offset, so a
block is decodable again from its key alone (exact resume). A block is a run of `SAMPLES_PER_BLOCK`
consecutive samples of a shard (a whole shard when it holds fewer).

Fields. `image_field` lists the image members' extensions ("jpg;png;webp"): every member of a sample with
one of them is an image of that sample, in the order the extensions are listed. `text_field` names the
text member: an extension ("txt": its UTF-8 content) or `ext:key` ("json:caption": that key of the
member parsed as JSON; with `template: chat`, e.g. "json:conversations").

Bad input, per sample (named by shard and key; on_error applies): no text member, or no image member
(a member without its pair); a text member that is not UTF-8 or JSON without the key; a member cut
short by a truncated shard. A shard whose headers cannot be read at all is a bad file.

Shard lists: `path` may use brace expansion (`shards-{000000..000099}.tar`, `{a,b}`), expanded here
(`expand_braces`) before the files are listed.
"""

from __future__ import annotations

import json
import posixpath
import re
import tarfile
import threading
from collections import OrderedDict

import numpy as np
import pyarrow as pa

from plait.errors import SourceError
from plait.media.registry import IMAGE, source_media
from plait.sources.multimodal import BadRecord, make_record
from plait.sources.reader import EMPTY_FILE, FormatReader, RawBlock

_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)\}")


def expand_braces(pattern: str) -> list[str]:
    """Bash-style brace expansion: `{000..003}` (numeric ranges keep the zero padding of the first) and
    `{a,b,c}` alternatives, nested or several in one pattern, left to right."""
    m = _RANGE.search(pattern)
    alt = _first_alternatives(pattern)
    if m and (alt is None or m.start() <= alt[0]):
        lo, hi = m.group(1), m.group(2)
        width = len(lo) if lo.lstrip("-").startswith("0") else 0
        step = 1 if int(hi) >= int(lo) else -1
        return [x for i in range(int(lo), int(hi) + step, step)
                for x in expand_braces(pattern[:m.start()] + str(i).zfill(width) + pattern[m.end():])]
    if alt is not None:
        start, end, options = alt
        return [x for o in options for x in expand_braces(pattern[:start] + o + pattern[end:])]
    return [pattern]


def _first_alternatives(pattern: str):
    """(start, end, options) of the first `{x,y}` group (top-level commas only), or None."""
    for start, ch in enumerate(pattern):
        if ch != "{":
            continue
        depth, parts, last = 0, [], start + 1
        for i in range(start, len(pattern)):
            c = pattern[i]
            depth += (c == "{") - (c == "}")
            if c == "," and depth == 1:
                parts.append(pattern[last:i])
                last = i + 1
            elif depth == 0:
                if parts:
                    return start, i + 1, parts + [pattern[last:i]]
                break
    return None


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file name; the rest, the extension."""
    folder, base = posixpath.split(name)
    stem, _, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower()


class WebDatasetReader(FormatReader):
    SAMPLES_PER_BLOCK = 256
    MAX_OPEN = 4

    def __init__(self, spec, fs):
        super().__init__(spec, fs)
        self.text_ext, _, self.text_key = (spec.text_field or "").partition(":")
        self.text_ext = self.text_ext.lower()
        self._index: OrderedDict[str, tuple[list, dict, set]] = OrderedDict()
        self._open: OrderedDict[str, object] = OrderedDict()
        self.member_lock = threading.Lock()  # one seek + read at a time: a SourceLoader's workers share the handles

    def _shard(self, path: str) -> tuple[list, dict, set]:
        """[(key, {ext: member name})] in tar order, {member name: (data offset, size)}, and the names of
        members cut short by a truncated shard."""
        entry = self._index.get(path)
        if entry is None:
            samples: OrderedDict[str, dict] = OrderedDict()
            where: dict[str, tuple[int, int]] = {}
            with self.open_stream(path) as f:
                f.seek(0, 2)
                total = f.tell()
                f.seek(0)
                try:
                    with tarfile.open(fileobj=f, mode="r:") as tar:
                        for m in tar:
                            if m.isfile():
                                key, ext = split_name(m.name)
                                samples.setdefault(key, {})[ext] = m.name
                                where[m.name] = (m.offset_data, m.size)
                except tarfile.ReadError as e:
                    if not where:
                        raise SourceError(self.spec.name, path, None, f"not a readable tar shard: {e}") from None
            if not samples:
                raise SourceError(self.spec.name, path, None, EMPTY_FILE)
            entry = (list(samples.items()), where, {n for n, (off, size) in where.items() if off + size > total})
            self._index[path] = entry
            while len(self._index) > 16:
                self._index.popitem(last=False)
        return entry

    def num_blocks(self, path: str) -> int:
        return -(-len(self._shard(path)[0]) // self.SAMPLES_PER_BLOCK)

    def _handle(self, path: str):
        f = self._open.get(path)
        if f is None:
            f = self._open[path] = self.open_stream(path)
            while len(self._open) > self.MAX_OPEN:
                self._open.popitem(last=False)[1].close()
        return f

    def _member(self, path: str, name: str, n: int | None = None) -> bytes:
        _, where, truncated = self._shard(path)
        if name not in where:
            raise OSError(f"no member {name!r} in the shard")
        if name in truncated:
            raise OSError(f"member {name!r} is cut short (truncated shard)")
        offset, size = where[name]
        with self.member_lock:
            f = self._handle(path)
            f.seek(offset)
            return f.read(size if n is None else min(n, size))

    def image_head(self, path: str, ref, n: int) -> tuple[bytes, bool]:
        if isinstance(ref, bytes):
            return ref, True
        head = self._member(path, ref, n)
        return head, len(head) < n or len(head) == self._shard(path)[1][ref][1]

    def image_bytes(self, path: str, ref) -> bytes:
        return ref if isinstance(ref, bytes) else self._member(path, ref)

    def video_input(self, path: str, ref) -> bytes:
        return self.image_bytes(path, ref)

    def read_block(self, path: str, block: int) -> RawBlock:
        samples = self._shard(path)[0]
        first = block * self.SAMPLES_PER_BLOCK
        run = samples[first:first + self.SAMPLES_PER_BLOCK]
        records, ok, bad = [], [], []
        kinds = [kind for kind, _ in source_media(self.spec)]
        # an image-only source's samples lack "image" members; one reading other media, "media" members
        what = "image" if kinds == [IMAGE] else "media"
        for i, (key, members) in enumerate(run):
            try:
                if self.text_ext not in members:
                    raise BadRecord(f"sample {key!r} has no {self.text_ext!r} member (has: {', '.join(sorted(members))})")
                media = {kind.name: kind.references([members[e] for e in kind.extensions(self.spec) if e in members])
                         for kind in kinds}
                if not any(media.values()):
                    wanted = [e for kind in kinds for e in kind.extensions(self.spec)]
                    raise BadRecord(f"sample {key!r} has no {what} member ({', '.join(wanted)}); "
                                    f"has: {', '.join(sorted(members))}")
                records.append(make_record(self._text(path, members[self.text_ext]), media, self.spec.template, key))
                ok.append(i)
            except BadRecord as e:
                bad.append((key, str(e)))
            except OSError as e:
                bad.append((key, f"cannot read: {e}"))
        return RawBlock(first, len(run), np.asarray(ok, np.int64), pa.array([""] * len(records), pa.string()),
                        bad, records)

    def _text(self, path: str, name: str):
        raw = self._member(path, name)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRecord(f"member {name!r} is not UTF-8 text") from None
        if not self.text_key:
            return text
        try:
            value = json.loads(text)
        except ValueError as e:
            raise BadRecord(f"member {name!r} is not JSON: {e}") from None
        if not isinstance(value, dict) or value.get(self.text_key) is None:
            raise BadRecord(f"member {name!r} has no key {self.text_key!r}")
        return value[self.text_key]

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
