"""Image-text records: templates, the image table of a DocBlock, header-only planning, decode at gather.

A format reader that reads an `image_field` returns its records as `MMRecord`s: the text cut into
segments around the images (text = seg_0 img_0 seg_1 img_1 ... seg_k) and, per image, a reference to
re-read its bytes (`ImageRef`: the bytes themselves for a Parquet image column, a member name for a
WebDataset shard, a path for LLaVA JSON). `ImageDocs.build` then, for a whole block:

  1. reads each image's *header* only (`image_size`, no pixel is decoded) and plans it with the spec's
     `ImagePolicy` (patches, placeholder tokens, grid);
  2. tokenizes every text segment of the block in one call and assembles each document as
     [bos] seg_0 run_0 seg_1 run_1 ... seg_k [eos], where run_j = `placeholder_run(image_token_id,
     tokens_j)`;
  3. applies the capacities: a document holding images is never cut (an image's placeholder run must
     reach the model whole, with its pixels), so one longer than `seq_len` tokens, or holding more than
     `max_patches` patches, is a bad record (named; on_error applies) -- as is an unreadable header, a
     missing file, a conversation whose `<image>` markers disagree with its images, an id outside the
     vocabulary.

Templates (`template:`):
  caption  the images first, then the text: [bos] run_0 ... run_k text [eos].
  chat     a LLaVA conversation, a list of turns {from|role: ..., value|content: "..."}, rendered as
           "user: <value>\\n" / "assistant: <value>\\n" / "system: <value>\\n" (from `human`/`user`,
           `gpt`/`assistant`, `system`), turns concatenated; every `<image>` in the values is where the
           next image's placeholder run goes (their count must equal the images'). Every text token is a
           label (no per-role loss mask yet); only placeholder predictions are masked.

At gather time `decode_pixels` decodes an image exactly once for the batch that delivers it. A body that
fails to decode after its header planned it (truncated data, a file changed since): under
`on_error: raise` the run stops naming source, shard, record and image; under `skip` its whole sample
is dropped from its micro-batch (SourceLoader.gather_payload; the micro-batch gets shorter), counted
once per delivery attempt (each epoch plans it again: the Planner sees headers only, and every data
plane must plan the same steps, so what one of them found at gather cannot change the plan).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from plait.media.audio import AudioRef
from plait.media.base import MediaError, field_media
from plait.media.image import BadImage, ImagePolicy
from plait.media.registry import AUDIO, BY_NAME, IMAGE, KINDS, VIDEO, kind_of
from plait.media.video import VideoRef
from plait.spec import SourceSpec, Spec
from plait.sources.audio import AudioDocs
from plait.sources.video import VIDEO_KIND, VideoDocs

ImageRef = bytes | str  # inline bytes, or what the reader resolves: a member name, a path
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
HEAD_BYTES = 1 << 16  # header prefix read at planning time (the whole image if its header needs more)


class BadRecord(ValueError):
    """A record that cannot become a document (one line, named by the caller)."""


@dataclass
class MMRecord:
    """One image-text record: len(segments) == len(images) + 1; `name` names it in errors."""

    segments: list[str]
    images: list[ImageRef]
    name: str


def placeholder_leads(source: SourceSpec) -> bool:
    """Whether this source's documents with images start with a placeholder (no bos, and the caption
    template puts the images first). Such a first placeholder has no label predicting it, so a document
    masks one placeholder label fewer than it has placeholders (the Planner's `global_label_tokens`)."""
    return source.bos is None and source.template != "chat"


def policy_of(spec: Spec) -> ImagePolicy | None:
    """The spec's image policy (None without an `images` section): the image medium's."""
    return IMAGE.medium.policy(spec)


class PlannedImage(NamedTuple):
    """What the media table keeps of a planned image for its decode (Medium.decode's `planned`)."""

    patches: int


# ----- templates ---------------------------------------------------------------------------------
def render_chat(turns) -> str:
    """A LLaVA conversation as text (see the module docstring); BadRecord when it is not one."""
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except ValueError:
            raise BadRecord("conversation is not JSON") from None
    if not isinstance(turns, list) or not turns:
        raise BadRecord("conversation is not a non-empty list of {from, value} turns")
    out = []
    for t in turns:
        if not isinstance(t, dict):
            raise BadRecord("a conversation turn is not a mapping")
        role = ROLES.get(str(t.get("from", t.get("role"))).lower())
        value = t.get("value", t.get("content"))
        if role is None or not isinstance(value, str):
            raise BadRecord(f"a turn needs from/role in {sorted(ROLES)} and a string value/content")
        out.append(f"{role}: {value}\n")
    return "".join(out)


def make_record(text, media: dict[str, list], template: str | None, name: str) -> MMRecord:
    """Segments and media of a record under the source's template; BadRecord when they disagree.
    `media`: the record's references by kind name (MediaKind.references), for the kinds its source reads;
    chat places each at its kind's marker, caption puts them first in KINDS order."""
    # an image-only source keeps `<video>` / `<audio>` in its text as text (as before those media
    # existed); a source reading any other medium claims every kind's marker
    kinds = [IMAGE] if set(media) <= {IMAGE.name} else KINDS
    refs = [(kind, media.get(kind.name, [])) for kind in kinds]
    if template != "chat":
        if not isinstance(text, str):
            raise BadRecord(f"text is {type(text).__name__}, not a string")
        flat = [r for _, kind_refs in refs for r in kind_refs]
        return MMRecord([""] * len(flat) + [text], flat, name)
    parts = re.split("(" + "|".join(kind.marker for kind, _ in refs) + ")", render_chat(text))
    markers = parts[1::2]
    for kind, kind_refs in refs:
        if markers.count(kind.marker) != len(kind_refs):
            raise BadRecord(f"conversation has {markers.count(kind.marker)} {kind.marker} marker(s) for "
                            f"{len(kind_refs)} {kind.name}(s)")
    queues = {kind.marker: iter(kind_refs) for kind, kind_refs in refs}
    return MMRecord(parts[0::2], [next(queues[m]) for m in markers], name)


def records_from_values(texts: list, media: dict[str, list], spec: SourceSpec, names: list[str],
                        folder: str | None = None):
    """MMRecords of rows (texts[i], and media[kind][i] for each kind the source reads: registry.source_media);
    returns (records, kept indices, bad (name, reason)).
    Relative media paths join `image_root`, else `folder` (a LLaVA JSON's own folder), else stay as they are."""
    records, kept, bad = [], [], []
    root = spec.image_root if spec.image_root is not None else folder
    for i, text in enumerate(texts):
        try:
            if text is None:
                raise BadRecord(f"field {spec.text_field!r} is null or missing")
            refs = {kind: BY_NAME[kind].references(field_media(values[i], root, kind)) for kind, values in media.items()}
            records.append(make_record(text, refs, spec.template, names[i]))
            kept.append(i)
        except (BadRecord, ValueError) as e:
            bad.append((names[i], str(e)))
    return records, np.asarray(kept, dtype=np.int64), bad


def describe_ref(ref: ImageRef | VideoRef | AudioRef) -> str:
    """How an error names a media: its kind and where it is ('image <path or member>', 'audio <...>'),
    and its clip window where it has one ('video <...> (clip window w)')."""
    window = getattr(ref, "window", 0)
    return f"{kind_of(ref).name} {_where(getattr(ref, 'ref', ref))}" + (f" (clip window {window})" if window else "")


def failure(ref, error: Exception) -> str:
    """What a bad media's record reports: a MediaError that names its file keeps its words (an audio clip's
    does); else the media is named here, before the decoder's reason (or an OSError's)."""
    if isinstance(error, MediaError) and error.name:
        return str(error)
    return f"{describe_ref(ref)}: {str(error) or type(error).__name__}"


def _where(ref: bytes | str) -> str:
    return f"<{len(ref)} inline bytes>" if isinstance(ref, bytes) else ref


# ----- the image table ---------------------------------------------------------------------------
@dataclass
class ImageTable:
    """A DocBlock's images. Per document (the DocBlock's shuffled order): `start`, `count` into the
    per-image arrays (file order). Per image: `patches`, `tokens` (its placeholder run), `grid` (t, h, w
    in patches), `at` (where its run starts inside the document's tokens), `refs` (how to re-read its
    bytes) and `records` (its record's name, for errors)."""

    start: np.ndarray  # int64 [docs]
    count: np.ndarray  # int64 [docs]
    patches: np.ndarray  # int64 [images]
    tokens: np.ndarray  # int64 [images]
    grid: np.ndarray  # int64 [images, 3]
    at: np.ndarray  # int64 [images]
    refs: list = field(default_factory=list)
    records: list = field(default_factory=list)
    units: np.ndarray | None = None  # int64 [media, 2]: its encoder units and their squares (Medium.encoder_units)
    audio: bool = False  # the source reads audio: the Planner gets its audio columns

    def take_docs(self, order: np.ndarray) -> ImageTable:
        return replace(self, start=self.start[order], count=self.count[order])

    @property
    def spans(self) -> np.ndarray | None:
        """The media's encoder units where the source reads audio (None where it does not)."""
        return self.units if self.audio else None

    def encoder_sums(self, encoder: str) -> np.ndarray:
        """Per document [docs, 3]: the encoder units, squared units and placeholder tokens of its media that
        `encoder` (a MediaKind's) encodes."""
        if self.units is None or not len(self.refs):
            return np.zeros((len(self.start), 3), np.int64)
        mine = np.fromiter((kind_of(r).encoder == encoder for r in self.refs), bool, len(self.refs))
        values = np.where(mine[:, None], np.column_stack([self.units, self.tokens]), 0).astype(np.int64)
        acc = np.concatenate([np.zeros((1, 3), np.int64), np.cumsum(values, axis=0)])
        return acc[self.start + self.count] - acc[self.start]

    def audio_sums(self) -> np.ndarray:
        """Per document [docs, 3]: its clips' encoder spans, squared spans and placeholder tokens (zeros
        without audio): the Planner's audio columns (plait.plan.Items)."""
        return self.encoder_sums(AUDIO.encoder)

    def doc_sums(self, power: int = 1) -> np.ndarray:
        """Per document: the sum of its images' and videos' patches (power 1) or their squares (power 2; a
        video's is t * (h*w)**2: Medium.encoder_units)."""
        return self.encoder_sums(IMAGE.encoder)[:, power - 1]

    @property
    def nbytes(self) -> int:
        inline = sum(len(getattr(r, "ref", r)) for r in self.refs if isinstance(getattr(r, "ref", r), bytes))
        return inline + sum(a.nbytes for a in (self.start, self.count, self.patches, self.tokens, self.grid, self.at))


# ----- planning: headers -> documents ------------------------------------------------------------
class ImageDocs:
    """Builds a block's documents from MMRecords (module docstring, steps 1-3)."""

    def __init__(self, spec: Spec, source: SourceSpec, encoder, reader, bad: Callable[[str, str, str], None]):
        self.policy = policy_of(spec)
        self.token_id = spec.images.image_token_id if spec.images is not None else -1
        self.videos = VideoDocs(spec, reader) if source.video_field is not None else None
        self.audio = AudioDocs(spec, reader) if source.audio_field is not None else None
        self.media = {VIDEO.name: self.videos, AUDIO.name: self.audio}  # the media planned apart from images
        self.token_ids = {IMAGE.name: self.token_id if self.policy is not None else None,  # None: not read
                          VIDEO.name: getattr(self.videos, "token_id", None), AUDIO.name: getattr(self.audio, "token_id", None)}
        self.seq_len = spec.packing.seq_len
        self.max_patches = spec.packing.max_patches
        self.max_audio_positions = spec.packing.max_audio_positions
        self.vocab_size = spec.vocab_size
        self.source = source
        self.encoder = encoder
        self.reader = reader
        self.bad = bad

    def plan(self, path: str, ref: ImageRef):
        """The image's plan from its header (a prefix of its bytes; all of them if the header needs more);
        a video's from its container headers (sources/video.py)."""
        if kind_of(ref) is not IMAGE:
            return self.media[kind_of(ref).name].plan(path, ref)
        medium = IMAGE.medium
        head, whole = self.reader.image_head(path, ref, HEAD_BYTES)
        try:
            return medium.plan(self.policy, medium.probe(head))
        except BadImage:
            if whole:
                raise
        return medium.plan(self.policy, medium.probe(self.reader.image_bytes(path, ref)))

    def _plans(self, path: str, records: list[MMRecord]) -> tuple[list[int], list[list]]:
        kept, plans = [], []
        for i, rec in enumerate(records):
            rec_plans = []
            try:
                for ref in rec.images:
                    rec_plans.append(self.plan(path, ref))
            except (MediaError, OSError) as e:
                self.bad(path, rec.name, failure(ref, e))
                continue
            plans.append(rec_plans)
            kept.append(i)
        return kept, plans

    def build(self, path: str, records: list[MMRecord]):
        """(tokens int32, offsets int64 [n+1], kept record indices, ImageTable in file order)."""
        kept, plans = self._plans(path, records)
        segs = [s for i in kept for s in records[i].segments]
        flat, seg_off = self.encoder.encode(pa.array(segs, pa.string())) if segs else (np.zeros(0, np.int32), np.zeros(1, np.int64))
        bos, eos = self.source.bos, self.source.eos
        pieces, lengths, ok = [], [], []
        img_counts, img_patches, img_tokens, img_grid, img_at, refs, names, units = [], [], [], [], [], [], [], []
        s = 0  # segment index
        for i, rec_plans in zip(kept, plans):
            rec = records[i]
            parts = [] if bos is None else [np.array([bos], np.int32)]
            at = []
            for j, seg_no in enumerate(range(s, s + len(rec.segments))):
                parts.append(flat[seg_off[seg_no]:seg_off[seg_no + 1]].astype(np.int32))
                if j < len(rec_plans):
                    at.append(sum(len(p) for p in parts))
                    token_id = self.token_ids[kind_of(rec.images[j]).name]
                    parts.append(np.full(rec_plans[j].tokens, token_id, np.int32))
            s += len(rec.segments)
            if eos is not None:
                parts.append(np.array([eos], np.int32))
            doc = np.concatenate(parts) if parts else np.zeros(0, np.int32)
            why = self._check(doc, rec.images, rec_plans)
            if why:
                self.bad(path, rec.name, why)
                continue
            pieces.append(doc)
            lengths.append(len(doc))
            ok.append(i)
            img_counts.append(len(rec_plans))
            img_patches += [p.patches for p in rec_plans]
            img_tokens += [p.tokens for p in rec_plans]
            img_grid += [p.grid for p in rec_plans]
            img_at += at
            refs += [self._planned(r, p) for r, p in zip(rec.images, rec_plans)]
            units += [kind_of(r).medium.encoder_units(p) for r, p in zip(rec.images, rec_plans)]
            names += [rec.name] * len(rec_plans)
        counts = np.asarray(img_counts, np.int64)
        table = ImageTable(np.cumsum(counts) - counts, counts, np.asarray(img_patches, np.int64),
                           np.asarray(img_tokens, np.int64), np.asarray(img_grid, np.int64).reshape(-1, 3),
                           np.asarray(img_at, np.int64), refs, names, np.asarray(units, np.int64).reshape(-1, 2),
                           self.audio is not None)
        tokens = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return tokens, offsets, np.asarray(ok, np.int64), table

    def _planned(self, ref, plan):
        """A media reference as the table keeps it: an image's as it is, others' with their plans (the
        medium's planner's `planned_ref`), so that the gather needs no probe."""
        kind = kind_of(ref)
        return ref if kind is IMAGE else self.media[kind.name].planned_ref(ref, plan)

    def _placeholder_ids(self, refs: list, plans: list) -> list[tuple[int, str, int]]:
        """(token id, kind, placeholders planned) for each kind the source reads (media sharing an id are
        counted together)."""
        ids: dict[int, list] = {}
        for kind in KINDS:
            token_id = self.token_ids[kind.name]
            if token_id is None:
                continue
            planned = sum(p.tokens for r, p in zip(refs, plans) if kind_of(r) is kind)
            entry = ids.setdefault(token_id, [token_id, kind.name, 0])
            entry[2] += planned
        return [tuple(e) for e in ids.values()]

    def _check(self, doc: np.ndarray, refs: list, plans: list) -> str | None:
        has_images, patches = bool(plans), sum(p.patches for p in plans)
        # labels are masked by these ids: each must mean an image (a video) of this document
        for token_id, kind, planned in self._placeholder_ids(refs, plans):
            extra = int(np.count_nonzero(doc == token_id)) - planned
            if extra:
                return f"its text holds the {kind} token id {token_id} outside its {kind}s' placeholders ({extra} time(s))"
        leads = bool(len(doc)) and any(doc[0] == token_id for token_id, _, _ in self._placeholder_ids(refs, plans))
        if has_images and leads != placeholder_leads(self.source):
            return "its first media is not where the template puts it (the text before it tokenizes to nothing)"
        if has_images and len(doc) > self.seq_len:
            return (f"a document holding media is {len(doc)} tokens, more than seq_len {self.seq_len} (documents "
                    "with media are never cut through; raise seq_len, lower the image policy's max_pixels, or "
                    "keep clips shorter: 750 tokens per 30 s of audio)")
        if self.max_patches is not None and patches > self.max_patches:
            return f"its images hold {patches} patches, more than packing.max_patches {self.max_patches}"
        if self.max_audio_positions is not None:
            positions = sum(AUDIO.medium.encoder_units(p)[0] for r, p in zip(refs, plans) if kind_of(r) is AUDIO)
            if positions > self.max_audio_positions:
                return (f"its audio holds {positions} encoder positions, more than packing.max_audio_positions "
                        f"{self.max_audio_positions}")
        if self.vocab_size is not None and len(doc) and int(doc.max()) >= self.vocab_size:
            return f"token id {int(doc.max())} is outside the vocabulary (vocab_size {self.vocab_size})"
        return None

    # ----- gather: decode ------------------------------------------------------------------------
    def decode_pixels(self, path: str, table: ImageTable, j: int,
                      out: np.ndarray | None = None) -> tuple[np.ndarray | None, str | None]:
        """Image (or video) j's uint8 patches [rows, patch*patch*3], decoded once (into `out` when given);
        on failure (see the module docstring) None and the reason (the caller applies the policy: a
        sample whose image or video fails after planning never reaches a trainer)."""
        ref = table.refs[j]
        try:
            if kind_of(ref) is IMAGE:
                data = self.reader.image_bytes(path, ref)
                return IMAGE.medium.decode(data, PlannedImage(int(table.patches[j])), self.policy, out=out), None
            return self.media[kind_of(ref).name].decode(path, ref, out), None
        except (MediaError, OSError) as e:
            return None, failure(ref, e)

    def frame_indices(self, table: ImageTable, j: int) -> tuple[int, ...]:
        """Media j's sampled source frame indices: a video's (its plan's), none for an image."""
        ref = table.refs[j]
        return ref.plan.indices if kind_of(ref) is VIDEO else ()

    def payload_entry(self, table: ImageTable, j: int) -> tuple[np.ndarray, int]:
        """Media j's grid in a payload and its kind (0 image; VIDEO_KIND: a video, grid (frames, h, w))."""
        ref = table.refs[j]
        if kind_of(ref) is VIDEO:
            return np.asarray(self.videos.payload_grid(ref.plan), np.int64), VIDEO_KIND
        return table.grid[j], 0
