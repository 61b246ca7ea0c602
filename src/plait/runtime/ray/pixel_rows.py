"""Pixels that go from the SourceLoaders to the trainer on Ray without passing through the Constructor.

A loader's gather of images (LoaderActor.gather_images) answers with two objects: the tokens and the
images' grids (read by the Constructor, which packs them) and, when the call's pixels are larger than
PIXELS_APART_BYTES, the pixels themselves: a list of arrays, one per request, that the Constructor never
reads. Each answer's `images.pixels` is then an `Apart` (which entry of that list, how many rows). The
Constructor places its micro-batches' pixel rows as `PixelRows` (object references and row numbers, 8
bytes a row instead of a 588-byte patch row) and the trainer-side client fetches the objects (zero-copy
numpy views of the object store) and assembles each micro-batch's `pixel_values` with one copy
(`resolve`). Before, the pixels were copied into the Constructor's merge and again into its reply.

Who keeps the objects: the caller of an actor call owns its returns, so the Constructor owns them and the
store keeps them after the loader's process ends (a loader that dies after answering loses nothing);
the trainer borrows them through the reply until it has assembled its batch. A Constructor that dies
before the trainer fetched them takes them along: the trainer sees `lost_errors` and asks again, as when
the Constructor died before answering. Small calls keep their pixels in the answer (an object of its own
costs more than the copies: benchmarks/ray_inline_returns.py); the Constructor then copies those rows,
as before.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from plait.runtime.ray.common import INLINE_RETURN_BYTES, ray_module

# A call's pixels above this travel as an object of their own: above it Ray would put the answer in the
# object store anyway, and the Constructor's merge and reply would copy them twice more.
PIXELS_APART_BYTES = INLINE_RETURN_BYTES


class Apart(NamedTuple):
    """In an answer's `images.pixels`: its pixels are entry `index` of the call's pixel object."""

    index: int
    rows: int
    width: int
    dtype: str


def set_apart(answers: list, limit: int = PIXELS_APART_BYTES) -> tuple[list, list | None]:
    """(the answers, the call's pixel list) with each answer's image pixels moved to the list when they
    add up to more than `limit` bytes; (answers, None) otherwise. Videos stay in the answers (the
    Constructor regroups their rows: plait.video_batch)."""
    pixels = [images_of(a) for a in answers]
    if sum(p.pixels.nbytes for p in pixels if p is not None) <= limit:
        return answers, None
    apart, kept = [], []
    for answer, images in zip(answers, pixels):
        if images is None:
            kept.append(answer)
            continue
        pix = images.pixels
        marker = Apart(len(apart), len(pix), int(pix.shape[1]), pix.dtype.str)
        apart.append(pix)
        kept.append(answer._replace(images=images._replace(pixels=marker)))
    return kept, apart


def images_of(answer):
    """An answer's image payload whose pixels can go apart (None: tokens only, no image, or a payload
    holding videos among its images)."""
    images = getattr(answer, "images", None)
    if images is None or not isinstance(images.pixels, np.ndarray) or not len(images.pixels):
        return None
    if images.kind is not None and images.kind.any():
        return None
    return images


class PixelRows:
    """The rows [n, width] of a payload's pixels, placed but not copied: row r is row `rows[r]` of the
    sources stacked, a source being a local array (a call answered inline) or (an ObjectRef of a call's
    pixel list, the entry). Sliced and indexed like the array it stands for (the Constructor cuts its
    micro-batches from it); `assemble` makes the array. Pickled with only the sources its rows use."""

    def __init__(self, sources: list, counts: np.ndarray, rows: np.ndarray, width: int, dtype):
        self.sources = sources
        self.bases = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.rows = np.asarray(rows, dtype=np.int64)
        self.width, self.dtype = int(width), np.dtype(dtype)

    @classmethod
    def of_source(cls, source, rows: int, width: int, dtype) -> PixelRows:
        return cls([source], np.array([rows]), np.arange(rows, dtype=np.int64), width, dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.rows), self.width

    ndim = 2

    @property
    def nbytes(self) -> int:
        return len(self.rows) * self.width * self.dtype.itemsize

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index) -> PixelRows:
        if isinstance(index, tuple):
            raise TypeError("PixelRows is indexed by rows only")
        out = PixelRows.__new__(PixelRows)
        out.sources, out.bases, out.width, out.dtype = self.sources, self.bases, self.width, self.dtype
        out.rows = self.rows[index]
        return out

    def refs(self) -> list:
        """The object references among the sources its rows use."""
        used = self._used()
        return [self.sources[j][0] for j in used if isinstance(self.sources[j], tuple)]

    def _used(self) -> np.ndarray:
        return np.unique(np.searchsorted(self.bases, self.rows, side="right") - 1)

    def assemble(self, fetched: dict) -> np.ndarray:
        """The array: each run of consecutive rows of one source copied once. `fetched`: each ObjectRef's
        pixel list (ray.get's zero-copy views)."""
        arrays = [s if isinstance(s, np.ndarray) else None for s in self.sources]
        for j in self._used():
            if arrays[j] is None:
                ref, entry = self.sources[j]
                arrays[j] = fetched[ref][entry]
        return copy_runs(arrays, self.bases, self.rows, self.width, self.dtype)

    def __reduce__(self):
        used = self._used()
        counts = np.diff(self.bases)[used]
        shift = np.zeros(len(self.sources), dtype=np.int64)
        shift[used] = (np.cumsum(counts) - counts) - self.bases[used]
        source = np.searchsorted(self.bases, self.rows, side="right") - 1
        return PixelRows, ([self.sources[j] for j in used], counts, self.rows + shift[source], self.width, self.dtype.str)


def copy_runs(arrays: list, bases: np.ndarray, rows: np.ndarray, width: int, dtype) -> np.ndarray:
    """Rows `rows` of the arrays stacked (row r of the stack is row r - bases[j] of arrays[j]), copied
    once: one slice per run of consecutive rows of one array (an image's rows are one run)."""
    out = np.empty((len(rows), width), dtype=dtype)
    if not len(rows):
        return out
    source = np.searchsorted(bases, rows, side="right") - 1
    cut = np.flatnonzero((np.diff(rows) != 1) | (np.diff(source) != 0)) + 1
    starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [len(rows)]])
    for a, b in zip(starts.tolist(), ends.tolist()):
        j = int(source[a])
        lo = int(rows[a] - bases[j])
        out[a:b] = arrays[j][lo:lo + b - a]
    return out


PIXEL_FIELDS = ("pixel_values",)


def placed(batches: list) -> list[tuple[object, str, PixelRows]]:
    """(micro-batch, field, PixelRows) of every field still placed, not assembled."""
    return [(mb, f, getattr(mb, f)) for mb in batches for f in PIXEL_FIELDS if isinstance(getattr(mb, f, None), PixelRows)]


def resolve(batches: list) -> list:
    """The micro-batches with their pixels assembled (in place; returned): every object they reference
    fetched in one ray.get. Raises one of `lost_errors` when an object is gone (its owner, the
    Constructor, died; or its node)."""
    todo = placed(batches)
    if not todo:
        return batches
    refs = list({r: None for _, _, p in todo for r in p.refs()})
    fetched = dict(zip(refs, ray_module().get(refs))) if refs else {}
    for mb, field, pixels in todo:
        setattr(mb, field, pixels.assemble(fetched))
    return batches


def resolve_built(built: tuple) -> tuple:
    """A Constructor's (state, micro-batches) with the pixels assembled (for a server in its process)."""
    state, batches = built
    return state, resolve(batches)


def lost_errors() -> tuple[type, ...]:
    """What fetching a placed pixel object raises when it is gone (its owner or its node died)."""
    return (ray_module().exceptions.ObjectLostError,)
